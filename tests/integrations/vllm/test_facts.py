"""Engine facts read from vLLM 0.32's own config and KV cache spec types."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hybridkv.integrations.vllm.facts import check_engine, eagle_drafting, layout_from_config
from hybridkv.spec import GroupKind

GDN_SHAPES = ((3, 384), (1, 128, 128))


def attention(cls: type, **kw: object) -> object:
    return cls(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32, **kw)


def mamba(mode: str = "align", **kw: object) -> MambaSpec:
    return MambaSpec(
        block_size=32,
        shapes=GDN_SHAPES,
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
        page_size_padded=262144,
        **kw,
    )


def kv_config(*specs: object) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def engine_config(**parallel: int) -> VllmConfig:
    return VllmConfig(
        parallel_config=ParallelConfig(**parallel), cache_config=CacheConfig(block_size=32)
    )


def test_gemma_and_qwen_like_groups_become_our_layout() -> None:
    gemma = kv_config(attention(SlidingWindowSpec, sliding_window=32), attention(FullAttentionSpec))
    check_engine(engine_config(), gemma)
    layout = layout_from_config(gemma, "m")
    assert [g.kind for g in layout.groups] == [GroupKind.SLIDING_WINDOW, GroupKind.FULL]
    assert layout.groups[0].sliding_window == 32
    assert layout.groups[0].page_size_bytes == 32 * 2 * 32 * 4
    assert layout.groups[1].layer_names == ("model.layers.1.attn",)
    qwen = kv_config(mamba(), attention(FullAttentionSpec))
    check_engine(engine_config(), qwen)
    layout = layout_from_config(qwen, "m")
    assert layout.groups[0].kind is GroupKind.MAMBA
    # The state's own bytes, not the page the allocator pads it to.
    assert layout.groups[0].page_size_bytes == 3 * 384 * 2 + 128 * 128 * 2 < 262144


def test_everything_we_cannot_serve_is_refused_in_one_error() -> None:
    config = kv_config(
        attention(CrossAttentionSpec),
        mamba("none"),
        mamba(num_speculative_blocks=1),
        attention(FullAttentionSpec),
    )
    with pytest.raises(ValueError) as info:
        check_engine(
            engine_config(
                tensor_parallel_size=2, decode_context_parallel_size=2, pipeline_parallel_size=2
            ),
            config,
        )
    message = str(info.value)
    assert "group 0" in message and "cross-attention" in message
    assert "group 1" in message and "'none'" in message and "align" in message
    assert "speculative decoding with Mamba groups" in message
    assert "group 2" not in message and "group 3" not in message
    assert "dcp=2" in message and "pipeline_parallel_size=2" in message


def test_without_speculative_decoding_no_block_is_dropped() -> None:
    config = kv_config(
        attention(SlidingWindowSpec, sliding_window=32), attention(FullAttentionSpec)
    )
    assert eagle_drafting(engine_config(), config) == (False, frozenset())
