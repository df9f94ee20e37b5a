"""ChainRecency: the order a request's blocks are touched in, and when it is forgotten."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.connector.recency import ChainRecency
from hybridkv.tiers.base import StoreKey


def key(group_id: int, index: int) -> StoreKey:
    return StoreKey(f"g{group_id}/b{index}")


def test_last_block_first_and_groups_of_a_position_together() -> None:
    chains = ChainRecency([4, 4])
    chains.add("r", 0, [0, 1, 2], [key(0, i) for i in range(3)])
    chains.add("r", 1, [1, 2], [key(1, i) for i in (1, 2)])
    chains.add("r", 0, [3], [key(0, 3)])  # a later step
    chains.add("other", 0, [0], [key(0, 9)])
    assert chains.take_orders() == []  # nothing stored or loaded yet
    chains.touched("r")
    order = [key(0, 3), key(0, 2), key(1, 2), key(0, 1), key(1, 1), key(0, 0)]
    assert chains.take_orders() == [(order, None)]
    assert chains.take_orders() == []  # until blocks move again
    chains.add("r", 0, [1], [key(0, 1)])  # stored again: still once
    chains.touched("r")
    assert chains.take_orders() == [(order, None)]


def test_positions_are_tokens_when_block_sizes_differ() -> None:
    chains = ChainRecency([4, 16])
    chains.add("r", 0, range(8), [key(0, i) for i in range(8)])
    chains.add("r", 1, [0, 1], [key(1, 0), key(1, 1)])
    chains.touched("r")
    ((order, passes),) = chains.take_orders()
    assert passes is None
    assert order == [
        *(key(0, i) for i in (7, 6, 5)),
        key(0, 4),
        key(1, 1),  # tokens 16..31 start with block 4 of group 0
        *(key(0, i) for i in (3, 2, 1)),
        key(0, 0),
        key(1, 0),
    ]


def test_a_finished_request_is_touched_after_its_last_store_then_forgotten() -> None:
    chains = ChainRecency([4])
    chains.add("r", 0, [0, 1], [key(0, 0), key(0, 1)])
    chains.start_store("r")
    chains.start_store("r")
    chains.finish({"r", "unknown"})
    chains.end_store("r")
    assert chains.take_orders() == [([key(0, 1), key(0, 0)], None)] and len(chains) == 1
    chains.end_store("r")
    assert chains.take_orders() == [([key(0, 1), key(0, 0)], None)] and len(chains) == 0
    chains.touched("r")  # a late load result of a forgotten request
    assert chains.take_orders() == []
    chains.check_integrity()


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20)), max_size=60))
def test_order_matches_a_sort_by_position(blocks: list[tuple[int, int]]) -> None:
    block_sizes = [2, 4, 8]
    chains = ChainRecency(block_sizes)
    for group_id, index in blocks:
        chains.add("r", group_id, [index], [key(group_id, index)])
    chains.touched("r")
    first_seen = list(dict.fromkeys(blocks))
    expected = sorted(first_seen, key=lambda b: -b[1] * block_sizes[b[0]])  # stable
    assert chains.take_orders() == ([([key(*b) for b in expected], None)] if blocks else [])
