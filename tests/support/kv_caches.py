"""KV caches for layout, tools and transfer tests: vLLM's own allocator for a Qwen3-Next-like
model (attention + two Mamba groups) and its layout, a Gemma-like layout, and brute-force
readers of a block's bytes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import CanonicalKVCaches


def group(
    kind: GroupKind,
    names: tuple[str, ...],
    page: int,
    block_size: int = 32,
    layer_pages: tuple[int, ...] = (),
) -> KVGroup:
    """A group; ``layer_pages`` gives each layer its own page (``page`` is then ignored)."""
    extra: dict[str, object] = {"sliding_window": 64} if kind is GroupKind.SLIDING_WINDOW else {}
    if kind is GroupKind.CHUNKED_LOCAL:
        extra = {"attention_chunk_size": 4 * block_size}
    if layer_pages:
        extra["layer_page_sizes_bytes"] = layer_pages
        page = max(layer_pages)
    return KVGroup(
        kind=kind, block_size=block_size, page_size_bytes=page, layer_names=names, **extra
    )


VllmAllocate = Callable[[str], tuple[dict[str, torch.Tensor], int, int]]


def real_vllm_allocator() -> VllmAllocate:
    """vLLM's own KV cache config and allocator for a Qwen3-Next-like model (attention
    + two Mamba groups): returns ``allocate(layout_name) -> (kv_caches, attention page
    bytes, unpadded Mamba page bytes)``."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    config = VllmConfig()
    attn = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=64,
        shapes=((3, 100), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attn.page_size_bytes,
    )
    groups = [
        KVCacheGroupSpec(["a.0", "a.3"], attn),
        KVCacheGroupSpec(["m.1", "m.4"], mamba),
        KVCacheGroupSpec(["m.2", "m.5"], mamba),
    ]

    def allocate(layout_name: str) -> tuple[dict[str, torch.Tensor], int, int]:
        config.cache_config.kv_cache_layout = layout_name
        kv_config = get_kv_cache_config_from_groups(config, groups, 1 << 21)
        kv = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[layout_name])
        return kv, attn.page_size_bytes, mamba.real_page_size_bytes

    return allocate


def qwen_next_like(attn_page: int, mamba_page: int) -> ModelGroups:
    return ModelGroups(
        groups=(
            group(GroupKind.FULL, ("a.0", "a.3"), attn_page, block_size=64),
            group(GroupKind.MAMBA, ("m.1", "m.4"), mamba_page, block_size=64),
            group(GroupKind.MAMBA, ("m.2", "m.5"), mamba_page, block_size=64),
        )
    )


def gemma_like(page: int = 4096) -> ModelGroups:
    """Sliding window + full attention, two layers each (vLLM groups layers 0,2 and 1,3)."""
    return ModelGroups(
        groups=(
            group(GroupKind.SLIDING_WINDOW, ("l.0", "l.2"), page),
            group(GroupKind.FULL, ("l.1", "l.3"), page),
        )
    )


Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def attention_shapes(model_groups: ModelGroups, dtype: torch.dtype) -> Shapes:
    """[kv_heads, block_size, C] pages, vLLM CPU style (K and V concatenated in C)."""
    shapes: Shapes = {}
    for g in model_groups.groups:
        elements = g.page_size_bytes // dtype.itemsize
        for name in g.layer_names:
            shapes[name] = ((2, g.block_size, elements // (2 * g.block_size)), dtype)
    return shapes


def page_bytes(view: torch.Tensor, block_id: int) -> bytes:
    """A page's bytes read through the engine-facing tensor (pages here are contiguous)."""
    return view[block_id].contiguous().view(torch.uint8).numpy().tobytes()


def reference_object(kv_caches: dict[str, torch.Tensor], g: KVGroup, block_id: int) -> bytes:
    return b"".join(page_bytes(kv_caches[name], block_id) for name in g.layer_names)


def object_via_spans(c: CanonicalKVCaches, group_id: int, block_id: int) -> bytes:
    out = bytearray(c.model_groups.groups[group_id].block_bytes)
    for span in c.group_block_spans(group_id):
        row = c.tensors[span.tensor_idx][block_id]
        chunk = row[span.offset_bytes : span.offset_bytes + span.num_bytes]
        end = span.object_offset_bytes + span.num_bytes
        out[span.object_offset_bytes : end] = chunk.numpy().tobytes()
    return bytes(out)


def fill_random(buffer: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8, generator=gen))
