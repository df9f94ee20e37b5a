"""The DeepSeek-V4 presets against vLLM 0.32's own grouping of the model's caches.

Every cache's spec is built with vLLM's spec classes exactly as the model code's
``get_kv_cache_spec`` methods build them with ``--kv-cache-dtype fp8_ds_mla``
(vllm/models/deepseek_v4/attention.py ``DeepseekV4Attention`` and
``DeepseekV4IndexerCache``, compressor.py ``CompressorStateCache``,
v1/attention/backends/mla/sparse_swa.py ``DeepseekV4SWACache``), in registration
order; vLLM's ``get_kv_cache_groups`` groups them; the adapter converts the groups.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import (
    _annotate_eagle_groups,
    generate_scheduler_kv_cache_config,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.integrations.vllm.facts import groups_from_config
from hybridkv.tools.presets import (
    DEEPSEEK_V4_FLASH_RATIOS,
    DEEPSEEK_V4_PRO_RATIOS,
    deepseek_v4_flash,
    deepseek_v4_pro,
)


def main_cache(ratio: int) -> MLAAttentionSpec:
    """``DeepseekV4Attention.get_kv_cache_spec`` (compressed layers only)."""
    return MLAAttentionSpec(
        block_size=256,  # cache_config.block_size, which DeepSeek-V4 sets to 256
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=ratio,
        cache_dtype_str="fp8_ds_mla",
        alignment=576,
        model_version="deepseek_v4",
        state_content_bytes=584,
    )


def indexer_cache(ratio: int) -> MLAAttentionSpec:
    """``DeepseekV4IndexerCache.get_kv_cache_spec``: 128 fp8 + 4 scale bytes a row."""
    return MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        tokens_per_state=ratio,
        alignment=576,
    )


def swa_cache() -> SlidingWindowMLASpec:
    """``DeepseekV4SWACache.get_kv_cache_spec`` (block 64, window = config.sliding_window)."""
    return SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        sliding_window=128,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=584,
        alignment=576,
        model_version="deepseek_v4",
    )


def state_cache(ratio: int, head_dim: int) -> SlidingWindowMLASpec:
    """``CompressorStateCache.get_kv_cache_spec``: fp32 KV + score states."""
    coff = 1 + (ratio == 4)
    return SlidingWindowMLASpec(
        block_size=4 if ratio == 4 else 8,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=2 * coff * head_dim,
        dtype=torch.float32,
        sliding_window=coff * ratio,
        alignment=576,
    )


def vllm_specs(ratios: tuple[int, ...], *, mtp: bool) -> dict[str, KVCacheSpec]:
    """Per layer, in the order the modules register: the indexer (K cache, then its
    compressor) is built before the sliding cache, the attention and its compressor."""
    specs: dict[str, KVCacheSpec] = {}
    for i, ratio in enumerate([*ratios, 0] if mtp else list(ratios)):
        prefix = f"model.layers.{i}.attn"
        if ratio == 4:
            specs[f"{prefix}.indexer.k_cache"] = indexer_cache(ratio)
            specs[f"{prefix}.indexer.compressor.state_cache"] = state_cache(ratio, 128)
        specs[f"{prefix}.swa_cache"] = swa_cache()
        if ratio > 1:
            specs[prefix] = main_cache(ratio)
            specs[f"{prefix}.compressor.state_cache"] = state_cache(ratio, 512)
    return specs


def vllm_groups(ratios: tuple[int, ...], *, mtp: bool) -> tuple[ModelGroups, list[Any]]:
    """vLLM's groups for these caches, through the adapter.

    ``get_kv_cache_groups`` dispatches this input (several page sizes, block-outer
    layout: DeepSeek-V4's indexer backend accepts only BLHNC / BLNHC) to
    ``_get_packed_kv_cache_groups``. The MTP group flag needs a speculative config,
    which needs a real draft model; so the flag is applied by the function that
    function calls, ``_annotate_eagle_groups``, with its DeepSeek-V4 trailing-layer
    rule, on a config whose speculative settings are the ones it reads.
    """
    config = VllmConfig(cache_config=CacheConfig(block_size=256))
    config.cache_config.kv_cache_layout = "BLHNC"
    specs = vllm_specs(ratios, mtp=mtp)
    groups = get_kv_cache_groups(config, specs)
    if mtp:
        _annotate_eagle_groups(_MtpConfig(), specs, groups, use_trailing_layer_fallback=True)
    kv_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    return groups_from_config(kv_config, "m"), groups


class _MtpSpeculation:
    method = "mtp"

    def use_eagle_block_drop(self) -> bool:
        return True


class _MtpConfig:
    speculative_config = _MtpSpeculation()


PRESETS = [
    ("flash", DEEPSEEK_V4_FLASH_RATIOS, deepseek_v4_flash),
    ("pro", DEEPSEEK_V4_PRO_RATIOS, deepseek_v4_pro),
]


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize(("name", "ratios", "preset"), PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_is_vllms_grouping(name: str, ratios: Any, preset: Any, mtp: bool) -> None:
    ours = preset(mtp=mtp)
    theirs, groups = vllm_groups(ratios, mtp=mtp)
    assert len(ours.groups) == len(theirs.groups) == 5
    for mine, vllm_group in zip(ours.groups, theirs.groups, strict=True):
        assert mine.kind is vllm_group.kind
        assert mine.block_size == vllm_group.block_size
        assert mine.sliding_window == vllm_group.sliding_window
        # vLLM keeps registration order inside a group: compare in order, pages too.
        assert mine.layer_names == vllm_group.layer_names
        assert mine.page_sizes_bytes == vllm_group.page_sizes_bytes
        assert mine.search_key == vllm_group.search_key
    assert ours.fingerprint == theirs.fingerprint
    flagged = [i for i, g in enumerate(groups) if g.is_eagle_group]
    mtp_swa = f"model.layers.{len(ratios)}.attn.swa_cache"
    assert flagged == ([1] if mtp else [])
    assert (mtp_swa in ours.groups[1].layer_names) is mtp


@pytest.mark.parametrize(("name", "ratios", "preset"), PRESETS, ids=[p[0] for p in PRESETS])
def test_scheduler_and_workers_name_blocks_alike(name: str, ratios: Any, preset: Any) -> None:
    """vLLM's engine core hands its scheduler each per-layer group as its first layer's
    spec (``generate_scheduler_kv_cache_config``); the workers keep every page. Both
    sides' layouts must give the same store keys, and the same hit-search specs."""
    config = VllmConfig(cache_config=CacheConfig(block_size=256))
    config.cache_config.kv_cache_layout = "BLHNC"
    groups = get_kv_cache_groups(config, vllm_specs(ratios, mtp=True))
    worker_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])
    worker = groups_from_config(worker_config, "m")
    scheduler = groups_from_config(scheduler_config, "m")
    assert any(g.layer_page_sizes_bytes for g in worker.groups)
    assert not any(g.layer_page_sizes_bytes for g in scheduler.groups)
    assert scheduler.fingerprint == worker.fingerprint
    for mine, theirs in zip(worker.groups, scheduler.groups, strict=True):
        assert (mine.kind, mine.block_size, mine.sliding_window, mine.layer_names) == (
            theirs.kind,
            theirs.block_size,
            theirs.sliding_window,
            theirs.layer_names,
        )


# Per 256-token segment, vLLM keeps only the tail blocks a later 256-aligned hit can
# use: the sliding KV's last 2 of 4 blocks (window 128, block 64), the CSA state's
# last 2 of 64 (window 8, block 4), the HCA state's last 16 of 32 (window 128,
# block 8), and the compressed group's one block.
KEPT_BLOCKS = {64: 2, 256: 1, 4: 2, 8: 16}


def stored_bytes_per_segment(model_groups: ModelGroups) -> int:
    return sum(KEPT_BLOCKS[g.block_size] * g.block_bytes for g in model_groups.groups)


def test_flash_stored_bytes_per_segment_are_the_notes_figure() -> None:
    # The notes' per-layer page table (real pages), Flash without MTP: 43 sliding
    # caches, 21 CSA + 21 indexer + 20 HCA compressed caches, 21 + 21 CSA states,
    # 20 HCA states.
    sliding = 43 * 37_376
    compressed = 21 * 37_376 + 21 * 8_448 + 20 * 1_168
    csa_state = 21 * 32_768 + 21 * 8_192
    hca_state = 20 * 32_768
    notes = 2 * sliding + 1 * compressed + 2 * csa_state + 16 * hca_state
    assert stored_bytes_per_segment(deepseek_v4_flash()) == notes == 16_406_080
    assert math.isclose(notes / 1e6, 16.4, abs_tol=0.05)
    # The HCA state tail dominates, as the notes say.
    assert 16 * hca_state > notes / 2
    kinds = {g.kind for g in deepseek_v4_flash().groups}
    assert kinds == {GroupKind.FULL, GroupKind.SLIDING_WINDOW}
