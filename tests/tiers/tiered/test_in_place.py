"""TieredStore.memory() over a real CpuTier and DiskTier: commits sent on to disk from
borrowed views of the CPU arena, never copied, never evicted while queued."""

from __future__ import annotations

import threading
import tracemalloc
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, Tier, TierMemory
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.cpu_index import Outstanding
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.tiered.store import TieredStore

SIZE = 4096


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/in-place/{i}")


def payload(k: str) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(k.encode())).integers(0, 256, SIZE, dtype=np.uint8)


def cpu(num_objects: int = 256) -> CpuTier:
    return CpuTier(CpuConfig(capacity_bytes=num_objects * SIZE, pin_memory=False))


def disk_config(path: Path, read_only: bool = False) -> DiskConfig:
    return DiskConfig(path=path, capacity_bytes=16 << 20, load_weight=4.0, read_only=read_only)


class GatedDisk(DiskTier):
    """A real disk tier whose puts first wait for ``gate``: holds write-back mid-flight."""

    def __init__(self, config: DiskConfig) -> None:
        super().__init__(config)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().put_many(keys, buffers, checksums)


def memory_of(store: TieredStore) -> TierMemory:
    memory = store.memory()
    assert memory is not None
    return memory


def commit_in_place(memory: TierMemory, keys: list[StoreKey]) -> None:
    """Reserve, write each key's payload straight into the memory, commit."""
    offsets = memory.reserve_many(keys, [SIZE] * len(keys))
    arena = memory.memory.numpy()
    for k, offset in zip(keys, offsets, strict=True):
        assert isinstance(offset, int), offset
        arena[offset : offset + SIZE] = payload(k)
    memory.commit_many(keys, [True] * len(keys))


def holds_payloads(tier: Tier, keys: list[StoreKey]) -> bool:
    outs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    statuses = tier.get_many_into(keys, outs)
    ok = all(status is GetStatus.OK for status in statuses)
    return ok and all(np.array_equal(out, payload(k)) for k, out in zip(keys, outs, strict=True))


def test_commits_reach_disk_by_write_back_without_a_copy(tmp_path: Path) -> None:
    cpu_tier = cpu()
    store = TieredStore([cpu_tier, DiskTier(disk_config(tmp_path / "d"))])
    memory = memory_of(store)
    assert memory.memory.data_ptr() == cpu_tier.arena.data_ptr()
    keys = [key(i) for i in range(40)]
    tracemalloc.start()
    try:
        commit_in_place(memory, keys)
        assert store.flush(timeout_s=30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated: the 64 MiB write-back arena was made"
    write_back = store.write_back_stats()
    assert (write_back.num_queued, write_back.num_copied, write_back.num_written) == (40, 0, 40)
    assert cpu_tier.outstanding() == Outstanding(0, 0), "a borrow outlived its write"
    assert cpu_tier.stats().gets == 0, "sending a block on is not a read"
    stats = store.stats()
    assert (stats.puts, stats.put_bytes) == (40, 40 * SIZE)
    store.check_integrity()
    fresh = DiskTier(disk_config(tmp_path / "d", read_only=True))  # the store still writes
    assert holds_payloads(fresh, keys)
    store.close()


def test_an_object_queued_for_write_back_is_not_evicted_until_written(tmp_path: Path) -> None:
    cpu_tier, lower = cpu(num_objects=4), GatedDisk(disk_config(tmp_path))
    store = TieredStore([cpu_tier, lower], promote=False)
    held = key("held")
    commit_in_place(memory_of(store), [held])
    assert lower.entered.wait(30)  # the write-back thread waits at the gate, holding it
    others = [key(i) for i in range(5)]
    assert store.put_many(others[:4], [payload(k) for k in others[:4]]) == [PutStatus.OK] * 4
    assert cpu_tier.contains_many([held, *others[:4]]) == [True, False, True, True, True]
    lower.gate.set()
    assert store.flush(timeout_s=30)
    assert cpu_tier.outstanding() == Outstanding(0, 0)
    assert holds_payloads(lower, [held])
    store.put_many(others[4:], [payload(others[4])])  # now the least recent goes: held
    assert cpu_tier.contains_many([held]) == [False]
    store.check_integrity()
    store.close()


def test_over_the_write_back_budget_a_commit_is_skipped_and_released(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), DiskTier(disk_config(tmp_path))
    store = TieredStore([cpu_tier, disk_tier], write_back_bytes=SIZE + SIZE // 2)
    keys = [key(i) for i in range(3)]
    commit_in_place(memory_of(store), keys)
    assert store.flush(timeout_s=30)
    write_back = store.write_back_stats()
    assert (write_back.num_queued, write_back.num_skipped, write_back.num_copied) == (1, 2, 0)
    assert cpu_tier.outstanding() == Outstanding(0, 0)
    assert disk_tier.contains_many(keys) == [True, False, False]
    assert cpu_tier.contains_many(keys) == [True] * 3
    store.check_integrity()
    store.close()


def test_delete_releases_the_borrow_of_a_queued_commit(tmp_path: Path) -> None:
    cpu_tier, lower = cpu(), GatedDisk(disk_config(tmp_path))
    store = TieredStore([cpu_tier, lower])
    memory = memory_of(store)
    first, queued = key("in-flight"), key("queued")
    commit_in_place(memory, [first])
    assert lower.entered.wait(30)
    commit_in_place(memory, [queued])
    assert cpu_tier.outstanding().num_borrows == 2
    assert store.delete_many([queued]) == 1
    assert cpu_tier.outstanding().num_borrows == 1
    assert cpu_tier.contains_many([queued]) == [False]
    lower.gate.set()
    assert store.flush(timeout_s=30)
    assert cpu_tier.outstanding() == Outstanding(0, 0)
    assert lower.contains_many([first, queued]) == [True, False]
    store.check_integrity()
    store.close()


def test_without_write_back_a_commit_reaches_every_tier_at_once(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), DiskTier(disk_config(tmp_path))
    store = TieredStore([cpu_tier, disk_tier], write_back=False)
    keys = [key(i) for i in range(3)]
    commit_in_place(memory_of(store), keys)
    assert holds_payloads(disk_tier, keys) and holds_payloads(cpu_tier, keys)
    assert cpu_tier.outstanding() == Outstanding(0, 0)
    assert cpu_tier.stats().gets == 3, "only the reads above count as gets"
    store.check_integrity()


def test_store_lookups_do_not_see_reservations(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), DiskTier(disk_config(tmp_path))
    store = TieredStore([cpu_tier, disk_tier])
    memory = memory_of(store)
    k = key("reserved")
    [offset] = memory.reserve_many([k], [SIZE])
    assert isinstance(offset, int)
    assert store.contains_many([k]) == [False]
    assert store.get_many_into([k], [np.zeros(SIZE, dtype=np.uint8)]) == [GetStatus.MISS]
    assert memory.borrow_many([k], [SIZE]) == [GetStatus.MISS]
    memory.memory.numpy()[offset : offset + SIZE] = payload(k)
    memory.commit_many([k], [True], num_borrows=1)  # the caller's own borrow, kept
    assert store.contains_many([k]) == [True]
    assert store.flush(timeout_s=30)
    assert cpu_tier.outstanding() == Outstanding(0, 1)
    memory.release_many([k])
    assert holds_payloads(disk_tier, [k])
    store.check_integrity()
    store.close()


def test_memory_is_the_first_tier_s_or_none(tmp_path: Path) -> None:
    assert TieredStore([DiskTier(disk_config(tmp_path)), cpu()]).memory() is None
    cpu_tier = cpu()
    alone = TieredStore([cpu_tier])
    commit_in_place(memory_of(alone), [key("alone")])
    assert cpu_tier.outstanding() == Outstanding(0, 0) and alone.stats().puts == 1
    assert holds_payloads(alone, [key("alone")])
