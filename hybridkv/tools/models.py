"""Tiny random-weight hybrid models, built locally for tests and the demo.

Runs in the calling process (pytest, ``hybridkv demo``); torch, transformers
and tokenizers are imported inside :func:`build_tiny_model` only. Nothing is
downloaded: each model is a random-weight checkpoint written with
``save_pretrained`` beside a tiny byte-level BPE tokenizer, cached per kind
and seed.

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
  (1, 128, 128) = 35072 bytes, padded to the attention page); group 1 full
  attention, layer 1 (2 KV heads x 256). vLLM grows the attention block
  until its page holds the Mamba state, and by how much depends on the CPU
  kernels: 32 (page 64 KiB) on one x86-64 machine, 64 (128 KiB) on an AMD
  Zen 4 with avx512_bf16.
* ``qwen3-next-multi``: 4 layers L L L F. Groups 0-2 Mamba, one linear
  layer each, equal specs; group 3 full attention, layer 3.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.spec import GroupKind

__all__ = [
    "LOGPROB_TOLERANCE",
    "GroupShape",
    "TinyModel",
    "TinyModelKind",
    "build_tiny_model",
    "default_prompt_token_ids",
    "greedy_mismatch",
]

_BUILD_VERSION = 5
"""Bump when a recipe changes: cached models of another version are rebuilt."""

_MARKER = "hybridkv-tiny-model.json"
_VOCAB_SIZE = 512
_BLOCK_SIZE = 32
"""The smallest block size vLLM's CPU attention backend accepts."""
_LINEAR_WEIGHT_SCALE = 8.0
"""Scale of the linear-attention input projections. Random weights barely
move the output; scaled up, a wrong recurrent state changes greedy tokens,
which is what tests need to see."""
_LINEAR_OUT_SCALE = 0.25
"""Scale of the linear-attention output projection, so that the scaled-up
branch does not drown the full-attention layers (both must matter)."""
_ATTENTION_SHARPNESS = 4.0
"""Multiplier of the full-attention q and k norms in the Qwen3-Next models
(attention logits x16): random attention is nearly uniform and averages the
values away; sharp attention reads a few past tokens, so their KV matters."""
_ATTENTION_OUT_SCALE = 4.0
"""Scale of the full-attention output projection, so that it is not drowned
by the scaled-up linear branch."""
_LINEAR_DECAY_RANGE = (0.005, 0.02)
"""Per-token decay rates (``A``) of the linear-attention state: random init
draws rates up to 16, which forget a prefix within a few tokens."""


LOGPROB_TOLERANCE = 0.2
"""Nats. vLLM on CPU is not batch invariant: batched differently (which a
connector's asynchronous loads always cause), a request's bfloat16
log-probabilities moved by up to 0.034 and near-ties flipped at gaps up to
0.064 (measured, Qwen3-Next kinds, no connector). A wrong KV block moves the
chosen token out of the top five in most requests."""


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
class GroupShape:
    """The parts of a KV cache group that do not depend on the machine."""

    kind: GroupKind
    layer_names: tuple[str, ...]
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class TinyModel:
    """A built tiny model and the engine settings it is meant to run with."""

    kind: TinyModelKind
    path: Path
    seed: int
    dtype: str
    block_size: int
    """The block size asked of the engine (it may choose larger, see the module doc)."""
    max_model_len: int
    vocab_size: int
    groups: tuple[GroupShape, ...]
    """The KV cache groups vLLM makes for this model, in vLLM's order."""

    @property
    def model_id(self) -> str:
        return f"tiny-{self.kind.value}-seed{self.seed}"

    def engine_kwargs(self, *, kv_cache_memory_bytes: int = 64 << 20) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` that keep an engine small and fast.

        Prefix caching stays on (a hybrid allocator needs it for hits), the
        KV cache size is explicit (no memory profiling run), eager mode.
        """
        return {
            "model": str(self.path),
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 4 * self.max_model_len,
        }


def default_prompt_token_ids(
    num_tokens: int, *, vocab_size: int = _VOCAB_SIZE, seed: int = 0
) -> list[int]:
    """A deterministic prompt of ``num_tokens`` ids in ``[3, vocab_size)``.

    Ids 0..2 are the tokenizer's special tokens and are left out.
    """
    problems = []
    if num_tokens < 0:
        problems.append(f"num_tokens={num_tokens} must be >= 0")
    if vocab_size <= 3:
        problems.append(f"vocab_size={vocab_size} must be > 3 (ids 0..2 are special tokens)")
    if problems:
        raise ValueError("; ".join(problems))
    digest = b""
    counter = 0
    while len(digest) < 2 * num_tokens:
        digest += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    span = vocab_size - 3
    return [
        3 + int.from_bytes(digest[2 * i : 2 * i + 2], "little") % span for i in range(num_tokens)
    ]


def greedy_mismatch(
    want_ids: Sequence[int],
    want_lps: Sequence[dict[str, float]],
    got_ids: Sequence[int],
    got_lps: Sequence[dict[str, float]],
    *,
    exact: bool,
    tolerance: float = LOGPROB_TOLERANCE,
) -> str | None:
    """Why greedy output ``got`` does not match ``want``; None when it does.

    ``exact`` (float32 models): the tokens must be equal. Otherwise the chosen
    tokens' log-probabilities must stay within ``tolerance`` and the first
    token that differs, if any, must be a near-tie in both runs; after it the
    contexts differ and nothing more is compared.
    """
    if exact or len(got_ids) != len(want_ids):
        return None if list(got_ids) == list(want_ids) else f"tokens {got_ids} != {want_ids}"
    for pos, (want, got) in enumerate(zip(want_ids, got_ids, strict=True)):
        want_top, got_top = want_lps[pos], got_lps[pos]
        if want == got:
            drift = abs(want_top[str(want)] - got_top[str(got)])
            if drift > tolerance:
                return f"position {pos}: token {got} log-probability moved by {drift:.3f}"
            continue
        for side, top, chosen, other in (
            ("reference", want_top, want, got),
            ("run", got_top, got, want),
        ):
            if str(other) not in top:
                return f"position {pos}: {got} != {want}; {other} not in the {side}'s top tokens"
            gap = top[str(chosen)] - top[str(other)]
            if gap > tolerance:
                return (
                    f"position {pos}: {got} != {want}; the {side} preferred {chosen} by {gap:.3f}"
                )
        return None
    return None


_COMMON_CONFIG: dict[str, Any] = {
    "vocab_size": _VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


@dataclass(frozen=True, kw_only=True)
class _Recipe:
    dtype: str
    max_model_len: int
    groups: tuple[GroupShape, ...]
    hf_config: dict[str, Any]


def _attention_layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _linear_layer(i: int) -> str:
    return f"model.layers.{i}.linear_attn"


def _gemma3_recipe(layer_types: list[str], group_layers: list[list[int]]) -> _Recipe:
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
    return _Recipe(dtype="float32", max_model_len=512, groups=tuple(groups), hf_config=hf_config)


def _qwen3_next_recipe(layer_types: list[str]) -> _Recipe:
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
    return _Recipe(dtype="bfloat16", max_model_len=512, groups=tuple(groups), hf_config=hf_config)


def _recipe(kind: TinyModelKind) -> _Recipe:
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


def _recipe_digest(kind: TinyModelKind, recipe: _Recipe, seed: int) -> str:
    body = {
        "version": _BUILD_VERSION,
        "kind": kind.value,
        "seed": seed,
        "dtype": recipe.dtype,
        **recipe.hf_config,
    }
    text = json.dumps(body, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    recipe = _recipe(kind)
    digest = _recipe_digest(kind, recipe, seed)
    path = Path(out_dir) / f"{kind.value}-seed{seed}"
    model = TinyModel(
        kind=kind,
        path=path,
        seed=seed,
        dtype=recipe.dtype,
        block_size=_BLOCK_SIZE,
        max_model_len=recipe.max_model_len,
        vocab_size=_VOCAB_SIZE,
        groups=recipe.groups,
    )
    if _marker_digest(path) == digest:
        return model
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_checkpoint(recipe, seed, staging)
        _write_tokenizer(staging)
        (staging / _MARKER).write_text(json.dumps({"digest": digest, "kind": kind.value}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model


def _marker_digest(path: Path) -> str | None:
    try:
        data = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    digest = data.get("digest") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) else None


def _write_checkpoint(recipe: _Recipe, seed: int, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    raw = dict(recipe.hf_config)
    model_type = raw.pop("model_type")
    if model_type == "gemma3_text":
        config = transformers.Gemma3TextConfig(**raw)
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.Qwen3NextConfig(**raw)
        model = transformers.Qwen3NextForCausalLM(config)
        _scale_for_state_sensitivity(model)
    dtype = getattr(torch, recipe.dtype)
    model = model.to(dtype)
    model.config.dtype = recipe.dtype
    hf_logging = transformers.utils.logging
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _scale_for_state_sensitivity(model: Any) -> None:
    """Make every group's cache matter: the recurrent state and the attention KV.

    Measured on vLLM (``tests/e2e/test_vllm_models.py``): with these values,
    zeroing the cached blocks of any one group, linear or full, moves the
    greedy tokens' log-probabilities far beyond bfloat16 noise.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".linear_attn." in name and param.dim() == 2:
                out = name.endswith("out_proj.weight")
                param.mul_(_LINEAR_OUT_SCALE if out else _LINEAR_WEIGHT_SCALE)
            elif ".linear_attn." in name and name.endswith(".A_log"):
                param.copy_(torch.empty_like(param).uniform_(*_LINEAR_DECAY_RANGE).log())
            elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                param.fill_(_ATTENTION_SHARPNESS - 1.0)  # zero-centred: scales by 1 + weight
            elif name.endswith("self_attn.o_proj.weight"):
                param.mul_(_ATTENTION_OUT_SCALE)


def _write_tokenizer(out: Path) -> None:
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers, trainers

    specials = ["<pad>", "<eos>", "<bos>"]
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
    )
    fast.save_pretrained(out)


_TRAINING_TEXT = [
    "Hybrid attention models keep a few layers with full attention and many with a "
    "sliding window or a recurrent state.",
    "The KV cache is split into groups; each group has its own block size and page size.",
    "Offloading moves blocks to CPU memory, to local disk and to a shared pool.",
    "A cache hit skips the prefill of a shared prefix and saves time to first token.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-'\"()",
] * 4
