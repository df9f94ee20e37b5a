"""CpuTier's memory(): reserve, commit, borrow and release in place, against a reference
model and under threads."""

from __future__ import annotations

import random
import time
import zlib
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, TierMemory
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.cpu_index import Outstanding
from hybridkv.tiers.memory import PAGE_BYTES
from tests.support.threads import run_on_threads

SLOT = 1000
"""Rounds to 1024 bytes: a tier of ``n * 1024`` bytes holds exactly ``n`` objects."""


def digests(keys: list[StoreKey]) -> list[bytes]:
    """What ``CpuTier.lru_digests`` names these keys by."""
    return [key_digest(k) for k in keys]


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/cpu-memory/{i}")


def payload(k: StoreKey, num_bytes: int = SLOT, version: int = 0) -> np.ndarray:
    seed = zlib.crc32(k.encode()) + 7919 * version
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def tier_of(num_slots: int) -> tuple[CpuTier, TierMemory, np.ndarray]:
    """A tier holding ``num_slots`` objects of ``SLOT`` bytes, its memory, and that memory
    as a numpy view."""
    tier = CpuTier(CpuConfig(capacity_bytes=num_slots * 1024, pin_memory=False))
    memory = tier.memory()
    assert memory is not None
    return tier, memory, memory.memory.numpy()


def store_in_place(memory: TierMemory, arena: np.ndarray, k: StoreKey, value: np.ndarray) -> int:
    [offset] = memory.reserve_many([k], [len(value)])
    assert isinstance(offset, int), offset
    arena[offset : offset + len(value)] = value
    memory.commit_many([k], [True])
    return offset


def borrow_one(memory: TierMemory, k: StoreKey, num_bytes: int = SLOT) -> int:
    [offset] = memory.borrow_many([k], [num_bytes])
    assert isinstance(offset, int), offset
    return offset


def test_memory_is_the_whole_page_aligned_arena() -> None:
    tier, memory, _ = tier_of(8)
    tensor = memory.memory
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.device.type == "cpu"
    assert tensor.numel() == 8 * 1024 and tensor.data_ptr() % PAGE_BYTES == 0
    assert tensor.is_pinned() == tier.is_pinned
    assert tier.memory() is memory and memory.memory.data_ptr() == tensor.data_ptr()


def test_reserve_write_commit_then_read_and_borrow_the_same_bytes() -> None:
    tier, memory, arena = tier_of(64)
    keys = [key(i) for i in range(3)]
    values = [payload(k, n) for k, n in zip(keys, [4000, 1, 0], strict=True)]
    offsets = memory.reserve_many(keys, [len(v) for v in values])
    assert all(isinstance(offset, int) for offset in offsets)
    for offset, value in zip(offsets, values, strict=True):
        assert isinstance(offset, int)
        arena[offset : offset + len(value)] = value
    memory.commit_many(keys, [True] * 3)
    assert tier.contains_many(keys) == [True] * 3
    outs = [np.zeros(len(v), dtype=np.uint8) for v in values]
    assert tier.get_many_into(keys, outs) == [GetStatus.OK] * 3
    assert all(np.array_equal(out, v) for out, v in zip(outs, values, strict=True))
    assert memory.borrow_many(keys, [len(v) for v in values]) == offsets
    assert tier.outstanding() == Outstanding(num_reserved=0, num_borrows=3)
    memory.release_many(keys)
    assert tier.outstanding() == Outstanding(num_reserved=0, num_borrows=0)
    stats = tier.stats()
    assert (stats.puts, stats.put_bytes) == (3, 4001)
    assert (stats.gets, stats.get_bytes) == (6, 2 * 4001)  # a borrow counts as a get
    tier.check_integrity()


def test_reserved_keys_are_invisible_and_an_unwritten_commit_frees_the_room() -> None:
    tier, memory, arena = tier_of(4)
    k = key("reserved")
    [offset] = memory.reserve_many([k], [SLOT])
    assert isinstance(offset, int)
    arena[offset : offset + SLOT] = 7
    out = np.zeros(SLOT, dtype=np.uint8)
    assert tier.contains_many([k]) == [False]
    assert tier.get_many_into([k], [out]) == [GetStatus.MISS] and not out.any()
    assert memory.borrow_many([k], [SLOT]) == [GetStatus.MISS]
    assert tier.delete_many([k]) == 0  # deletes leave reservations alone
    assert tier.usage().num_objects == 0 and tier.outstanding().num_reserved == 1
    memory.commit_many([k], [False])
    assert tier.contains_many([k]) == [False] and tier.outstanding().num_reserved == 0
    assert memory.reserve_many([k], [SLOT]) == [offset]  # the room came back
    memory.commit_many([k], [True])
    assert tier.contains_many([k]) == [True] and tier.stats().puts == 1
    tier.check_integrity()


def test_stored_and_reserved_keys_answer_exists() -> None:
    tier, memory, _ = tier_of(8)
    stored, other, fresh = key("stored"), key("other"), key("fresh")
    tier.put_many([stored, other], [payload(stored), payload(other)])
    answers = memory.reserve_many([stored, fresh, fresh], [SLOT] * 3)
    assert answers[0] is PutStatus.EXISTS and answers[2] is PutStatus.EXISTS
    assert isinstance(answers[1], int)
    assert tier.lru_digests() == digests([other, stored]), "an EXISTS marks the stored key recent"
    assert tier.put_many([fresh], [payload(fresh)]) == [PutStatus.EXISTS]  # reserved
    memory.commit_many([fresh], [True])
    assert tier.put_many([fresh], [payload(fresh)]) == [PutStatus.EXISTS]
    tier.check_integrity()


def test_full_when_everything_is_borrowed_or_reserved() -> None:
    tier, memory, arena = tier_of(4)
    keys = [key(i) for i in range(5)]
    for k in keys[:2]:
        store_in_place(memory, arena, k, payload(k))
        borrow_one(memory, k)
    assert all(isinstance(a, int) for a in memory.reserve_many(keys[2:4], [SLOT, SLOT]))
    assert memory.reserve_many(keys[4:], [SLOT]) == [PutStatus.FULL]
    assert tier.put_many(keys[4:], [payload(keys[4])]) == [PutStatus.FULL]
    stats = tier.stats()
    assert stats.evictions == 0 and stats.put_skipped_full == 2
    assert tier.contains_many(keys[:2]) == [True, True]
    memory.release_many(keys[:1])
    [offset] = memory.reserve_many(keys[4:], [SLOT])
    assert offset == 0 and tier.stats().evictions == 1  # keys[0]'s extent, once released
    assert tier.contains_many(keys[:2]) == [False, True]
    tier.check_integrity()


def test_what_cannot_fit_beside_the_borrowed_evicts_nothing() -> None:
    tier, memory, _ = tier_of(4)
    keys = [key(i) for i in range(4)]
    tier.put_many(keys, [payload(k) for k in keys])
    borrow_one(memory, keys[0])
    borrow_one(memory, keys[2])
    assert memory.reserve_many([key("big")], [3 * 1024]) == [PutStatus.FULL]
    assert tier.contains_many(keys) == [True] * 4 and tier.stats().evictions == 0
    assert isinstance(memory.reserve_many([key("small")], [SLOT])[0], int)
    assert tier.contains_many(keys) == [True, False, True, True]
    tier.check_integrity()


def test_borrowed_objects_survive_eviction_and_the_rest_go_least_recent_first() -> None:
    tier, memory, _ = tier_of(4)
    keys = [key(i) for i in range(7)]
    tier.put_many(keys[:4], [payload(k) for k in keys[:4]])
    borrow_one(memory, keys[0])
    for k in keys[1:4]:  # keys[0] is least recently used again, but borrowed
        assert tier.get_many_into([k], [np.zeros(SLOT, dtype=np.uint8)]) == [GetStatus.OK]
    assert tier.lru_digests() == digests(keys[:4])
    tier.put_many(keys[4:6], [payload(k) for k in keys[4:6]])
    assert tier.lru_digests() == digests([keys[0], keys[3], keys[4], keys[5]])
    assert tier.stats().evictions == 2
    memory.release_many(keys[:1])
    tier.put_many(keys[6:], [payload(keys[6])])
    assert tier.lru_digests() == digests([keys[3], keys[4], keys[5], keys[6]])
    tier.check_integrity()


def test_a_deleted_borrowed_object_keeps_its_bytes_until_its_last_release() -> None:
    tier, memory, arena = tier_of(4)
    gone, other, later = key("gone"), key("other"), key("later")
    value = payload(gone)
    assert store_in_place(memory, arena, gone, value) == 0
    assert borrow_one(memory, gone) == borrow_one(memory, gone) == 0  # borrowed twice
    assert tier.delete_many([gone]) == 1
    assert tier.contains_many([gone]) == [False]
    assert memory.borrow_many([gone], [SLOT]) == [GetStatus.MISS]
    assert tier.usage().num_objects == 0
    assert store_in_place(memory, arena, other, payload(other)) == 1024, "extent reused early"
    assert memory.reserve_many([gone], [SLOT]) == [PutStatus.FULL], "one key, two extents"
    memory.release_many([gone])
    assert tier.outstanding().num_borrows == 1
    assert np.array_equal(arena[:SLOT], value)
    tier.check_integrity()
    memory.release_many([gone])
    assert tier.outstanding().num_borrows == 0
    assert store_in_place(memory, arena, later, payload(later)) == 0  # freed at last
    assert isinstance(memory.reserve_many([gone], [SLOT])[0], int)
    tier.check_integrity()


def test_a_commit_may_borrow_without_counting_a_get() -> None:
    tier, memory, _ = tier_of(2)
    keys = [key(i) for i in range(3)]
    assert isinstance(memory.reserve_many(keys[:1], [SLOT])[0], int)
    memory.commit_many(keys[:1], [True], num_borrows=2)
    assert tier.outstanding().num_borrows == 2 and tier.stats().gets == 0
    tier.put_many(keys[1:], [payload(k) for k in keys[1:]])  # evicts keys[1], not keys[0]
    assert tier.contains_many(keys) == [True, False, True]
    memory.release_many([keys[0], keys[0]])
    tier.check_integrity()


def test_size_mismatch_on_borrow_is_corrupt_and_drops_the_object() -> None:
    tier, memory, arena = tier_of(4)
    k = key("size")
    store_in_place(memory, arena, k, payload(k))
    assert memory.borrow_many([k], [SLOT + 1]) == [GetStatus.CORRUPT]
    assert tier.contains_many([k]) == [False] and tier.stats().corrupt == 1
    assert tier.outstanding() == Outstanding(0, 0)
    tier.check_integrity()


def test_misuse_raises_before_changing_anything() -> None:
    tier, memory, arena = tier_of(4)
    k, other = key("k"), key("other")
    with pytest.raises(ValueError, match="not reserved"):
        memory.commit_many([k], [True])
    store_in_place(memory, arena, k, payload(k))
    borrow_one(memory, k)
    with pytest.raises(ValueError, match="release_many ends borrows"):
        memory.release_many([k, k])
    assert tier.outstanding().num_borrows == 1, "a refused batch released something"
    with pytest.raises(ValueError, match="release_many ends borrows"):
        memory.release_many([other])
    assert isinstance(memory.reserve_many([other], [SLOT])[0], int)
    with pytest.raises(ValueError, match="repeated"):
        memory.commit_many([other, other], [True, True])
    with pytest.raises(ValueError, match="one size per key"):
        memory.reserve_many([k], [])
    with pytest.raises(ValueError, match=">= 0"):
        memory.borrow_many([k], [-1])
    with pytest.raises(TypeError, match="sizes"):
        memory.reserve_many([k], [1.5])  # type: ignore[list-item]
    assert tier.outstanding() == Outstanding(num_reserved=1, num_borrows=1)
    tier.check_integrity()
    tier.close()  # with a borrow and a reservation open: dropped
    with pytest.raises(RuntimeError, match="closed"):
        memory.release_many([k])


# --- against a reference model ------------------------------------------------------------

NUM_SLOTS = 3
NUM_KEYS = 5
OPS = ("reserve", "commit", "borrow", "release", "delete", "put", "get")
WEIGHTED_OPS = (*OPS, "commit", "borrow", "release", "put")
"""Few keys and slots, commits after reserves and releases after borrows made likely: the
states worth reaching (full of borrowed objects, a deleted one still borrowed) come often."""


class Model:
    """What the tier must hold: LRU over stored objects, borrowed ones never evicted."""

    def __init__(self) -> None:
        self.stored: OrderedDict[StoreKey, np.ndarray] = OrderedDict()
        self.borrows: Counter[StoreKey] = Counter()  # of stored objects
        self.zombies: Counter[StoreKey] = Counter()  # borrows of deleted objects
        self.reserved: dict[StoreKey, tuple[int, np.ndarray]] = {}
        self.held: list[tuple[StoreKey, int, np.ndarray]] = []

    def room_for(self, k: StoreKey) -> PutStatus | None:
        """EXISTS, FULL, or None where there is room (after evicting as the tier must)."""
        if k in self.stored:
            self.stored.move_to_end(k)
            return PutStatus.EXISTS
        if k in self.reserved:
            return PutStatus.EXISTS
        if k in self.zombies:
            return PutStatus.FULL
        if len(self.stored) + len(self.reserved) + len(self.zombies) < NUM_SLOTS:
            return None
        victim = next((s for s in self.stored if not self.borrows[s]), None)
        if victim is None:
            return PutStatus.FULL
        del self.stored[victim]
        return None

    def drop(self, k: StoreKey) -> None:
        del self.stored[k]
        if self.borrows[k]:
            self.zombies[k] = self.borrows.pop(k)


def apply(model: Model, tier: CpuTier, step: int, op: str, k: StoreKey, variant: int) -> None:
    """One operation on the tier, the same on the model, and their answers compared.
    ``variant`` 0: a commit that was not written, a borrow or get of the wrong size;
    1: a commit that borrows."""
    memory, arena = tier.memory(), tier.memory().memory.numpy()
    assert memory is not None
    value = payload(k, version=step)
    if op in ("reserve", "put"):
        expected = model.room_for(k)
        if op == "put":
            assert tier.put_many([k], [value]) == [expected or PutStatus.OK]
            if expected is None:
                model.stored[k] = value
            return
        [answer] = memory.reserve_many([k], [SLOT])
        assert answer is expected if expected else isinstance(answer, int)
        if isinstance(answer, int):
            arena[answer : answer + SLOT] = value
            model.reserved[k] = (answer, value)
    elif op == "commit" and k in model.reserved:
        num_borrows = 1 if variant == 1 else 0
        memory.commit_many([k], [variant > 0], num_borrows=num_borrows)
        offset, value = model.reserved.pop(k)
        if variant > 0:
            model.stored[k] = value
        if variant == 1:
            model.borrows[k] += 1
            model.held.append((k, offset, value))
    elif op in ("borrow", "get"):
        out = np.zeros(SLOT + 1 if variant == 0 else SLOT, dtype=np.uint8)
        if op == "borrow":
            [answer] = memory.borrow_many([k], [len(out)])
        else:
            [answer] = tier.get_many_into([k], [out])
        if k not in model.stored:
            assert answer is GetStatus.MISS
        elif variant == 0:
            assert answer is GetStatus.CORRUPT
            model.drop(k)
        else:
            model.stored.move_to_end(k)
            if op == "get":
                assert answer is GetStatus.OK and np.array_equal(out, model.stored[k])
            else:
                assert isinstance(answer, int)
                model.borrows[k] += 1
                model.held.append((k, answer, model.stored[k]))
    elif op == "release":
        mine = [j for j, (held, _, _) in enumerate(model.held) if held == k]
        if mine:
            model.held.pop(mine[0])
            memory.release_many([k])
            counts = model.zombies if k in model.zombies else model.borrows
            counts[k] -= 1
            if not counts[k]:
                del counts[k]
    elif op == "delete":
        assert tier.delete_many([k]) == (k in model.stored)
        if k in model.stored:
            model.drop(k)


def check_against(model: Model, tier: CpuTier, arena: np.ndarray, keys: list[StoreKey]) -> None:
    tier.check_integrity()
    assert tier.contains_many(keys) == [k in model.stored for k in keys]
    assert tier.lru_digests() == digests(list(model.stored))
    num_borrows = sum(model.borrows.values()) + sum(model.zombies.values())
    assert tier.outstanding() == Outstanding(len(model.reserved), num_borrows)
    extents = [*model.reserved.values(), *((o, v) for _, o, v in model.held)]
    for offset, value in extents:  # borrowed or reserved bytes are never reused
        assert np.array_equal(arena[offset : offset + SLOT], value)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(WEIGHTED_OPS), st.integers(0, NUM_KEYS - 1), st.integers(0, 7)),
        min_size=40,
        max_size=120,
    )
)
def test_in_place_calls_match_a_reference_model(ops: list[tuple[str, int, int]]) -> None:
    tier, _, arena = tier_of(NUM_SLOTS)
    keys = [key(i) for i in range(NUM_KEYS)]
    model = Model()
    for step, (op, i, variant) in enumerate(ops):
        apply(model, tier, step, op, keys[i], variant)
        check_against(model, tier, arena, keys)


def test_threads_borrowing_and_committing_keep_bytes_and_bookkeeping() -> None:
    tier, memory, arena = tier_of(24)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(600):
            k = key(rng.randrange(40))
            op = rng.random()
            if op < 0.35:
                [offset] = memory.reserve_many([k], [SLOT])
                if isinstance(offset, int):
                    arena[offset : offset + SLOT] = payload(k)
                    memory.commit_many([k], [rng.random() < 0.9])
            elif op < 0.85:
                [offset] = memory.borrow_many([k], [SLOT])
                if isinstance(offset, int):
                    for _ in range(2):  # still the object's bytes after others ran
                        if not np.array_equal(arena[offset : offset + SLOT], payload(k)):
                            errors.append(f"borrowed bytes of {k} changed")
                        time.sleep(0)
                    memory.release_many([k])
                elif offset is not GetStatus.MISS:
                    errors.append(f"{offset} for {k}")
            elif op < 0.95:
                out = np.zeros(SLOT, dtype=np.uint8)
                status = tier.get_many_into([k], [out])[0]
                if status is GetStatus.OK and not np.array_equal(out, payload(k)):
                    errors.append(f"wrong bytes for {k}")
            else:
                tier.delete_many([k])

    run_on_threads(work, num_threads=8)
    assert errors == []
    assert tier.outstanding() == Outstanding(0, 0)
    assert tier.stats().evictions > 0
    tier.check_integrity()


# --- batches get adjacent room ---------------------------------------------------------------


def store_batch(memory: TierMemory, arena: np.ndarray, keys: list[StoreKey]) -> list[int]:
    offsets = memory.reserve_many(keys, [SLOT] * len(keys))
    assert all(isinstance(o, int) for o in offsets), offsets
    for k, offset in zip(keys, offsets, strict=True):
        assert isinstance(offset, int)
        arena[offset : offset + SLOT] = payload(k)
    memory.commit_many(keys, [True] * len(keys))
    return [o for o in offsets if isinstance(o, int)]


def test_a_batch_gets_one_run_of_adjacent_room_even_in_a_full_arena() -> None:
    """A device copies adjacent objects in one piece: a batch's new objects are reserved
    side by side, also once the arena is full and the room comes from evicting (the
    least recently used objects, as many as the batch needs)."""
    tier, memory, arena = tier_of(16)
    first = [key(f"a{i}") for i in range(6)]
    assert store_batch(memory, arena, first) == [i * 1024 for i in range(6)]
    singles = [key(f"s{i}") for i in range(10)]
    for k in singles:  # the arena is full
        store_batch(memory, arena, [k])
    batch = [key(f"b{i}") for i in range(5)]
    assert store_batch(memory, arena, batch) == [i * 1024 for i in range(5)]
    assert tier.contains_many(first) == [False] * 5 + [True]
    assert tier.stats().evictions == 5
    for k in [*batch, first[5], *singles]:
        out = np.zeros(SLOT, np.uint8)
        assert tier.get_many_into([k], [out]) == [GetStatus.OK]
        assert np.array_equal(out, payload(k))
    tier.check_integrity()


def test_free_holes_are_used_before_anything_is_evicted_for_a_run() -> None:
    tier, memory, arena = tier_of(8)
    keys = [key(i) for i in range(8)]
    store_batch(memory, arena, keys)
    tier.delete_many(keys[::2])  # four single holes: room for a batch of four, not a run
    offsets = store_batch(memory, arena, [key(f"n{i}") for i in range(4)])
    assert sorted(offsets) == [0, 2048, 4096, 6144]
    assert tier.stats().evictions == 0
    assert tier.contains_many(keys[1::2]) == [True] * 4
    tier.check_integrity()


def test_borrowed_objects_between_holes_leave_single_holes_only() -> None:
    tier, memory, arena = tier_of(8)
    keys = [key(i) for i in range(8)]
    store_batch(memory, arena, keys)
    memory.borrow_many(keys[1::2], [SLOT] * 4)
    offsets = store_batch(memory, arena, [key(f"n{i}") for i in range(3)])
    assert len(set(offsets)) == 3 and all(o // 1024 % 2 == 0 for o in offsets)
    assert tier.contains_many(keys[1::2]) == [True] * 4, "borrowed objects are never evicted"
    memory.release_many(keys[1::2])
    tier.check_integrity()
