"""Per-group block tables, divide-or-multiply slicing, stored prefixes and chunk plans."""

from __future__ import annotations

import logging
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.planner import ChunkPlan, GroupBlockTable, slice_group_blocks, stored_prefix_tokens
from hybridkv.spec import GroupKind, KVGroup, KVLayoutSpec

DSV4_BLOCK_SIZES = (256, 64, 64, 4, 8)


def layout_of(block_sizes: tuple[int, ...], **kwargs: int) -> KVLayoutSpec:
    groups = tuple(
        KVGroup(
            kind=GroupKind.FULL if i == 0 else GroupKind.SLIDING_WINDOW,
            block_size=bs,
            page_size_bytes=64,
            layer_names=(f"layers.{i}",),
            sliding_window=None if i == 0 else 128,
        )
        for i, bs in enumerate(block_sizes)
    )
    return KVLayoutSpec(groups=groups, model_id="m", **kwargs)


# ---------------------------------------------------------------- GroupBlockTable


def test_block_table_appends_per_group_per_step() -> None:
    table = GroupBlockTable(3)
    table.append([[1, 2], [7], []])
    table.append(None)  # a step without new blocks
    table.append([[3], [], [9, 10]])
    assert table.block_ids == {0: [1, 2, 3], 1: [7], 2: [9, 10]}
    assert [table.num_blocks(g) for g in range(3)] == [3, 1, 2]
    assert table.group_block_ids(2) == [9, 10]
    table.clear()
    assert [table.num_blocks(g) for g in range(3)] == [0, 0, 0]


def test_block_table_rejects_wrong_group_counts() -> None:
    table = GroupBlockTable(2)
    with pytest.raises(ValueError, match="new_block_ids has 3 groups; this table has 2"):
        table.append([[1], [2], [3]])
    assert table.block_ids == {0: [], 1: []}
    with pytest.raises(ValueError, match=r"group_id=2 is out of range \[0, 2\)"):
        table.num_blocks(2)
    with pytest.raises(ValueError, match="num_groups=0"):
        GroupBlockTable(0)


# ---------------------------------------------------------------- divide or multiply


def test_slicing_divides_for_larger_and_multiplies_for_smaller_groups() -> None:
    # DeepSeek-V4-Flash: unit 4 (the GCD), groups of 256 / 64 / 4 / 8 tokens.
    assert slice_group_blocks(4, 256, 0, 1024) == (0, 16)
    assert slice_group_blocks(4, 64, 128, 1024) == (8, 64)
    assert slice_group_blocks(4, 4, 5, 9) == (5, 9)
    assert slice_group_blocks(4, 8, 2, 10) == (1, 5)
    # A unit larger than the group: each unit block holds several group blocks.
    assert slice_group_blocks(256, 64, 1, 3) == (4, 12)
    assert slice_group_blocks(256, 4, 0, 2) == (0, 128)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((4, 6, 0, 1), "group_block_size=6 and unit_block_size=4 must divide one another"),
        ((0, 4, 0, 1), "unit_block_size=0 must be an int > 0"),
        ((4, 4, 3, 1), "start=3 must be <= end=1"),
        ((4, 4, -1, 1), "start=-1 must be an int >= 0"),
    ],
)
def test_slicing_errors(args: tuple[int, int, int, int], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        slice_group_blocks(*args)


@given(
    unit_exp=st.integers(0, 6),
    group_exp=st.integers(0, 6),
    odd=st.sampled_from([1, 3]),
    start=st.integers(0, 40),
    length=st.integers(0, 40),
)
@settings(max_examples=300, deadline=None)
def test_slicing_matches_brute_force(
    unit_exp: int, group_exp: int, odd: int, start: int, length: int
) -> None:
    unit, group = odd * 2**unit_exp, odd * 2**group_exp
    end = start + length
    got = slice_group_blocks(unit, group, start, end)
    # Group block j belongs to unit range [start, end) when it ends within its tokens.
    expected = [
        j for j in range(end * unit // group + 2) if start * unit < (j + 1) * group <= end * unit
    ]
    assert list(range(*got)) == expected


# ---------------------------------------------------------------- stored prefix


def test_worked_example_deepseek_v4_flash_4096_tokens() -> None:
    num_tokens = 4096
    counts = [num_tokens // bs for bs in DSV4_BLOCK_SIZES]
    assert counts == [16, 64, 64, 1024, 512]
    assert stored_prefix_tokens(counts, DSV4_BLOCK_SIZES) == 4096
    # Scheduler unit 4: unit blocks [0, 1024) map to every group's full range.
    assert [slice_group_blocks(4, bs, 0, 1024) for bs in DSV4_BLOCK_SIZES] == [
        (0, c) for c in counts
    ]
    # One group behind bounds everything; a group with no blocks bounds it at 0.
    assert stored_prefix_tokens([16, 64, 60, 1024, 512], DSV4_BLOCK_SIZES) == 3840
    assert stored_prefix_tokens([16, 64, 64, 0, 512], DSV4_BLOCK_SIZES) == 0


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 64)), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_stored_prefix_matches_brute_force(groups: list[tuple[int, int]]) -> None:
    counts = [n for n, _ in groups]
    sizes = [bs for _, bs in groups]
    longest = max(n * bs for n, bs in groups)
    expected = max(t for t in range(longest + 1) if all(n * bs >= t for n, bs in groups))
    assert stored_prefix_tokens(counts, sizes) == expected


def test_stored_prefix_errors() -> None:
    with pytest.raises(ValueError, match="got 2 counts for 3 block sizes"):
        stored_prefix_tokens([1, 2], [4, 4, 4])
    with pytest.raises(ValueError, match="must be >= 0"):
        stored_prefix_tokens([-1], [4])


# ---------------------------------------------------------------- chunk plans


def test_chunk_plan_of_deepseek_v4_flash() -> None:
    plan = ChunkPlan.build(layout_of(DSV4_BLOCK_SIZES), chunk_tokens=256, max_model_len=4096)
    assert [u.blocks_per_chunk for u in plan.units] == [1, 4, 4, 64, 32]
    assert plan.warnings == ()
    assert plan.max_chunks == 16
    assert plan.chunks_ready(4095) == 15 and plan.chunks_ready(4096) == 16
    assert plan.chunk_token_range(2) == range(512, 768)
    assert plan.group_blocks_for_chunk(0, 2) == range(2, 3)
    assert plan.group_blocks_for_chunk(3, 2) == range(128, 192)
    assert plan.group_blocks_for_chunk(4, 2) == range(64, 96)


def test_unchunkable_group_warns_with_a_chunk_size_that_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridkv.planner"):
        plan = ChunkPlan.build(layout_of(DSV4_BLOCK_SIZES), chunk_tokens=64, max_model_len=4096)
    assert [u.blocks_per_chunk for u in plan.units] == [None, 1, 1, 16, 8]
    assert len(plan.warnings) == 1
    warning = plan.warnings[0]
    assert "group 0" in warning and "block_size=256" in warning
    assert "chunk_tokens=64" in warning and "chunk_tokens=256" in warning
    assert [r.getMessage() for r in caplog.records] == [warning]
    # The 256-token group's block completes in every fourth chunk.
    assert [len(plan.group_blocks_for_chunk(0, i)) for i in range(8)] == [0, 0, 0, 1] * 2
    suggested = int(warning.rsplit("chunk_tokens=", 1)[1])
    fixed = ChunkPlan.build(layout_of(DSV4_BLOCK_SIZES), suggested, 4096)
    assert all(u.blocks_per_chunk for u in fixed.units)


def suggested_chunk(message: str) -> int:
    match = re.search(r"e\.g\. chunk_tokens=(\d+)", message)
    assert match, message
    return int(match.group(1))


@pytest.mark.parametrize(
    ("block_sizes", "chunk_tokens", "max_model_len", "fragments"),
    [
        (DSV4_BLOCK_SIZES, 6, 4096, ["chunk_tokens=6", "not a multiple of hash_block_size=4"]),
        (
            DSV4_BLOCK_SIZES,
            8192,
            4096,
            ["chunk_tokens=8192 exceeds max_model_len=4096", "no chunk could ever be stored"],
        ),
        (
            (16, 48),
            16,
            40,
            ["group 1 block_size=48 exceeds max_model_len=40", "raise max_model_len"],
        ),
        ((16,), 0, 100, ["chunk_tokens=0 must be an int > 0"]),
        ((16,), 16, -1, ["max_model_len=-1 must be an int > 0"]),
    ],
)
def test_chunk_plan_errors_name_the_problem_and_a_fix(
    block_sizes: tuple[int, ...], chunk_tokens: int, max_model_len: int, fragments: list[str]
) -> None:
    layout = layout_of(block_sizes)
    with pytest.raises(ValueError) as info:
        ChunkPlan.build(layout, chunk_tokens, max_model_len)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    if "e.g. chunk_tokens=" in message:  # the suggested size must be one that works
        plan = ChunkPlan.build(layout, suggested_chunk(message), max_model_len)
        assert plan.warnings == ()


def test_chunk_plan_errors_are_collected() -> None:
    with pytest.raises(ValueError) as info:
        ChunkPlan.build(layout_of((16, 48)), chunk_tokens=100, max_model_len=40)
    message = str(info.value)
    assert "not a multiple of hash_block_size=16" in message
    assert "exceeds max_model_len=40" in message
    assert "group 1 block_size=48" in message


def test_chunk_index_and_group_validation() -> None:
    plan = ChunkPlan.build(layout_of((16,)), 16, 64)
    with pytest.raises(ValueError, match="chunk_index=-1"):
        plan.chunk_token_range(-1)
    with pytest.raises(ValueError, match=r"group_id=1 is out of range \[0, 1\)"):
        plan.group_blocks_for_chunk(1, 0)
    with pytest.raises(ValueError, match="num_computed_tokens=-5"):
        plan.chunks_ready(-5)


@st.composite
def plans(draw: st.DrawFn) -> tuple[KVLayoutSpec, int]:
    hash_bs = draw(st.integers(1, 4))
    multiples = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    layout = layout_of(tuple(m * hash_bs for m in multiples), hash_block_size=hash_bs)
    chunk = hash_bs * draw(st.integers(1, 24))
    return layout, chunk


@given(plans(), st.integers(0, 600))
@settings(max_examples=200, deadline=None)
def test_chunk_plan_matches_brute_force(plan_args: tuple[KVLayoutSpec, int], tokens: int) -> None:
    layout, chunk = plan_args
    max_model_len = max(chunk, *layout.block_sizes) * 4
    plan = ChunkPlan.build(layout, chunk, max_model_len)
    num_ready = plan.chunks_ready(tokens)
    assert num_ready == sum(1 for i in range(tokens + 1) if (i + 1) * chunk <= tokens)
    for group_id, block_size in enumerate(layout.block_sizes):
        unit = plan.units[group_id]
        assert unit.blocks_per_chunk == (chunk // block_size if chunk % block_size == 0 else None)
        owned: list[int] = []
        for i in range(num_ready):
            token_range = plan.chunk_token_range(i)
            blocks = plan.group_blocks_for_chunk(group_id, i)
            # Brute force: the group blocks whose last token falls inside this chunk.
            expected = [
                j
                for j in range(tokens // block_size + 1)
                if token_range.start < (j + 1) * block_size <= token_range.stop
            ]
            assert list(blocks) == expected
            if unit.blocks_per_chunk is not None:
                assert len(blocks) == unit.blocks_per_chunk
            owned.extend(blocks)
        # Every group block complete by the last ready chunk's end belongs to exactly one chunk.
        assert owned == list(range(num_ready * chunk // block_size))
    unchunkable = [u.group_id for u in plan.units if u.blocks_per_chunk is None]
    assert len(plan.warnings) == len(unchunkable)
    working = math.lcm(*layout.block_sizes)
    for group_id, warning in zip(unchunkable, plan.warnings, strict=True):
        assert f"group {group_id} " in warning
        suggestion = int(warning.rsplit("chunk_tokens=", 1)[1])
        assert suggestion % working == 0  # every group divides the suggested chunk
        if working <= max_model_len:
            assert suggestion <= max_model_len
        else:
            assert f"raise max_model_len to at least {working}" in warning
