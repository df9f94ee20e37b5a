"""ValkeyTier over a real 3-shard Valkey Cluster on 127.0.0.1 (``LocalPool`` starts it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus
from hybridkv.tiers.registry import parse_tier_config
from hybridkv.tiers.valkey.cluster import Node, SlotMap, key_slot
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.valkey_cluster import slot_ranges
from tests.support.servers import MIB, ValkeyServer
from tests.support.tier_data import new_keys, payloads

NUM_SHARDS = 3
MAXMEMORY_BYTES = 32 * MIB


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPool]:
    with ValkeyServer(maxmemory_bytes=MAXMEMORY_BYTES, shards=NUM_SHARDS) as running:
        yield running


@pytest.fixture(scope="module")
def shards(cluster: LocalPool) -> Iterator[list[redis.Redis]]:
    clients = [redis.Redis(host="127.0.0.1", port=port) for port in cluster.shard_ports]
    yield clients
    for client in clients:
        client.close()


def make_tier(cluster: LocalPool) -> ValkeyTier:
    entry = next(e for e in cluster.tier_configs() if e["kind"] == "valkey")
    return ValkeyTier(parse_tier_config(entry | {"op_timeout_s": 1.0}))  # type: ignore[arg-type]


def test_slot_ranges_cover_every_slot_once() -> None:
    for num_shards in (1, 2, 3, 7):
        ranges = slot_ranges(num_shards)
        slots = [slot for start, end in ranges for slot in range(start, end + 1)]
        assert slots == list(range(16384)), num_shards


def test_cluster_config_rejects_another_db() -> None:
    with pytest.raises(ValueError, match=r"db=2 with cluster true.*set db to 0"):
        ValkeyConfig(port=7000, cluster=True, db=2)


def test_local_pool_starts_a_cluster_of_primaries(cluster: LocalPool) -> None:
    (entry,) = cluster.tier_configs()
    assert entry == {"kind": "valkey", "host": "127.0.0.1", "port": cluster.shard_ports[0],
                     "cluster": True}  # fmt: skip
    status = cluster.status()
    assert [status[f"valkey-shard-{i}"]["alive"] for i in range(NUM_SHARDS)] == [True] * 3
    assert status["valkey_pool"]["maxmemory_bytes"] == NUM_SHARDS * MAXMEMORY_BYTES
    reloaded = LocalPool.load(cluster.run_dir)
    assert reloaded.shard_ports == cluster.shard_ports and reloaded.tier_configs() == [entry]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text(alphabet="ab{}/0", max_size=12))
def test_key_slot_matches_the_server(shards: list[redis.Redis], key: str) -> None:
    assert key_slot(key) == shards[0].execute_command("CLUSTER KEYSLOT", key)


def test_keys_spread_over_every_shard_by_slot(
    cluster: LocalPool, shards: list[redis.Redis]
) -> None:
    keys = new_keys(300)
    buffers = payloads([2000 + i for i in range(300)], seed=11)
    sizes_before = [client.dbsize() for client in shards]
    with make_tier(cluster) as tier:
        assert tier.put_many(keys, buffers) == [PutStatus.OK] * 300
        added = [
            client.dbsize() - before for client, before in zip(shards, sizes_before, strict=True)
        ]
        assert sum(added) == 300 and min(added) > 50, added  # about a third each
        ranges = slot_ranges(NUM_SHARDS)
        for key in keys[:30]:  # each key on the shard that owns its slot
            owner = next(i for i, (a, b) in enumerate(ranges) if a <= key_slot(key) <= b)
            assert holders(shards, key) == [owner]
        outs = [np.empty(len(buf), dtype=np.uint8) for buf in buffers]
        assert tier.get_many_into(keys, outs) == [GetStatus.OK] * 300
        assert all(np.array_equal(out, buf) for out, buf in zip(outs, buffers, strict=True))
        assert tier.contains_many(keys) == [True] * 300
        assert tier.delete_many(keys[:100]) == 100
        assert tier.contains_many(keys[:101]) == [False] * 100 + [True]
        usage = tier.usage()
        assert usage.num_objects == sum(client.dbsize() for client in shards)
        assert usage.capacity_bytes == NUM_SHARDS * MAXMEMORY_BYTES
        assert tier.stats().errors == 0
        tier.check_integrity()


def test_a_moved_slot_costs_one_error_then_the_map_is_read_again(
    cluster: LocalPool, shards: list[redis.Redis], caplog: pytest.LogCaptureFixture
) -> None:
    (warm,) = new_keys(1)
    buffers = payloads([4096, 4096], seed=12)
    with make_tier(cluster) as tier, caplog.at_level(logging.WARNING):
        assert tier.put_many([warm], buffers[:1]) == [PutStatus.OK]  # the map is read
        # A key in a slot no key was written to yet (keys are random: one could share one).
        while True:
            (moving,) = new_keys(1)
            slot = key_slot(moving)
            owner = _owner_of(slot)
            if shards[owner].execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0:
                break
        target = (owner + 1) % NUM_SHARDS
        target_id = shards[target].execute_command("CLUSTER MYID")
        for i in (target, owner, *(i for i in range(NUM_SHARDS) if i not in (owner, target))):
            assert shards[i].execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        assert tier.put_many([moving], buffers[1:]) == [PutStatus.ERROR]  # MOVED
        assert tier.stats().errors == 1
        assert tier.put_many([moving], buffers[1:]) == [PutStatus.OK]
        assert holders(shards, moving) == [target]
        out = np.empty(4096, dtype=np.uint8)
        assert tier.get_many_into([moving], [out]) == [GetStatus.OK]
        assert np.array_equal(out, buffers[1])
        tier.check_integrity()
    redirects = [r.getMessage() for r in caplog.records if "MOVED" in r.getMessage()]
    assert len(redirects) == 1 and "slots again" in redirects[0], redirects


def holders(shards: list[redis.Redis], key: str) -> list[int]:
    """The shards that hold ``key`` (asked per slot: a shard answers MOVED for others' keys)."""
    found = []
    for i, client in enumerate(shards):
        listed = client.execute_command("CLUSTER GETKEYSINSLOT", key_slot(key), 1000)
        if key in [k.decode() if isinstance(k, bytes) else k for k in listed]:
            found.append(i)
    return found


def _owner_of(slot: int) -> int:
    return next(i for i, (a, b) in enumerate(slot_ranges(NUM_SHARDS)) if a <= slot <= b)


def test_slot_map_from_a_reply_with_gaps_and_unannounced_hosts() -> None:
    reply = [[0, 99, [b"", 7001, b"id-a", []]], [200, 16383, [b"127.0.0.1", 7002, b"id-b"]]]
    slots = SlotMap.from_reply(reply, "localhost")
    by_slot: dict[int, str] = {}
    for i in range(2000):  # keys until every region was seen
        by_slot.setdefault(key_slot(f"k{i}"), f"k{i}")
    for slot, key in by_slot.items():
        expected = (
            Node("localhost", 7001) if slot < 100
            else None if slot < 200
            else Node("127.0.0.1", 7002)
        )  # fmt: skip
        assert slots.node_of(key) == expected, (slot, key)
    assert slots.nodes == [Node("127.0.0.1", 7002), Node("localhost", 7001)]
