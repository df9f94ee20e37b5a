"""ChangeLog: what a store's tiers stored and removed, replayed against what they hold.

Real CpuTier and a real valkey-server (a pool, which cannot see its own evictions).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.segments import PAGE
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.registry import parse_tier_config
from hybridkv.tiers.tiered.changes import ChangeLog, KeyChange, TierLog
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from tests.support.servers import ValkeyServer

SIZE = 4096
ARENA_OBJECTS = 4


def key(i: int) -> StoreKey:
    return StoreKey(f"test/changes/{i}")


def payload(k: StoreKey) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(k.encode())).integers(0, 256, SIZE, dtype=np.uint8)


def cpu_store(num_objects: int = ARENA_OBJECTS) -> tuple[TieredStore, ChangeLog]:
    tier = CpuTier(CpuConfig(capacity_bytes=num_objects * SIZE, pin_memory=False))
    store = TieredStore([tier])
    log = ChangeLog()
    store.record_changes(log)
    return store, log


def replay(changes: Sequence[KeyChange], tier_index: int = 0) -> set[StoreKey]:
    """The keys a tier holds, by its changes alone."""
    held: set[StoreKey] = set()
    for change in changes:
        if change.tier_index != tier_index:
            continue
        if change.stored:
            held.add(change.key)
        else:
            held.discard(change.key)
    return held


def read(store: TieredStore, keys: Sequence[StoreKey]) -> list[GetStatus]:
    return store.get_many_into(keys, [np.zeros(SIZE, dtype=np.uint8) for _ in keys])


def test_cpu_tier_logs_stores_then_evictions_in_order() -> None:
    store, log = cpu_store()
    for i in range(6):
        assert store.put_many([key(i)], [payload(key(i))]) == [PutStatus.OK]
    first = [KeyChange(0, key(i), True) for i in range(ARENA_OBJECTS)]
    then = [
        KeyChange(0, key(0), False),
        KeyChange(0, key(4), True),
        KeyChange(0, key(1), False),
        KeyChange(0, key(5), True),
    ]
    assert log.take() == first + then
    assert log.take() == []  # drained
    assert store.delete_many([key(2), key(9)]) == 1
    assert log.take() == [KeyChange(0, key(2), False)]


def test_in_place_commits_are_logged_and_unwritten_ones_are_not() -> None:
    store, log = cpu_store()
    memory = store.memory()
    assert memory is not None
    offsets = memory.reserve_many([key(1), key(2)], [SIZE, SIZE])
    assert all(isinstance(o, int) for o in offsets)
    memory.commit_many([key(1), key(2)], [True, False])
    assert log.take() == [KeyChange(0, key(1), True)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 9))))
def test_replayed_changes_are_what_the_cpu_tier_holds(ops: list[tuple[str, int]]) -> None:
    store, log = cpu_store()
    tier = store.tiers[0]
    assert isinstance(tier, CpuTier)
    changes: list[KeyChange] = []
    for op, i in ops:
        if op == "put":
            store.put_many([key(i)], [payload(key(i))])
        elif op == "get":
            read(store, [key(i)])
        else:
            store.delete_many([key(i)])
        changes += log.take()
        assert {key_digest(k) for k in replay(changes)} == set(tier.lru_digests())
    assert log.num_lost == 0


def test_the_log_keeps_the_newest_changes_when_full() -> None:
    log = ChangeLog(max_changes=5)
    log.add(1, [key(i) for i in range(8)], True)
    assert log.take() == [KeyChange(1, key(i), True) for i in range(3, 8)]
    assert log.num_lost == 3


def test_removals_named_by_digest_become_keys_and_the_oldest_are_withdrawn() -> None:
    log = ChangeLog(max_digest_keys=3)
    tier_log = TierLog(log, 2)
    tier_log.removed_digests(key_digest(key(0)))  # before keep_digests: cannot be named
    tier_log.keep_digests()
    tier_log.stored([key(0), key(1), key(2)])
    tier_log.removed_digests(key_digest(key(1)) + key_digest(key(7)))  # 7 never stored
    tier_log.stored([key(3), key(4)])  # four remembered: the oldest (0) is withdrawn
    stored = [KeyChange(2, key(i), True) for i in range(3)]
    assert log.take() == [
        *stored,
        KeyChange(2, key(1), False),
        KeyChange(2, key(3), True),
        KeyChange(2, key(4), True),
        KeyChange(2, key(0), False),
    ]
    tier_log.removed_digests(key_digest(key(0)))  # withdrawn already: nothing more
    assert log.take() == []


def test_disk_tier_logs_its_puts_and_names_segment_evictions_and_deletes(tmp_path: Path) -> None:
    segment = 2 * PAGE + 2 * SIZE  # header and slot table, then two objects
    config = DiskConfig(path=tmp_path, capacity_bytes=3 * segment, segment_bytes=segment)
    store = TieredStore([DiskTier(config)])
    log = ChangeLog()
    store.record_changes(log)
    keys = [key(i) for i in range(9)]
    changes: list[KeyChange] = []
    for k in keys:  # a segment per two objects, three at most: whole segments evicted
        assert store.put_many([k], [payload(k)]) == [PutStatus.OK]
        changes += log.take()
        held = {k for k, found in zip(keys, store.contains_many(keys), strict=True) if found}
        assert replay(changes) == held
    assert changes[:2] == [KeyChange(0, keys[0], True), KeyChange(0, keys[1], True)]
    assert store.tiers[0].stats().evictions == sum(not c.stored for c in changes) > 0
    assert store.delete_many([keys[8]]) == 1
    changes += log.take()
    assert changes[-1] == KeyChange(0, keys[8], False)
    held = {k for k, found in zip(keys, store.contains_many(keys), strict=True) if found}
    assert replay(changes) == held and keys[8] not in held
    store.close()


# --- a pool: the store records what it learns -------------------------------------------


@pytest.fixture(scope="module")
def valkey() -> Iterator[LocalPool]:
    with ValkeyServer() as running:
        yield running


def test_a_pool_is_recorded_by_the_store_from_writes_reads_and_deletes(valkey: LocalPool) -> None:
    entry = next(e for e in valkey.tier_configs() if e["kind"] == "valkey")
    pool = ValkeyTier(parse_tier_config(entry))  # type: ignore[arg-type]
    cpu = CpuTier(CpuConfig(capacity_bytes=ARENA_OBJECTS * SIZE, pin_memory=False))
    store = TieredStore([cpu, pool])
    log = ChangeLog()
    store.record_changes(log)
    assert log.logs_itself(0) and not log.logs_itself(1)
    keys = [key(100 + i) for i in range(3)]
    try:
        store.put_many(keys, [payload(k) for k in keys])
        assert store.flush(30)
        changes = log.take()
        assert replay(changes, 0) == set(keys) and replay(changes, 1) == set(keys)

        # The pool loses one (its own eviction, unseen); a read of it through the store,
        # after the CPU tier dropped it too, finds it gone.
        client = redis.Redis(host="127.0.0.1", port=valkey.valkey_port)
        assert client.delete(keys[0]) == 1
        client.close()
        store.tiers[0].delete_many([keys[0]])
        assert read(store, [keys[0], keys[1]]) == [GetStatus.MISS, GetStatus.OK]
        changes += log.take()
        assert replay(changes, 0) == set(keys[1:]) and replay(changes, 1) == set(keys[1:])

        store.delete_many([keys[2]])
        changes += log.take()
        assert replay(changes, 1) == {keys[1]}
    finally:
        store.delete_many(keys)
        store.close()
