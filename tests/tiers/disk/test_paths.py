"""DiskPaths: the one place a disk tier's directory and file names are built; the rank
travels in the config, never parsed back out of a path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.schema import ConfigError
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.paths import DiskPaths, is_temp, segment_seq
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.registry import parse_tier_config


def test_names_in_the_directory_read_back() -> None:
    paths = DiskPaths(Path("/cache"))
    assert paths.root == Path("/cache") and not paths.root_is_ours
    assert paths.segment(0x2A) == "/cache/000000000000002a.seg"
    assert segment_seq("000000000000002a.seg") == 0x2A
    assert [segment_seq(n) for n in ("2a.seg", "000000000000002A.seg", "writer.lock")] == [
        None,
        None,
        None,
    ]
    temp = Path(paths.temp(123, 4))
    assert temp.parent == paths.root and is_temp(temp.name) and segment_seq(temp.name) is None
    assert {paths.lock.name, paths.quarantine.name} == DiskPaths.kept
    assert paths.lock.parent == paths.quarantine.parent == paths.root


def test_a_rank_uses_its_own_directory_which_the_tier_names() -> None:
    paths = DiskPaths(Path("/cache"), WorkerRank(tp_rank=1, tp_size=4))
    assert paths.root == Path("/cache/tp1of4") and paths.root_is_ours
    assert paths.segment(1) == "/cache/tp1of4/0000000000000001.seg"
    assert paths.lock == Path("/cache/tp1of4/writer.lock")
    # A configured directory that merely looks like a rank's is still the user's own.
    assert not DiskPaths(Path("/cache/tp1of4")).root_is_ours


def test_the_rank_is_carried_by_the_config_and_never_set_by_users(tmp_path: Path) -> None:
    config = DiskConfig(path=tmp_path, capacity_bytes=1 << 20)  # type: ignore[arg-type]
    ranks = [config.for_rank(WorkerRank(tp_rank=rank, tp_size=2)) for rank in range(2)]
    assert [r.rank for r in ranks] == [
        WorkerRank(tp_rank=0, tp_size=2),
        WorkerRank(tp_rank=1, tp_size=2),
    ]
    assert ranks[0] != ranks[1] and ranks[0].path == ranks[1].path == tmp_path
    assert ranks[1].lookup_only().paths == DiskPaths(tmp_path, WorkerRank(tp_rank=1, tp_size=2))
    assert len({r.lookup_only() for r in ranks}) == 2  # one lookup tier per rank
    with pytest.raises(ConfigError, match="rank: unknown key"):
        parse_tier_config(
            {"kind": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 20, "rank": [1, 2]}
        )
