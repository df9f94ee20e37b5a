"""Stores and loads straight into and out of the CPU tier's memory.

Real tiers (CPU, disk): a store copies each block once, into the tier's own
memory, with no staging; a load borrows what the CPU tier holds and reads
the rest through staging; an asynchronous engine (CUDA's mode, run here on
CPU with the chunked copies) does the same after ``submit`` has returned.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import (
    JobResult,
    TransferConfig,
    TransferEngine,
    TransferPart,
)

NUM_BLOCKS = 64
PAGE = 1024


def spec() -> ModelGroups:
    full = KVGroup(
        kind=GroupKind.FULL,
        block_size=16,
        page_size_bytes=PAGE,
        layer_names=("f.0", "f.1", "f.2"),
    )
    window = KVGroup(
        kind=GroupKind.SLIDING_WINDOW,
        block_size=16,
        page_size_bytes=PAGE,
        layer_names=("s.0", "s.1", "s.2"),
        sliding_window=64,
    )
    return ModelGroups(groups=(full, window))


def keys(tag: str, group_id: int, ids: list[int]) -> list[StoreKey]:
    return [StoreKey(f"in-place/{tag}/{group_id}/{b}") for b in ids]


def run(engine: TransferEngine, job: object) -> JobResult:
    assert job is not None
    assert engine.wait([job], 30)  # type: ignore[list-item]
    (result,) = engine.poll_finished()
    return result


MODES = {
    "sync": {},
    "async-chunked": {"asynchronous": True, "chunked_copies": True},
}


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest) -> dict[str, object]:
    return MODES[request.param]


@pytest.fixture
def caches() -> Iterator[tuple[ModelGroups, torch.Tensor, object]]:
    model_groups = spec()
    alloc = allocate_kv_caches(model_groups, NUM_BLOCKS, kind=KVLayoutKind.LAYER_MAJOR)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    yield model_groups, alloc.buffer, alloc.canonical


def block_bytes_of(canonical: object, group_id: int, block_id: int) -> bytes:
    from hybridkv.transfer import BlockCopier

    copier = BlockCopier(canonical, chunked=False)  # type: ignore[arg-type]
    out = np.empty(copier.block_bytes(group_id), np.uint8)
    copier.gather(group_id, [block_id], out)
    return out.tobytes()


def cpu_and_disk(tmp_path: Path, cpu_bytes: int = 1 << 20) -> tuple[CpuTier, DiskTier, TieredStore]:
    """A CPU tier (its memory lent out for in-place copies) in front of a 16 MiB disk tier."""
    cpu = CpuTier(CpuConfig(capacity_bytes=cpu_bytes, pin_memory=False))
    disk = DiskTier(DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=16 << 20))
    return cpu, disk, TieredStore([cpu, disk])


def in_place_engine(
    canonical: object, store: TieredStore, mode: dict[str, object]
) -> TransferEngine:
    config = TransferConfig(staging_bytes=1 << 20, **mode)  # type: ignore[arg-type]
    return TransferEngine(canonical, store, config)  # type: ignore[arg-type]


def assert_load_restores(
    engine: TransferEngine,
    parts: list[TransferPart],
    buffer: torch.Tensor,
    canonical: object,
    ids: list[int],
    where: str = "",
) -> None:
    """Zero blocks ``ids`` of every cache, load ``parts``: the job succeeds and every
    byte of the caches is back."""
    saved = buffer.clone()
    for t in canonical.tensors:  # type: ignore[attr-defined]
        t[ids] = 0
    assert run(engine, engine.submit_load(parts)).ok
    assert torch.equal(buffer, saved), where


def test_a_store_lands_in_the_tier_memory_without_staging(
    caches: tuple[ModelGroups, torch.Tensor, object], mode: dict[str, object]
) -> None:
    model_groups, buffer, canonical = caches
    cpu = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    with in_place_engine(canonical, TieredStore([cpu]), mode) as engine:
        ids = random.Random(1).sample(range(1, NUM_BLOCKS), 9)
        parts = [TransferPart(g, ids, keys("s", g, ids)) for g in range(2)]
        result = run(engine, engine.submit_store(parts))
        assert result.ok and engine.arena.used_bytes == 0
        assert engine.stats().bytes["store"] == 2 * 9 * model_groups.groups[0].block_bytes
        # The tier's memory holds each block's bytes at the offset it lends out.
        memory = cpu.memory()
        assert memory is not None
        for g in range(2):
            sizes = [model_groups.groups[g].block_bytes] * len(ids)
            offsets = memory.borrow_many(keys("s", g, ids), sizes)
            for block, offset in zip(ids, offsets, strict=True):
                assert isinstance(offset, int)
                got = memory.memory[offset : offset + sizes[0]].numpy().tobytes()
                assert got == block_bytes_of(canonical, g, block)
            memory.release_many(keys("s", g, ids))
        # Load back into wiped blocks: all from memory, none through staging.
        assert_load_restores(engine, parts, buffer, canonical, ids)
        engine.check_integrity()
    cpu.check_integrity()


def test_a_load_reads_what_the_cpu_tier_lacks_from_the_disk_tier(
    tmp_path: Path,
    caches: tuple[ModelGroups, torch.Tensor, object],
    mode: dict[str, object],
) -> None:
    _, buffer, canonical = caches
    cpu, disk, store = cpu_and_disk(tmp_path)
    ids = random.Random(2).sample(range(1, NUM_BLOCKS), 12)
    with in_place_engine(canonical, store, mode) as engine:
        parts = [TransferPart(0, ids, keys("d", 0, ids))]
        assert run(engine, engine.submit_store(parts)).ok
        assert store.flush(30)
        assert all(disk.contains_many(keys("d", 0, ids)))
        gone = ids[::2]  # dropped from the CPU tier: only the disk tier has them
        assert cpu.delete_many(keys("d", 0, gone)) == len(gone)
        assert_load_restores(engine, parts, buffer, canonical, ids)
        assert disk.stats().gets == len(gone), "only what the CPU tier lacks is read from disk"
        # A block neither tier holds fails alone, and its KV is untouched.
        missing = [b for b in range(1, NUM_BLOCKS) if b not in ids][:2]
        for t in canonical.tensors:  # type: ignore[attr-defined]
            t[missing] = 9
        part = [TransferPart(0, [*missing, ids[1]], keys("d", 0, [*missing, ids[1]]))]
        result = run(engine, engine.submit_load(part))
        assert result.failed_block_ids[0] == tuple(missing)
        assert result.ok_block_ids[0] == (ids[1],)
        assert all(bool((t[missing] == 9).all()) for t in canonical.tensors)  # type: ignore[attr-defined]
        engine.check_integrity()
    store.check_integrity()
    store.close()


def test_a_borrowed_block_is_not_evicted_while_a_load_reads_it(
    caches: tuple[ModelGroups, torch.Tensor, object],
) -> None:
    """Loads release what they borrowed: afterwards every object can be evicted again."""
    model_groups, _, canonical = caches
    block_bytes = model_groups.groups[0].block_bytes
    cpu = CpuTier(CpuConfig(capacity_bytes=4 * block_bytes, pin_memory=False))
    with TransferEngine(canonical, TieredStore([cpu]), TransferConfig()) as engine:  # type: ignore[arg-type]
        parts = [TransferPart(0, [1, 2, 3, 4], keys("e", 0, [1, 2, 3, 4]))]
        assert run(engine, engine.submit_store(parts)).ok
        assert run(engine, engine.submit_load(parts)).ok
        more = [TransferPart(0, [5, 6, 7, 8], keys("e", 0, [5, 6, 7, 8]))]
        assert run(engine, engine.submit_store(more)).ok, "nothing stays pinned after a load"
        assert cpu.contains_many(keys("e", 0, [1, 2, 3, 4])) == [False] * 4
        memory = cpu.memory()
        assert memory is not None
        got = memory.borrow_many(keys("e", 0, [5]), [block_bytes])
        assert isinstance(got[0], int)
        assert memory.borrow_many(keys("e", 0, [1]), [block_bytes]) == [GetStatus.MISS]
        memory.release_many(keys("e", 0, [5]))
    cpu.check_integrity()


def test_a_failing_tier_fails_the_store_never_the_caller(
    caches: tuple[ModelGroups, torch.Tensor, object], mode: dict[str, object]
) -> None:
    """A closed CPU tier raises on every call: the store is reported failed, the load
    too, and neither raises into the engine's thread."""
    _, buffer, canonical = caches
    cpu = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    with in_place_engine(canonical, TieredStore([cpu]), mode) as engine:
        cpu.close()
        parts = [TransferPart(0, [1, 2, 3], keys("f", 0, [1, 2, 3]))]
        result = run(engine, engine.submit_store(parts))
        assert not result.ok and result.failed_block_ids[0] == (1, 2, 3)
        before = buffer.clone()
        result = run(engine, engine.submit_load(parts))
        assert not result.ok and torch.equal(buffer, before)
        engine.check_integrity()


def test_blocks_the_cpu_tier_has_no_room_for_still_reach_the_disk_tier(
    tmp_path: Path,
    caches: tuple[ModelGroups, torch.Tensor, object],
    mode: dict[str, object],
) -> None:
    """One store larger than the CPU tier: what its memory cannot take goes through the
    tiered store's put, so the disk tier gets every block and every block reads back."""
    model_groups, buffer, canonical = caches
    block_bytes = model_groups.groups[0].block_bytes
    cpu, disk, store = cpu_and_disk(tmp_path, cpu_bytes=4 * block_bytes)
    ids = list(range(1, 13))
    parts = [TransferPart(0, ids, keys("big", 0, ids))]
    with in_place_engine(canonical, store, mode) as engine:
        result = run(engine, engine.submit_store(parts))
        assert result.ok and result.ok_block_ids[0] == tuple(ids)
        assert store.flush(30)
        assert all(disk.contains_many(keys("big", 0, ids))), "every block reached the disk"
        assert 0 < sum(cpu.contains_many(keys("big", 0, ids))) <= 4
        assert_load_restores(engine, parts, buffer, canonical, ids)
        engine.check_integrity()
    store.check_integrity()
    store.close()


def test_a_load_part_reads_only_the_tier_it_names(
    tmp_path: Path,
    caches: tuple[ModelGroups, torch.Tensor, object],
    mode: dict[str, object],
) -> None:
    """Whole-request selection: a part naming the disk tier reads every block from the
    disk, even those the CPU tier's memory holds; one naming the CPU tier borrows from
    its memory and never reads the disk, so a block only on disk fails."""
    model_groups, buffer, canonical = caches
    block_bytes = model_groups.groups[0].block_bytes
    cpu, disk, store = cpu_and_disk(tmp_path)
    ids = [3, 5, 8, 13]
    stored = keys("n", 0, ids)
    with in_place_engine(canonical, store, mode) as engine:
        assert run(engine, engine.submit_store([TransferPart(0, ids, stored)])).ok
        assert store.flush(30) and all(disk.contains_many(stored))
        # The CPU tier now holds other bytes under the same keys: the bytes loaded name
        # the tier that served them.
        assert cpu.delete_many(stored) == len(ids)
        other = [np.full(block_bytes, 7, np.uint8) for _ in ids]
        assert cpu.put_many(stored, other) == [PutStatus.OK] * len(ids)
        cpu_gets, disk_gets = cpu.stats().gets, disk.stats().gets
        from_disk = [TransferPart(0, ids, stored, tier_index=1)]
        assert_load_restores(
            engine, from_disk, buffer, canonical, ids, "every block came from the disk tier"
        )
        assert disk.stats().gets == disk_gets + len(ids) and cpu.stats().gets == cpu_gets
        from_cpu = [TransferPart(0, ids, stored, tier_index=0)]
        assert run(engine, engine.submit_load(from_cpu)).ok
        assert all(block_bytes_of(canonical, 0, b) == bytes([7]) * block_bytes for b in ids)
        assert disk.stats().gets == disk_gets + len(ids), "the CPU tier served them all"
        assert engine.arena.used_bytes == 0
        # Only on disk now: a load naming the CPU tier misses it, its KV untouched.
        assert cpu.delete_many(stored[:1]) == 1
        for t in canonical.tensors:  # type: ignore[attr-defined]
            t[ids[0]] = 9
        result = run(engine, engine.submit_load(from_cpu))
        assert result.failed_block_ids[0] == (ids[0],) and result.ok_block_ids[0] == tuple(ids[1:])
        assert all(bool((t[ids[0]] == 9).all()) for t in canonical.tensors)  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="tier_index=2 not in"):
            engine.submit_load([TransferPart(0, ids, stored, tier_index=2)])
        with pytest.raises(ValueError, match="a store goes to every tier"):
            engine.submit_store([TransferPart(0, ids, stored, tier_index=0)])
        engine.check_integrity()
    store.check_integrity()
    store.close()
