"""TieredStore's admission over a real CpuTier and DiskTier: with ``reused`` a store
stops at the first tier once the disk is full, until ``retention.admit`` sends it on;
while the disk has room, and always with ``all``, it goes on."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hybridkv.tiers.admission import Admission
from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.retention import StackMode
from hybridkv.tiers.tiered.store import TieredStore

SIZE = 4096


def key(i: int) -> StoreKey:
    return StoreKey(f"test/admission/{i}")


def payload(k: str) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(k.encode())).integers(0, 256, SIZE, dtype=np.uint8)


SMALL_DISK = 64 * SIZE
"""A disk tier of one segment: full once anything is written to it."""


def disk(path: Path, capacity_bytes: int = 16 << 20) -> DiskTier:
    return DiskTier(DiskConfig(path=path, capacity_bytes=capacity_bytes))


def fill(second: DiskTier) -> None:
    """One object noted reused fills a one-segment disk: its only victim is reused."""
    filler = key(1000)
    assert second.put_many([filler], [payload(filler)]) == [PutStatus.OK]
    assert second.usage().used_bytes == second.usage().capacity_bytes
    assert second.retention.evicts_reused(1) is False
    second.retention.note_reused([filler])
    assert second.retention.evicts_reused(1) is True


def make_store(
    tmp_path: Path, admission: Admission, *, write_back: bool = True, full: bool = True
) -> TieredStore:
    """A CPU tier before a disk tier; ``full``: a small disk already holding an object
    noted reused, so it has no room to give (``tiers.tiered.room``)."""
    first = CpuTier(CpuConfig(capacity_bytes=64 * SIZE, pin_memory=False))
    second = disk(tmp_path / "disk", SMALL_DISK if full else 16 << 20)
    if full:
        fill(second)
    return TieredStore([first, second], admission=admission, write_back=write_back)


def store_in_place(store: TieredStore, keys: list[StoreKey]) -> None:
    """As a transfer stores: reserve in the first tier's memory, write, commit."""
    memory = store.memory()
    assert memory is not None
    offsets = memory.reserve_many(keys, [SIZE] * len(keys))
    arena = memory.memory.numpy()
    for k, offset in zip(keys, offsets, strict=True):
        assert isinstance(offset, int)
        arena[offset : offset + SIZE] = payload(k)
    memory.commit_many(keys, [True] * len(keys))


def store_by_put(store: TieredStore, keys: list[StoreKey]) -> None:
    assert store.put_many(keys, [payload(k) for k in keys]) == [PutStatus.OK] * len(keys)


StoreBlocks = Callable[[TieredStore, list[StoreKey]], None]


@pytest.fixture(params=[store_in_place, store_by_put], ids=["in-place", "put"])
def store_blocks(request: pytest.FixtureRequest) -> StoreBlocks:
    """How blocks reach the store: as a transfer writes them, or by put."""
    blocks_in: StoreBlocks = request.param
    return blocks_in


@pytest.fixture(params=[True, False], ids=["write-back", "sync"])
def write_back(request: pytest.FixtureRequest) -> bool:
    """Whether the store writes the later tiers behind the caller or before returning."""
    return bool(request.param)


def on_disk(store: TieredStore, keys: list[StoreKey]) -> list[bool]:
    assert store.flush(30)
    return store.tiers[1].contains_many(keys)


def assert_reads_back(tier: Tier, keys: list[StoreKey]) -> None:
    buffers = [np.empty(SIZE, np.uint8) for _ in keys]
    assert tier.get_many_into(keys, buffers) == [GetStatus.OK] * len(keys)
    for k, buf in zip(keys, buffers, strict=True):
        assert np.array_equal(buf, payload(k))


def test_a_block_stored_once_reaches_a_full_disk_only_with_all(
    tmp_path: Path, store_blocks: StoreBlocks, write_back: bool
) -> None:
    keys = [key(i) for i in range(8)]
    for admission, expected in ((Admission.ALL, True), (Admission.REUSED, False)):
        store = make_store(tmp_path / admission.value, admission, write_back=write_back)
        store_blocks(store, keys)
        assert on_disk(store, keys) == [expected] * 8
        assert store.tiers[0].contains_many(keys) == [True] * 8  # still a hit from the cpu tier
        disk_stats = store.stats_by_tier()["disk"]
        assert (disk_stats.admitted, disk_stats.rejected) == ((8, 0) if expected else (0, 8))
        assert store.stats_by_tier()["cpu"].rejected == 0
        store.check_integrity()
        store.close()


def test_admitted_blocks_go_on_from_the_first_tier(tmp_path: Path, write_back: bool) -> None:
    store = make_store(tmp_path, Admission.REUSED, write_back=write_back)
    keys = [key(i) for i in range(8)]
    store_in_place(store, keys)
    absent = key(99)
    assert store.retention.admit([*keys[2:5], absent], [SIZE] * 4) == 3
    assert on_disk(store, [*keys, absent]) == [False] * 2 + [True] * 3 + [False] * 4
    assert_reads_back(store.tiers[1], keys[2:5])
    disk_stats = store.stats_by_tier()["disk"]
    assert (disk_stats.admitted, disk_stats.rejected) == (3, 8)
    assert disk_stats.admission_lost == 1  # the block the first tier did not hold
    store.check_integrity()  # every borrow the admission took was released
    store.tiers[0].delete_many(keys)  # nothing left pinned: deletes go through
    assert store.tiers[0].usage().num_objects == 0
    store.close()


def test_admission_reads_a_first_tier_without_memory(tmp_path: Path) -> None:
    far = disk(tmp_path / "far", SMALL_DISK)
    fill(far)
    store = TieredStore([disk(tmp_path / "near"), far], admission=Admission.REUSED)
    assert store.memory() is None
    keys = [key(i) for i in range(4)]
    store_by_put(store, keys)
    assert on_disk(store, keys) == [False] * 4
    assert store.retention.admit([*keys[:2], key(99)], [SIZE] * 3) == 2
    assert on_disk(store, keys) == [True] * 2 + [False] * 2
    assert_reads_back(store.tiers[1], keys[:2])
    assert list(store.stats_by_tier().values())[1].admission_lost == 1
    assert store.stats().admission_lost == 1
    store.close()


def test_with_all_admit_has_nothing_to_do(tmp_path: Path) -> None:
    store = make_store(tmp_path, Admission.ALL)
    keys = [key(i) for i in range(4)]
    store_in_place(store, keys)
    assert store.retention.admit(keys, [SIZE] * 4) == 0
    assert store.stats_by_tier()["disk"].admitted == 4
    with pytest.raises(ValueError, match="4 keys but 3 sizes"):
        store.retention.admit(keys, [SIZE] * 3)
    store.close()


def test_reused_sends_every_store_on_while_the_disk_has_room(
    tmp_path: Path, store_blocks: StoreBlocks, write_back: bool
) -> None:
    keys = [key(i) for i in range(8)]
    store = make_store(tmp_path, Admission.REUSED, write_back=write_back, full=False)
    store_blocks(store, keys)
    assert on_disk(store, keys) == [True] * 8
    disk_stats = store.stats_by_tier()["disk"]
    assert (disk_stats.admitted, disk_stats.rejected) == (8, 0)
    store.check_integrity()  # the borrows taken to send them on were released
    store.close()
    reopened = disk(tmp_path / "disk")  # what a restarted engine finds
    assert_reads_back(reopened, keys)
    reopened.close()


def test_admitted_blocks_outlive_a_disk_filling_with_blocks_not_reused(
    tmp_path: Path, write_back: bool
) -> None:
    """Admitted blocks go into disk segments of their own: later stores (sent on while
    what they evict holds nothing reused) push out the blocks stored beside them
    before, never the admitted ones."""
    segment = 16 * SIZE
    second = DiskTier(
        DiskConfig(path=tmp_path / "disk", capacity_bytes=4 * segment, segment_bytes=segment)
    )
    first = CpuTier(CpuConfig(capacity_bytes=64 * SIZE, pin_memory=False))
    store = TieredStore([first, second], admission=Admission.REUSED, write_back=write_back)
    plain = [key(i) for i in range(4)]
    store_by_put(store, plain)  # the disk has room: they go on
    admitted = [key(100 + i) for i in range(4)]
    assert first.put_many(admitted, [payload(k) for k in admitted]) == [PutStatus.OK] * 4
    assert store.retention.admit(admitted, [SIZE] * 4) == 4
    assert on_disk(store, [*plain, *admitted]) == [True] * 8
    later = [key(200 + i) for i in range(64)]  # four disks' worth of segments
    for start in range(0, len(later), 4):
        store_by_put(store, later[start : start + 4])
        assert store.flush(30)
    assert on_disk(store, admitted) == [True] * 4
    assert on_disk(store, plain) == [False] * 4
    assert_reads_back(second, admitted)
    assert second.stats().evictions > 0
    store.check_integrity()
    store.close()


def test_kept_slower_tiers_take_only_free_room(tmp_path: Path, write_back: bool) -> None:
    """While ``KEEP_SLOWER``, nothing is evicted on the disk for what goes on: stores go
    on while they fit in free room, then are held back, admissions too; off again, stores
    go on by evicting unreused blocks."""
    segment = 16 * SIZE
    second = DiskTier(
        DiskConfig(path=tmp_path / "disk", capacity_bytes=4 * segment, segment_bytes=segment)
    )
    first = CpuTier(CpuConfig(capacity_bytes=64 * SIZE, pin_memory=False))
    store = TieredStore([first, second], admission=Admission.REUSED, write_back=write_back)
    store.retention.use_mode(StackMode.KEEP_SLOWER)
    kept: list[StoreKey] = []
    for start in range(0, 256, 4):  # four disks' worth
        batch = [key(i) for i in range(start, start + 4)]
        store_by_put(store, batch)
        if not all(on_disk(store, batch)):
            break
        kept += batch
    assert 16 <= len(kept) < 64, "the disk took what fitted, then held back"
    later = [key(1000 + i) for i in range(64)]
    for start in range(0, len(later), 4):
        store_by_put(store, later[start : start + 4])
    assert store.retention.admit(later[:4], [SIZE] * 4) == 0
    assert on_disk(store, kept) == [True] * len(kept), "kept: nothing evicted"
    assert not any(on_disk(store, later)), "the full disk took them"
    store.retention.use_mode(StackMode.OWN_RULES)
    again = [key(2000 + i) for i in range(8)]
    store_by_put(store, again)
    assert on_disk(store, again) == [True] * 8, "evicting unreused blocks again"
    assert not all(on_disk(store, kept))
    store.check_integrity()
    store.close()


def test_admitted_blocks_read_from_the_disk_are_noted_reused_there(tmp_path: Path) -> None:
    """A load that read blocks from the disk (the first tier never held them) admits
    them: the disk notes them reused, so blocks not reused no longer evict them."""
    second = disk(tmp_path / "disk", SMALL_DISK)
    loaded = key(1)
    assert second.put_many([loaded], [payload(loaded)]) == [PutStatus.OK]
    first = CpuTier(CpuConfig(capacity_bytes=64 * SIZE, pin_memory=False))
    store = TieredStore([first, second], admission=Admission.REUSED)
    assert second.retention.evicts_reused(SIZE) is False
    assert store.retention.admit([loaded], [SIZE]) == 0  # not in the first tier
    assert second.retention.evicts_reused(SIZE) is True
    assert store.stats_by_tier()["disk"].admission_lost == 1
    store.close()
