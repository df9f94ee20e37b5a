"""Differential test of hybridkv.hits against vLLM's own hybrid coordinator.

The engine's coordinator (``get_kv_cache_coordinator``: the hybrid one for several
groups, the unitary one for a single group) runs over a real ``BlockPool`` whose
prefix-cache map holds exactly the blocks of random existence sets; ours runs
over the same sets through ``contains``. Hits must agree in length and in the
blocks each group loads (vLLM's non-null blocks).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from functools import reduce
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from hybridkv.groups import GroupKind, KVGroup
from hybridkv.hits import Hit, find_longest_hit
from hybridkv.integrations.vllm.facts import groups_from_config
from hybridkv.tools.presets import deepseek_v4_flash, deepseek_v4_pro
from tests.support.hits import (
    chunked,
    full,
    lookup,
    mamba,
    random_groups,
    random_stores,
    reference,
    swa,
)


def vllm_spec(group: KVGroup) -> KVCacheSpec:
    """A vLLM spec per group; equal ``search_key`` <=> equal vLLM spec.

    The page size enters through ``page_size_padded`` (the tiny unpadded page is
    always smaller), so groups differing only in page size stay separate specs.
    """
    attention: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.int8,
        "page_size_padded": 2 * group.block_size + group.page_size_bytes,
    }
    if group.kind is GroupKind.FULL:
        return FullAttentionSpec(**attention)
    if group.kind is GroupKind.SLIDING_WINDOW:
        return SlidingWindowSpec(**attention, sliding_window=group.sliding_window)
    if group.kind is GroupKind.CHUNKED_LOCAL:
        return ChunkedLocalAttentionSpec(
            **attention, attention_chunk_size=group.attention_chunk_size
        )
    return MambaSpec(
        block_size=group.block_size,
        shapes=((1,),),
        dtypes=(torch.int8,),
        page_size_padded=1 + group.page_size_bytes,
        mamba_cache_mode="align",
    )


def vllm_hit(
    groups: list[KVGroup],
    stored: list[set[int]],
    max_hit_tokens: int,
    alignment_tokens: int,
    hash_block_size: int,
    use_eagle: bool,
    eagle_groups: frozenset[int] = frozenset(),
    make_spec: Callable[[KVGroup], KVCacheSpec] = vllm_spec,
    dcp_world_size: int = 1,
) -> Hit:
    """vLLM's answer: the engine's coordinator over a BlockPool caching ``stored``.

    ``eagle_groups``: groups flagged ``is_eagle_group`` (none: vLLM treats all as such).
    """
    num_blocks = sum(len(s) for s in stored) + 2
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names=list(g.layer_names),
                kv_cache_spec=make_spec(g),
                is_eagle_group=i in eagle_groups,
            )
            for i, g in enumerate(groups)
        ],
    )
    coordinator = get_kv_cache_coordinator(
        config,
        max_model_len=1 << 20,
        max_in_flight_tokens=1 << 12,
        use_eagle=use_eagle,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=dcp_world_size,
        pcp_world_size=1,
        scheduler_block_size=alignment_tokens,
        hash_block_size=hash_block_size,
        allow_partial_hash_hits=False,  # hits on the alignment, never inside a block
    )
    if len(groups) > 1:
        assert coordinator._cache_hit_alignment_tokens == alignment_tokens
    # The request is max_hit_tokens + 1 tokens long; one chained hash per hash block.
    block_hashes = [
        BlockHash(j.to_bytes(8, "big")) for j in range((max_hit_tokens + 1) // hash_block_size)
    ]
    pool = coordinator.block_pool
    for group_id, (group, blocks) in enumerate(zip(groups, stored, strict=True)):
        scale = group.block_size // hash_block_size
        # Group block i is keyed by the hash ending it (as vLLM's block-size view does).
        keys = [
            make_block_hash_with_group_id(block_hashes[(i + 1) * scale - 1], group_id)
            for i in sorted(blocks)
            if (i + 1) * scale <= len(block_hashes)
        ]
        for key, block in zip(keys, pool.get_new_blocks(len(keys)), strict=True):
            block.set_block_hash(key)
            pool.cached_block_hash_to_block.insert(key, block)
    hit_blocks, num_tokens, _ = coordinator.find_longest_cache_hit(block_hashes, max_hit_tokens)
    loaded = tuple(
        tuple(i for i, block in enumerate(blocks) if not block.is_null) for blocks in hit_blocks
    )
    return Hit(num_tokens, loaded)


def hash_block_size_for(rng: random.Random, groups: list[KVGroup]) -> int:
    gcd = reduce(math.gcd, (g.block_size for g in groups))
    if len(groups) == 1:
        return gcd  # the unitary coordinator hashes at the block size
    return rng.choice([d for d in range(1, gcd + 1) if gcd % d == 0])


STORE_STYLES = ("dense", "holes", "holes", "holes", "prefix", "sparse", "empty")


def three_kind_groups(rng: random.Random) -> tuple[list[KVGroup], int | None, bool]:
    """Sliding window + Mamba (+ full attention): where later sweeps shrink the hit."""
    sizes = [rng.choice([1, 2, 4, 8]) for _ in range(3)]
    window = rng.randint(1, 4 * sizes[0] + 3)
    groups = [swa(sizes[0], window, name="a"), mamba(sizes[1], name="b"), full(sizes[2])]
    if rng.random() < 0.5:
        groups.append(swa(sizes[0], window, name="d"))  # same spec as "a"
    if rng.random() < 0.3:
        groups.remove(groups[2])  # no full attention
    rng.shuffle(groups)
    return groups, None, rng.random() < 0.4


def test_matches_vllm_coordinator_on_random_layouts() -> None:
    rng = random.Random(0x5EED)
    counts = {"cases": 0, "eagle": 0, "hits": 0, "one group": 0, "3+ sweeps": 0}
    for case in range(5000):
        make_groups = three_kind_groups if case % 5 == 4 else random_groups
        groups, alignment, use_eagle = make_groups(rng)
        if len(groups) == 1:
            alignment = None  # the engine aligns a single group to its block size
        align = alignment or math.lcm(*(g.block_size for g in groups))
        max_hit_tokens = rng.randint(0, 200)
        # Mostly well-filled stores with holes: hits long enough for several sweeps.
        stored = random_stores(rng, groups, max_hit_tokens, STORE_STYLES)
        hbs = hash_block_size_for(rng, groups)
        expected = vllm_hit(groups, stored, max_hit_tokens, align, hbs, use_eagle)
        got, _ = lookup(
            groups, stored, max_hit_tokens, alignment_tokens=alignment, use_eagle=use_eagle
        )
        assert got == expected, (groups, stored, max_hit_tokens, alignment, hbs, use_eagle)
        counts["cases"] += 1
        counts["eagle"] += use_eagle
        counts["hits"] += got.num_tokens > 0
        counts["one group"] += len(groups) == 1
        # Sweep 2 shrank the hit again, so sweep 3 ran.
        counts["3+ sweeps"] += (
            reference(groups, stored, max_hit_tokens, alignment, use_eagle)[1] > 2
        )
    # The generator must reach the interesting cases, not only trivial ones.
    assert counts["eagle"] > 1000 and counts["hits"] > 2000 and counts["one group"] > 200, counts
    assert counts["3+ sweeps"] > 60, counts


def test_gemma_and_qwen_like_layouts_at_scale() -> None:
    """A few long requests on realistic layouts; stores cut at random with rare holes."""
    rng = random.Random(3)
    hits: list[int] = []
    layouts = [
        [swa(16, 1024, name=f"s{i}") for i in range(3)] + [full(16)],
        [mamba(64, page=4096, name=f"m{i}") for i in range(3)] + [full(64)],
        [full(32), swa(32, 128), mamba(64)],
    ]
    for groups in layouts:
        for use_eagle in (False, True):
            max_hit_tokens = rng.randint(4000, 8000)
            stored = []
            for g in groups:
                nb = max_hit_tokens // g.block_size + 1
                cut = rng.randint(nb // 2, nb)
                stored.append({i for i in range(cut) if rng.random() < 0.998})
            align = math.lcm(*(g.block_size for g in groups))
            hbs = reduce(math.gcd, (g.block_size for g in groups))
            expected = vllm_hit(groups, stored, max_hit_tokens, align, hbs, use_eagle)
            got, _ = lookup(groups, stored, max_hit_tokens, use_eagle=use_eagle)
            assert got == expected
            hits.append(got.num_tokens)
    assert sum(t > 1024 for t in hits) >= 4, hits  # long hits, not only trivial ones


@pytest.mark.parametrize(("num_groups", "expected"), [(1, 64), (2, 80), (3, 80)])
def test_eagle_with_identical_full_groups_matches_vllm(num_groups: int, expected: int) -> None:
    """Full groups of one spec, block 16, a 96-token request, every block stored.

    vLLM's hybrid coordinator (2+ groups) looks one block past the bound before
    dropping one (80 tokens); its single-group coordinator does not (64)."""
    groups = [full(16, name=f"f{i}") for i in range(num_groups)]
    stored = [set(range(6)) for _ in groups]
    want = vllm_hit(groups, stored, 95, 16, 16, use_eagle=True)
    got, _ = lookup(groups, stored, 95, use_eagle=True)
    assert got == want and got.num_tokens == expected
    assert got.blocks_to_load == tuple(tuple(range(expected // 16)) for _ in groups)


def eagle_groups(rng: random.Random) -> list[KVGroup]:
    """Several groups, often of one spec: full attention copies, windows, states."""
    bs = rng.choice([1, 2, 4, 8, 16])
    groups = [full(bs, name="f0")]
    for i in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.5:
            groups.append(full(bs, name=f"f{i + 1}"))  # the same spec as f0
        elif roll < 0.8:
            groups.append(swa(bs * rng.choice([1, 2]), rng.randint(1, 4 * bs), name=f"s{i}"))
        else:
            groups.append(mamba(bs * rng.choice([1, 2]), name=f"m{i}"))
    rng.shuffle(groups)
    return groups


def test_eagle_drops_where_vllm_drops_with_any_groups_flagged() -> None:
    """EAGLE/MTP flag the groups of draft layers (or none: then every group drops);
    request lengths on block multiples are where one-group and hybrid rules part."""
    rng = random.Random(0xEA61E)
    seen = {"flagged some": 0, "flagged none": 0, "on a multiple": 0, "hits": 0}
    for _ in range(3000):
        groups = eagle_groups(rng)
        align = math.lcm(*(g.block_size for g in groups))
        request = align * rng.randint(1, 12) + (0 if rng.random() < 0.6 else rng.randint(1, 5))
        stored = random_stores(rng, groups, request, STORE_STYLES)
        flagged = frozenset(i for i in range(len(groups)) if rng.random() < 0.4)
        hbs = hash_block_size_for(rng, groups)
        want = vllm_hit(groups, stored, request - 1, align, hbs, True, flagged)
        got, _ = lookup(
            groups, stored, request - 1, use_eagle=True, eagle_group_ids=flagged or None
        )
        assert got == want, (groups, stored, request, sorted(flagged), hbs)
        seen["flagged some" if flagged else "flagged none"] += 1
        seen["on a multiple"] += request % align == 0
        seen["hits"] += got.num_tokens > 0
    assert min(seen.values()) > 300, seen


def test_layouts_we_reject_are_ones_vllm_rejects() -> None:
    """EAGLE with chunked local attention, and chunked local below the alignment."""
    for groups, use_eagle in [([full(4), chunked(4, 8)], True), ([full(8), chunked(4, 8)], False)]:
        align = math.lcm(*(g.block_size for g in groups))
        with pytest.raises(AssertionError, match="chunked local attention"):
            vllm_hit(groups, [set(range(9))] * 2, 30, align, 4, use_eagle)
        with pytest.raises(ValueError, match="chunked local attention"):
            find_longest_hit(groups, 30, lambda g, ids: [True] * len(ids), use_eagle=use_eagle)


# ---------------------------------------------------------------- DeepSeek-V4 layouts


def mla_layer_spec(group: KVGroup, page: int) -> KVCacheSpec:
    """One DeepSeek-V4 cache as vLLM specs it: MLA (full) or sliding-window MLA."""
    mla: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.int8,
        "page_size_padded": group.block_size + page,
    }
    if group.kind is GroupKind.FULL:
        return MLAAttentionSpec(**mla)
    return SlidingWindowMLASpec(**mla, sliding_window=group.sliding_window)


def scheduler_spec(group: KVGroup) -> KVCacheSpec:
    """The group as the scheduler's coordinator sees it.

    vLLM's grouping wraps a DeepSeek-V4 group's layers in ``UniformTypeKVCacheSpecs``,
    but the engine core hands the scheduler only the first layer's spec
    (``generate_scheduler_kv_cache_config``); the coordinator has no manager for the
    wrapper. So two sliding groups of one window compare equal and are searched
    together, and the MLA group is a ``FullAttentionSpec``, searched first and once.
    """
    return mla_layer_spec(group, group.page_sizes_bytes[0])


def dsv4_variant(rng: random.Random) -> list[KVGroup]:
    """Block sizes 256 / 64 / 64 / 4 / 8, windows 128 / 128 / 8 / 128 (or small ones),
    the full group with mixed pages, the two 64-token groups of one spec or not."""
    windows = [rng.choice([128, rng.randint(1, 200)]) for _ in range(4)]
    if rng.random() < 0.5:
        windows[1] = windows[0]
    group_kinds = [
        (256, None),
        (64, windows[0]),
        (64, windows[1]),
        (4, windows[2]),
        (8, windows[3]),
    ]
    groups = []
    for i, (block_size, window) in enumerate(group_kinds):
        names = tuple(f"g{i}.l{j}" for j in range(rng.randint(1, 3)))
        pages = tuple(rng.choice([64, 1168, 8448]) for _ in names) if i == 0 else ()
        page = max(pages) if pages else 64
        groups.append(
            KVGroup(
                kind=GroupKind.FULL if window is None else GroupKind.SLIDING_WINDOW,
                block_size=block_size,
                page_size_bytes=page,
                layer_names=names,
                sliding_window=window,
                layer_page_sizes_bytes=pages if len(set(pages)) > 1 else (),
            )
        )
    order = [0, 1, 2, 3, 4]
    rng.shuffle(order)
    return [groups[i] for i in order]


def tail_stores(rng: random.Random, groups: list[KVGroup], max_tokens: int) -> list[set[int]]:
    """What vLLM keeps per 256-token segment: each window's tail before the boundary."""
    end = rng.randint(0, max_tokens) // 256 * 256
    stored = []
    for g in groups:
        keep = (
            256
            if g.sliding_window is None
            else min(256, math.ceil(g.sliding_window / g.block_size) * g.block_size)
        )
        stored.append(
            {
                i
                for i in range(end // g.block_size)
                if (i + 1) * g.block_size % 256 > 256 - keep or (i + 1) * g.block_size % 256 == 0
            }
        )
    return stored


def test_deepseek_v4_layouts_match_vllm() -> None:
    """The presets (MTP group flagged for EAGLE) and small variants, alignment 256,
    hash blocks of 4 tokens: hits and each group's loaded blocks as vLLM's."""
    rng = random.Random(0xD5F4)
    seen = {"hits": 0, "eagle": 0, "tail": 0}
    presets = [deepseek_v4_flash(mtp=True), deepseek_v4_pro(mtp=True)]
    for case in range(300):
        if case % 3 == 0:
            model_groups = presets[case % 2]
            groups = list(model_groups.groups)
            mtp = 1  # the odd sliding layers' group holds the MTP layer
        else:
            groups = dsv4_variant(rng)
            mtp = rng.randrange(len(groups))
        use_eagle = rng.random() < 0.5
        flagged = frozenset([mtp]) if use_eagle else frozenset()
        max_hit_tokens = rng.randint(0, 3000)
        if rng.random() < 0.3:
            stored = tail_stores(rng, groups, max_hit_tokens)
            seen["tail"] += 1
        else:
            stored = random_stores(
                rng, groups, max_hit_tokens, ("dense", "dense", "holes", "prefix")
            )
        want = vllm_hit(groups, stored, max_hit_tokens, 256, 4, use_eagle, flagged, scheduler_spec)
        got, _ = lookup(
            groups,
            stored,
            max_hit_tokens,
            alignment_tokens=256,
            use_eagle=use_eagle,
            eagle_group_ids=flagged or None,
        )
        assert got == want, (case, groups, max_hit_tokens, sorted(flagged))
        seen["hits"] += got.num_tokens > 0
        seen["eagle"] += use_eagle
    assert min(seen.values()) > 40, seen


def _dcp_specs(rng: random.Random) -> list[KVCacheSpec]:
    """Full attention (sharded by DCP) and Mamba (replicated) groups, as vLLM declares
    them: each spec's block size is a rank's physical block."""
    attention_size = rng.choice([1, 2, 4, 8])
    specs: list[KVCacheSpec] = [
        FullAttentionSpec(block_size=attention_size, num_kv_heads=1, head_size=1, dtype=torch.int8)
    ]
    for _ in range(rng.randint(1, 2)):
        specs.append(
            MambaSpec(
                block_size=attention_size * rng.choice([1, 2, 4]),
                shapes=((1,),),
                dtypes=(torch.int8,),
                mamba_cache_mode="align",
            )
        )
    if rng.random() < 0.3:
        specs.append(specs[0])  # a second full-attention group
    rng.shuffle(specs)
    return specs


@pytest.mark.parametrize("dcp", [2, 4])
def test_decode_context_parallel_hits_match_vllms_coordinator(dcp: int) -> None:
    """With decode context parallel a full-attention block spans ``block_size * dcp``
    tokens (each rank holds its share in a block of ``block_size``) and a Mamba block
    its own ``block_size``: the groups hybridkv reads from the engine's config take
    those spans, and their hits equal vLLM's coordinator's (``dcp_world_size``) over
    the same stores."""
    rng = random.Random(0xDC9 + dcp)
    counts = {"cases": 0, "hits": 0, "eagle": 0}
    for _ in range(1500):
        specs = _dcp_specs(rng)
        spans = [s.block_size * (dcp if s.dcp_sharded else 1) for s in specs]
        hash_block_size = rng.choice([d for d in range(1, min(spans) + 1) if min(spans) % d == 0])
        hash_block_size = math.gcd(hash_block_size, *spans)
        config = KVCacheConfig(
            num_blocks=1,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l.{i}"], s) for i, s in enumerate(specs)],
            hash_block_size=hash_block_size,
        )
        groups = list(groups_from_config(config, "m", dcp).groups)
        assert [g.block_size for g in groups] == spans
        use_eagle = rng.random() < 0.3
        max_hit_tokens = rng.randint(0, 300)
        stored = random_stores(rng, groups, max_hit_tokens, STORE_STYLES)
        expected = vllm_hit(
            groups,
            stored,
            max_hit_tokens,
            math.lcm(*spans),
            hash_block_size,
            use_eagle,
            make_spec=lambda g: specs[groups.index(g)],  # noqa: B023
            dcp_world_size=dcp,
        )
        got, _ = lookup(groups, stored, max_hit_tokens, use_eagle=use_eagle)
        assert got == expected, (specs, stored, max_hit_tokens, hash_block_size, use_eagle)
        counts["cases"] += 1
        counts["hits"] += got.num_tokens > 0
        counts["eagle"] += use_eagle and got.num_tokens > 0
    assert counts["hits"] > 500 and counts["eagle"] > 100, counts
