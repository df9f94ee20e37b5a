"""Tiny random-weight hybrid models, built locally for tests.

Runs in the calling process (pytest); nothing is downloaded: each model is a
random-weight checkpoint (``models.build``) beside a tiny byte-level BPE
tokenizer, cached per kind and seed.

KV cache groups vLLM 0.32 makes for each kind (CPU, hybrid allocator on,
``TinyModel.engine_kwargs()``, block size 32 asked for), checked against the
engine's ``kv_cache_config`` by ``tests/e2e/test_vllm_models.py``. Kinds,
layers and windows are the same everywhere; block and page sizes are the
engine's choice and differ between CPUs (read them from the engine):

* ``gemma3``: 4 layers, sliding (window 32) / full alternating, float32.
  Group 0 sliding window, layers 0, 2; group 1 full attention, layers 1, 3.
  Block 32, page 2 x 32 x 1 x 32 x 4 = 8 KiB per layer.
* ``gemma3-multi``: 6 layers S S F S S F. vLLM cuts the four sliding layers
  into groups as large as the full group: group 0 sliding layers 0, 3;
  group 1 sliding layers 1, 4 (same spec as group 0); group 2 full, layers
  2, 5.
* ``qwen3-next``: 2 layers, gated delta net then full attention, bfloat16.
  Group 0 Mamba, layer 0 (conv state (3, 384) + recurrent state
  (1, 128, 128), padded to the attention page); group 1 full attention,
  layer 1 (2 KV heads x 256). The state's dtypes and vLLM's attention block
  (grown until its page holds the state) depend on the CPU kernels: a
  bfloat16 state of 35072 bytes and block 32 (page 64 KiB) on one x86-64
  machine, a float32 recurrent state (67840 bytes) and block 64 (128 KiB)
  on an AMD Zen 4 with avx512_bf16.
* ``qwen3-next-multi``: 4 layers L L L F. Groups 0-2 Mamba, one linear
  layer each, equal specs; group 3 full attention, layer 3.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.groups import GroupKind
from hybridkv.tools.models.build import (
    SPECIAL_TOKEN_IDS,
    VOCAB_SIZE,
    GroupShape,
    LocalModel,
    Recipe,
    build_checkpoint,
)

_BUILD_VERSION = 5
"""Bump when a recipe changes: cached models of another version are rebuilt."""
_BLOCK_SIZE = 32
"""The smallest block size vLLM's CPU attention backend accepts."""


class TinyModelKind(enum.Enum):
    """Which tiny hybrid architecture to build (values are CLI names)."""

    GEMMA3 = "gemma3"
    """Sliding window + full attention: two KV cache groups."""
    GEMMA3_MULTI = "gemma3-multi"
    """Sliding window + full attention: three groups, two with equal specs."""
    QWEN3_NEXT = "qwen3-next"
    """Gated delta net (Mamba-style state) + full attention: two groups."""
    QWEN3_NEXT_MULTI = "qwen3-next-multi"
    """Gated delta net + full attention: three equal Mamba groups + one full."""


@dataclass(frozen=True, kw_only=True)
class TinyModel(LocalModel):
    """A built tiny model and the engine settings it is meant to run with."""

    kind: TinyModelKind

    @property
    def model_id(self) -> str:
        return f"tiny-{self.kind.value}-seed{self.seed}"


_COMMON_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    **SPECIAL_TOKEN_IDS,
}


@dataclass(frozen=True, kw_only=True)
class _TinyRecipe:
    recipe: Recipe
    max_model_len: int
    groups: tuple[GroupShape, ...]


def _attention_layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _linear_layer(i: int) -> str:
    return f"model.layers.{i}.linear_attn"


def _gemma3_recipe(layer_types: list[str], group_layers: list[list[int]]) -> _TinyRecipe:
    num_kv_heads, head_dim, window = 1, 32, 32
    groups = []
    for layer_ids in group_layers:
        sliding = layer_types[layer_ids[0]] == "sliding_attention"
        groups.append(
            GroupShape(
                kind=GroupKind.SLIDING_WINDOW if sliding else GroupKind.FULL,
                layer_names=tuple(_attention_layer(i) for i in layer_ids),
                sliding_window=window if sliding else None,
            )
        )
    hf_config = {
        **_COMMON_CONFIG,
        "model_type": "gemma3_text",
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 2,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": window,
        "layer_types": layer_types,
    }
    recipe = Recipe(dtype="float32", hf_config=hf_config)
    return _TinyRecipe(recipe=recipe, max_model_len=512, groups=tuple(groups))


def _qwen3_next_recipe(layer_types: list[str]) -> _TinyRecipe:
    num_kv_heads, head_dim = 2, 256
    linear_ids = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
    full_ids = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    groups = [GroupShape(kind=GroupKind.MAMBA, layer_names=(_linear_layer(i),)) for i in linear_ids]
    groups.append(
        GroupShape(kind=GroupKind.FULL, layer_names=tuple(_attention_layer(i) for i in full_ids))
    )
    hf_config = {
        **_COMMON_CONFIG,
        "model_type": "qwen3_next",
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 2,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        # Head dims of 128 are what vLLM's CPU gated-delta-net kernel accepts.
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        # vLLM's Qwen3-Next needs MoE layers; keep them as small as it allows.
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "tie_word_embeddings": False,
    }
    recipe = Recipe(dtype="bfloat16", hf_config=hf_config, scale_state=True)
    return _TinyRecipe(recipe=recipe, max_model_len=512, groups=tuple(groups))


def _recipe(kind: TinyModelKind) -> _TinyRecipe:
    sliding, full, linear = "sliding_attention", "full_attention", "linear_attention"
    if kind is TinyModelKind.GEMMA3:
        return _gemma3_recipe([sliding, full, sliding, full], [[0, 2], [1, 3]])
    if kind is TinyModelKind.GEMMA3_MULTI:
        # vLLM cuts the four sliding layers into groups as large as the full group.
        return _gemma3_recipe([sliding, sliding, full] * 2, [[0, 3], [1, 4], [2, 5]])
    if kind is TinyModelKind.QWEN3_NEXT:
        return _qwen3_next_recipe([linear, full])
    if kind is TinyModelKind.QWEN3_NEXT_MULTI:
        return _qwen3_next_recipe([linear, linear, linear, full])
    raise AssertionError(f"no recipe for {kind}")


def build_tiny_model(kind: TinyModelKind, out_dir: Path, *, seed: int = 0) -> TinyModel:
    """Build (or reuse) a tiny random-weight model of ``kind`` under ``out_dir``.

    The model lands in ``out_dir/<kind>-seed<seed>``; a marker file holding
    the recipe digest makes a second call with the same arguments return at
    once. Building writes into a temporary sibling and renames it, so a
    crashed build never leaves a half-written model behind.
    """
    if not isinstance(kind, TinyModelKind):
        allowed = [k.value for k in TinyModelKind]
        raise ValueError(f"kind={kind!r} is not a TinyModelKind; use one of {allowed}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    tiny = _recipe(kind)
    path = Path(out_dir) / f"{kind.value}-seed{seed}"
    build_checkpoint(tiny.recipe, path, seed=seed, version=_BUILD_VERSION)
    return TinyModel(
        kind=kind,
        path=path,
        seed=seed,
        dtype=tiny.recipe.dtype,
        block_size=_BLOCK_SIZE,
        max_model_len=tiny.max_model_len,
        max_num_batched_tokens=4 * tiny.max_model_len,
        vocab_size=VOCAB_SIZE,
        groups=tiny.groups,
    )
