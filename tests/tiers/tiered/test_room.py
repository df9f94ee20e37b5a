"""SlowerRoom over real tiers: a disk is asked for every batch, with the bytes still
queued for it counted against its room; a pool's room is read at most once per
refresh and what is sent in between is counted against it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hybridkv.tiers.base import PutStatus, StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.mooncake.tier import MooncakeTier
from hybridkv.tiers.tiered.guard import TierGuard
from hybridkv.tiers.tiered.room import SlowerRoom
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from tests.support.servers import MIB, MooncakePool, ValkeyServer

CAPACITY = 4 << 20
SEGMENT = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def room_over_disk(
    tmp_path: Path, clock: Clock, queued: list[int] | None = None
) -> tuple[SlowerRoom, DiskTier, CpuTier]:
    """``queued``: bytes the write-back has not written yet, as the room reads them."""
    first = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    config = DiskConfig(path=tmp_path, capacity_bytes=CAPACITY, segment_bytes=SEGMENT)
    second = DiskTier(config)
    guard = TierGuard("test", ["cpu", "disk"], logging.getLogger(__name__))
    waiting = queued if queued is not None else [0]
    room = SlowerRoom([first, second], guard, queued=lambda: waiting[0], reread_s=1.0, clock=clock)
    return room, second, first


def put(disk: DiskTier, name: str, num_bytes: int = 4096) -> StoreKey:
    key = StoreKey(f"test/room/{name}")
    assert disk.put_many([key], [np.zeros(num_bytes, np.uint8)]) == [PutStatus.OK]
    return key


def test_a_disk_is_asked_for_every_batch_with_what_is_queued_for_it(tmp_path: Path) -> None:
    clock = Clock()
    queued = [0]
    room, second, first = room_over_disk(tmp_path, clock, queued)
    second.retention.note_reused([put(second, "reused")])  # the next victim is reused
    free = CAPACITY - SEGMENT
    assert second.usage().used_bytes == SEGMENT
    assert room.take(free)
    assert room.take(free)  # nothing was written or queued since: the disk is as it was
    assert not room.take(free + 1)
    queued[0] = free // 2  # sent on, still in the write-back's queue
    assert room.take(free // 2)
    assert not room.take(free // 2 + 1)
    queued[0] = 0
    written = [put(second, f"written/{name}", SEGMENT // 2) for name in ("a", "b")]
    second.retention.note_reused(written)  # the second needed a new segment, now kept too
    assert second.usage().used_bytes == 2 * SEGMENT  # read at once, no refresh
    assert not room.take(free - SEGMENT + 1)
    assert room.take(free - SEGMENT)
    assert clock.now == 0.0
    second.close()
    first.close()


def test_a_full_disk_takes_stores_while_what_they_evict_holds_nothing_reused(
    tmp_path: Path,
) -> None:
    clock = Clock()
    room, second, first = room_over_disk(tmp_path, clock)
    oldest = [put(second, f"old/{i}", 64 << 10) for i in range(15)]  # the first segment
    i = 0
    while second.usage().used_bytes < CAPACITY:
        put(second, f"fill/{i}", 64 << 10)
        i += 1
    fill = [StoreKey(f"test/room/fill/{j}") for j in range(i)]
    assert second.retention.evicts_reused(1) is False
    assert room.take(1)  # full, but evicting takes nothing reused: as plain recency
    second.retention.note_reused(oldest[-1:])  # one reused object makes its segment kept
    assert second.retention.evicts_reused(1) is False  # a segment holding nothing reused is next
    assert room.take(1)
    # The other three segments: as many segments' data areas (less than a segment each).
    assert second.retention.evicts_reused(CAPACITY - 2 * SEGMENT) is False
    assert second.retention.evicts_reused(CAPACITY - SEGMENT) is True
    assert not room.take(CAPACITY)  # a batch bigger than what may be evicted for it
    second.retention.note_reused(fill)  # now every segment holds one
    assert second.retention.evicts_reused(1) is True
    clock.now = 1.0
    assert not room.take(1)
    second.close()
    first.close()


def test_a_pool_has_room_only_where_its_server_tells_its_capacity(tmp_path: Path) -> None:
    """Valkey under ``maxmemory`` reports it; Mooncake's client cannot learn it."""
    first = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    guard = TierGuard("test", ["cpu", "pool"], logging.getLogger(__name__))
    clock = Clock()
    with (
        ValkeyServer(maxmemory_bytes=64 * MIB) as server,
        ValkeyTier(ValkeyConfig(port=server.valkey_port)) as valkey,
    ):
        room = SlowerRoom([first, valkey], guard, reread_s=1.0, clock=clock)
        assert not room.take(64 * MIB)  # valkey's own memory already takes some
        assert room.take(30 * MIB)
        assert room.take(30 * MIB)
        assert not room.take(30 * MIB)  # sent since the read: counted, not asked again
        clock.now = 0.5
        assert not room.take(30 * MIB)
        clock.now = 1.0
        assert room.take(30 * MIB)  # read again: nothing was written there
    with (
        MooncakePool(segment_bytes=64 * MIB) as pool,
        MooncakeTier(
            MooncakeConfig(master_address=pool.master_address, local_buffer_bytes=2 * MIB)
        ) as mooncake,
    ):
        assert not SlowerRoom([first, mooncake], guard).take(1)
    only_first = SlowerRoom([first], TierGuard("test", ["cpu"], logging.getLogger(__name__)))
    assert not only_first.take(1)  # no slower tier: nothing to send on
    first.close()


def test_only_a_short_tier_is_asked_what_it_would_evict(tmp_path: Path) -> None:
    """A full disk whose victim holds nothing reused takes the batch; a pool with room
    behind it, which cannot name a victim, does not refuse it."""
    first = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    disk = DiskTier(DiskConfig(path=tmp_path, capacity_bytes=CAPACITY, segment_bytes=SEGMENT))
    guard = TierGuard("test", ["cpu", "disk", "pool"], logging.getLogger(__name__))
    i = 0
    while disk.usage().used_bytes < CAPACITY:
        put(disk, f"fill/{i}", 64 << 10)
        i += 1
    with (
        ValkeyServer(maxmemory_bytes=64 * MIB) as server,
        ValkeyTier(ValkeyConfig(port=server.valkey_port)) as valkey,
    ):
        assert valkey.retention.evicts_reused(1) is None  # a pool cannot tell
        room = SlowerRoom([first, disk, valkey], guard)
        assert room.take(MIB)  # the disk evicts an unreused segment; valkey has room
        disk.retention.note_reused([StoreKey(f"test/room/fill/{j}") for j in range(i)])
        assert not room.take(MIB)  # now the disk would evict something reused
        assert not room.take(64 * MIB)  # and valkey has no room for this much
    disk.close()
    first.close()
