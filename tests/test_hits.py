"""Tests of hybridkv.hits: worked examples, a brute-force reference, call counting."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.groups import KVGroup
from hybridkv.hits import Hit, find_longest_hit
from tests.support.hits import (
    Store,
    chunked,
    full,
    layouts,
    lookup,
    mamba,
    random_groups,
    random_stores,
    reference,
    swa,
)

# ------------------------------------------------------- worked examples


def test_full_attention_is_the_longest_prefix() -> None:
    hit, store = lookup([full(4)], [{0, 1, 2, 4, 5}], 23)
    assert hit == Hit(12, ((0, 1, 2),))
    assert store.calls == [(0, [0, 1, 2, 3, 4])]  # the whole range, once


def test_full_attention_eagle_drops_one_block() -> None:
    hit, _ = lookup([full(4)], [{0, 1, 2, 4, 5}], 23, use_eagle=True)
    assert hit == Hit(8, ((0, 1),))


def test_max_hit_tokens_caps_the_hit() -> None:
    hit, store = lookup([full(4)], [set(range(100))], 10)
    assert hit == Hit(8, ((0, 1),))
    assert store.calls == [(0, [0, 1])]


def test_sliding_window_needs_the_last_window_only() -> None:
    # window 8, block 4: a hit needs cdiv(7, 4) = 2 stored blocks before it.
    groups = [full(4), swa(4, 8)]
    hit, _ = lookup(groups, [set(range(10)), {2, 3, 5}], 31)
    assert hit == Hit(16, ((0, 1, 2, 3), (2, 3)))


def test_sliding_window_run_from_block_zero_may_be_shorter() -> None:
    groups = [full(4), swa(4, 8)]
    hit, _ = lookup(groups, [set(range(10)), {0, 4}], 31)
    assert hit == Hit(4, ((0,), (0,)))


def test_sliding_window_run_must_end_on_the_alignment() -> None:
    # block 4, alignment 8: a run must end after an odd block index.
    groups = [full(8), swa(4, 5)]  # need = cdiv(4, 4) = 1 block
    hit, _ = lookup(groups, [set(range(10)), {2, 4}], 40)
    assert hit == Hit(0, ((), ()))
    hit, _ = lookup(groups, [set(range(10)), {2, 5}], 40)
    assert hit == Hit(24, ((0, 1, 2), (5,)))


def test_mamba_takes_the_last_aligned_state() -> None:
    groups = [full(4), mamba(8)]
    hit, _ = lookup(groups, [set(range(20)), {1, 3}], 40)
    assert hit == Hit(32, (tuple(range(8)), (3,)))
    # Mamba states that end off the alignment never hit.
    groups = [full(8), mamba(4)]
    hit, _ = lookup(groups, [set(range(20)), {0, 2}], 40)
    assert hit == Hit(0, ((), ()))
    hit, _ = lookup(groups, [set(range(20)), {1, 2}], 40)
    assert hit == Hit(8, ((0,), (1,)))


def test_mamba_is_asked_only_states_that_end_on_the_alignment() -> None:
    groups = [full(8), mamba(4)]
    _, store = lookup(groups, [set(range(20)), set(range(20))], 40)
    assert store.calls_of(1) == [[9]]  # the last state held: no other can do better
    hit, store = lookup(groups, [set(range(20)), set(range(9))], 40)
    assert store.calls_of(1) == [[9], [1, 3, 5, 7]]
    assert hit == Hit(32, (tuple(range(4)), (7,)))


def test_a_sliding_window_holding_its_last_run_is_asked_only_that_run() -> None:
    groups = [full(16), swa(16, 64)]  # a run is 4 blocks
    hit, store = lookup(groups, [set(range(1000)), set(range(1000))], 16 * 1000 - 1)
    assert store.calls_of(1) == [list(range(995, 999))]
    assert hit == Hit(16 * 999, (tuple(range(999)), (995, 996, 997, 998)))
    # A hole in that run: the rest is asked once, and the hit ends before the hole.
    held = set(range(1000)) - {997}
    hit, store = lookup(groups, [set(range(1000)), held], 16 * 1000 - 1)
    assert [len(c) for c in store.calls_of(1)] == [4, 995]
    assert hit == Hit(16 * 997, (tuple(range(997)), (993, 994, 995, 996)))


def test_chunked_local_loads_from_the_chunk_start() -> None:
    groups = [full(4), chunked(4, 8)]
    hit, _ = lookup(groups, [set(range(6)), {4}], 22)
    assert hit == Hit(20, ((0, 1, 2, 3, 4), (4,)))
    hit, _ = lookup(groups, [set(range(6)), set()], 22)
    assert hit == Hit(16, ((0, 1, 2, 3), ()))


def test_equal_specs_hit_only_where_every_group_has_the_block() -> None:
    groups = [full(4), swa(4, 8, name="s0"), swa(4, 8, name="s1")]
    hit, store = lookup(groups, [set(range(10)), {0, 1, 2, 3, 6, 7}, {0, 1, 2, 3, 7}], 35)
    assert hit == Hit(16, ((0, 1, 2, 3), (2, 3), (2, 3)))
    # The second group of the spec is asked only what the first one has.
    assert set(store.calls_of(2)[0]) <= {0, 1, 2, 3, 6, 7}


def test_different_page_sizes_are_searched_separately() -> None:
    groups = [full(4), swa(4, 8, page=64, name="s0"), swa(4, 8, page=32, name="s1")]
    hit, _ = lookup(groups, [set(range(10)), {2, 3}, {0, 1, 2, 3, 6, 7}], 35)
    assert hit == Hit(16, ((0, 1, 2, 3), (2, 3), (2, 3)))


def test_sweeps_repeat_until_the_hit_stops_shrinking() -> None:
    # Pass 1: Mamba shrinks 44 to 24. Pass 2: the window below 24 lacks block 4, so
    # the sliding window shrinks it to 16 and Mamba follows. Pass 3 changes nothing.
    groups = [full(4), swa(4, 8), mamba(4)]
    stored = [set(range(12)), set(range(12)) - {4}, {3, 5}]
    hit, store = lookup(groups, stored, 44)
    assert hit == Hit(16, ((0, 1, 2, 3), (2, 3), (3,)))
    expected, sweeps = reference(groups, stored, 44)
    assert hit == expected and sweeps == 3
    assert len(store.calls_of(0)) == 1  # full attention: once, never again
    assert all(len(store.calls_of(g)) <= sweeps for g in range(3))


def test_first_full_group_is_asked_the_whole_range_once() -> None:
    groups = [swa(16, 64), full(16), mamba(16)]
    _, store = lookup(groups, [set(range(1000))] * 3, 16 * 1000 - 1)
    assert store.calls[0] == (1, list(range(999)))
    assert len(store.calls_of(1)) == 1
    assert store.calls_of(0) == [list(range(995, 999))] and store.calls_of(2) == [[998]]


def test_no_block_is_asked_twice() -> None:
    rng = random.Random(7)
    groups = [full(4), swa(4, 9), swa(4, 9, name="s2"), mamba(8)]
    stored = [{i for i in range(64) if rng.random() < 0.9} for _ in groups]
    _, store = lookup(groups, stored, 250, use_eagle=True)
    for g in range(len(groups)):
        asked = [i for ids in store.calls_of(g) for i in ids]
        assert len(asked) == len(set(asked))


def test_contains_answers_may_be_numpy_or_bytes() -> None:
    groups = [full(4), swa(4, 8)]
    stored = [set(range(10)), {2, 3, 5}]

    def as_numpy(g: int, ids: Sequence[int]) -> np.ndarray:
        return np.array([i in stored[g] for i in ids], dtype=bool)

    def as_bytes(g: int, ids: Sequence[int]) -> bytes:
        return bytes(i in stored[g] for i in ids)

    for contains in (as_numpy, as_bytes):
        hit = find_longest_hit(groups, 31, contains)  # type: ignore[arg-type]
        assert hit == Hit(16, ((0, 1, 2, 3), (2, 3)))


def test_later_groups_of_a_spec_are_asked_every_run_that_can_hit() -> None:
    # s0 holds a run of exactly the 2 blocks a hit needs; s1 lacks one of them.
    groups = [full(4), swa(4, 8, name="s0"), swa(4, 8, name="s1")]
    hit, store = lookup(groups, [set(range(10)), {3, 4}, {3}], 23)
    assert hit == Hit(0, ((), (), ()))
    assert store.calls_of(2) == [[3, 4]]


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("groups", "max_hit_tokens", "kwargs", "message"),
    [
        ([full(4)], -1, {}, "max_hit_tokens=-1 must be >= 0"),
        ([full(4)], 1.5, {}, "max_hit_tokens=1.5 must be an int"),
        ([], 10, {}, "groups=[] must be a non-empty sequence"),
        ([full(4), swa(6, 8)], 10, {"alignment_tokens": 8}, "not a multiple of the block_size"),
        ([full(4)], 10, {"alignment_tokens": 0}, "must be a positive int"),
        (
            [full(4), chunked(4, 8)],
            10,
            {"use_eagle": True},
            "vLLM rejects EAGLE with chunked local",
        ),
        ([full(8), chunked(4, 8)], 10, {}, "chunked local attention needs"),
        (["full"], 10, {}, "are not KVGroup"),
    ],
)
def test_bad_input_is_a_clear_value_error(
    groups: list[KVGroup], max_hit_tokens: int, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        find_longest_hit(groups, max_hit_tokens, Store([set()] * 4).contains, **kwargs)  # type: ignore[arg-type]


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ValueError, match=r"max_hit_tokens=-3.*alignment_tokens=6"):
        find_longest_hit([full(4)], -3, Store([set()]).contains, alignment_tokens=6)


def test_first_miss_token_is_the_earliest_block_answered_absent() -> None:
    # window 8, block 4: full holds 0..9, the window lacks block 1 (token 4) and 4.
    hit, _ = lookup([full(4), swa(4, 8)], [set(range(10)), {0, 2, 3, 5}], 31)
    assert hit.num_tokens == 16
    assert hit.first_miss_token == 4
    everything, _ = lookup([full(4)], [set(range(100))], 23)
    assert everything.first_miss_token is None


def test_wrong_answer_length_from_contains_is_reported() -> None:
    with pytest.raises(ValueError, match=r"contains\(0, \.\.\.\) returned 1 answers for 3"):
        find_longest_hit([full(4)], 12, lambda g, ids: [True])


def test_matches_reference_on_many_seeded_cases() -> None:
    rng = random.Random(20240611)
    for _ in range(3000):
        groups, alignment, use_eagle = random_groups(rng)
        max_hit_tokens = rng.randint(0, 160)
        stored = random_stores(rng, groups, max_hit_tokens)
        hit, _ = lookup(
            groups, stored, max_hit_tokens, alignment_tokens=alignment, use_eagle=use_eagle
        )
        expected, _ = reference(groups, stored, max_hit_tokens, alignment, use_eagle)
        assert hit == expected, (groups, stored, max_hit_tokens, alignment, use_eagle)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_groups=layouts(), max_hit_tokens=st.integers(0, 120), seed=st.integers(0, 2**32))
def test_matches_brute_force_reference(
    model_groups: tuple[list[KVGroup], int | None, bool], max_hit_tokens: int, seed: int
) -> None:
    groups, alignment, use_eagle = model_groups
    stored = random_stores(random.Random(seed), groups, max_hit_tokens)
    hit, store = lookup(
        groups, stored, max_hit_tokens, alignment_tokens=alignment, use_eagle=use_eagle
    )
    expected, sweeps = reference(groups, stored, max_hit_tokens, alignment, use_eagle)
    assert hit == expected
    align = alignment or math.lcm(*(g.block_size for g in groups))
    assert hit.num_tokens % align == 0 and 0 <= hit.num_tokens <= max_hit_tokens
    for g_id, group in enumerate(groups):
        calls = store.calls_of(g_id)
        assert len(calls) <= 2 * sweeps, "more than two contains calls per group per sweep"
        asked = [i for ids in calls for i in ids]
        assert len(asked) == len(set(asked)), "a block was asked twice"
        assert all(0 <= i < (max_hit_tokens + 1) // group.block_size for i in asked)
        # Every block to load is stored, and only blocks below the hit are loaded.
        assert set(hit.blocks_to_load[g_id]) <= stored[g_id]
        assert all((i + 1) * group.block_size <= hit.num_tokens for i in hit.blocks_to_load[g_id])
    # The search reports the earliest block any group was answered absent, and only it.
    misses = [
        i * groups[g_id].block_size
        for g_id, ids in store.calls
        for i in ids
        if i not in stored[g_id]
    ]
    assert hit.first_miss_token == min(misses, default=None)


def test_very_long_requests_get_plain_block_tuples() -> None:
    groups = [full(1), mamba(1)]
    num_tokens = (1 << 18) + 5
    hit, _ = lookup(groups, [set(range(num_tokens)), {num_tokens - 3}], num_tokens - 1)
    assert hit.num_tokens == num_tokens - 2
    assert hit.blocks_to_load == (tuple(range(num_tokens - 2)), (num_tokens - 3,))
