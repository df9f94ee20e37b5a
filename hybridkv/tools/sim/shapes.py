"""The simulated model's shape: its groups and its KV tensors, laid out as vLLM's CPU
worker registers them.

Runs in the process of the test or benchmark that builds a ``SimEngine``.
Attention layers are ``[num_blocks, kv_heads, block_size, 2 * head_dim]``
float32; Mamba layers int8 ``[num_blocks, 1, 1, state_bytes]`` inside a page
padded to the attention page; layer ``i`` of every group shares one storage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups

HEAD_DIM = 4
NUM_KV_HEADS = 1
MAMBA_STATE_BYTES = 96


def attention_page_bytes(block_size: int) -> int:
    """One attention layer's page: K and V of ``block_size`` tokens, float32."""
    return NUM_KV_HEADS * block_size * 2 * HEAD_DIM * 4


def make_groups(
    kinds: Sequence[GroupKind],
    *,
    block_size: int = 4,
    window: int = 8,
    layers_per_group: int = 2,
    model_id: str = "sim",
) -> ModelGroups:
    """Groups of the given kinds, equal block sizes, ``layers_per_group`` layers each."""
    groups = []
    for g, kind in enumerate(kinds):
        page = MAMBA_STATE_BYTES if kind is GroupKind.MAMBA else attention_page_bytes(block_size)
        groups.append(
            KVGroup(
                kind=kind,
                block_size=block_size,
                page_size_bytes=page,
                layer_names=tuple(f"layers.{g}.{i}" for i in range(layers_per_group)),
                sliding_window=window if kind is GroupKind.SLIDING_WINDOW else None,
            )
        )
    return ModelGroups(groups=tuple(groups), model_id=model_id)


def make_kv_caches(model_groups: ModelGroups, num_blocks: int) -> dict[str, torch.Tensor]:
    """Per-layer tensors as vLLM's CPU backend registers them (storage shared per slot)."""
    bs = model_groups.groups[0].block_size
    page = attention_page_bytes(bs)
    num_slots = max(g.num_layers for g in model_groups.groups)
    buffers = [torch.zeros(num_blocks * page, dtype=torch.int8) for _ in range(num_slots)]
    caches: dict[str, torch.Tensor] = {}
    for group in model_groups.groups:
        for slot, name in enumerate(group.layer_names):
            buf = buffers[slot]
            if group.kind is GroupKind.MAMBA:
                caches[name] = buf.as_strided(
                    (num_blocks, 1, 1, MAMBA_STATE_BYTES), (page, 0, 0, 1)
                )
            else:
                caches[name] = buf.view(torch.float32).view(
                    num_blocks, NUM_KV_HEADS, bs, 2 * HEAD_DIM
                )
    return caches
