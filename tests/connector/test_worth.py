"""``ChainWorth``: the passes a request's blocks earn by prefill saved per byte held, and
``ChainRecency`` giving them to the blocks a hit at the chain's end reads."""

from __future__ import annotations

import pytest

from hybridkv.connector.recency import ChainRecency
from hybridkv.connector.worth import ChainWorth
from hybridkv.groups import GroupKind
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.retention import MAX_PASSES
from hybridkv.tools.sim.shapes import make_groups

MAMBA, FULL, SW = GroupKind.MAMBA, GroupKind.FULL, GroupKind.SLIDING_WINDOW
QWEN3_NEXT = ChainWorth.for_groups(make_groups((MAMBA, MAMBA, MAMBA, FULL), block_size=3))
"""Three Mamba groups and one full-attention group, every page one size (as vLLM's hybrid
allocator makes them: 3-token blocks in the simulated engine)."""
BLOCK = QWEN3_NEXT.groups[0].block_bytes


def test_one_page_size_in_every_group() -> None:
    assert {g.block_bytes for g in QWEN3_NEXT.groups} == {BLOCK}
    assert QWEN3_NEXT.densest_bytes_per_token == pytest.approx(4 * BLOCK / 3)


def test_a_long_prompt_in_one_step_earns_more_passes_than_a_short_one() -> None:
    """A prompt of n blocks prefilled in one step: n full blocks and a state per Mamba
    group, 4n / (n + 3) times the least a chain saves per byte."""

    def passes(num_blocks: int, least: float = 1.0) -> int:
        return QWEN3_NEXT.passes(QWEN3_NEXT.ratio(3 * num_blocks, (num_blocks + 3) * BLOCK), least)

    assert QWEN3_NEXT.ratio(3, 4 * BLOCK) == pytest.approx(1.0)  # four blocks for one
    assert QWEN3_NEXT.ratio(4 * 3, 7 * BLOCK) == pytest.approx(16 / 7)
    assert QWEN3_NEXT.ratio(10 * 3, 13 * BLOCK) == pytest.approx(40 / 13)
    assert [passes(n) for n in (1, 4, 10, 100)] == [0, 1, 2, MAX_PASSES]
    # against the least the tier is storing now (two-block prompts: 1.6)
    assert [passes(n, least=1.6) for n in (2, 4, 10, 100)] == [0, 0, 1, 1]
    assert QWEN3_NEXT.ratio(0, 0) == 1.0


def test_full_attention_alone_earns_no_pass_at_any_length() -> None:
    worth = ChainWorth.for_groups(make_groups((FULL, FULL), block_size=16))
    block = sum(g.block_bytes for g in worth.groups)
    assert [worth.ratio(16 * n, n * block) for n in (1, 10, 1000)] == [1.0, 1.0, 1.0]


def test_a_hit_reads_every_full_block_the_last_window_and_the_last_state() -> None:
    worth = ChainWorth.for_groups(make_groups((MAMBA, SW, FULL), block_size=4, window=8))
    assert worth.hit_blocks(0, 40) == range(9, 10)
    assert worth.hit_blocks(1, 40) == range(8, 10)  # 8 tokens: two blocks (and the last)
    assert worth.hit_blocks(2, 40) == range(0, 10)
    with pytest.raises(ValueError, match="no groups"):
        ChainWorth(())


def keys(name: str, group: int, indices: range) -> list[StoreKey]:
    return [StoreKey(f"{name}/g{group}/{i}") for i in indices]


def test_every_block_of_a_chain_gets_what_a_hit_at_its_end_earns() -> None:
    """A conversation's tenth turn (one Mamba group and one full group, 4-token blocks,
    two blocks a turn), touched after a one-block prompt (worth the least): it loaded
    18 blocks and the ninth turn's state, and stored two blocks and a state; the earlier
    turns' states are in the chain too. A hit at 80 tokens reads the 20 full blocks and
    the last state: 80 tokens in 21 blocks earn one pass over the one-block prompt,
    which every block of the chain gets, earlier states too (a request sharing only an
    earlier turn hits there). Counting every state held would have earned none."""
    groups = make_groups((MAMBA, FULL), block_size=4)
    worth = ChainWorth.for_groups(groups)
    chains = ChainRecency([4, 4], worth)
    chains.add("short", 1, [0], keys("s", 1, range(1)))
    chains.add("short", 0, [0], keys("s", 0, range(1)))
    chains.touched("short")
    assert chains.take_orders() == [(keys("s", 1, range(1)) + keys("s", 0, range(1)), 0)]
    for _ in range(2):  # a block added again (a load of what was stored) counts once
        chains.add("turn 10", 1, range(20), keys("t", 1, range(20)))
        chains.add("turn 10", 0, range(1, 20, 2), keys("t", 0, range(1, 20, 2)))
    chains.touched("turn 10")
    ((order, passes),) = chains.take_orders()
    assert len(order) == len(set(order)) == 30
    assert order[:2] == [StoreKey("t/g1/19"), StoreKey("t/g0/19")]
    assert order[-1] == StoreKey("t/g1/0")
    full = sum(g.block_bytes for g in groups.groups if g.kind is FULL)
    state = sum(g.block_bytes for g in groups.groups if g.kind is MAMBA)
    least = worth.ratio(4, full + state)
    assert passes == worth.passes(worth.ratio(80, 20 * full + state), least) == 1
    assert worth.passes(worth.ratio(80, 20 * full + 10 * state), least) == 0


def test_chains_all_worth_the_same_get_no_pass() -> None:
    """Against the least of the chains touched lately: a tier storing only chains of one
    worth keeps plain chain order, whatever that worth is."""
    chains = ChainRecency([4, 4], ChainWorth.for_groups(make_groups((MAMBA, FULL), block_size=4)))
    for r in range(3):
        chains.add(f"r{r}", 1, range(40), keys(f"r{r}", 1, range(40)))
        chains.add(f"r{r}", 0, [39], keys(f"r{r}", 0, range(39, 40)))
        chains.touched(f"r{r}")
        ((_, passes),) = chains.take_orders()
        assert passes == 0


def test_a_chain_missing_a_group_earns_nothing() -> None:
    chains = ChainRecency([4, 4], ChainWorth.for_groups(make_groups((MAMBA, FULL), block_size=4)))
    chains.add("r", 1, range(10), keys("r", 1, range(10)))
    chains.touched("r")
    assert chains.take_orders() == [(keys("r", 1, range(10))[::-1], 0)]
