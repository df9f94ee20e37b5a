"""Engines sharing a full pool judge reuse together (``connector.sightings``): with
``admission: reused`` a prefix two engines each computed once reaches the pool,
because the second finds the first one's mark there. Real schedulers, workers,
CPU tiers and a real valkey-server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.setup import EngineFacts, build_scheduler, sighting_tier
from hybridkv.connector.sightings import PoolSightings
from hybridkv.connector.stats import SchedulerStats
from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.keys import BlockHash, KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import every_key, run_request, stored_keys
from tests.support.servers import ValkeyServer

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
BLOCK_SIZE = 4
CHUNK = 32
PREFIX = prompt(64, seed=100)
"""What both engines compute: 16 blocks, two steps."""


@pytest.fixture
def pool() -> Iterator[LocalPool]:
    """A server without ``maxmemory``: its room is unknown, so ``admission: reused``
    sends it only blocks reached twice, as to a full pool."""
    with ValkeyServer(maxmemory_bytes=0) as running:
        yield running


def raw_client(pool: LocalPool) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=pool.valkey_port)


def pool_config(
    tmp_path: Path, pool: LocalPool, ttl_s: int, admission: str = "reused"
) -> ConnectorConfig:
    tiers = [
        {"kind": "cpu", "capacity_bytes": "8MiB", "pin_memory": False},
        {"kind": "valkey", "port": pool.valkey_port, "op_timeout_s": 2.0},
    ]
    return make_config(tmp_path, tiers=tiers, admission=admission, admission_sighting_ttl_s=ttl_s)


def in_pool(pool: LocalPool, keys: list[str]) -> list[bool]:
    client = raw_client(pool)
    try:
        return [bool(client.exists(key)) for key in keys]
    finally:
        client.close()


def run(engine: SimEngine, req_id: str, tokens: list[int]) -> int:
    return run_request(engine, req_id, tokens, CHUNK)


@pytest.mark.parametrize("ttl_s", [3600, 0], ids=["marks", "alone"])
@pytest.mark.parametrize("kinds", [(SW, FULL), (MAMBA, FULL)], ids=["sliding+full", "mamba+full"])
def test_a_prefix_two_engines_computed_once_each_reaches_a_full_pool(
    tmp_path: Path, pool: LocalPool, kinds: tuple[GroupKind, ...], ttl_s: int
) -> None:
    model_groups = make_groups(kinds, block_size=BLOCK_SIZE)
    config = pool_config(tmp_path, pool, ttl_s)
    first = make_engine(model_groups, config)
    assert run(first, "a", PREFIX + prompt(CHUNK, seed=1)) == 0
    prefix_keys = stored_keys(model_groups, first, PREFIX)
    assert in_pool(pool, prefix_keys) == [False] * len(prefix_keys)  # seen once
    second = make_engine(model_groups, config)  # another engine: its own cpu tier
    assert run(second, "b", PREFIX + prompt(CHUNK, seed=2)) == 0
    assert stored_keys(model_groups, second, PREFIX) == prefix_keys
    assert {key.split("|")[3] for key in prefix_keys} == {"g0", "g1"}
    reached = ttl_s > 0
    assert in_pool(pool, prefix_keys) == [reached] * len(prefix_keys)  # every group
    suffix_keys = every_key(model_groups, PREFIX + prompt(CHUNK, seed=2))[len(prefix_keys) :]
    suffix_keys = [k for k in suffix_keys if k not in prefix_keys]
    assert not any(in_pool(pool, suffix_keys))  # seen by one engine only
    hashes = (len(PREFIX) + CHUNK) // model_groups.hash_block_size  # each request's
    prefix_hashes = len(PREFIX) // model_groups.hash_block_size
    first_stats, second_stats = first.scheduler.stats, second.scheduler.stats
    assert first_stats.pool_sightings == second_stats.pool_sightings == (hashes if reached else 0)
    assert first_stats.pool_sightings_before == 0
    assert second_stats.pool_sightings_before == (prefix_hashes if reached else 0)
    close_engine(first)
    close_engine(second)
    third = make_engine(model_groups, config)  # a third engine, or one restarted
    assert run(third, "c", PREFIX + prompt(CHUNK, seed=3)) == (len(PREFIX) if reached else 0)
    close_engine(third)


def test_marks_tell_which_hashes_any_client_saw_and_expire(pool: LocalPool) -> None:
    config = ValkeyConfig(port=pool.valkey_port, op_timeout_s=2.0)
    one, other = ValkeyTier(config), ValkeyTier(config)
    keys = [f"m|f|seen|{i:02x}" for i in range(6)]
    assert one.sight_many(keys[:4], 60) == [False] * 4
    assert other.sight_many(keys[2:], 60) == [True, True, False, False]
    assert one.sight_many(keys, 60) == [True] * 6
    client = raw_client(pool)
    assert all(0 < client.ttl(key) <= 60 for key in keys)
    assert client.get(keys[0]) == b"1"
    client.close()
    one.close()
    other.close()


def test_an_unreachable_pool_answers_every_hash_unseen() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    tier = ValkeyTier(ValkeyConfig(port=port, op_timeout_s=0.5, retry_interval_s=0.2))
    assert tier.sight_many(["m|f|seen|00", "m|f|seen|01"], 60) == [False, False]
    assert tier.stats().errors == 2
    tier.close()


def test_marks_are_named_by_model_and_groups_not_by_rank(pool: LocalPool) -> None:
    """Every rank's builder names a hash's mark alike; another model's marks are apart,
    and a mark is never taken for a block's key."""
    groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    other_model = make_groups((SW, FULL), block_size=BLOCK_SIZE, model_id="other")
    rank0, rank1 = (
        KeyBuilder(groups, KeyNamespace.for_groups(groups, tp_rank=r, tp_size=2)) for r in (0, 1)
    )
    hasher = RequestBlockHasher(groups.hash_block_size)
    hasher.extend(PREFIX)
    hashes = list(hasher.block_hashes)
    assert rank0.sighting_keys(hashes) == rank1.sighting_keys(hashes)
    assert all(rank0.parse(key) is None for key in rank0.sighting_keys(hashes))
    tier = ValkeyTier(ValkeyConfig(port=pool.valkey_port, op_timeout_s=2.0))
    mine = PoolSightings(tier, rank0, ttl_s=60, stats=SchedulerStats())
    theirs = PoolSightings(
        tier,
        KeyBuilder(other_model, KeyNamespace.for_groups(other_model)),
        ttl_s=60,
        stats=SchedulerStats(),
    )
    assert not mine.sight(hashes).any()
    assert not theirs.sight(hashes).any()
    again = PoolSightings(tier, rank1, ttl_s=60, stats=SchedulerStats())
    assert np.array_equal(again.sight([*hashes[:3], hashes[-1]]), [True] * 4)
    assert again.stats.pool_sightings == 4 and again.stats.pool_sightings_before == 4
    tier.close()


def test_only_a_tier_that_marks_sightings_is_picked_or_taken(
    tmp_path: Path, pool: LocalPool
) -> None:
    """``sighting_tier`` passes over tiers without ``marks_sightings`` (and views that are
    not tiers); ``PoolSightings`` refuses one, naming it."""
    groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    config = pool_config(tmp_path, pool, ttl_s=60)
    builder = KeyBuilder(groups, KeyNamespace.for_groups(groups))
    cpu = CpuTier(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    valkey = ValkeyTier(ValkeyConfig(port=pool.valkey_port, op_timeout_s=2.0))
    try:
        assert sighting_tier(config, [None, cpu, valkey]) is valkey
        assert sighting_tier(config, [cpu]) is None
        with pytest.raises(ValueError, match="tier cpu cannot mark sightings"):
            PoolSightings(cpu, builder, ttl_s=60, stats=SchedulerStats())
        with pytest.raises(NotImplementedError, match="tier cpu cannot mark sightings"):
            cpu.sight_many(["m|f|seen|00"], 60)
    finally:
        cpu.close()
        valkey.close()


@pytest.mark.parametrize(
    ("admission", "ttl_s", "marks"),
    [("reused", 3600, True), ("reused", 0, False), ("all", 3600, False)],
)
def test_the_scheduler_of_another_process_marks_in_its_own_view_of_the_pool(
    tmp_path: Path, pool: LocalPool, admission: str, ttl_s: int, marks: bool
) -> None:
    """``build_scheduler`` without the worker's store (vLLM's scheduler process) marks
    through the lookup-only Valkey tier it opens, and only where it should."""
    model_groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    config = pool_config(tmp_path, pool, ttl_s, admission)
    facts = EngineFacts(model_groups=model_groups, alignment_tokens=BLOCK_SIZE)
    scheduler, opened = build_scheduler(config, facts)
    try:
        sightings = None if scheduler.admission is None else scheduler.admission.sightings
        assert (sightings is not None) == marks
        if sightings is not None:
            assert sightings.tier in opened and sightings.ttl_s == ttl_s
            scheduler.lookup("r", PREFIX, 0)
            keys = scheduler.builders[0].sighting_keys(sightings_hashes(model_groups))
            assert in_pool(pool, keys) == [True] * len(keys)
            client = raw_client(pool)
            assert 0 < client.ttl(keys[0]) <= ttl_s
            client.close()
    finally:
        for tier in opened:
            tier.close()


def sightings_hashes(model_groups: ModelGroups) -> list[BlockHash]:
    hasher = RequestBlockHasher(model_groups.hash_block_size)
    hasher.extend(PREFIX)
    return list(hasher.block_hashes)
