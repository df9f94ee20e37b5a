"""vLLM configs and KV cache specs of hybrid models, for vLLM's own scheduler in tests.

Test helper. vLLM's CPU build cannot run a Mamba2 model with prefix caching
nor a Mamba model with speculative decoding, so ``tests.support.vllm_scheduler``
drives hybridkv with vLLM's scheduler instead; this module builds what that
scheduler is built from, as vLLM's engine core builds it:

* a real ``VllmConfig`` for a tiny model (only its ``config.json`` is written:
  the scheduler never loads weights), with prefix caching on (Mamba "align"
  mode) and optionally ngram, EAGLE or MTP drafting;
* each layer's KV cache spec as the model's layer classes declare it
  (``MambaBase.get_kv_cache_spec`` with the state shapes of vLLM's
  ``MambaStateShapeCalculator``; ``MambaMixer2.get_kv_cache_spec`` adds one prefill
  checkpoint block, the KDA layers of Kimi-K3 / GLM-5 next a checkpoint alignment
  of 16 with the FlashKDA backend); a drafter's layers come last;
* the ``KVCacheConfig`` vLLM derives from them (``get_kv_cache_configs``) with the
  hash block size and hit alignment the engine core resolves.

Pages are tiny: attention layers hold 1 KV head of 4 float32 values (32 bytes a
token, ``hybridkv.tools.sim.model.token_kv``), Mamba states are padded to the
attention page as vLLM pads them.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec

from hybridkv.tools.sim.shapes import HEAD_DIM, NUM_KV_HEADS

BLOCK_SIZE = 16
"""Tokens per block of every group (Mamba "align" mode: the attention block size)."""
MAX_MODEL_LEN = 1024
NUM_SPECULATIVE_TOKENS = 2
VOCAB_SIZE = 512


class SimModel(enum.Enum):
    """Which hybrid model's layers (values name them in test ids)."""

    GRANITE = "granite-4.0-h"
    """Mamba2 (``MambaMixer2``: one prefill checkpoint block) : attention, 3 : 1."""
    QWEN3_NEXT = "qwen3-next"
    """Gated delta net (no checkpoint) : full attention, 1 : 1; MTP drafting."""
    KIMI_KDA = "kimi-kda"
    """KDA (FlashKDA checkpoints every 16 tokens) : full attention, 1 : 1."""


class Drafting(enum.Enum):
    NONE = "none"
    NGRAM = "ngram"
    EAGLE = "eagle"
    """A separate EAGLE draft model (one Llama layer)."""
    MTP = "mtp"
    """The model's own MTP layer (Qwen3-Next)."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    model: SimModel
    drafting: Drafting = Drafting.NONE
    dense: bool = False
    """Keep every block boundary's state (``prefix_cache_retention_interval=None``);
    vLLM's default (0) keeps a prompt's replay boundary and shared-prefix junctions."""


_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4 * MAX_MODEL_LEN,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": NUM_KV_HEADS,
    "torch_dtype": "float32",
}
_GRANITE = {
    **_COMMON,
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 4,
    "hidden_size": 8,  # its checks: mamba_expand x hidden_size = heads x head dim
    "layer_types": ["mamba", "mamba", "mamba", "attention"],
    "mamba_n_heads": 2,
    "mamba_d_head": 4,
    "mamba_n_groups": 1,
    "mamba_d_state": 4,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "num_local_experts": 0,
    "shared_intermediate_size": 128,
    "position_embedding_type": "rope",
}
_QWEN3_NEXT = {
    **_COMMON,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "head_dim": HEAD_DIM,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 1,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_nextn_predict_layers": 1,
}
_EAGLE_DRAFT = {
    **_COMMON,
    "architectures": ["EagleLlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "head_dim": HEAD_DIM,
}


def _write_config(root: Path, name: str, config: dict[str, Any]) -> str:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def build_vllm_config(
    setup: Setup, root: Path, connector_extra: dict[str, Any] | None
) -> VllmConfig:
    """The engine's config; ``connector_extra`` None: no connector (the engine alone)."""
    hf_config = _GRANITE if setup.model is SimModel.GRANITE else _QWEN3_NEXT
    model_config = ModelConfig(
        model=_write_config(root, setup.model.value, hf_config),
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
    )
    parallel = ParallelConfig()
    return VllmConfig(
        model_config=model_config,
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=2 * MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            prefix_cache_retention_interval=None if setup.dense else 0,
        ),
        speculative_config=_speculative(setup.drafting, root, model_config, parallel),
        kv_transfer_config=None
        if connector_extra is None
        else KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=connector_extra,
        ),
    )


def _speculative(
    drafting: Drafting, root: Path, target: ModelConfig, parallel: ParallelConfig
) -> SpeculativeConfig | None:
    k = NUM_SPECULATIVE_TOKENS
    if drafting is Drafting.NONE:
        return None
    if drafting is Drafting.NGRAM:
        return SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1
        )
    targets = {"target_model_config": target, "target_parallel_config": parallel}
    if drafting is Drafting.EAGLE:
        draft = _write_config(root, "eagle-draft", _EAGLE_DRAFT)
        return SpeculativeConfig(method="eagle", model=draft, num_speculative_tokens=k, **targets)
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k, **targets)


def attention_spec() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )


def _mamba_spec(vllm_config: VllmConfig, shapes: tuple[tuple[int, ...], ...]) -> MambaSpec:
    """``MambaBase.get_kv_cache_spec``: the state padded to the attention page, the
    engine's cache mode, one speculative block per drafted token."""
    cache = vllm_config.cache_config
    return MambaSpec(
        shapes=shapes,
        dtypes=tuple(torch.float32 for _ in shapes),
        block_size=BLOCK_SIZE,
        page_size_padded=attention_spec().page_size_bytes,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=vllm_config.num_speculative_tokens,
    )


def layer_specs(setup: Setup, vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """Every layer's KV cache spec, in registration order (a drafter's last)."""
    num_spec = vllm_config.num_speculative_tokens
    specs: dict[str, KVCacheSpec] = {}
    if setup.model is SimModel.GRANITE:
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=1,
            intermediate_size=_GRANITE["mamba_n_heads"] * _GRANITE["mamba_d_head"],
            n_groups=_GRANITE["mamba_n_groups"],
            num_heads=_GRANITE["mamba_n_heads"],
            head_dim=_GRANITE["mamba_d_head"],
            state_size=_GRANITE["mamba_d_state"],
            conv_kernel=_GRANITE["mamba_d_conv"],
            num_spec=num_spec,
        )
        # MambaMixer2.get_kv_cache_spec: the checkpoint is exported inside the forward.
        mamba2 = replace(
            _mamba_spec(vllm_config, shapes),
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=1,
        )
        for i in range(3):
            specs[f"model.layers.{i}.mixer"] = mamba2
        specs["model.layers.3.self_attn.attn"] = attention_spec()
    elif setup.model is SimModel.QWEN3_NEXT:
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 1, 1, 4, 4, 4, num_spec)
        specs["model.layers.0.linear_attn"] = _mamba_spec(vllm_config, shapes)
        specs["model.layers.1.self_attn.attn"] = attention_spec()
    else:
        shapes = MambaStateShapeCalculator.kda_state_shape(1, 1, 4, num_spec=num_spec)
        alignment = kda_prefill_checkpoint_alignment("flashkda")
        specs["model.layers.0.self_attn"] = replace(
            _mamba_spec(vllm_config, shapes),
            num_prefill_checkpoint_blocks=int(alignment is not None),
            prefill_checkpoint_alignment=alignment,
        )
        specs["model.layers.1.self_attn.attn"] = attention_spec()
    if setup.drafting is Drafting.EAGLE:
        specs["draft.model.layers.0.self_attn.attn"] = attention_spec()
    elif setup.drafting is Drafting.MTP:
        specs["model.layers.2.mtp_block.self_attn.attn"] = attention_spec()
    return specs


def kv_cache_config(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_blocks: int
) -> KVCacheConfig:
    """vLLM's config for these specs and ``num_blocks`` blocks, with the hash block size
    and hit alignment its engine core resolves (and the scheduler block size set)."""
    # The engine core resolves one layout first; the one every backend supports will do.
    resolve_kv_cache_layout(vllm_config, [["LBHNC"]], specs.values())
    page = attention_spec().page_size_bytes
    (config,) = get_kv_cache_configs(vllm_config, [specs], [num_blocks * page * len(specs)])
    config = generate_scheduler_kv_cache_config([config])
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(config, vllm_config)
    config.hash_block_size = hash_block_size
    config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        config, vllm_config, scheduler_block_size, hash_block_size
    )
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    vllm_config.cache_config.hash_block_size = hash_block_size
    vllm_config.cache_config.cache_hit_alignment_tokens = config.cache_hit_alignment_tokens
    return config
