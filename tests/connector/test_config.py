"""The connector's extra config: defaults, per-rank tiers, and one error naming every problem."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridkv.connector.config import (
    DEFAULT_CPU_CAPACITY_BYTES,
    DEFAULT_DISK_CAPACITY_BYTES,
    DEFAULT_SWITCH_INTERVAL_S,
    ConnectorConfig,
)
from hybridkv.connector.setup import EngineFacts, hit_alignment, lower_switch_interval
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.keys import HashAlgo
from hybridkv.paths import default_cache_dir
from hybridkv.schema import ConfigError
from hybridkv.tiers.cpu import CpuConfig
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.selection import Selection
from tests.support.errors import assert_names_every_problem


def test_empty_config_is_cpu_then_disk_under_the_cache_dir_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    config = ConnectorConfig.from_dict({})
    cpu, disk = config.tier_configs
    assert isinstance(cpu, CpuConfig) and cpu.capacity_bytes == DEFAULT_CPU_CAPACITY_BYTES
    assert isinstance(disk, DiskConfig) and disk.capacity_bytes == DEFAULT_DISK_CAPACITY_BYTES
    assert disk.path == tmp_path / "cache" / "kv"
    assert config.selection is Selection.PER_BLOCK
    assert config.hash_algo is HashAlgo.XXH3_128
    assert config.hit_alignment_tokens is None and config.model_id is None
    assert config.tiers is None
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
            "hit_alignment_tokens": 256,
            "model_id": "my-model",
            "hash_algo": "sha256",
        }
    )
    cpu, disk = config.tier_configs
    assert cpu.capacity_bytes == 1 << 30 and disk.capacity_bytes == 5 << 30
    assert isinstance(disk, DiskConfig) and disk.path == tmp_path / "kv"
    assert config.selection is Selection.WHOLE_REQUEST
    assert config.load_timeout_s == 2.5 and config.hit_alignment_tokens == 256
    assert config.model_id == "my-model" and config.hash_algo is HashAlgo.SHA256


def test_explicit_tiers_replace_the_default(tmp_path: Path) -> None:
    config = ConnectorConfig.from_dict(
        {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"}]}
    )
    (disk,) = config.tier_configs
    assert isinstance(disk, DiskConfig) and config.tiers is not None


def test_each_rank_gets_its_own_disk_directory(tmp_path: Path) -> None:
    config = ConnectorConfig.from_dict({"cache_dir": str(tmp_path)})
    assert config.for_rank(WorkerRank()) == config.tier_configs  # one rank: the path as given
    paths = [
        config.for_rank(WorkerRank(tp_rank=rank, tp_size=2))[1].paths.root for rank in range(2)
    ]  # type: ignore[union-attr]
    assert paths == [tmp_path / "kv" / "tp0of2", tmp_path / "kv" / "tp1of2"]
    assert [t.kind for t in config.for_rank(WorkerRank(tp_rank=1, tp_size=2))] == ["cpu", "disk"]


def test_all_problems_in_one_error_with_the_allowed_keys() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_dict(
            {
                "cpu_capacity": 1,
                "load_timeout_s": -1,
                "hit_alignment_tokens": "many",
                "selection": "fastest",
                "hash_algo": "md5",
                "cache_dir": 7,
                "tiers": [{"kind": "cpu"}, {"kind": "tape"}],
            }
        )
    problems = [
        "cpu_capacity: unknown key; allowed keys: tiers, cache_dir, cpu_capacity_bytes",
        "load_timeout_s=-1: must be greater than 0",
        "hit_alignment_tokens='many': must be a valid integer",
        "selection='fastest': must be 'per_block' or 'whole_request'",
        "hash_algo='md5': must be 'xxh3_128' or 'sha256'",
        "cache_dir=7: must be a non-empty path string",
        "tiers[0].capacity_bytes: required key is missing (size of the memory arena)",
        "tiers[1].kind='tape': must be one of 'cpu', 'disk', 'mooncake', 'valkey'",
    ]
    assert_names_every_problem(info, "kv_connector_extra_config: 8 problems:", problems)


def test_default_sizes_with_explicit_tiers_are_refused() -> None:
    with pytest.raises(ConfigError, match="cpu_capacity_bytes size the default tiers only"):
        ConnectorConfig.from_dict(
            {"cpu_capacity_bytes": "1GiB", "tiers": [{"kind": "cpu", "capacity_bytes": 4096}]}
        )


def test_a_password_is_never_shown() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_dict({"tiers": [{"kind": "valkey", "password": 12345}]})
    assert "password=<hidden>" in str(info.value) and "12345" not in str(info.value)


@pytest.mark.parametrize(
    "raw",
    [
        {"cpu_capacity_bytes": 0},
        {"disk_capacity_bytes": "lots"},
        {"load_timeout_s": True},
        {"hit_alignment_tokens": 0},
        {"model_id": ""},
        {"tiers": "cpu"},
        {"tiers": []},
        {"tiers": [{"capacity_bytes": 4096}]},
    ],
)
def test_impossible_values_are_refused(raw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ConnectorConfig.from_dict(raw)


def test_configs_are_frozen_and_replace_validates(tmp_path: Path) -> None:
    config = ConnectorConfig.from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.load_timeout_s = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="greater than 0"):
        dataclasses.replace(config, load_timeout_s=0)


@pytest.fixture
def switch_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_switch_interval_is_only_ever_lowered(switch_interval: float) -> None:
    config = ConnectorConfig.from_dict({})
    assert config.thread_switch_interval_s == DEFAULT_SWITCH_INTERVAL_S
    sys.setswitchinterval(0.005)
    lower_switch_interval(config.thread_switch_interval_s)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_S)
    lower_switch_interval(0.002)  # higher than now: kept
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.005)
    lower_switch_interval(
        ConnectorConfig.from_dict({"thread_switch_interval_s": None}).thread_switch_interval_s
    )
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with pytest.raises(ConfigError, match="thread_switch_interval_s"):
        ConnectorConfig.from_dict({"thread_switch_interval_s": 0})


def _facts(*groups: KVGroup) -> EngineFacts:
    return EngineFacts(model_groups=ModelGroups(groups=groups), alignment_tokens=32)


def test_a_coarser_hit_alignment_is_taken_for_attention_groups() -> None:
    facts = _facts(
        KVGroup(kind=GroupKind.FULL, block_size=32, page_size_bytes=64, layer_names=("f",)),
        KVGroup(
            kind=GroupKind.SLIDING_WINDOW,
            block_size=32,
            page_size_bytes=64,
            sliding_window=32,
            layer_names=("s",),
        ),
    )
    assert hit_alignment(ConnectorConfig.from_dict({}), facts) == 32
    config = ConnectorConfig.from_dict({"hit_alignment_tokens": 128})
    assert hit_alignment(config, facts) == 128
    with pytest.raises(ConfigError, match="must be a multiple of the engine's alignment 32"):
        hit_alignment(ConnectorConfig.from_dict({"hit_alignment_tokens": 48}), facts)


def test_a_coarser_hit_alignment_is_refused_with_mamba_groups() -> None:
    """Mamba states exist only where engine steps end: a coarser alignment would not hit."""
    facts = _facts(
        KVGroup(kind=GroupKind.FULL, block_size=32, page_size_bytes=64, layer_names=("f",)),
        KVGroup(kind=GroupKind.MAMBA, block_size=32, page_size_bytes=64, layer_names=("m",)),
    )
    config = ConnectorConfig.from_dict({"hit_alignment_tokens": 128})
    with pytest.raises(
        ConfigError, match=r"group 1 \(mamba\): hit_alignment_tokens=128 is coarser"
    ):
        hit_alignment(config, facts)
    same = ConnectorConfig.from_dict({"hit_alignment_tokens": 32})
    assert hit_alignment(same, facts) == 32
