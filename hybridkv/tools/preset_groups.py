"""How vLLM sizes and groups the KV caches of a model's layers, for presets.

Pure functions, any process (``hybridkv.tools.presets`` and its model families).
Conventions every preset shares: tensor parallel size 1, bf16 KV cache, vLLM's
GPU default block size 16 unless the model forces another; an attention page
(one layer's block) is 2 (K and V) x block_size x num_kv_heads x head_dim x 2
bytes; layers are split into groups as vLLM's
``_get_kv_cache_groups_uniform_page_size`` does (``group_layers_like_vllm``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.groups import GroupKind, KVGroup

BF16_BYTES = 2
GPU_DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, kw_only=True)
class LayerKV:
    """One layer's KV cache before grouping (a KVGroup without layer names)."""

    kind: GroupKind
    block_size: int
    page_size_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


def attention_page_size_bytes(
    *, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = BF16_BYTES
) -> int:
    """One attention layer's block: K and V for ``block_size`` tokens."""
    return 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def gated_delta_net_state_bytes(
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel_size: int,
    dtype_bytes: int = BF16_BYTES,
    tp_size: int = 1,
) -> int:
    """One gated-delta-net layer's state: conv state plus recurrent state (vLLM's shapes).

    conv: ``(head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads) / tp`` channels x
    ``conv_kernel_size - 1`` steps; recurrent: ``num_v_heads / tp x head_v_dim x head_k_dim``.
    """
    conv_dim = head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads
    conv = conv_dim // tp_size * (conv_kernel_size - 1)
    recurrent = num_v_heads // tp_size * head_v_dim * head_k_dim
    return (conv + recurrent) * dtype_bytes


def attention_block_size_for_state(
    *, state_bytes: int, attention_bytes_per_token: int, kernel_block_size: int = 16
) -> int:
    """The smallest multiple of ``kernel_block_size`` whose attention page holds the state.

    vLLM raises the attention block size of attention + Mamba models this way so
    one page size fits both kinds, then pads the Mamba page up to the attention page.
    """
    per_kernel_block = kernel_block_size * attention_bytes_per_token
    return kernel_block_size * math.ceil(state_bytes / per_kernel_block)


def group_layers_like_vllm(layers: Sequence[tuple[str, LayerKV]]) -> tuple[KVGroup, ...]:
    """Split layers into KV cache groups of equal size, as vLLM does for one page size.

    Layers with equal specs form a bucket (first appearance orders the buckets).
    The group size is the smallest bucket's size, or the largest one's when no
    bucket exceeds 1.5x the smallest. A bucket of n layers becomes
    ``ceil(n / group_size)`` groups, group i taking every k-th layer from i on.
    """
    buckets: dict[LayerKV, list[str]] = {}
    for name, spec in layers:
        buckets.setdefault(spec, []).append(name)
    sizes = [len(names) for names in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups: list[KVGroup] = []
    for spec, names in buckets.items():
        num_groups = math.ceil(len(names) / group_size)
        for i in range(num_groups):
            groups.append(
                KVGroup(
                    kind=spec.kind,
                    block_size=spec.block_size,
                    page_size_bytes=spec.page_size_bytes,
                    layer_names=tuple(names[i::num_groups]),
                    sliding_window=spec.sliding_window,
                    attention_chunk_size=spec.attention_chunk_size,
                )
            )
    return tuple(groups)


def mamba2_state_bytes(
    *,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_size: int,
    conv_kernel: int,
    dtype_bytes: int = BF16_BYTES,
) -> int:
    """One Mamba2 layer's state (vLLM's ``mamba2_state_shape``, tensor parallel size 1):
    conv state ``heads x head_dim + 2 x n_groups x state_size`` channels x
    ``conv_kernel - 1`` steps, plus the SSM state ``heads x head_dim x state_size``."""
    conv_dim = num_heads * head_dim + 2 * n_groups * state_size
    return (conv_dim * (conv_kernel - 1) + num_heads * head_dim * state_size) * dtype_bytes
