"""A running disk-tier writer whose directory is changed from outside: files removed,
files dropped in. It must notice, count, store again, and keep its integrity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.disk import directory
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier

NUM_BYTES = 10_000


def disk_tier(path: Path) -> DiskTier:
    return DiskTier(DiskConfig(path=path, capacity_bytes=64 << 20))


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/outside/{i}")


def payload(name: str, num_bytes: int) -> np.ndarray:
    return np.frombuffer((name.encode() * num_bytes)[:num_bytes], dtype=np.uint8).copy()


def get_one(tier: DiskTier, k: StoreKey, num_bytes: int) -> tuple[GetStatus, np.ndarray]:
    out = np.zeros(num_bytes, dtype=np.uint8)
    return tier.get_many_into([k], [out])[0], out


def test_segment_removed_from_outside_is_stored_again(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "kv")
    k = key("removed")
    assert tier.put_many([k], [payload(str(k), NUM_BYTES)]) == [PutStatus.OK]
    for path in (tmp_path / "kv").glob("*.seg"):
        path.unlink()
    # The writer still holds the unlinked file open: without noticing it would answer
    # EXISTS for ever while every other process (and its next start) misses the key.
    assert tier.put_many([k], [payload(str(k), NUM_BYTES)]) == [PutStatus.OK]
    assert tier.stats().corrupt == 1
    assert list((tmp_path / "kv").glob("*.seg")), "the object is on disk again"
    status, out = get_one(tier, k, NUM_BYTES)
    assert status is GetStatus.OK and np.array_equal(out, payload(str(k), NUM_BYTES))
    tier.check_integrity()
    tier.close()


def test_files_dropped_in_are_quarantined_by_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(directory, "RESCAN_EVERY_S", 0.0)
    root = tmp_path / "kv"
    tier = disk_tier(root)
    assert tier.put_many([key(0)], [payload("0", NUM_BYTES)]) == [PutStatus.OK]
    (root / "00000000000000ff.seg").write_bytes(b"\0" * 8192)  # a segment name, not ours
    (root / "notes.txt").write_text("not a segment\n")
    (root / "subdir").mkdir()
    assert tier.put_many([key(1)], [payload("1", NUM_BYTES)]) == [PutStatus.OK]
    assert sorted(p.name for p in root.iterdir() if p.name.endswith((".seg", ".txt"))) == [
        "0000000000000001.seg"
    ]
    assert (root / "subdir").is_dir(), "directories are left alone"
    assert tier.stats().corrupt == 2
    quarantined = sorted(p.name for p in (root / "quarantine").iterdir())
    assert any("00000000000000ff.seg" in name for name in quarantined), quarantined
    for i in range(2):
        assert get_one(tier, key(i), NUM_BYTES)[0] is GetStatus.OK
    tier.check_integrity()
    tier.close()
