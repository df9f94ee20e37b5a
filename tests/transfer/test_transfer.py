"""Transfer engine: store -> wipe -> load round trips for every group kind and storage
layout, corruption and misses, backpressure, timeouts, cancel, many concurrent jobs,
the staging allocator against a brute-force model, and a tier framing objects in
place in staging (header room, parked regions)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind, canonicalize
from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierStats,
    TierUsage,
    check_batch,
)
from hybridkv.tiers.codec import (
    HEADER_BYTES,
    checksum,
    pack_header,
    verify_header,
    verify_object,
    write_header_into,
)
from hybridkv.tools.allocate import AllocatedKVCaches, allocate_kv_caches
from hybridkv.transfer import (
    BlockCopier,
    JobId,
    JobKind,
    JobOutcome,
    JobResult,
    StagingArena,
    TransferConfig,
    TransferEngine,
    TransferPart,
)
from hybridkv.transfer.staging import PHASE_BYTES, STAGING_ALIGN_BYTES
from tests.support.errors import assert_names_every_problem
from tests.support.kv_caches import VllmAllocate, qwen_next_like, real_vllm_allocator

pytestmark = pytest.mark.timeout(120)

# ---------------------------------------------------------------- a small in-memory tier


class MemoryTier(Tier):
    """A real dict-backed tier storing header + payload, verified on every read.

    ``gate`` (cleared = closed) holds every call until opened; ``entered`` is set when
    a call is waiting at or past the gate. ``fail_keys`` answer ERROR; ``raise_next``
    makes the next call raise.
    """

    name = "memory"

    def __init__(self) -> None:
        self._objects: dict[StoreKey, bytes] = {}
        self._lock = threading.Lock()
        self._stats = TierStats()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_keys: set[StoreKey] = set()
        self.raise_next: Exception | None = None
        self.num_calls = 0

    def hold(self) -> None:
        """Close the gate: the next calls wait there, and ``entered`` is set by the first."""
        self.gate.clear()
        self.entered.clear()

    def _enter(self) -> None:
        self.num_calls += 1
        self.entered.set()
        self.gate.wait()
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            return [k in self._objects for k in keys]

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        check_batch(keys, buffers)
        self._enter()
        out = []
        with self._lock:
            for key, buf in zip(keys, buffers, strict=True):
                if key in self.fail_keys:
                    out.append(PutStatus.ERROR)
                elif key in self._objects:
                    out.append(PutStatus.EXISTS)
                else:
                    self._objects[key] = pack_header(key, buf) + buf.tobytes()
                    self._stats.puts += 1
                    out.append(PutStatus.OK)
        return out

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        self._enter()
        out = []
        with self._lock:
            for key, buf in zip(keys, buffers, strict=True):
                data = self._objects.get(key)
                if key in self.fail_keys:
                    out.append(GetStatus.ERROR)
                elif data is None:
                    out.append(GetStatus.MISS)
                else:
                    payload = np.frombuffer(data, np.uint8, offset=HEADER_BYTES)
                    if len(payload) != len(buf) or verify_object(data, key, payload):
                        self._stats.corrupt += 1
                        out.append(GetStatus.CORRUPT)
                    else:
                        buf[:] = payload
                        out.append(GetStatus.OK)
        return out

    def corrupt(self, key: StoreKey) -> None:
        """Flip one payload bit of a stored object (as a bad disk or wire would)."""
        with self._lock:
            data = bytearray(self._objects[key])
            data[HEADER_BYTES + len(data) // 3] ^= 0x10
            self._objects[key] = bytes(data)

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        with self._lock:
            return sum(self._objects.pop(k, None) is not None for k in keys)

    def usage(self) -> TierUsage:
        with self._lock:
            used = sum(len(v) for v in self._objects.values())
            return TierUsage(num_objects=len(self._objects), used_bytes=used, capacity_bytes=None)

    def stats(self) -> TierStats:
        return self._stats

    def check_integrity(self) -> None:
        """Every object carries a header for its own key and length (payloads may be
        corrupt on purpose: reads must catch that)."""
        with self._lock:
            for key, data in self._objects.items():
                assert verify_header(data, key, len(data) - HEADER_BYTES) is None, key


# ---------------------------------------------------------------- fixtures and helpers


def kv_group(kind: GroupKind, names: tuple[str, ...], page: int) -> KVGroup:
    extra: dict[str, int] = {}
    if kind is GroupKind.SLIDING_WINDOW:
        extra["sliding_window"] = 64
    if kind is GroupKind.CHUNKED_LOCAL:
        extra["attention_chunk_size"] = 128
    return KVGroup(kind=kind, block_size=32, page_size_bytes=page, layer_names=names, **extra)


ALL_KINDS = ModelGroups(
    groups=(
        kv_group(GroupKind.FULL, ("f.0", "f.4"), 2048),
        kv_group(GroupKind.SLIDING_WINDOW, ("s.1", "s.5"), 2048),
        kv_group(GroupKind.CHUNKED_LOCAL, ("c.2", "c.6"), 2048),
        kv_group(GroupKind.MAMBA, ("m.3", "m.7"), 2048),
    )
)
UNEVEN = ModelGroups(
    groups=(
        kv_group(GroupKind.FULL, ("f.0", "f.1", "f.2"), 1024),
        kv_group(GroupKind.MAMBA, ("m.3",), 1000),
    )
)
MIXED_PAGES = ModelGroups(  # DeepSeek-V4-like: one block of group 0 is three page sizes
    groups=(
        KVGroup(
            kind=GroupKind.FULL,
            block_size=32,
            page_size_bytes=2048,
            layer_names=("csa.0", "indexer.0", "hca.1", "csa.2"),
            layer_page_sizes_bytes=(2048, 512, 96, 2048),
        ),
        kv_group(GroupKind.SLIDING_WINDOW, ("swa.0", "swa.1"), 2048),
        KVGroup(
            kind=GroupKind.SLIDING_WINDOW,
            block_size=32,
            page_size_bytes=1024,
            sliding_window=8,
            layer_names=("state.0", "indexer_state.0"),
            layer_page_sizes_bytes=(1024, 256),
        ),
    )
)
NUM_BLOCKS = 24


def shapes_for(model_groups: ModelGroups) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Engine-like dtypes: bf16 attention pages, raw int8 Mamba state."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for g in model_groups.groups:
        for name, page in zip(g.layer_names, g.page_sizes_bytes, strict=True):
            if g.kind is GroupKind.MAMBA:
                shapes[name] = ((1, 1, page), torch.int8)
            else:
                shapes[name] = ((2, 8, page // 32), torch.bfloat16)
    return shapes


def allocate(model_groups: ModelGroups, kind: KVLayoutKind) -> AllocatedKVCaches:
    return allocate_kv_caches(model_groups, NUM_BLOCKS, kind=kind, shapes=shapes_for(model_groups))


def separate_tensors(model_groups: ModelGroups) -> dict[str, torch.Tensor]:
    """One tensor per layer, as an engine without a shared pool registers them."""
    kv = {}
    for name, (shape, dtype) in shapes_for(model_groups).items():
        kv[name] = torch.zeros((NUM_BLOCKS, *shape), dtype=dtype)
    return kv


def fill_random(kv: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def pool_block_ids(model_groups: ModelGroups, seed: int, per_group: int) -> list[list[int]]:
    """Disjoint block ids per group, drawn from one pool like an engine's allocator."""
    pool = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(pool)
    return [pool[g * per_group : (g + 1) * per_group] for g in range(model_groups.num_groups)]


def keys_for(group_id: int, block_ids: Sequence[int], tag: str = "") -> list[StoreKey]:
    return [StoreKey(f"{tag}g{group_id}/b{b}") for b in block_ids]


def parts_for(ids: list[list[int]], tag: str = "") -> list[TransferPart]:
    return [TransferPart(g, b, keys_for(g, b, tag)) for g, b in enumerate(ids)]


def snapshot(
    kv: dict[str, torch.Tensor], model_groups: ModelGroups, ids: list[list[int]]
) -> dict[tuple[str, int], torch.Tensor]:
    return {
        (name, b): kv[name][b].clone()
        for g, group_ids in enumerate(ids)
        for name in model_groups.groups[g].layer_names
        for b in group_ids
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes make NaNs, which never compare equal as floats)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


WIPED = 0x5A


def wipe(kv: dict[str, torch.Tensor], value: int = WIPED) -> None:
    for t in kv.values():
        t.view(torch.uint8).fill_(value)


def store_then_wipe(
    engine: TransferEngine, kv: dict[str, torch.Tensor], ids: list[list[int]]
) -> None:
    """Store the blocks ``ids`` name, then wipe the KV cache: only a load brings them back."""
    assert run_job(engine, engine.submit_store(parts_for(ids))).ok
    wipe(kv)


def still_wiped(kv: dict[str, torch.Tensor]) -> bool:
    """Whether every cache still holds only the bytes ``wipe`` wrote: nothing was loaded."""
    return all(bool((t.view(torch.uint8) == WIPED).all()) for t in kv.values())


def run_job(engine: TransferEngine, job_id: JobId | None) -> JobResult:
    assert job_id is not None
    assert engine.wait([job_id], timeout_s=30)
    results = engine.poll_finished()
    assert [r.job_id for r in results] == [job_id]
    return results[0]


def assert_store_wipe_load_restores(
    engine: TransferEngine,
    kv: dict[str, torch.Tensor],
    ids: list[list[int]],
    saved: dict[tuple[str, int], torch.Tensor],
) -> None:
    """Store the blocks, overwrite the caches, load them back: the saved bytes return."""
    store_then_wipe(engine, kv, ids)
    assert run_job(engine, engine.submit_load(parts_for(ids))).ok
    for (name, b), want in saved.items():
        assert same_bytes(kv[name][b], want), (name, b)


def assert_idle(engine: TransferEngine, tier: MemoryTier) -> None:
    assert engine.wait_idle(timeout_s=30)
    engine.check_integrity()
    tier.check_integrity()
    assert engine.num_inflight_bytes == 0
    assert engine.arena.free_bytes == engine.arena.total_bytes


@pytest.fixture
def tier() -> Iterator[MemoryTier]:
    t = MemoryTier()
    yield t
    t.gate.set()


def make_engine(
    kv_caches: dict[str, torch.Tensor], model_groups: ModelGroups, tier: Tier, **cfg: object
) -> TransferEngine:
    config = TransferConfig(**{"staging_bytes": 1 << 20, **cfg})  # type: ignore[arg-type]
    return TransferEngine(canonicalize(kv_caches, model_groups), tier, config)


@contextmanager
def stored_then_wiped(
    tier: Tier, storage: str, seed: int, per_group: int
) -> Iterator[tuple[TransferEngine, dict[str, torch.Tensor], list[list[int]]]]:
    """An engine over random ``ALL_KINDS`` caches in ``storage`` that stored the blocks
    ``ids`` names, then had its caches wiped: only a load brings them back."""
    kv = build(ALL_KINDS, storage)
    fill_random(kv, seed=seed)
    ids = pool_block_ids(ALL_KINDS, seed=seed + 1, per_group=per_group)
    with make_engine(kv, ALL_KINDS, tier) as engine:
        store_then_wipe(engine, kv, ids)
        yield engine, kv, ids


# ---------------------------------------------------------------- round trips

STORAGES = ["block_major", "layer_major", "separate"]


def build(model_groups: ModelGroups, storage: str) -> dict[str, torch.Tensor]:
    if storage == "separate":
        return separate_tensors(model_groups)
    return allocate(model_groups, KVLayoutKind(storage)).kv_caches


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
    "model_groups", [ALL_KINDS, UNEVEN, MIXED_PAGES], ids=["all_kinds", "uneven", "mixed_pages"]
)
def test_store_wipe_load_restores_every_group(
    tier: MemoryTier, model_groups: ModelGroups, storage: str
) -> None:
    kv = build(model_groups, storage)
    fill_random(kv, seed=1)
    ids = pool_block_ids(model_groups, seed=2, per_group=5)
    saved = snapshot(kv, model_groups, ids)
    with make_engine(kv, model_groups, tier) as engine:
        stored = run_job(engine, engine.submit_store(parts_for(ids)))
        assert stored.ok and stored.kind is JobKind.STORE
        assert stored.ok_block_ids == {g: tuple(b) for g, b in enumerate(ids)}
        wipe(kv)
        loaded = run_job(engine, engine.submit_load(parts_for(ids)))
        assert loaded.ok and loaded.detail is None and loaded.outcome is JobOutcome.OK
        for (name, b), want in saved.items():
            assert same_bytes(kv[name][b], want), (name, b)
        stats = engine.stats()
        assert stats.ok_blocks == {
            "store": 5 * model_groups.num_groups,
            "load": 5 * model_groups.num_groups,
        }
        assert stats.bytes["load"] == sum(5 * g.block_bytes for g in model_groups.groups)
        assert_idle(engine, tier)


@pytest.mark.parametrize("model_groups", [ALL_KINDS, MIXED_PAGES], ids=["all_kinds", "mixed_pages"])
@pytest.mark.parametrize("source", STORAGES)
@pytest.mark.parametrize("target", STORAGES)
def test_objects_load_into_another_storage_layout(
    tier: MemoryTier, source: str, target: str, model_groups: ModelGroups
) -> None:
    src, dst = build(model_groups, source), build(model_groups, target)
    fill_random(src, seed=3)
    ids = pool_block_ids(model_groups, seed=4, per_group=4)
    with make_engine(src, model_groups, tier) as store_engine:
        assert run_job(store_engine, store_engine.submit_store(parts_for(ids))).ok
        assert_idle(store_engine, tier)
    with make_engine(dst, model_groups, tier) as load_engine:
        assert run_job(load_engine, load_engine.submit_load(parts_for(ids))).ok
        assert_idle(load_engine, tier)
    for g, group_ids in enumerate(ids):
        for name in model_groups.groups[g].layer_names:
            for b in group_ids:
                assert same_bytes(dst[name][b], src[name][b]), (name, b)


@pytest.fixture(scope="module")
def vllm_allocate() -> VllmAllocate:
    return real_vllm_allocator()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
def test_round_trip_through_real_vllm_kv_caches(
    tier: MemoryTier,
    vllm_allocate: VllmAllocate,
    layout_name: str,
) -> None:
    """vLLM's own allocator: groups overlay one buffer, Mamba pages padded."""
    kv, attn_page, _ = vllm_allocate(layout_name)
    model_groups = qwen_next_like(attn_page, attn_page)
    fill_random(kv, seed=21)
    ids = pool_block_ids(model_groups, seed=22, per_group=4)
    saved = snapshot(kv, model_groups, ids)
    with make_engine(kv, model_groups, tier) as engine:
        expected = 1 if layout_name == "BLHNC" else 2
        assert [engine.copier.copies_per_block(g) for g in range(3)] == [expected] * 3
        assert_store_wipe_load_restores(engine, kv, ids, saved)
        assert_idle(engine, tier)


def test_store_gathers_before_returning(tier: MemoryTier) -> None:
    """The engine may overwrite blocks right after submit: the tier gets the old bytes."""
    kv = build(ALL_KINDS, "block_major")
    fill_random(kv, seed=5)
    ids = pool_block_ids(ALL_KINDS, seed=6, per_group=3)
    saved = snapshot(kv, ALL_KINDS, ids)
    with make_engine(kv, ALL_KINDS, tier) as engine:
        tier.gate.clear()
        job = engine.submit_store(parts_for(ids))
        fill_random(kv, seed=7)  # the engine reuses the blocks
        tier.gate.set()
        assert run_job(engine, job).ok
        wipe(kv)
        assert run_job(engine, engine.submit_load(parts_for(ids))).ok
        for (name, b), want in saved.items():
            assert same_bytes(kv[name][b], want)
        assert_idle(engine, tier)


# ---------------------------------------------------------------- failures are values


def test_corrupt_missing_and_failing_blocks_are_reported_and_never_scattered(
    tier: MemoryTier,
) -> None:
    model_groups = ALL_KINDS
    kv = build(model_groups, "layer_major")
    fill_random(kv, seed=8)
    ids = pool_block_ids(model_groups, seed=9, per_group=4)
    saved = snapshot(kv, model_groups, ids)
    with make_engine(kv, model_groups, tier) as engine:
        assert run_job(engine, engine.submit_store(parts_for(ids))).ok
        bad = {0: {ids[0][1]}, 1: {ids[1][0], ids[1][3]}, 2: {ids[2][2]}, 3: {ids[3][0]}}
        tier.corrupt(keys_for(0, [ids[0][1]])[0])
        tier.corrupt(keys_for(1, [ids[1][0]])[0])
        tier.delete_many(keys_for(1, [ids[1][3]]))
        tier.corrupt(keys_for(2, [ids[2][2]])[0])
        tier.fail_keys.add(keys_for(3, [ids[3][0]])[0])
        wipe(kv)
        result = run_job(engine, engine.submit_load(parts_for(ids)))
        assert {g: set(b) for g, b in result.failed_block_ids.items()} == bad
        assert result.num_failed == 5 and not result.ok
        assert result.detail == "3 corrupt, 1 error, 1 miss" and result.outcome is JobOutcome.FAILED
        for (name, b), want in saved.items():
            owner = model_groups.group_of_layer(name)
            if b in bad[owner]:
                assert bool((kv[name][b].view(torch.uint8) == 0x5A).all()), (name, b)
            else:
                assert same_bytes(kv[name][b], want), (name, b)
        assert engine.stats().statuses == {"corrupt": 3, "error": 1, "miss": 1}
        assert_idle(engine, tier)


def test_a_tier_that_raises_fails_the_whole_job(tier: MemoryTier) -> None:
    kv = build(ALL_KINDS, "block_major")
    ids = pool_block_ids(ALL_KINDS, seed=10, per_group=2)
    with make_engine(kv, ALL_KINDS, tier) as engine:
        tier.raise_next = ConnectionError("pool is down")
        result = run_job(engine, engine.submit_store(parts_for(ids)))
        assert result.ok_block_ids == {g: () for g in range(4)}
        assert result.failed_block_ids == {g: tuple(b) for g, b in enumerate(ids)}
        assert result.detail == "tier memory raised ConnectionError: pool is down"
        assert result.outcome is JobOutcome.ERROR
        wipe(kv, 0x11)
        tier.raise_next = OSError("disk gone")
        result = run_job(engine, engine.submit_load(parts_for(ids)))
        assert result.num_failed == 8 and "OSError: disk gone" in (result.detail or "")
        assert all(bool((t.view(torch.uint8) == 0x11).all()) for t in kv.values())
        assert_idle(engine, tier)


class ShortTier(MemoryTier):
    """Answers one status fewer than asked: a broken tier, caught at the boundary."""

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        return super().get_many_into(keys, buffers)[:-1]


def test_a_tier_answering_the_wrong_number_of_statuses_fails_the_job() -> None:
    tier = ShortTier()
    with stored_then_wiped(tier, "block_major", seed=19, per_group=2) as (engine, kv, ids):
        result = run_job(engine, engine.submit_load(parts_for(ids)))
        assert result.num_failed == 8
        assert "returned 7 statuses for 8 keys" in (result.detail or "")
        assert still_wiped(kv)
        assert_idle(engine, tier)


# ---------------------------------------------------------------- backpressure, timeouts, cancel


def test_backpressure_returns_none_and_recovers(tier: MemoryTier) -> None:
    model_groups = ALL_KINDS
    kv = build(model_groups, "block_major")
    block_bytes = model_groups.groups[0].block_bytes  # 4096
    with make_engine(kv, model_groups, tier, staging_bytes=5 * block_bytes) as engine:
        tier.gate.clear()
        jobs = []
        for b in range(NUM_BLOCKS):
            job = engine.submit_store([TransferPart(0, [b], keys_for(0, [b]))])
            if job is None:
                break
            jobs.append(job)
        assert len(jobs) == 5  # the bound: five 4096-byte blocks
        assert engine.num_inflight_bytes == 5 * block_bytes
        assert engine.stats().backpressured == 1
        tier.gate.set()
        assert engine.wait(jobs, timeout_s=30)
        assert sorted(r.job_id for r in engine.poll_finished()) == sorted(jobs)
        assert engine.submit_store([TransferPart(0, [7], keys_for(0, [7]))]) is not None
        with pytest.raises(ValueError, match="split the job or raise"):
            engine.submit_load([TransferPart(0, list(range(6)), keys_for(0, range(6)))])
        assert_idle(engine, tier)


def test_load_past_its_timeout_fails_and_its_late_bytes_are_dropped(tier: MemoryTier) -> None:
    with stored_then_wiped(tier, "block_major", seed=11, per_group=3) as (engine, kv, ids):
        tier.hold()
        job = engine.submit_load(parts_for(ids), timeout_s=0.05)
        assert tier.entered.wait(10)  # the tier call is running
        time.sleep(0.1)
        [result] = engine.poll_finished()
        assert result.job_id == job and result.num_failed == 12
        assert result.detail == "timed out after 0.05 s" and result.outcome is JobOutcome.TIMED_OUT
        assert engine.num_inflight_bytes > 0  # the tier may still write into staging
        tier.gate.set()
        assert_idle(engine, tier)
        assert engine.poll_finished() == []  # reported once
        assert still_wiped(kv)
        assert engine.stats().timeouts == 1


def test_cancel_queued_and_running_jobs(tier: MemoryTier) -> None:
    with stored_then_wiped(tier, "layer_major", seed=13, per_group=2) as (engine, kv, ids):
        tier.hold()
        running = engine.submit_load(parts_for(ids))
        assert running is not None and tier.entered.wait(10)
        queued = engine.submit_load(parts_for(ids))
        assert queued is not None
        assert engine.cancel(queued) and engine.cancel(running)
        assert not engine.cancel(queued) and not engine.cancel(JobId(999))
        results = {r.job_id: r for r in engine.poll_finished()}
        assert set(results) == {running, queued}
        assert all(
            r.detail == "cancelled" and r.outcome is JobOutcome.CANCELLED and r.num_failed == 8
            for r in results.values()
        )
        tier.gate.set()
        assert_idle(engine, tier)
        assert still_wiped(kv)
        assert tier.num_calls == 2  # the queued load never reached the tier
        assert engine.stats().cancels == 2


def test_loads_overtake_queued_stores(tier: MemoryTier) -> None:
    kv = build(ALL_KINDS, "block_major")
    with make_engine(kv, ALL_KINDS, tier) as engine:
        tier.hold()
        first = engine.submit_store([TransferPart(0, [0], keys_for(0, [0]))])
        assert tier.entered.wait(10)
        store = engine.submit_store([TransferPart(0, [1], keys_for(0, [1]))])
        load = engine.submit_load([TransferPart(0, [2], keys_for(0, [0]))])
        tier.gate.set()
        assert engine.wait(timeout_s=30)
        assert [r.job_id for r in engine.poll_finished()] == [first, load, store]
        assert_idle(engine, tier)


def test_close_cancels_queued_jobs_and_refuses_new_ones(tier: MemoryTier) -> None:
    kv = build(ALL_KINDS, "block_major")
    engine = make_engine(kv, ALL_KINDS, tier)
    tier.hold()
    running = engine.submit_store([TransferPart(0, [0], keys_for(0, [0]))])
    assert tier.entered.wait(10)
    queued = engine.submit_store([TransferPart(0, [1], keys_for(0, [1]))])
    threading.Timer(0.1, tier.gate.set).start()
    engine.close()
    results: dict[JobId | None, JobResult] = {r.job_id: r for r in engine.poll_finished()}
    assert results[queued].outcome is JobOutcome.CLOSED and results[running].ok
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_load([TransferPart(0, [0], keys_for(0, [0]))])
    engine.close()  # idempotent
    assert_idle(engine, tier)


# ---------------------------------------------------------------- edge cases and validation


def test_empty_jobs_finish_without_calling_the_tier(tier: MemoryTier) -> None:
    kv = build(ALL_KINDS, "block_major")
    with make_engine(kv, ALL_KINDS, tier) as engine:
        store = engine.submit_store([])
        load = engine.submit_load([TransferPart(2, [], [])])
        results: dict[JobId | None, JobResult] = {r.job_id: r for r in engine.poll_finished()}
        assert results[store].ok and results[store].ok_block_ids == {}
        assert results[load].ok and results[load].ok_block_ids == {2: ()}
        assert tier.num_calls == 0
        assert_idle(engine, tier)


def test_invalid_parts_name_every_problem(tier: MemoryTier) -> None:
    kv = build(ALL_KINDS, "block_major")
    with make_engine(kv, ALL_KINDS, tier) as engine:
        with pytest.raises(ValueError) as err:
            engine.submit_load(
                [
                    TransferPart(7, [1], keys_for(7, [1])),
                    TransferPart(0, [1, 1], keys_for(0, [1, 2])),
                    TransferPart(1, [NUM_BLOCKS], keys_for(1, [0])),
                    TransferPart(2, [3, 4], keys_for(2, [3])),
                    TransferPart(2, [5], keys_for(2, [5])),
                ]
            )
        text = str(err.value)
        assert "parts[0].group_id=7 not in [0, 4)" in text
        assert "parts[1]: group 0: block ids [1, 1] has duplicates" in text
        assert f"parts[2]: group 1: block ids [{NUM_BLOCKS}] not in [0, {NUM_BLOCKS})" in text
        assert "parts[3]: 1 keys for 2 block ids" in text
        assert "parts[4]: group 2 appears twice" in text
        assert tier.num_calls == 0
        assert_idle(engine, tier)


def test_many_concurrent_jobs_account_for_every_block(tier: MemoryTier) -> None:
    """Random mixed stores and loads on two workers: one result per job, data intact."""
    model_groups = UNEVEN
    kv = build(model_groups, "layer_major")
    rng = random.Random(15)
    fill_random(kv, seed=16)
    ids = pool_block_ids(model_groups, seed=17, per_group=10)
    saved = snapshot(kv, model_groups, ids)
    stored: set[tuple[int, int]] = set()
    submitted: dict[JobId, TransferPart] = {}
    results: list[JobResult] = []
    with make_engine(kv, model_groups, tier, staging_bytes=32 << 10, num_workers=2) as engine:
        for step in range(300):
            g = rng.randrange(model_groups.num_groups)
            blocks = rng.sample(ids[g], rng.randint(1, 4))
            part = TransferPart(g, blocks, keys_for(g, blocks))
            is_store = step < 20 or rng.random() < 0.5
            job = engine.submit_store([part]) if is_store else engine.submit_load([part])
            if job is None:
                results += engine.poll_finished()
                continue
            submitted[job] = part
            if is_store:
                stored.update((g, b) for b in blocks)
            if step % 7 == 0:
                results += engine.poll_finished()
        assert engine.wait(timeout_s=60)
        results += engine.poll_finished()
        assert sorted(r.job_id for r in results) == sorted(submitted)
        for r in results:
            done = submitted[r.job_id]
            assert set(r.ok_block_ids[done.group_id]) | set(
                r.failed_block_ids[done.group_id]
            ) == set(done.block_ids)
            if r.kind is JobKind.STORE:
                assert r.ok
        assert engine.stats().backpressured > 0  # the bound was exercised
        wipe(kv)
        for g in range(model_groups.num_groups):
            blocks = [b for b in ids[g] if (g, b) in stored]
            for i in range(0, len(blocks), 4):  # jobs that fit the small staging arena
                chunk = blocks[i : i + 4]
                load = TransferPart(g, chunk, keys_for(g, chunk))
                assert run_job(engine, engine.submit_load([load])).ok
        for (name, b), want in saved.items():
            if (model_groups.group_of_layer(name), b) in stored:
                assert same_bytes(kv[name][b], want)
        assert_idle(engine, tier)


# ---------------------------------------------------------------- copier and staging


@pytest.mark.parametrize("storage", ["block_major", "layer_major"])
def test_copier_moves_one_span_per_block_major_block(storage: str) -> None:
    model_groups = ALL_KINDS
    alloc = allocate(model_groups, KVLayoutKind(storage))
    copier = BlockCopier(alloc.canonical)
    expected = 1 if storage == "block_major" else 2
    assert [copier.copies_per_block(g) for g in range(4)] == [expected] * 4
    fill_random(alloc.kv_caches, seed=18)
    out = np.empty(3 * 4096 + 1, np.uint8)[1:]  # deliberately misaligned
    copier.gather(3, [5, 0, 9], out)
    want = b"".join(
        alloc.kv_caches[name][b].contiguous().view(torch.uint8).numpy().tobytes()
        for b in (5, 0, 9)
        for name in model_groups.groups[3].layer_names
    )
    assert out.tobytes() == want


class CopierCase(NamedTuple):
    model_groups: ModelGroups
    kv_caches: dict[str, torch.Tensor]
    pages: dict[str, torch.Tensor]
    """Per layer: ``(num_blocks, page_bytes)`` int8 view of each block's page."""
    backing: list[torch.Tensor]
    """Every tensor that holds KV bytes (to compare whole caches after a scatter)."""


PAGE = 512
ONE_GROUP = ModelGroups(groups=(kv_group(GroupKind.FULL, ("a.0", "a.1"), PAGE),))


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)


def allocated_case(model_groups: ModelGroups, kind: KVLayoutKind, seed: int) -> CopierCase:
    alloc = allocate_kv_caches(model_groups, NUM_BLOCKS, kind=kind)
    alloc.buffer.copy_(random_bytes(alloc.buffer.numel(), seed))
    return CopierCase(model_groups, alloc.kv_caches, alloc.kv_caches, [alloc.buffer])


def placed_case(places: dict[str, tuple[int, int]], nbytes: int, seed: int) -> CopierCase:
    """ONE_GROUP's layers as views of one buffer: name -> (offset of block 0, stride)."""
    buffer = random_bytes(nbytes, seed)
    kv = {
        name: buffer.as_strided((NUM_BLOCKS, PAGE), (stride, 1), offset)
        for name, (offset, stride) in places.items()
    }
    return CopierCase(ONE_GROUP, kv, kv, [buffer])


def copier_case(name: str, seed: int) -> CopierCase:
    n = NUM_BLOCKS
    mixed = ModelGroups(
        groups=(
            kv_group(GroupKind.FULL, ("a.0", "a.1"), 2048),
            kv_group(GroupKind.MAMBA, ("m.0",), 4096),
        )
    )
    uneven_blocks = ModelGroups(
        groups=(
            kv_group(GroupKind.FULL, ("a.0",), 3000),
            kv_group(GroupKind.MAMBA, ("m.1", "m.2", "m.3"), 900),
        )
    )
    if name in ("block_major", "layer_major"):
        return allocated_case(ALL_KINDS, KVLayoutKind(name), seed)
    if name == "mixed_slots":  # slot 0 rows of 4096 bytes, slot 1 rows of 2048
        return allocated_case(mixed, KVLayoutKind.LAYER_MAJOR, seed)
    if name == "padded_rows":  # rows of 3008 bytes hold blocks of 3000 and 2700
        return allocated_case(uneven_blocks, KVLayoutKind.BLOCK_MAJOR, seed)
    if name == "separate":
        kv = {k: random_bytes(n * 2048, seed + i).view(n, 2048) for i, k in enumerate(ALL_NAMES)}
        return CopierCase(ALL_KINDS, kv, kv, list(kv.values()))
    if name == "reversed_slots":  # layer 1's slot comes first
        return placed_case({"a.0": (n * PAGE, PAGE), "a.1": (0, PAGE)}, 2 * n * PAGE, seed)
    if name == "gapped_rows":  # rows of three pages, the middle one unused
        return placed_case({"a.0": (0, 3 * PAGE), "a.1": (2 * PAGE, 3 * PAGE)}, 3 * n * PAGE, seed)
    if name == "aliased_layers":  # block b of a.1 is block b + 2 of a.0
        return placed_case({"a.0": (0, PAGE), "a.1": (2 * PAGE, PAGE)}, (n + 2) * PAGE, seed)
    assert name == "kernel_blocks"  # vLLM split each block into two kernel blocks
    storage = random_bytes(2 * n * PAGE, seed).view(2, 2 * n, PAGE // 2)
    kv = {"a.0": storage[0], "a.1": storage[1]}
    pages = {k: v.reshape(n, PAGE) for k, v in kv.items()}
    return CopierCase(ONE_GROUP, kv, pages, [storage])


ALL_NAMES = [name for g in ALL_KINDS.groups for name in g.layer_names]
COPIER_CASES = {  # case -> per group: do its CPU copies go block by block
    "block_major": [True] * 4,
    "layer_major": [True] * 4,
    "mixed_slots": [False, True],
    "padded_rows": [True, True],  # one span per block
    "separate": [True] * 4,  # a storage per layer: no span shares bytes
    "reversed_slots": [True],
    "gapped_rows": [True],
    "aliased_layers": [False],
    "kernel_blocks": [True],
}


def reference_scatter(
    case: CopierCase, group_id: int, ids: Sequence[int], rows: np.ndarray
) -> None:
    """Write rows layer by layer through the per-layer views: the general path's order."""
    g = case.model_groups.groups[group_id]
    page = g.page_size_bytes
    for i, name in enumerate(g.layer_names):
        for block_id, row in zip(ids, rows, strict=True):
            chunk = torch.from_numpy(row[i * page : (i + 1) * page].copy())
            case.pages[name][block_id].copy_(chunk.view(torch.int8))


@pytest.mark.parametrize("chunked", [False, True], ids=["native", "chunked"])
@pytest.mark.parametrize("name", list(COPIER_CASES))
def test_copier_paths_move_exactly_the_bytes_of_the_layer_views(name: str, chunked: bool) -> None:
    """Both paths: the native CPU one, and the chunked one CUDA takes (run here on CPU
    tensors, with a chunk of three blocks, so calls move several pieces)."""
    model_groups = copier_case(name, seed=5).model_groups
    rng = random.Random(name)
    chunk_bytes = 3 * max(g.block_bytes for g in model_groups.groups)
    for group_id, g in enumerate(model_groups.groups):
        case, expected = copier_case(name, seed=5), copier_case(name, seed=5)
        canonical = canonicalize(case.kv_caches, case.model_groups)
        copier = BlockCopier(canonical, chunked=chunked, chunk_bytes=chunk_bytes)
        if not chunked:
            assert copier.copies_block_by_block(group_id) == COPIER_CASES[name][group_id]
        ids = list(dict.fromkeys([*rng.sample(range(NUM_BLOCKS), 7), NUM_BLOCKS - 1, 0]))
        want = b"".join(
            case.pages[layer][b].numpy().tobytes() for b in ids for layer in g.layer_names
        )
        nbytes = len(ids) * g.block_bytes
        for shift in (0, 1):  # aligned and deliberately misaligned staging
            out = np.zeros(nbytes + 1, np.uint8)[shift : shift + nbytes]
            assert copier.gather(group_id, ids, out) is None
            assert out.tobytes() == want
        # Rows apart with their checksums taken as they are written (a framing tier's
        # put): each row's hash is the codec's checksum of what the row holds.
        stride = g.block_bytes + 3 * STAGING_ALIGN_BYTES
        framed = np.zeros((len(ids) - 1) * stride + g.block_bytes, np.uint8)
        hashes = copier.gather(group_id, ids, framed, row_stride=stride, hashed=True)
        rows_out = [framed[i * stride : i * stride + g.block_bytes] for i in range(len(ids))]
        assert b"".join(row.tobytes() for row in rows_out) == want
        assert hashes is not None and hashes.dtype == np.uint64
        assert hashes.tolist() == [checksum(row) for row in rows_out]
        # Scatter fresh rows (all, then a subset) and compare every KV byte with the
        # same writes done through the per-layer views of an identical cache.
        for only_rows in (None, [0, 2, 5]):
            rows = np.frombuffer(rng.randbytes(nbytes), np.uint8).copy()
            copier.scatter(group_id, ids, rows, only_rows=only_rows)
            picked = list(range(len(ids))) if only_rows is None else only_rows
            written = [ids[r] for r in picked]
            reference_scatter(expected, group_id, written, rows.reshape(len(ids), -1)[picked])
            for got, ref in zip(case.backing, expected.backing, strict=True):
                assert torch.equal(got, ref)


@pytest.mark.parametrize("name", ["layer_major", "separate"])
def test_copier_refuses_block_ids_outside_the_cache(name: str) -> None:
    case = copier_case(name, seed=6)
    copier = BlockCopier(canonicalize(case.kv_caches, case.model_groups))
    before = [t.clone() for t in case.backing]
    rows = np.ones(2 * ALL_KINDS.groups[0].block_bytes, np.uint8)
    for ids in ([1, -1], [NUM_BLOCKS, 0]):
        with pytest.raises(IndexError, match="not in"):
            copier.scatter(0, ids, rows)
        with pytest.raises(IndexError, match="not in"):
            copier.gather(0, ids, rows)
    with pytest.raises(IndexError, match="only_rows"):
        copier.scatter(0, [1, 2], rows, only_rows=[-1])
    with pytest.raises(ValueError, match="flat sequence"):
        copier.scatter(0, np.array([[1], [2]]), rows)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(case.backing, before, strict=True))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=60))
def test_staging_arena_matches_a_first_fit_model(ops: list[tuple[bool, int]]) -> None:
    total = 16 << 10
    arena = StagingArena(total)
    model: dict[int, int] = {}  # offset -> rounded size
    for allocate_now, n in ops:
        if allocate_now or not model:
            size = -(-n // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES
            expect = None
            position = 0
            for offset in [*sorted(model), total]:
                if offset - position >= size:
                    expect = position
                    break
                position = max(position, offset + model.get(offset, 0))
            got = arena.allocate(n)
            assert got == expect
            if got is not None:
                model[got] = size
                arena.view(got, n)[:] = 7  # writable, in bounds
        else:
            victim = sorted(model)[n % len(model)]
            arena.free(victim)
            del model[victim]
        arena.check_integrity()
        assert arena.used_bytes == sum(model.values())
    for offset in list(model):
        arena.free(offset)
    arena.check_integrity()
    assert arena.free_bytes == arena.total_bytes


@pytest.mark.parametrize("phase", [0, 16, 64, 2048, 4088])
def test_staging_arena_starts_at_the_asked_phase_of_a_page(phase: int) -> None:
    arena = StagingArena(64 << 10, address_phase=phase)
    assert arena.array.ctypes.data % PHASE_BYTES == phase
    assert arena.tensor.data_ptr() == arena.array.ctypes.data
    assert arena.total_bytes == 64 << 10 and not arena.array.any()
    with pytest.raises(ValueError, match="multiple of 8"):
        StagingArena(64 << 10, address_phase=phase + 4)


@pytest.mark.parametrize("storage", STORAGES)
def test_staging_shares_the_caches_phase_and_still_round_trips(
    tier: MemoryTier, storage: str
) -> None:
    model_groups = ALL_KINDS
    kv = build(model_groups, storage)
    fill_random(kv, seed=5)
    ids = pool_block_ids(model_groups, seed=6, per_group=3)
    saved = snapshot(kv, model_groups, ids)
    with make_engine(kv, model_groups, tier) as engine:
        phase = engine.caches.tensors[0].data_ptr() % PHASE_BYTES
        assert engine.arena.array.ctypes.data % PHASE_BYTES == phase // 8 * 8
        assert_store_wipe_load_restores(engine, kv, ids, saved)
        assert_idle(engine, tier)


# ---------------------------------------------------------------- header room in staging


class FramingTier(MemoryTier):
    """Stores header + payload framed in place in the room in front of each buffer.

    A put writes the header into the room and keeps room + payload as one
    object; a get writes the whole stored object back over room + buffer,
    corrupt or not (as a tier reading straight into staging does). ``busy``
    is what ``staging_busy`` answers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.staging: Buffer | None = None
        self.busy = False
        self.calls: list[list[tuple[int, int]]] = []
        """Per put: the staging address ranges its buffers and their room cover."""

    def register_staging(self, staging: Buffer) -> int:
        self.staging = staging
        return HEADER_BYTES

    def staging_busy(self) -> bool:
        return self.busy

    def _framed(self, buffer: Buffer) -> Buffer:
        assert self.staging is not None
        offset = int(buffer.ctypes.data) - int(self.staging.ctypes.data) - HEADER_BYTES
        assert offset >= 0, "a buffer without room in front"
        return self.staging[offset : offset + HEADER_BYTES + len(buffer)]

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        check_batch(keys, buffers, checksums)
        self._enter()
        # The engine took each block's checksum while gathering it; the header trusts
        # it, so the verify_object checks on what is stored test those checksums.
        assert checksums is not None, "a framing tier's stores come with their checksums"
        for key, buffer, value in zip(keys, buffers, checksums, strict=True):
            write_header_into(self._framed(buffer), key, buffer, value)
        framed = [self._framed(buffer) for buffer in buffers]
        self.calls.append([(int(f.ctypes.data), int(f.ctypes.data) + len(f)) for f in framed])
        with self._lock:
            for key, buffer in zip(keys, buffers, strict=True):
                self._objects.setdefault(key, self._framed(buffer).tobytes())
        return [PutStatus.OK] * len(keys)

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        self._enter()
        statuses = []
        for key, buffer in zip(keys, buffers, strict=True):
            data = self._objects.get(key)
            if data is None:
                statuses.append(GetStatus.MISS)
                continue
            framed = self._framed(buffer)
            framed[: len(data)] = np.frombuffer(data, np.uint8)[: len(framed)]
            bad = verify_object(framed[:HEADER_BYTES], key, framed[HEADER_BYTES:])
            statuses.append(GetStatus.CORRUPT if bad else GetStatus.OK)
        return statuses

    def corrupt(self, key: StoreKey) -> None:
        data = bytearray(self._objects[key])
        data[-1] ^= 0xFF
        self._objects[key] = bytes(data)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
    "model_groups", [ALL_KINDS, UNEVEN, MIXED_PAGES], ids=["all_kinds", "uneven", "mixed_pages"]
)
def test_headers_framed_in_place_never_clobber_neighbouring_blocks(
    model_groups: ModelGroups, storage: str
) -> None:
    tier = FramingTier()
    kv = build(model_groups, storage)
    fill_random(kv, seed=5)
    ids = pool_block_ids(model_groups, seed=6, per_group=5)
    saved = snapshot(kv, model_groups, ids)
    with make_engine(kv, model_groups, tier) as engine:
        assert engine.placement.room_bytes >= HEADER_BYTES
        assert_store_wipe_load_restores(engine, kv, ids, saved)
        engine.check_integrity()
    # Every stored object is its header then the block's bytes, whole.
    assert all(verify_object(o, k, np.frombuffer(o, np.uint8, offset=HEADER_BYTES)) is None
               for k, o in tier._objects.items())  # fmt: skip


def test_a_corrupt_object_read_into_staging_never_reaches_the_caches() -> None:
    tier = FramingTier()
    kv = build(ALL_KINDS, "block_major")
    fill_random(kv, seed=7)
    ids = pool_block_ids(ALL_KINDS, seed=8, per_group=4)
    saved = snapshot(kv, ALL_KINDS, ids)
    with make_engine(kv, ALL_KINDS, tier) as engine:
        parts = parts_for(ids)
        assert run_job(engine, engine.submit_store(parts)).ok
        bad_block = parts[0].block_ids[1]
        tier.corrupt(parts[0].keys[1])
        wipe(kv)
        result = run_job(engine, engine.submit_load(parts))
        assert result.outcome is JobOutcome.FAILED
        assert result.failed_block_ids[0] == (bad_block,)
        for (name, b), want in saved.items():
            if b == bad_block and name in ALL_KINDS.groups[0].layer_names:
                assert (kv[name][b].view(torch.uint8) == 0x5A).all(), "corrupt bytes scattered"
            else:
                assert same_bytes(kv[name][b], want), (name, b)
        engine.check_integrity()


def test_regions_stay_parked_while_the_tier_may_touch_staging() -> None:
    tier = FramingTier()
    kv = build(ALL_KINDS, "block_major")
    ids = pool_block_ids(ALL_KINDS, seed=9, per_group=2)
    with make_engine(kv, ALL_KINDS, tier) as engine:
        tier.busy = True  # as after a call the tier gave up on
        assert run_job(engine, engine.submit_store(parts_for(ids))).ok
        held = engine.num_inflight_bytes
        assert held > 0, "a region was freed while the tier said it may still use it"
        engine.check_integrity()
        assert not engine.wait_idle(timeout_s=0.05)
        assert run_job(engine, engine.submit_store(parts_for(ids, "again"))).ok
        first, second = tier.calls
        overlaps = [(a, b) for a in first for b in second if a[0] < b[1] and b[0] < a[1]]
        assert not overlaps, "a parked region was handed to the next job"
        assert engine.num_inflight_bytes == 2 * held
        tier.busy = False
        assert engine.wait_idle(timeout_s=5)
        assert engine.arena.free_bytes == engine.arena.total_bytes
        engine.check_integrity()


def test_transfer_config_names_every_bad_setting() -> None:
    with pytest.raises(ValueError) as info:
        TransferConfig(staging_bytes=0, num_workers=True, load_timeout_s=-1.0, pin_memory=1)  # type: ignore[arg-type]
    bad_settings = [
        "staging_bytes=0: must be greater than 0",
        "num_workers=True: must be a valid integer",
        "load_timeout_s=-1.0: must be greater than 0",
        "pin_memory=1: must be a valid boolean",
    ]
    assert_names_every_problem(info, "invalid TransferConfig: ", bad_settings)
    assert TransferConfig(load_timeout_s=None, store_timeout_s=5).store_timeout_s == 5
