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
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from hybridkv.groups import GroupKind
from hybridkv.integrations.vllm.facts import (
    check_engine,
    eagle_drafting,
    groups_from_config,
    handoff_groups,
)

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


def test_gemma_and_qwen_like_groups_become_ours() -> None:
    gemma = kv_config(attention(SlidingWindowSpec, sliding_window=32), attention(FullAttentionSpec))
    check_engine(engine_config(), gemma)
    model_groups = groups_from_config(gemma, "m")
    assert [g.kind for g in model_groups.groups] == [GroupKind.SLIDING_WINDOW, GroupKind.FULL]
    assert model_groups.groups[0].sliding_window == 32
    assert model_groups.groups[0].page_size_bytes == 32 * 2 * 32 * 4
    assert model_groups.groups[1].layer_names == ("model.layers.1.attn",)
    qwen = kv_config(mamba(), attention(FullAttentionSpec))
    check_engine(engine_config(), qwen)
    model_groups = groups_from_config(qwen, "m")
    assert model_groups.groups[0].kind is GroupKind.MAMBA
    # The state's own bytes, not the page the allocator pads it to.
    assert model_groups.groups[0].page_size_bytes == 3 * 384 * 2 + 128 * 128 * 2 < 262144


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
    assert "'all'" not in message  # vLLM 0.32's modes are 'align' and 'none'
    # Speculative blocks are served (the states come as vLLM's hand-offs).
    assert "speculative" not in message
    assert "group 2" not in message and "group 3" not in message
    # Pipeline and decode context parallel are served.
    assert "pipeline" not in message and "context parallel" not in message


def test_prefill_context_parallel_is_refused_naming_the_setting_and_the_fix() -> None:
    config = kv_config(attention(FullAttentionSpec))
    engine = engine_config()
    # Set after building: vLLM's CPU model runner refuses it in the config's own checks.
    engine.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(ValueError) as info:
        check_engine(engine, config)
    message = str(info.value)
    assert "(prefill_context_parallel_size=2) is not supported; use 1" in message, message


def test_a_pipeline_stage_without_layers_of_a_group_keeps_the_group_empty() -> None:
    config = kv_config(
        attention(SlidingWindowSpec, sliding_window=32), attention(FullAttentionSpec)
    )
    config.kv_cache_groups[1].layer_names = []  # vLLM's projection onto a stage without them
    check_engine(engine_config(pipeline_parallel_size=2), config)
    model_groups = groups_from_config(config, "m")
    assert model_groups.groups[1].layer_names == () and model_groups.groups[1].block_bytes == 0
    assert model_groups.groups[1].kind is GroupKind.FULL and model_groups.groups[1].block_size == 32
    with pytest.raises(ValueError, match=r"group 1.*the group has no layers"):
        check_engine(engine_config(), config)  # without pipeline parallel vLLM never makes one


def test_mamba2_checkpoints_speculative_blocks_and_kda_alignment_are_served() -> None:
    """Mamba2 sets one prefill checkpoint block (``MambaMixer2.get_kv_cache_spec``),
    KDA a checkpoint alignment, speculative decoding speculative blocks: those groups'
    states come by block id; a gated delta net's without either stay at their blocks."""
    config = kv_config(
        mamba(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1),
        mamba(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16),
        mamba(num_speculative_blocks=2),
        mamba(),
        attention(FullAttentionSpec),
    )
    check_engine(engine_config(), config)
    assert handoff_groups(config) == frozenset({0, 1, 2})


def test_hits_inside_a_mamba_block_are_refused_with_the_fix() -> None:
    """A hash block below the Mamba block (``--prefix-match-unit``) lets vLLM resume
    inside a Mamba block from a copied partial tail; refused, naming the setting."""
    config = kv_config(mamba(), attention(FullAttentionSpec))
    config.hash_block_size = config.cache_hit_alignment_tokens = 16
    with pytest.raises(ValueError) as info:
        check_engine(engine_config(), config)
    message = str(info.value)
    assert "group 0" in message and "block_size=32" in message and "every 16 tokens" in message
    assert "--prefix-match-unit" in message and "32" in message
    config.hash_block_size = config.cache_hit_alignment_tokens = 32
    check_engine(engine_config(), config)


def test_without_speculative_decoding_no_block_is_dropped() -> None:
    config = kv_config(
        attention(SlidingWindowSpec, sliding_window=32), attention(FullAttentionSpec)
    )
    assert eagle_drafting(engine_config(), config) == (False, frozenset())


def test_deepseek_v4_per_layer_spec_groups_keep_each_layers_real_page() -> None:
    def mla(head_size: int, ratio: int) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=256,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            alignment=576,
        )

    state = SlidingWindowMLASpec(
        block_size=8, num_kv_heads=1, head_size=1024, dtype=torch.float32, sliding_window=128
    )
    compressed = {
        "l2.attn.indexer.k_cache": mla(132, 4),
        "l2.attn": mla(584, 4),
        "l3.attn": mla(584, 128),
    }
    states = {"l3.attn.compressor.state_cache": state, "l5.attn.compressor.state_cache": state}
    groups = [
        KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=bs, kv_cache_specs=specs))
        for specs, bs in ((compressed, 256), (states, 8))
    ]
    groups[1].is_eagle_group = True
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[KVCacheTensor(size=0, layers=[], layer_stride=1, block_stride=1)],
        kv_cache_groups=groups,
        hash_block_size=4,
    )
    check_engine(engine_config(), config)
    model_groups = groups_from_config(config, "m")
    mixed, window = model_groups.groups
    assert mixed.kind is GroupKind.FULL and mixed.block_size == 256
    # Real pages (64 x 132, 64 x 584, 2 x 584), not the 576-aligned ones vLLM allocates.
    assert mixed.page_sizes_bytes == (8448, 37376, 1168)
    assert compressed["l3.attn"].page_size_bytes == 1728
    assert mixed.layer_names == ("l2.attn.indexer.k_cache", "l2.attn", "l3.attn")
    # Equal pages: an ordinary group, searched with any other group of its spec.
    assert window.kind is GroupKind.SLIDING_WINDOW and window.sliding_window == 128
    assert window.layer_page_sizes_bytes == () and window.page_size_bytes == 8 * 1024 * 4
    assert model_groups.hash_block_size == 4 and model_groups.scheduler_block_size == 256


def test_per_layer_spec_groups_mixing_kinds_or_windows_are_refused() -> None:
    def swa(window: int) -> SlidingWindowMLASpec:
        return SlidingWindowMLASpec(
            block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32, sliding_window=window
        )

    specs: dict[str, object] = {
        "a.attn": swa(8),
        "b.attn": swa(128),
        "c.attn": attention(CrossAttentionSpec),
    }
    group = KVCacheGroupSpec(
        list(specs), UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=specs)
    )
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    with pytest.raises(ValueError) as info:
        check_engine(engine_config(), config)
    message = str(info.value)
    assert "group 0 (UniformTypeKVCacheSpecs" in message and "cross-attention" in message
    assert "['a.attn']: SlidingWindowMLASpec block_size=32 sliding_window=8" in message
    assert "['b.attn']: SlidingWindowMLASpec block_size=32 sliding_window=128" in message
    assert "['c.attn']: CrossAttentionSpec" in message
