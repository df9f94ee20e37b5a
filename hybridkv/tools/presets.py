"""The KV cache groups of real hybrid models, grouped the way vLLM groups them.

Pure data for any process (the CLI's ``inspect``, tests, documentation). Each
preset states where its config facts were checked; the conventions they share
(tensor parallel size 1, bf16, page sizes, vLLM's grouping) are in
``hybridkv.tools.preset_groups``; Mamba2 models are in ``hybridkv.tools.mamba2_presets``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.tools.mamba2_presets import granite_4_0_h_tiny, nemotron_nano_9b_v2
from hybridkv.tools.preset_groups import (
    GPU_DEFAULT_BLOCK_SIZE,
    LayerKV,
    attention_block_size_for_state,
    attention_page_size_bytes,
    gated_delta_net_state_bytes,
    group_layers_like_vllm,
)


def _sliding_and_full(
    *, num_kv_heads: int, head_dim: int, sliding_window: int
) -> tuple[LayerKV, LayerKV]:
    """A sliding-window and a full attention layer of one head shape: both at the GPU
    default block size, so one page size."""
    block_size = GPU_DEFAULT_BLOCK_SIZE
    page = attention_page_size_bytes(
        block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    sliding = LayerKV(
        kind=GroupKind.SLIDING_WINDOW,
        block_size=block_size,
        page_size_bytes=page,
        sliding_window=sliding_window,
    )
    full = LayerKV(kind=GroupKind.FULL, block_size=block_size, page_size_bytes=page)
    return sliding, full


def gemma3_27b() -> ModelGroups:
    """Gemma 3 27B: 62 layers, 5 sliding (window 1024) : 1 full, 16 KV heads x 128.

    Checked against google/gemma-3-27b-it config.json as transcribed in
    AI-Hypercomputer/maxtext src/MaxText/utils/ckpt_conversion/utils/hf_model_configs.py
    (``gemma3_27b_config``: num_hidden_layers 62, num_key_value_heads 16, head_dim 128,
    sliding_window 1024, sliding_window_pattern 6: layer i is full when (i + 1) % 6 == 0).
    vLLM groups the 52 sliding and 10 full layers into 6 sliding groups of 9 or 8
    layers and 1 full group of 10.
    """
    sliding, full = _sliding_and_full(num_kv_heads=16, head_dim=128, sliding_window=1024)
    layers = [
        (f"language_model.model.layers.{i}.self_attn.attn", full if (i + 1) % 6 == 0 else sliding)
        for i in range(62)
    ]
    return ModelGroups(groups=group_layers_like_vllm(layers), model_id="google/gemma-3-27b-it")


def gpt_oss_20b() -> ModelGroups:
    """gpt-oss-20b: 24 layers alternating sliding (window 128, even layers) / full.

    Checked against openai/gpt-oss-20b config.json as transcribed in
    AI-Hypercomputer/maxtext src/MaxText/utils/ckpt_conversion/utils/hf_model_configs.py
    (``gpt_oss_20b_dict``: num_hidden_layers 24, num_key_value_heads 8, head_dim 64,
    sliding_window 128, layer_types sliding/full alternating from layer 0), and
    vllm-project/vllm tests/config/base_model_arch_groundtruth.json (24 layers, 8 KV
    heads, head size 64). vLLM makes 2 groups of 12 layers.
    """
    sliding, full = _sliding_and_full(num_kv_heads=8, head_dim=64, sliding_window=128)
    layers = [(f"model.layers.{i}.attn.attn", sliding if i % 2 == 0 else full) for i in range(24)]
    return ModelGroups(groups=group_layers_like_vllm(layers), model_id="openai/gpt-oss-20b")


QWEN3_NEXT_STATE_BYTES = gated_delta_net_state_bytes(
    num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel_size=4
)
"""1,097,728 bytes: conv (8192 x 3) + recurrent (32 x 128 x 128) bf16 values."""


def qwen3_next_80b_a3b() -> ModelGroups:
    """Qwen3-Next-80B-A3B: 48 layers, 3 gated-delta-net : 1 full attention.

    Checked against vllm-project/vllm tests/config/base_model_arch_groundtruth.json
    (Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers, 2 KV heads, head size 256, bf16)
    and huggingface/transformers
    src/transformers/models/qwen3_next/configuration_qwen3_next.py (the 80B-A3B
    defaults: linear_num_key_heads 16, linear_num_value_heads 32, linear key/value
    head dim 128, linear_conv_kernel_dim 4, full_attention_interval 4: layer i is
    full when (i + 1) % 4 == 0).

    Block size: vLLM raises the attention block size until an attention page
    (2048 bytes per token) holds a gated-delta-net state (1,097,728 bytes):
    16 x ceil(1,097,728 / (16 x 2048)) = 544 tokens (the CPU backend's alignment 32
    gives 544 too). With prefix caching the Mamba block size follows it ("align"
    mode). Mamba page: we use vLLM's padded page (= the attention page,
    1,114,112 bytes) so groups built from the engine's matches this one;
    the state itself is 1,097,728 bytes (``QWEN3_NEXT_STATE_BYTES``). vLLM makes 3
    Mamba groups and 1 full group of 12 layers each.
    """
    attention_bytes_per_token = attention_page_size_bytes(
        block_size=1, num_kv_heads=2, head_dim=256
    )
    block_size = attention_block_size_for_state(
        state_bytes=QWEN3_NEXT_STATE_BYTES, attention_bytes_per_token=attention_bytes_per_token
    )
    page = block_size * attention_bytes_per_token
    mamba = LayerKV(kind=GroupKind.MAMBA, block_size=block_size, page_size_bytes=page)
    full = LayerKV(kind=GroupKind.FULL, block_size=block_size, page_size_bytes=page)
    layers = [
        (f"model.layers.{i}.self_attn.attn", full)
        if (i + 1) % 4 == 0
        else (f"model.layers.{i}.linear_attn", mamba)
        for i in range(48)
    ]
    return ModelGroups(
        groups=group_layers_like_vllm(layers), model_id="Qwen/Qwen3-Next-80B-A3B-Instruct"
    )


FP8_DS_MLA_ENTRY_BYTES = 584
"""One fp8_ds_mla cache entry: 448 B fp8 NoPE + 128 B bf16 RoPE + 7 B scales + 1 B pad."""
INDEXER_ENTRY_BYTES = 132
"""One indexer K entry: 128 fp8 values + one fp32 scale."""
FP32_BYTES = 4
DEEPSEEK_V4_FLASH_RATIOS = (0, 0, *(4 if i % 2 == 0 else 128 for i in range(2, 43)))
DEEPSEEK_V4_PRO_RATIOS = (128, 128, *(4 if i % 2 == 0 else 128 for i in range(2, 61)))


@dataclass(frozen=True, kw_only=True)
class PackedLayer:
    """One cache of a model whose groups pack different pages into one block."""

    name: str
    kind: GroupKind
    block_size: int
    page_size_bytes: int
    sliding_window: int | None = None


def deepseek_v4_caches(ratios: Sequence[int], *, mtp: bool) -> list[PackedLayer]:
    """Every KV cache of a DeepSeek-V4 model, in the order vLLM registers them.

    Per layer (vllm/models/deepseek_v4/attention.py, compressor.py): a CSA layer
    (ratio 4) first builds its indexer (K cache, then its compressor state), then
    every layer its sliding-window cache (64 tokens, window 128), then a compressed
    layer its MLA cache (256 tokens, one entry per ``ratio`` tokens) and its
    compressor state (4 tokens, window 8 for CSA; 8 tokens, window 128 for HCA).
    The MTP layer (index ``len(ratios)``) has ratio 1: a sliding-window cache only.
    """
    caches: list[PackedLayer] = []
    for i, ratio in enumerate([*ratios, 0] if mtp else ratios):
        prefix = f"model.layers.{i}.attn"
        if ratio == 4:
            caches += [
                _mla(f"{prefix}.indexer.k_cache", 64 * INDEXER_ENTRY_BYTES),
                _state(f"{prefix}.indexer.compressor.state_cache", ratio, head_dim=128),
            ]
        caches.append(
            PackedLayer(
                name=f"{prefix}.swa_cache",
                kind=GroupKind.SLIDING_WINDOW,
                block_size=64,
                page_size_bytes=64 * FP8_DS_MLA_ENTRY_BYTES,
                sliding_window=128,
            )
        )
        if ratio > 1:
            caches += [
                _mla(prefix, 256 // ratio * FP8_DS_MLA_ENTRY_BYTES),
                _state(f"{prefix}.compressor.state_cache", ratio, head_dim=512),
            ]
    return caches


def _mla(name: str, page: int) -> PackedLayer:
    return PackedLayer(name=name, kind=GroupKind.FULL, block_size=256, page_size_bytes=page)


def _state(name: str, ratio: int, *, head_dim: int) -> PackedLayer:
    """Compressor state: fp32 KV and score, twice as wide for overlapping CSA windows."""
    overlap = 2 if ratio == 4 else 1
    block_size = 4 if ratio == 4 else 8
    return PackedLayer(
        name=name,
        kind=GroupKind.SLIDING_WINDOW,
        block_size=block_size,
        page_size_bytes=block_size * 2 * overlap * head_dim * FP32_BYTES,
        sliding_window=overlap * ratio,
    )


def group_packed_like_vllm(caches: Sequence[PackedLayer]) -> tuple[KVGroup, ...]:
    """Groups as vLLM's ``_get_packed_kv_cache_groups`` makes them (block-outer layout).

    Caches of one kind, block size and window form a bucket (first appearance
    orders them). A bucket is balanced when each of its page sizes has as many
    layers. Balanced buckets split into groups of ``repeats`` layers per page
    size, ``repeats`` being the value >= the largest mixed-page balanced bucket
    that pads the balanced buckets least (ties: the larger); other buckets stay
    whole. No Mamba or circular-buffer buckets here (their split differs).
    """
    buckets: dict[tuple[object, ...], list[PackedLayer]] = {}
    for cache in caches:
        key = (cache.kind, cache.block_size, cache.sliding_window)
        buckets.setdefault(key, []).append(cache)
    by_page = [_by_page(bucket) for bucket in buckets.values()]
    balanced = [len({len(v) for v in pages.values()}) == 1 for pages in by_page]
    widths = [max(len(v) for v in pages.values()) for pages in by_page]
    floor = max(
        (w for w, b, p in zip(widths, balanced, by_page, strict=True) if b and len(p) > 1),
        default=0,
    )
    counts = [w for w, b in zip(widths, balanced, strict=True) if b]
    repeats = _least_padding(counts, floor) if floor else 0
    groups: list[KVGroup] = []
    for bucket, pages, is_balanced, width in zip(
        buckets.values(), by_page, balanced, widths, strict=True
    ):
        num_groups = math.ceil(width / repeats) if is_balanced and repeats else 1
        pattern = list(zip(*pages.values(), strict=True)) if num_groups > 1 else [tuple(bucket)]
        for i in range(num_groups):
            members = [c for repeat in pattern[i::num_groups] for c in repeat]
            groups.append(_packed_group(members))
    return tuple(groups)


def _by_page(bucket: list[PackedLayer]) -> dict[int, list[PackedLayer]]:
    pages: dict[int, list[PackedLayer]] = {}
    for cache in bucket:
        pages.setdefault(cache.page_size_bytes, []).append(cache)
    return pages


def _least_padding(counts: list[int], floor: int) -> int:
    def padding(d: int) -> int:
        return sum(-c % d for c in counts)

    return min(range(floor, max(max(counts), floor) + 1), key=lambda d: (padding(d), -d))


def _packed_group(members: list[PackedLayer]) -> KVGroup:
    first = members[0]
    pages = tuple(c.page_size_bytes for c in members)
    return KVGroup(
        kind=first.kind,
        block_size=first.block_size,
        page_size_bytes=max(pages),
        layer_names=tuple(c.name for c in members),
        sliding_window=first.sliding_window,
        layer_page_sizes_bytes=pages if len(set(pages)) > 1 else (),
    )


def deepseek_v4_flash(*, mtp: bool = False) -> ModelGroups:
    """DeepSeek-V4-Flash: 43 layers (+1 MTP layer), fp8_ds_mla KV, five KV cache groups.

    Layer facts checked against a copy of DeepSeek-V4-Flash's config.json in
    patrickbdevaney/deepseek-v4-flash-0731-cuda docs/config.json (a pruned
    derivative; the attention fields are the original's): 43 layers, head_dim 512,
    sliding_window 128, compress_ratios 0 for layers 0-1 then 4 (CSA, even layers
    2-42, 21 layers) and 128 (HCA, odd layers 3-41, 20 layers); index_head_dim 128.
    Caches and pages from vLLM 0.32's model code (``deepseek_v4_caches``); real
    (unpadded) pages. Grouping checked by running vLLM's own ``get_kv_cache_groups``
    on these specs (tests/groups/test_deepseek_v4_vllm.py): sliding-window caches of
    even / odd layers (block 64; the MTP layer joins the odd group), the compressed
    MLA + indexer caches (block 256), CSA states (block 4), HCA states (block 8).
    """
    caches = deepseek_v4_caches(DEEPSEEK_V4_FLASH_RATIOS, mtp=mtp)
    return ModelGroups(
        groups=group_packed_like_vllm(caches), model_id="deepseek-ai/DeepSeek-V4-Flash"
    )


def deepseek_v4_pro(*, mtp: bool = False) -> ModelGroups:
    """DeepSeek-V4-Pro: 61 layers (+1 MTP layer), 30 CSA and 31 HCA, no sliding-only layer.

    Checked against a public copy of deepseek-ai/DeepSeek-V4-Pro's config.json with
    its weight listing: num_hidden_layers 61, head_dim 512, sliding_window 128,
    index_head_dim 128, compress_ratios [128, 128, then 4 / 128 alternating from
    layer 2 (even: 4), ..., 4, 0] (62 entries, the last the MTP layer's); indexer
    weights on 30 layers (2-60 even). Grouped as for Flash; the HCA state bucket
    comes before the CSA one (layer 0 is HCA), so the last two groups swap.
    """
    caches = deepseek_v4_caches(DEEPSEEK_V4_PRO_RATIOS, mtp=mtp)
    return ModelGroups(
        groups=group_packed_like_vllm(caches), model_id="deepseek-ai/DeepSeek-V4-Pro"
    )


PRESETS: dict[str, Callable[[], ModelGroups]] = {
    "gemma3-27b": gemma3_27b,
    "gpt-oss-20b": gpt_oss_20b,
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "deepseek-v4-flash": deepseek_v4_flash,
    "deepseek-v4-pro": deepseek_v4_pro,
    "granite-4.0-h-tiny": granite_4_0_h_tiny,
    "nemotron-nano-9b-v2": nemotron_nano_9b_v2,
}


def load_groups(name_or_path: str | Path) -> ModelGroups:
    """A preset by name, or a groups JSON file in ``ModelGroups.to_dict`` format."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(name_or_path)!r} is neither a preset nor a groups JSON file; presets: "
            f"{sorted(PRESETS)}; a groups file holds ModelGroups.to_dict() as JSON"
        )
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"groups file {str(path)!r} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"groups file {str(path)!r} must hold a JSON object (ModelGroups.to_dict()), "
            f"got {type(data).__name__}"
        )
    return ModelGroups.from_dict(data, where=f"groups file {str(path)!r}")
