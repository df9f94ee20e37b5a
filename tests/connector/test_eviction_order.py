"""``eviction_order``: a CPU tier too small for two prompts keeps the head of the first
(``chain``, ``worth``), or loses it first (``lru``); with ``worth`` a long prompt held in
fewer bytes per token than short ones outlives them; on a real scheduler, worker and
tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.connector.retention import POLICIES, ChainPolicy, EvictionOrder, register
from hybridkv.groups import GroupKind
from hybridkv.tiers.cpu import CpuTier
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.check import assert_kv_matches_cold
from hybridkv.tools.sim.drive import run_to_end, wait_loaded
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import attention_page_bytes, make_groups
from tests.support.connector import block_keys

FULL, SW = GroupKind.FULL, GroupKind.SLIDING_WINDOW
BLOCK_SIZE = 4
NUM_BLOCKS = 40
"""Blocks of each prompt; the tier holds 60 blocks of every group."""
CHUNK = 32
"""Tokens per step: a prompt is stored over five steps (chunked prefill)."""


def _store(engine: SimEngine, req_id: str, tokens: list[int]) -> None:
    assert engine.add(req_id, tokens) == 0
    run_to_end(engine, req_id, CHUNK)
    engine.settle()
    assert engine.finish(req_id) is False


@pytest.mark.parametrize("kinds", [(FULL,), (SW, FULL)], ids=["full", "sliding+full"])
@pytest.mark.parametrize("order", ["chain", "worth", "lru"])
def test_a_second_prompt_evicts_the_tail_of_the_first(
    tmp_path: Path, kinds: tuple[GroupKind, ...], order: str
) -> None:
    model_groups = make_groups(kinds, block_size=BLOCK_SIZE)
    block_bytes = 2 * attention_page_bytes(BLOCK_SIZE)  # two layers per group
    capacity = 60 * len(kinds) * block_bytes
    tier = {"kind": "cpu", "capacity_bytes": capacity, "pin_memory": False}
    config = make_config(tmp_path, tiers=[tier], eviction_order=order)
    engine = make_engine(model_groups, config)
    a, b = prompt(NUM_BLOCKS * BLOCK_SIZE), prompt(NUM_BLOCKS * BLOCK_SIZE, seed=1)
    _store(engine, "a", a)
    _store(engine, "b", b)  # evicts about 20 blocks of every group of a
    cpu = engine.worker.store.tiers[0]
    assert isinstance(cpu, CpuTier)
    full_id = kinds.index(FULL)
    survived = cpu.contains_many(block_keys(model_groups, a, full_id, range(NUM_BLOCKS)))
    num_kept = survived.count(True)
    assert 0 < num_kept < NUM_BLOCKS
    hit = engine.add("a again", a)
    if order != "lru":  # its head, whole, in every group (every chain is worth the same)
        assert survived == [True] * num_kept + [False] * (NUM_BLOCKS - num_kept)
        assert hit == num_kept * BLOCK_SIZE
        req = wait_loaded(engine, "a again")
        assert req.outcomes[-1].ok
        assert assert_kv_matches_cold(engine, req, hit) > 0
    else:  # its tail, useless without the head
        assert survived == [False] * (NUM_BLOCKS - num_kept) + [True] * num_kept
        assert hit == 0
    close_engine(engine)


MAMBA = GroupKind.MAMBA
LONG_BLOCKS, SHORT_BLOCKS, NUM_SHORT = 40, 1, 17


def _store_in_one_step(engine: SimEngine, req_id: str, tokens: list[int]) -> None:
    """As vLLM prefills a prompt under its token budget: one step, one Mamba state."""
    assert engine.add(req_id, tokens) == 0
    run_to_end(engine, req_id, len(tokens))
    engine.settle()
    assert engine.finish(req_id) is False


@pytest.mark.parametrize("order", ["chain", "worth"])
def test_a_long_prompt_held_in_fewer_bytes_per_token_outlives_short_ones(
    tmp_path: Path, order: str
) -> None:
    """Mamba + full attention, each prompt in one step: a 40-block prompt holds 41 blocks
    (one state), a 1-block prompt 2, so the long one saves 1.7 times the prefill per
    byte of the short one stored before it, and ``worth`` passes it over once. Short
    prompts stored after it overflow the tier: chain order evicts the long prompt's
    tail, its one state with it, and no hit is left; ``worth`` evicts the short prompts
    instead, once."""
    model_groups = make_groups((MAMBA, FULL), block_size=BLOCK_SIZE)
    capacity = 64 * 2 * attention_page_bytes(BLOCK_SIZE)  # 64 blocks of the full group
    tier = {"kind": "cpu", "capacity_bytes": capacity, "pin_memory": False}
    engine = make_engine(model_groups, make_config(tmp_path, tiers=[tier], eviction_order=order))
    long = prompt(LONG_BLOCKS * BLOCK_SIZE)
    shorts = [prompt(SHORT_BLOCKS * BLOCK_SIZE, seed=10 + i) for i in range(NUM_SHORT)]
    _store_in_one_step(engine, "short 0", shorts[0])
    _store_in_one_step(engine, "long", long)
    for i in range(1, NUM_SHORT):  # 75 blocks in all: 11 more than the tier holds
        _store_in_one_step(engine, f"short {i}", shorts[i])
    cpu = engine.worker.store.tiers[0]
    assert isinstance(cpu, CpuTier) and cpu.stats().evictions > 0
    kept = cpu.contains_many(block_keys(model_groups, long, 1, range(LONG_BLOCKS)))
    hit = engine.add("long again", long + prompt(BLOCK_SIZE, seed=99))
    if order == "chain":
        assert kept.count(False) > 0 and hit == 0
    else:
        assert kept == [True] * LONG_BLOCKS
        assert hit == LONG_BLOCKS * BLOCK_SIZE
        req = wait_loaded(engine, "long again")
        assert req.outcomes[-1].ok
        assert assert_kv_matches_cold(engine, req, hit) > 0
        after = cpu.contains_many(block_keys(model_groups, shorts[1], 1, range(SHORT_BLOCKS)))
        assert after == [False] * SHORT_BLOCKS  # a short prompt stored after it went instead
    close_engine(engine)


def test_finished_requests_are_forgotten_once_their_stores_end(tmp_path: Path) -> None:
    engine = make_engine(make_groups((SW, FULL)), make_config(tmp_path))
    tokens = prompt(NUM_BLOCKS * BLOCK_SIZE)
    assert engine.add("a", tokens) == 0
    engine.step({"a": len(tokens)})
    policy = engine.worker.retention
    assert isinstance(policy, ChainPolicy) and len(policy.chains) == 1
    engine.finish("a")
    engine.settle()
    assert len(policy.chains) == 0
    close_engine(engine)


def test_each_eviction_order_names_a_policy_of_its_own(tmp_path: Path) -> None:
    """The registry: every ``eviction_order`` builds its own policy class; chain and worth
    keep chains (worth with passes), lru none; a second policy for a name is refused."""
    model_groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    classes = set()
    for order in EvictionOrder:
        engine = make_engine(
            model_groups, make_config(tmp_path / order.value, eviction_order=order.value)
        )
        policy = engine.worker.retention
        assert type(policy) is POLICIES[order] and policy.order is order
        classes.add(type(policy))
        if order is EvictionOrder.LRU:
            assert not isinstance(policy, ChainPolicy)
        else:
            assert isinstance(policy, ChainPolicy)
            assert (policy.chains.worth is not None) == (order is EvictionOrder.WORTH)
        close_engine(engine)
    assert len(classes) == len(EvictionOrder)
    with pytest.raises(ValueError, match="has a policy already"):
        register(EvictionOrder.CHAIN)(ChainPolicy)
