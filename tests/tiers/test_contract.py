"""The tier contract, run against every tier: cpu, disk, tiered, mooncake, valkey, and
valkey over a 3-shard Valkey Cluster.

What ``hybridkv.tiers.base.Tier`` promises, checked on real tiers (real
Mooncake and Valkey servers on 127.0.0.1): a tier answers like a dict whose
first value wins, writes a buffer only when its status is OK, reads back the
exact bytes stored, never serves an object of another size, answers every
key of a batch in order, counts what happened, and stays consistent. A tier
offering its memory (``Tier.memory()``) keeps the ``TierMemory`` protocol.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from hybridkv.tiers.base import GetStatus, PutStatus, Tier
from hybridkv.tiers.codec import checksum
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.mooncake.tier import MooncakeTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from tests.support.servers import MIB, MooncakePool, ValkeyServer
from tests.support.tier_data import check_round_trip_matches_a_dict, new_keys, payloads

KINDS = ("cpu", "disk", "tiered", "mooncake", "valkey", "valkey-cluster")


@pytest.fixture(scope="module")
def mooncake_pool() -> Iterator[LocalPool]:
    with MooncakePool(segment_bytes=128 * MIB) as running:
        yield running


@pytest.fixture(scope="module")
def valkey_server() -> Iterator[LocalPool]:
    with ValkeyServer(maxmemory_bytes=128 * MIB) as running:
        yield running


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[LocalPool]:
    with ValkeyServer(maxmemory_bytes=64 * MIB, shards=3) as running:
        yield running


@pytest.fixture(params=KINDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    kind: str = request.param
    builders: dict[str, Callable[[], Tier]] = {
        "cpu": lambda: CpuTier(CpuConfig(capacity_bytes=16 * MIB)),
        "disk": lambda: DiskTier(DiskConfig(path=tmp_path / "disk", capacity_bytes=64 * MIB)),
        "tiered": lambda: TieredStore(
            [
                CpuTier(CpuConfig(capacity_bytes=16 * MIB)),
                DiskTier(DiskConfig(path=tmp_path / "tiered", capacity_bytes=64 * MIB)),
            ]
        ),
        "mooncake": lambda: MooncakeTier(
            MooncakeConfig(
                master_address=request.getfixturevalue("mooncake_pool").master_address,
                local_buffer_bytes=4 * MIB,
            )
        ),
        "valkey": lambda: ValkeyTier(
            ValkeyConfig(port=request.getfixturevalue("valkey_server").valkey_port)
        ),
        "valkey-cluster": lambda: ValkeyTier(
            ValkeyConfig(port=request.getfixturevalue("valkey_cluster").valkey_port, cluster=True)
        ),
    }
    built = builders[kind]()
    yield built
    built.check_integrity()
    built.close()
    built.close()  # closing twice is harmless


@pytest.mark.parametrize("wrong_size", [False, True])
def test_round_trip_matches_a_first_value_wins_dict(tier: Tier, wrong_size: bool) -> None:
    batches = [[(0, 4096), (1, 100), (2, 65536)], [(1, 100), (3, 7), (0, 4096)], [(4, 300_000)]]
    check_round_trip_matches_a_dict(tier, batches, wrong_size)


def test_every_key_is_answered_in_order(tier: Tier) -> None:
    keys = new_keys(40)
    stored = keys[::3]
    assert tier.put_many(stored, payloads([512] * len(stored))) == [PutStatus.OK] * len(stored)
    assert tier.contains_many(keys) == [key in stored for key in keys]
    assert tier.contains_many(list(reversed(keys))) == [key in stored for key in reversed(keys)]
    outs = [np.full(512, 7, dtype=np.uint8) for _ in keys]
    statuses = tier.get_many_into(keys, outs)
    for key, status, out in zip(keys, statuses, outs, strict=True):
        assert status is (GetStatus.OK if key in stored else GetStatus.MISS)
        if status is not GetStatus.OK:
            assert (out == 7).all(), "a buffer was written without an OK status"


def test_deleted_keys_miss_and_can_be_stored_again(tier: Tier) -> None:
    keys = new_keys(6)
    first, second = payloads([2048] * 6, seed=1), payloads([2048] * 6, seed=2)
    tier.put_many(keys, first)
    assert tier.delete_many(keys[:4]) == 4
    assert tier.delete_many(keys[:4]) == 0  # already gone
    assert tier.contains_many(keys) == [False] * 4 + [True] * 2
    assert tier.put_many(keys, second) == [PutStatus.OK] * 4 + [PutStatus.EXISTS] * 2
    outs = [np.zeros(2048, dtype=np.uint8) for _ in keys]
    assert tier.get_many_into(keys, outs) == [GetStatus.OK] * 6
    for i, out in enumerate(outs):  # new values where deleted, first values elsewhere
        assert np.array_equal(out, second[i] if i < 4 else first[i])


def test_empty_and_mismatched_batches(tier: Tier) -> None:
    assert tier.put_many([], []) == [] and tier.get_many_into([], []) == []
    assert tier.contains_many([]) == [] and tier.delete_many([]) == 0
    keys = new_keys(2)
    with pytest.raises(ValueError, match="need one buffer per key"):
        tier.put_many(keys, payloads([16]))
    with pytest.raises(TypeError, match="1-D numpy uint8 array"):
        tier.get_many_into(keys[:1], [np.zeros(4, dtype=np.int32)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="checksums"):
        tier.put_many(keys, payloads([16, 16]), [0])
    assert tier.contains_many(keys) == [False, False]


def test_puts_with_their_checksums_read_back_the_same(tier: Tier) -> None:
    """A caller that took the checksums (the transfer engine, while gathering) hands them
    over; every tier stores the same objects as without them."""
    keys = new_keys(3)
    values = payloads([4096, 100, 65536], seed=4)
    sums = [checksum(value) for value in values]
    assert tier.put_many(keys, values, sums) == [PutStatus.OK] * 3
    outs = [np.zeros(len(value), dtype=np.uint8) for value in values]
    assert tier.get_many_into(keys, outs) == [GetStatus.OK] * 3
    assert all(np.array_equal(out, value) for out, value in zip(outs, values, strict=True))


def test_stats_and_usage_count_what_happened(tier: Tier) -> None:
    before, used_before = tier.stats(), tier.usage()
    keys = new_keys(8)
    tier.put_many(keys[:5], payloads([1000] * 5))
    assert tier.contains_many(keys) == [True] * 5 + [False] * 3
    outs = [np.zeros(1000, dtype=np.uint8) for _ in keys]
    tier.get_many_into(keys, outs)
    after, used_after = tier.stats(), tier.usage()
    assert after.queries - before.queries == 8
    assert after.hits - before.hits == 5
    assert after.puts - before.puts == 5 and after.put_bytes - before.put_bytes >= 5000
    assert after.gets - before.gets == 5 and after.get_bytes - before.get_bytes == 5000
    assert used_after.num_objects - used_before.num_objects >= 5
    assert used_after.used_bytes - used_before.used_bytes >= 5000
    capacity = used_after.capacity_bytes
    assert capacity is None or used_after.used_bytes <= capacity


def test_memory_is_none_or_keeps_the_protocol(tier: Tier) -> None:
    """In place: reserved objects are invisible, committed ones read back exactly (through
    buffers and borrowed), unwritten ones vanish, and a stored key answers EXISTS."""
    memory = tier.memory()
    if memory is None:
        return
    arena = memory.memory
    assert arena.dtype == torch.uint8 and arena.dim() == 1 and arena.device.type == "cpu"
    keys = new_keys(3)
    values = payloads([4096, 100, 65536], seed=5)
    sizes = [len(value) for value in values]
    offsets = memory.reserve_many(keys, sizes)
    assert tier.contains_many(keys) == [False] * 3
    view = arena.numpy()
    for offset, value in zip(offsets, values, strict=True):
        assert isinstance(offset, int) and offset + len(value) <= len(view)
        view[offset : offset + len(value)] = value
    memory.commit_many(keys, [True, True, False])
    assert tier.contains_many(keys) == [True, True, False]
    assert memory.reserve_many(keys[:1], sizes[:1]) == [PutStatus.EXISTS]
    outs = [np.zeros(size, dtype=np.uint8) for size in sizes]
    assert tier.get_many_into(keys, outs) == [GetStatus.OK, GetStatus.OK, GetStatus.MISS]
    borrowed = memory.borrow_many(keys, sizes)
    assert borrowed[2] is GetStatus.MISS
    for j in range(2):
        offset = borrowed[j]
        assert isinstance(offset, int)
        assert np.array_equal(outs[j], values[j])
        assert np.array_equal(view[offset : offset + sizes[j]], values[j])
    memory.release_many(keys[:2])
