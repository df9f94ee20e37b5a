"""Storing only what a later hit can use: each kind's ``stored_blocks`` rule.

Properties over random layouts, alignments, EAGLE groups, prompts and prefill
chunkings: every hit the search finds over what the rules stored equals the hit
over a layer-blind store of every completed block, and loads only stored blocks.
The sliding-window rule is also checked against vLLM's own block mask.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.groups import GroupKind, KVGroup
from hybridkv.groups.kinds import rules_for
from hybridkv.hits import drafting_groups, find_longest_hit
from tests.support.hits import full, layouts, mamba, swa


def chunking(rng: random.Random, num_tokens: int) -> list[tuple[int, int]]:
    """Prefill steps ``[start, end)`` covering the prompt, as chunked prefill splits it."""
    steps, start = [], 0
    while start < num_tokens:
        end = min(num_tokens, start + rng.choice([1, 3, 8, 17, 64, num_tokens]))
        steps.append((start, end))
        start = end
    return steps


def stored_by_rules(
    groups: list[KVGroup], steps: list[tuple[int, int]], align: int, drops: tuple[bool, ...]
) -> list[set[int]]:
    return [
        {i for s, e in steps for i in rules_for(g.kind).stored_blocks(g, s, e, align, drop)}
        for g, drop in zip(groups, drops, strict=True)
    ]


def stored_layer_blind(groups: list[KVGroup], steps: list[tuple[int, int]]) -> list[set[int]]:
    """Every completed block; a Mamba group has a state only where a step ended on a block end."""
    blind = []
    for g in groups:
        if g.kind is GroupKind.MAMBA:
            bs = g.block_size
            blind.append({e // bs - 1 for _, e in steps if e >= bs and e % bs == 0})
        else:
            blind.append({i for s, e in steps for i in range(s // g.block_size, e // g.block_size)})
    return blind


@settings(max_examples=400, deadline=None)
@given(layouts(), st.randoms(use_true_random=False), st.data())
def test_every_hit_over_what_was_stored_equals_the_layer_blind_hit_and_loads_completely(
    model_groups: tuple[list[KVGroup], int | None, bool], rng: random.Random, data: st.DataObject
) -> None:
    groups, alignment, use_eagle = model_groups
    align = alignment or math.lcm(*(g.block_size for g in groups))
    eagle_ids = None
    if use_eagle and data.draw(st.booleans()):
        eagle_ids = frozenset(data.draw(st.sets(st.integers(0, len(groups) - 1), max_size=2)))
    drops = drafting_groups(groups, use_eagle, eagle_ids)
    num_tokens = rng.randint(0, 12 * align + 5)
    steps = chunking(rng, num_tokens)
    stored = stored_by_rules(groups, steps, align, drops)
    blind = stored_layer_blind(groups, steps)
    assert all(s <= b for s, b in zip(stored, blind, strict=True))
    for _ in range(4):  # later requests sharing the first `shared` tokens
        shared = rng.randint(0, num_tokens)
        query = shared + rng.randint(1, 2 * align)

        def search(have: list[set[int]], shared: int = shared, query: int = query) -> object:
            def contains(gid: int, block_ids: object) -> list[bool]:
                bs = groups[gid].block_size
                return [i in have[gid] and (i + 1) * bs <= shared for i in block_ids]  # type: ignore[attr-defined]

            return find_longest_hit(
                groups,
                query - 1,
                contains,
                alignment_tokens=alignment,
                use_eagle=use_eagle,
                eagle_group_ids=eagle_ids,
            )

        hit, want = search(stored), search(blind)
        assert hit == want, (shared, query)
        for group_id, blocks in enumerate(hit.blocks_to_load):  # type: ignore[attr-defined]
            assert set(blocks) <= stored[group_id], (group_id, shared)


def test_sliding_windows_store_only_the_tail_of_each_aligned_segment() -> None:
    # DeepSeek-V4's sliding KV: window 128, 64-token blocks, hits on 256 tokens.
    g = swa(64, 128)
    rule = rules_for(g.kind)
    assert list(rule.stored_blocks(g, 0, 1024, 256, False)) == [2, 3, 6, 7, 10, 11, 14, 15]
    # EAGLE peeks one block past the boundary: the tail shifts by one.
    assert list(rule.stored_blocks(g, 0, 1024, 256, True)) == [2, 3, 4, 6, 7, 8, 10, 11, 12, 14, 15]
    # A chunk stores only its own completed blocks of those tails.
    assert list(rule.stored_blocks(g, 200, 700, 256, False)) == [3, 6, 7]
    # Compressor states: CSA (window 8, block 4) 62-63 of 64; HCA (window 128, block 8) 16-31.
    assert list(rule.stored_blocks(swa(4, 8), 0, 256, 256, False)) == [62, 63]
    assert list(rule.stored_blocks(swa(8, 128), 0, 256, 256, False)) == list(range(16, 32))


def test_windows_as_long_as_a_segment_store_every_block() -> None:
    g = swa(16, 1024)  # Gemma 3 27B's window at a 1024-token alignment: all blocks needed
    assert list(rules_for(g.kind).stored_blocks(g, 0, 4096, 1024, False)) == list(range(256))
    # Gemma 3 27B at a 2048-token alignment: 64 of 128 blocks per segment.
    assert len(rules_for(g.kind).stored_blocks(g, 0, 4096, 2048, False)) == 128


def test_full_attention_stores_every_block_and_mamba_only_aligned_step_ends() -> None:
    f, m = full(16), mamba(16)
    assert list(rules_for(f.kind).stored_blocks(f, 32, 100, 64, False)) == [2, 3, 4, 5]
    assert list(rules_for(m.kind).stored_blocks(m, 0, 128, 64, False)) == [7]
    assert list(rules_for(m.kind).stored_blocks(m, 0, 120, 64, False)) == []


vllm = pytest.importorskip("vllm")


def test_sliding_rule_equals_vllms_block_mask() -> None:
    import torch
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    rng = random.Random(7)
    for _ in range(3000):
        bs = rng.choice([1, 2, 4, 8, 16, 64])
        window = rng.randint(2, 8 * bs)  # vLLM needs 0 blocks for window 1; we keep 1
        align = bs * rng.randint(1, 12)
        eagle = rng.random() < 0.5
        start = rng.randint(0, 40)
        end = start + rng.randint(0, 60)
        spec = SlidingWindowSpec(
            block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.int8, sliding_window=window
        )
        mask = SlidingWindowManager.reachable_block_mask(
            start_block=start,
            end_block=end,
            alignment_tokens=align,
            kv_cache_spec=spec,
            use_eagle=eagle,
        )
        want = (
            list(range(start, end))
            if mask is None
            else [start + i for i, m in enumerate(mask) if m]
        )
        g = swa(bs, window)
        got = rules_for(g.kind).stored_blocks(g, start * bs, end * bs, align, eagle)
        assert list(got) == want, (bs, window, align, eagle, start, end)
