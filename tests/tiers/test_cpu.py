"""CpuTier and its ExtentAllocator: round trips, LRU order, capacity, sizes, threads."""

from __future__ import annotations

import random
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import checksum, key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.memory import ALIGN_BYTES, PAGE_BYTES, ExtentAllocator, allocate_arena
from tests.support.threads import random_calls_on_threads


def digests(keys: list[StoreKey]) -> list[bytes]:
    """What ``CpuTier.lru_digests`` names these keys by."""
    return [key_digest(k) for k in keys]


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/cpu/{i}")


def payload(k: StoreKey, num_bytes: int, version: int = 0) -> np.ndarray:
    seed = zlib.crc32(k.encode()) + 7919 * version
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def cpu_tier(capacity_bytes: int) -> CpuTier:
    return CpuTier(CpuConfig(capacity_bytes=capacity_bytes, pin_memory=False))


def get_one(tier: CpuTier, k: StoreKey, num_bytes: int) -> tuple[GetStatus, np.ndarray]:
    out = np.zeros(num_bytes, dtype=np.uint8)
    return tier.get_many_into([k], [out])[0], out


# --- ExtentAllocator against a brute-force bitmap -----------------------------------------

NUM_UNITS = 32


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12 * ALIGN_BYTES)), max_size=80))
def test_allocator_matches_brute_force(ops: list[tuple[bool, int]]) -> None:
    allocator = ExtentAllocator(NUM_UNITS * ALIGN_BYTES)
    used = [False] * NUM_UNITS
    live: list[tuple[int, int]] = []
    for do_free, num_bytes in ops:
        if do_free and live:
            offset, units = live.pop(num_bytes % len(live))
            allocator.free(offset)
            used[offset // ALIGN_BYTES : offset // ALIGN_BYTES + units] = [False] * units
        else:
            units = -(-num_bytes // ALIGN_BYTES)
            longest_run = run = 0
            for flag in used:
                run = 0 if flag else run + 1
                longest_run = max(longest_run, run)
            new_offset = allocator.allocate(num_bytes)
            assert (new_offset is None) == (longest_run < units)
            if new_offset is not None:
                offset = new_offset
                first = offset // ALIGN_BYTES
                assert offset % ALIGN_BYTES == 0 and first + units <= NUM_UNITS
                assert not any(used[first : first + units]), "extent overlaps a live one"
                used[first : first + units] = [True] * units
                live.append((offset, units))
        allocator.check_integrity()
        assert allocator.allocated_bytes == sum(used) * ALIGN_BYTES


def test_allocator_reuses_exact_size_and_merges_neighbours() -> None:
    allocator = ExtentAllocator(10 * ALIGN_BYTES)
    a, b, c = (allocator.allocate(2 * ALIGN_BYTES) for _ in range(3))
    assert (a, b, c) == (0, 2 * ALIGN_BYTES, 4 * ALIGN_BYTES)
    assert b is not None and a is not None and c is not None
    allocator.free(b)
    assert allocator.allocate(2 * ALIGN_BYTES) == b  # exact-size hole, not the tail
    allocator.free(a)
    allocator.free(b)
    allocator.free(c)
    allocator.check_integrity()
    assert allocator.allocate(10 * ALIGN_BYTES) == 0  # all merged back into one extent


# --- CpuTier --------------------------------------------------------------------------------


def test_round_trip_random_sizes() -> None:
    rng = random.Random(1)
    tier = cpu_tier(8 << 20)
    sizes = {key(i): rng.choice([0, 1, 63, 64, 65, rng.randrange(1, 300_000)]) for i in range(60)}
    statuses = tier.put_many(list(sizes), [payload(k, n) for k, n in sizes.items()])
    assert statuses == [PutStatus.OK] * len(sizes)
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes.values()]
    assert tier.get_many_into(list(sizes), outs) == [GetStatus.OK] * len(sizes)
    for (k, n), out in zip(sizes.items(), outs, strict=True):
        assert np.array_equal(out, payload(k, n))
    assert tier.usage().used_bytes == sum(sizes.values())
    assert tier.stats().get_bytes == sum(sizes.values())
    tier.check_integrity()


def test_lru_eviction_order_with_uniform_sizes() -> None:
    size = 1000  # rounds to 1024: four fit in 4096 bytes
    tier = cpu_tier(4096)
    keys = [key(i) for i in range(6)]
    tier.put_many(keys[:4], [payload(k, size) for k in keys[:4]])
    assert get_one(tier, keys[0], size)[0] is GetStatus.OK  # 0 becomes most recent
    assert tier.put_many([keys[1]], [payload(keys[1], size)]) == [PutStatus.EXISTS]  # so does 1
    tier.put_many(keys[4:], [payload(k, size) for k in keys[4:]])
    assert tier.contains_many(keys) == [True, True, False, False, True, True]
    assert tier.lru_digests() == digests([keys[0], keys[1], keys[4], keys[5]])
    assert tier.stats().evictions == 2
    tier.check_integrity()


def test_touch_sets_the_order_evictions_then_follow() -> None:
    """A chain touched last block first: later puts evict its tail first, its head last."""
    size = 1000  # rounds to 1024: eight fit in 8192 bytes
    tier = cpu_tier(8192)
    chain = [key(f"chain/{i}") for i in range(8)]
    tier.put_many(chain, [payload(k, size) for k in chain])  # block 0 least recent
    tier.retention.touch([*reversed(chain), key("absent")])
    assert tier.lru_digests() == digests(chain[::-1])
    assert tier.stats().gets == 0  # a touch is no read
    for n, k in enumerate(key(f"new/{i}") for i in range(5)):
        assert tier.put_many([k], [payload(k, size)]) == [PutStatus.OK]
        assert tier.contains_many(chain) == [True] * (7 - n) + [False] * (n + 1)
    assert tier.stats().evictions == 5
    tier.check_integrity()


def test_exists_keeps_the_first_value() -> None:
    tier = cpu_tier(1 << 16)
    k = key("first")
    tier.put_many([k], [payload(k, 500, version=1)])
    assert tier.put_many([k], [payload(k, 500, version=2)]) == [PutStatus.EXISTS]
    status, out = get_one(tier, k, 500)
    assert status is GetStatus.OK and np.array_equal(out, payload(k, 500, version=1))


def test_object_larger_than_capacity_is_full_and_keeps_the_rest() -> None:
    tier = cpu_tier(4096)
    small, big = key("small"), key("big")
    tier.put_many([small], [payload(small, 100)])
    assert tier.put_many([big], [payload(big, 4097)]) == [PutStatus.FULL]
    assert tier.contains_many([small, big]) == [True, False]
    assert tier.stats().put_skipped_full == 1
    tier.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "delete", "touch"]),
            st.integers(0, 11),
            st.integers(0, 2),
        ),
        max_size=60,
    )
)
def test_lru_against_reference_model(ops: list[tuple[str, int, int]]) -> None:
    """Mixed sizes: bytes always right, capacity kept, and the stored keys are always
    the most recently used ones (eviction takes the least recently used first)."""
    sizes = [700, 1500, 3000]
    tier = cpu_tier(8192)
    stored: dict[StoreKey, np.ndarray] = {}
    recency: list[StoreKey] = []  # least recent first; keys that were put and not deleted
    for op, i, size_class in ops:
        k = key(i)
        if op == "put":
            was_present = tier.contains_many([k])[0]
            assert was_present <= (k in stored)
            value = payload(k, sizes[size_class], version=len(recency))
            status = tier.put_many([k], [value])[0]
            assert status is (PutStatus.EXISTS if was_present else PutStatus.OK)
            if not was_present:
                stored[k] = value
            if k in recency:
                recency.remove(k)
            recency.append(k)
        elif op == "get" and k in stored:
            got, out = get_one(tier, k, len(stored[k]))
            if got is GetStatus.OK:
                assert np.array_equal(out, stored[k])
                recency.remove(k)
                recency.append(k)
            else:
                assert got is GetStatus.MISS
        elif op == "touch":
            touched = [k, key((i + 1) % 12), key((i + 5) % 12)]
            present = tier.contains_many(touched)
            tier.retention.touch(touched)
            for t in (t for t, p in zip(touched, present, strict=True) if p):
                recency.remove(t)
                recency.append(t)
        elif op == "delete":
            tier.delete_many([k])
            stored.pop(k, None)
            if k in recency:
                recency.remove(k)
        flags = tier.contains_many(recency)
        assert flags == sorted(flags), f"a less recent key survived a more recent one: {flags}"
        assert tier.lru_digests() == digests([k for k, f in zip(recency, flags, strict=True) if f])
        assert tier.usage().used_bytes <= 8192
        tier.check_integrity()


def test_get_returns_the_arena_s_current_bytes_unchecked() -> None:
    """No checksum and no hidden copy: a byte changed in the arena after the put is what
    the next get returns (process memory is trusted like the KV cache)."""
    tier = cpu_tier(1 << 16)
    k = key("flip")
    tier.put_many([k], [payload(k, 4000)])
    memory = tier.memory()
    assert memory is not None
    [offset] = memory.borrow_many([k], [4000])
    assert isinstance(offset, int)
    memory.release_many([k])
    memory.memory[offset + 1234] ^= 0x10
    status, out = get_one(tier, k, 4000)
    expected = payload(k, 4000)
    expected[1234] ^= 0x10
    assert status is GetStatus.OK and np.array_equal(out, expected)
    assert tier.stats().corrupt == 0
    tier.check_integrity()


def test_given_checksums_are_accepted_and_ignored() -> None:
    """The engine may hand checksums over; the CPU tier keeps none, so even a wrong one
    costs nothing."""
    tier = cpu_tier(1 << 16)
    keys, values = [key("given-0"), key("given-1")], [payload(key(i), 3000) for i in "ab"]
    right = checksum(values[0])
    assert tier.put_many(keys, values, [right, right]) == [PutStatus.OK] * 2
    for k, value in zip(keys, values, strict=True):
        status, out = get_one(tier, k, 3000)
        assert status is GetStatus.OK and np.array_equal(out, value)
    with pytest.raises(ValueError, match="checksums"):
        tier.put_many(keys, values, [right])
    tier.check_integrity()


def test_buffer_of_another_size_is_corrupt() -> None:
    tier = cpu_tier(1 << 16)
    k = key("size")
    tier.put_many([k], [payload(k, 4000)])
    status, out = get_one(tier, k, 4001)
    assert status is GetStatus.CORRUPT and not out.any(), "a partial read reached the buffer"
    assert tier.stats().corrupt == 1
    assert tier.contains_many([k]) == [False], "an object of another size is dropped"
    tier.check_integrity()


def test_puts_do_not_allocate_memory() -> None:
    tier = cpu_tier(8 << 20)
    keys = [key(i) for i in range(64)]
    buffers = [payload(k, 256 << 10) for k in keys]
    tracemalloc.start()
    try:
        for _ in range(3):  # fill, clear, refill: reuse of freed extents too
            tier.put_many(keys, buffers)
            tier.delete_many(keys[::2])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, f"{peak} bytes allocated while copying {64 * 3} objects of 256 KiB"
    tier.check_integrity()


@pytest.mark.parametrize("num_bytes", [1, 4095, 4096, 1 << 20, (1 << 20) + 17])
def test_arena_starts_on_a_page_and_is_zeroed(num_bytes: int) -> None:
    for _ in range(4):  # numpy alone gives 16-byte alignment: several tries catch that
        arena, _ = allocate_arena(num_bytes, pin_memory=False)
        assert arena.ctypes.data % PAGE_BYTES == 0
        assert len(arena) == num_bytes and arena.dtype == np.uint8
        assert arena.flags.c_contiguous and not arena.any()


def test_arena_is_pinned_exactly_when_cuda_is_available() -> None:
    tier = CpuTier(CpuConfig(capacity_bytes=1 << 16))
    assert tier.is_pinned == torch.cuda.is_available()
    assert not cpu_tier(1 << 16).is_pinned
    if torch.cuda.is_available():
        assert CpuTier(CpuConfig(capacity_bytes=1 << 16, pin_memory=True)).is_pinned
    else:
        with pytest.raises(ValueError, match="needs CUDA"):
            CpuTier(CpuConfig(capacity_bytes=1 << 16, pin_memory=True))


def test_threads_under_eviction_pressure_keep_bookkeeping_consistent() -> None:
    tier = cpu_tier(64 << 10)
    sizes = [1000, 2500, 7000]
    assert random_calls_on_threads(tier, key, payload, sizes, num_calls=400) == []
    assert tier.stats().evictions > 0
    tier.check_integrity()


def test_closed_tier_refuses_calls() -> None:
    tier = cpu_tier(1 << 16)
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.contains_many([key(1)])
    tier.close()  # idempotent


def test_config_validation_names_every_problem() -> None:
    with pytest.raises(ValueError) as info:
        CpuConfig(capacity_bytes=-1, load_weight=0.0)
    assert "capacity_bytes" in str(info.value) and "load_weight" in str(info.value)
    assert "2 validation errors" in str(info.value)
