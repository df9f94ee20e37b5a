"""The CPU tier's ``second_chance``: an object read since it was stored is passed over
once when it would be evicted, so objects never read go first; and passes granted by
``retention.touch`` (``eviction_order: worth``). Against a list model (hypothesis) and
through ``CpuTier`` with real puts and gets."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, StoreKey
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.cpu_lru import PROTECTED, LruObjects
from hybridkv.tiers.digest_table import NONE, digest_words
from hybridkv.tiers.retention import MAX_PASSES

NUM_KEYS = 16


def digest(i: int) -> bytes:
    return (i % 4).to_bytes(8, "little") + i.to_bytes(8, "little")


def model_victim(
    order: list[int], read: set[int], passes: dict[int, int], borrowed: set[int]
) -> int | None:
    """The walk, on a plain list: skip borrowed; pass one with passes left over (one
    spent); else pass a read one over once (mark cleared) unless more than
    ``PROTECTED`` of all are read; else return it. One passed over goes to the end,
    unless it is the last: then it is returned."""
    i = 0
    most_read = int(PROTECTED * len(order))
    while i < len(order):
        k = order[i]
        if k in borrowed:
            i += 1
            continue
        if passes.get(k, 0):
            passes[k] -= 1
        elif k in read and len(read) <= most_read:
            read.discard(k)
        else:
            return k
        if i == len(order) - 1:
            return k
        order.append(order.pop(i))
    return None


keys = st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=5)
kinds = st.sampled_from(["add", "touch", "read", "grant", "borrow", "evict"])
ops = st.lists(st.tuples(kinds, keys, st.integers(0, MAX_PASSES)))


@settings(max_examples=300, deadline=None)
@given(ops, st.booleans())
def test_eviction_follows_the_model(steps: list[tuple[str, list[int], int]], second: bool) -> None:
    objects = LruObjects(second_chance=second)
    order: list[int] = []
    read: set[int] = set()
    passes: dict[int, int] = {}
    granted: dict[int, int] = {}
    entry = 0  # passes of a new object: the most once any were granted
    borrowed: set[int] = set()
    for op, batch, num_passes in steps:
        rows = objects.find(digest_words(b"".join(map(digest, batch))))
        present = [(i, int(r)) for i, r in zip(batch, rows, strict=True) if r >= 0]
        if op == "add":
            fresh = list(dict.fromkeys(i for i in batch if i not in order))
            added = objects.add(
                digest_words(b"".join(map(digest, fresh))),
                np.arange(len(fresh), dtype=np.int64),
                np.ones(len(fresh), np.int64),
            )
            assert np.all(added >= 0)
            order += fresh
            passes |= dict.fromkeys(fresh, entry)
            granted |= dict.fromkeys(fresh, entry)
        elif op == "touch":
            objects.touch(np.array([r for _, r in present], np.int64))
            for i, _ in present:
                order.append(order.pop(order.index(i)))
                passes[i] = granted[i]  # a use restores what was granted
        elif op == "read":
            objects.mark_read(np.array([r for _, r in present], np.int64))
            read |= {i for i, _ in present}
        elif op == "grant":
            objects.grant(np.array([r for _, r in present], np.int64), num_passes)
            passes |= {i: num_passes for i, _ in present}
            granted |= {i: num_passes for i, _ in present}
            entry = MAX_PASSES if present and num_passes else entry
        elif op == "borrow":
            for i, r in dict(present).items():
                objects.borrows[r] += 1
                borrowed.add(i)
        else:
            want = model_victim(order, read if second else set(), passes, borrowed)
            got = objects.oldest_unborrowed()
            if want is None:
                assert got == NONE
            else:
                assert objects.digest(got) == digest(want)
                objects.remove(np.array([got], np.int64))
                order.remove(want)
                read.discard(want)
                del passes[want], granted[want]
        assert [objects.digest(r) for r in objects.order()] == [digest(i) for i in order]
        for i, row in present:
            if i in order:
                assert objects.passes_left(row) == passes.get(i, 0)
        objects.check()


SIZE = 1000  # rounds to 1024: eight fit in 8192 bytes


def tier(second: bool) -> CpuTier:
    config = CpuConfig(capacity_bytes=8192, pin_memory=False, second_chance=second)
    return CpuTier(config)


def put(t: CpuTier, names: list[str]) -> None:
    t.put_many([StoreKey(n) for n in names], [np.full(SIZE, 7, np.uint8) for _ in names])


def read(t: CpuTier, names: list[str]) -> list[GetStatus]:
    out = [np.empty(SIZE, np.uint8) for _ in names]
    return t.get_many_into([StoreKey(n) for n in names], out)


def test_a_prefix_read_again_outlives_one_off_prompts_once() -> None:
    """A shared prefix (read once since stored) and one-off prompts stored after it:
    plain recency evicts the prefix first; second chance evicts the one-offs and keeps
    the prefix for one more round, after which, unread, it goes too."""
    shared = ["shared/0", "shared/1"]
    kept = {}
    for second in (False, True):
        t = tier(second)
        put(t, shared)
        assert read(t, shared) == [GetStatus.OK] * 2
        put(t, [f"once/{i}" for i in range(6)])  # the tier is full now
        put(t, [f"once/{i}" for i in range(6, 9)])  # three more: three evictions
        kept[second] = t.contains_many([StoreKey(n) for n in shared])
        t.check_integrity()
        if second:
            # The first eviction passed both over (to the recent end), then took once/0.
            names = ["once/3", "once/4", "once/5", *shared, "once/6", "once/7", "once/8"]
            assert t.lru_digests() == [key_digest(StoreKey(n)) for n in names]
            assert t.contains_many([StoreKey(f"once/{i}") for i in range(3)]) == [False] * 3
            put(t, [f"once/{i}" for i in range(9, 17)])  # a whole round, nothing read
            assert t.contains_many([StoreKey(n) for n in shared]) == [False, False]
    assert kept == {False: [False, False], True: [True, True]}


def test_plain_lru_suspends_second_chance_until_it_ends() -> None:
    """While most first sightings come back (``connector.returns``) a prefix read again
    goes in plain recency order; the marks of reads stay for when it ends."""
    shared = ["shared/0", "shared/1"]
    t = tier(True)
    put(t, shared)
    assert read(t, shared) == [GetStatus.OK] * 2
    t.retention.use_plain_lru(True)
    put(t, [f"once/{i}" for i in range(7)])  # full, then one eviction
    assert t.contains_many([StoreKey(n) for n in shared]) == [False, True]
    t.retention.use_plain_lru(False)
    put(t, ["once/7"])  # shared/1, read, is passed over; once/0 goes
    assert t.contains_many([StoreKey("shared/1"), StoreKey("once/0")]) == [True, False]
    t.check_integrity()


def test_protection_is_capped_when_most_objects_were_read() -> None:
    """Where nearly every object was read (each document of long-doc-qa is asked again),
    passing them all over would leave the never-read ones, the newest included, the only
    ones to go. Beyond ``PROTECTED`` of the objects read, the least recent goes, read or
    not; once back under it, read objects are passed over again."""
    names = [f"doc/{i}" for i in range(8)]
    t = tier(True)
    put(t, names)  # full
    assert read(t, names[:7]) == [GetStatus.OK] * 7  # 7 of 8 read: over 0.75
    t.retention.touch([StoreKey("doc/7")])  # the one never read is the most recent
    assert int(PROTECTED * 8) < 7
    put(t, ["new/0"])
    assert t.contains_many([StoreKey(n) for n in names]) == [False] + [True] * 7
    put(t, ["new/1"])  # 6 of 8 read now: each is passed over, and doc/7 goes
    assert t.contains_many([StoreKey(n) for n in names[1:]]) == [True] * 6 + [False]
    t.check_integrity()


def put_touched(t: CpuTier, names: list[str], passes: int = 0) -> None:
    """A put, then the touch with passes that the worker gives a chain once stored."""
    put(t, names)
    t.retention.touch([StoreKey(n) for n in names], passes)


def test_passes_granted_by_a_touch_outlast_recency_until_spent() -> None:
    """``retention.touch(keys, passes)`` (``eviction_order: worth``) without ``second_chance``:
    a chain given two passes is passed over twice when it comes round as the least
    recent, then goes; another touch grants passes anew, replacing those left; plain
    LRU passes nothing over."""
    worth = ["worth/0", "worth/1"]
    t = tier(False)
    put_touched(t, worth, 2)
    put_touched(t, [f"once/{i}" for i in range(6)])  # full
    for i in range(6, 20):  # each round of six evicts every "once" and spends a pass
        put_touched(t, [f"once/{i}"])
        assert t.contains_many([StoreKey(n) for n in worth]) == [i < 18, i < 19], i
    t.check_integrity()

    t = tier(False)
    put_touched(t, worth, 3)
    t.retention.touch([StoreKey(n) for n in worth], 0)  # replaced: none left
    put_touched(t, [f"once/{i}" for i in range(7)])
    assert t.contains_many([StoreKey(n) for n in worth]) == [False, True]

    t = tier(False)
    put_touched(t, worth, 3)
    t.retention.use_plain_lru(True)
    put_touched(t, [f"once/{i}" for i in range(7)])
    assert t.contains_many([StoreKey(n) for n in worth]) == [False, True]
    t.check_integrity()


def test_a_use_restores_the_passes_and_new_objects_wait_for_theirs() -> None:
    """Passes spent come back with a read (a hit's load): what a chain is worth holds at
    each use, as GreedyDual's priority does. Objects stored once any passes were granted
    enter with the most, until their chain's touch gives theirs: what was just stored
    is not the first thing to go while every older object still has passes."""
    t = tier(False)
    put_touched(t, ["worth/0"], 1)
    put_touched(t, [f"once/{i}" for i in range(7)])  # full
    put_touched(t, ["once/7"])  # worth/0 spends its pass; once/0 goes
    assert read(t, ["worth/0"]) == [GetStatus.OK]  # the most recent, its pass back
    put_touched(t, [f"once/{i}" for i in range(8, 15)])  # once/1..7 go: worth/0 is oldest
    put_touched(t, ["once/15"])  # worth/0 spends its pass again; once/8 goes
    assert t.contains_many([StoreKey("worth/0"), StoreKey("once/8")]) == [True, False]
    put_touched(t, [f"once/{i}" for i in range(16, 22)])  # once/9..14 go
    put_touched(t, ["once/22"])  # no pass left, no use since
    assert t.contains_many([StoreKey("worth/0"), StoreKey("once/15")]) == [False, True]

    t = tier(False)
    put_touched(t, [f"old/{i}" for i in range(7)], 1)  # full but for one
    put(t, ["new/0", "new/1"])  # stored, not touched yet: the most passes
    assert t.contains_many([StoreKey("new/0"), StoreKey("new/1")]) == [True, True]
    assert t.contains_many([StoreKey("old/0")]) == [False]  # old/0 went, its pass spent
    t.retention.touch([StoreKey("new/0"), StoreKey("new/1")], 0)  # their chain's touch
    put(t, ["new/2"])  # old/1 has spent its pass: it goes
    assert t.contains_many([StoreKey("new/0"), StoreKey("old/1")]) == [True, False]
    t.check_integrity()
