"""The connector's extra config: defaults, and one error naming every problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.connector import ConnectorConfig
from hybridkv.connector.config import (
    ALLOWED_KEYS,
    DEFAULT_CPU_CAPACITY_BYTES,
    DEFAULT_DISK_CAPACITY_BYTES,
    default_cache_dir,
)
from hybridkv.keys import HashAlgo
from hybridkv.tiers.cpu import CpuConfig
from hybridkv.tiers.disk.tier import DiskConfig
from hybridkv.tiers.selection import Selection


def test_empty_config_is_cpu_then_disk_under_the_cache_dir_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    config = ConnectorConfig.from_dict({})
    cpu, disk = config.tiers
    assert isinstance(cpu, CpuConfig) and cpu.capacity_bytes == DEFAULT_CPU_CAPACITY_BYTES
    assert isinstance(disk, DiskConfig) and disk.capacity_bytes == DEFAULT_DISK_CAPACITY_BYTES
    assert disk.path == tmp_path / "cache" / "kv"
    assert config.cache_dir == tmp_path / "cache"
    assert config.selection is Selection.PER_BLOCK
    assert config.hash_algo is HashAlgo.XXH3_128
    assert config.chunk_tokens is None and config.model_id is None
    assert config.uses_default_tiers
    assert ConnectorConfig.from_dict(None) == config


def test_without_the_env_the_cache_dir_is_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HYBRIDKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "hybridkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hybridkv"


def test_every_key_parses(tmp_path: Path) -> None:
    config = ConnectorConfig.from_dict(
        {
            "cache_dir": str(tmp_path),
            "cpu_capacity_bytes": "1GiB",
            "disk_capacity_bytes": 5 << 30,
            "selection": "whole_request",
            "load_timeout_s": 2.5,
            "chunk_tokens": 256,
            "model_id": "my-model",
            "hash_algo": "sha256",
        }
    )
    assert config.tiers[0].capacity_bytes == 1 << 30  # type: ignore[attr-defined]
    assert config.tiers[1].capacity_bytes == 5 << 30  # type: ignore[attr-defined]
    assert config.selection is Selection.WHOLE_REQUEST
    assert config.load_timeout_s == 2.5 and config.chunk_tokens == 256
    assert config.model_id == "my-model" and config.hash_algo is HashAlgo.SHA256


def test_explicit_tiers_replace_the_default(tmp_path: Path) -> None:
    config = ConnectorConfig.from_dict(
        {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"}]}
    )
    (disk,) = config.tiers
    assert isinstance(disk, DiskConfig) and not config.uses_default_tiers


def test_all_problems_in_one_error_with_the_allowed_keys() -> None:
    with pytest.raises(ValueError) as info:
        ConnectorConfig.from_dict(
            {
                "cpu_capacity": 1,
                "load_timeout_s": -1,
                "chunk_tokens": "many",
                "selection": "fastest",
                "hash_algo": "md5",
                "cache_dir": 7,
            }
        )
    message = str(info.value)
    for fragment in (
        "unknown key 'cpu_capacity'",
        "load_timeout_s=-1",
        "chunk_tokens='many'",
        "selection='fastest'",
        "hash_algo='md5'",
        "cache_dir=7",
        "6 problem(s)",
    ):
        assert fragment in message, fragment
    for key in ALLOWED_KEYS:
        assert key in message


def test_tier_problems_and_default_sizes_with_tiers_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        ConnectorConfig.from_dict(
            {
                "cpu_capacity_bytes": "1GiB",
                "tiers": [{"kind": "cpu"}, {"kind": "tape"}],
            }
        )
    message = str(info.value)
    assert "cpu_capacity_bytes sizes the default tiers only" in message
    assert "missing required key 'capacity_bytes'" in message
    assert "'tape'" in message


@pytest.mark.parametrize(
    "raw",
    [
        {"cpu_capacity_bytes": 0},
        {"disk_capacity_bytes": "lots"},
        {"load_timeout_s": True},
        {"chunk_tokens": 0},
        {"model_id": ""},
        {"tiers": "cpu"},
        {"tiers": []},
    ],
)
def test_impossible_values_are_refused(raw: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        ConnectorConfig.from_dict(raw)
