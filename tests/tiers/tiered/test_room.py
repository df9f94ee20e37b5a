"""SlowerRoom over a real DiskTier: free room is read at most once per refresh and
what is sent in between is counted against it."""

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


def room_over_disk(tmp_path: Path, clock: Clock) -> tuple[SlowerRoom, DiskTier, CpuTier]:
    first = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    config = DiskConfig(path=tmp_path, capacity_bytes=CAPACITY, segment_bytes=SEGMENT)
    second = DiskTier(config)
    guard = TierGuard("test", ["cpu", "disk"], logging.getLogger(__name__))
    return SlowerRoom([first, second], guard, refresh_s=1.0, clock=clock), second, first


def put(disk: DiskTier, name: str, num_bytes: int = 4096) -> StoreKey:
    key = StoreKey(f"test/room/{name}")
    assert disk.put_many([key], [np.zeros(num_bytes, np.uint8)]) == [PutStatus.OK]
    return key


def test_sent_bytes_count_until_the_next_read(tmp_path: Path) -> None:
    clock = Clock()
    room, second, first = room_over_disk(tmp_path, clock)
    second.note_reused_many([put(second, "reused")])  # the next victim is reused
    free = CAPACITY - SEGMENT
    assert second.usage().used_bytes == SEGMENT
    assert room.take(free // 2)
    assert room.take(free // 2)
    assert not room.take(1)  # counted full although nothing was written yet
    clock.now = 0.5
    assert not room.take(1)  # not read again yet
    clock.now = 1.0
    assert not room.take(free + 1)  # read again: what the disk has
    assert room.take(free)
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
    assert second.evicts_reused(1) is False
    assert room.take(1)  # full, but evicting takes nothing reused: as plain recency
    second.note_reused_many(oldest[-1:])  # one reused object makes its segment kept
    assert second.evicts_reused(1) is False  # a segment holding nothing reused is next
    assert room.take(1)
    # The other three segments: as many segments' data areas (less than a segment each).
    assert second.evicts_reused(CAPACITY - 2 * SEGMENT) is False
    assert second.evicts_reused(CAPACITY - SEGMENT) is True
    assert not room.take(CAPACITY)  # a batch bigger than what may be evicted for it
    second.note_reused_many(fill)  # now every segment holds one
    assert second.evicts_reused(1) is True
    clock.now = 1.0
    assert not room.take(1)
    second.close()
    first.close()


def test_a_pool_has_room_only_where_its_server_tells_its_capacity(tmp_path: Path) -> None:
    """Valkey under ``maxmemory`` reports it; Mooncake's client cannot learn it."""
    first = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    guard = TierGuard("test", ["cpu", "pool"], logging.getLogger(__name__))
    with (
        ValkeyServer(maxmemory_bytes=64 * MIB) as server,
        ValkeyTier(ValkeyConfig(port=server.valkey_port)) as valkey,
    ):
        room = SlowerRoom([first, valkey], guard)
        assert room.take(MIB)
        assert not room.take(64 * MIB)  # valkey's own memory already takes some
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
