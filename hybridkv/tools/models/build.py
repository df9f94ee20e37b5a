"""Writing random-weight Hugging Face checkpoints and a tiny tokenizer, locally.

Runs in the calling process; torch, transformers and tokenizers are imported
inside the functions that need them. Nothing is downloaded. A built model
gets a marker file holding its recipe's digest, so a second build of the same
recipe returns at once; building writes into a temporary sibling and renames
it, so a crashed build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.groups import GroupKind

MARKER = "hybridkv-model.json"
VOCAB_SIZE = 512
"""The tokenizer's vocabulary (recipes with a larger vocabulary pass token ids)."""
SPECIAL_TOKEN_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
"""The ids of the tokenizer's <pad>, <eos> and <bos>, for every recipe's config."""
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


@dataclass(frozen=True, kw_only=True)
class GroupShape:
    """The parts of a KV cache group that do not depend on the machine."""

    kind: GroupKind
    layer_names: tuple[str, ...]
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class LocalModel:
    """A model built here, and the engine settings it is meant to run with."""

    path: Path
    seed: int
    dtype: str
    block_size: int
    """The block size asked of the engine (it may choose larger for Mamba models)."""
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    groups: tuple[GroupShape, ...]
    """The KV cache groups vLLM makes for this model, in vLLM's order."""

    def engine_kwargs(self, *, kv_cache_memory_bytes: int = 64 << 20) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` (and the server's flags).

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
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A random-weight checkpoint: a Hugging Face config and the dtype to save it in."""

    dtype: str
    hf_config: dict[str, Any]
    scale_state: bool = False
    """Rescale linear-attention and attention weights so every cache group matters."""


def recipe_digest(recipe: Recipe, seed: int, version: int) -> str:
    body = {"version": version, "seed": seed, "dtype": recipe.dtype, **recipe.hf_config}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def build_checkpoint(
    recipe: Recipe,
    path: Path,
    *,
    seed: int,
    version: int,
    progress: Callable[[str], None] | None = None,
) -> bool:
    """Write ``recipe``'s checkpoint and tokenizer to ``path`` unless it is there already.

    Returns True when it built the model, False when an identical one was found.
    """
    digest = recipe_digest(recipe, seed, version)
    if _marker_digest(path) == digest:
        return False
    if progress is not None:
        progress(f"building {path.name} (random weights, {recipe.dtype})")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_checkpoint(recipe, seed, staging)
        _write_tokenizer(staging)
        (staging / MARKER).write_text(json.dumps({"digest": digest}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return True


def default_prompt_token_ids(
    num_tokens: int, *, vocab_size: int = VOCAB_SIZE, seed: int = 0
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


def _marker_digest(path: Path) -> str | None:
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    digest = data.get("digest") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) else None


_MODEL_CLASSES = {
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
"""transformers' config and model classes (by name: transformers is imported lazily)
for each ``model_type`` a recipe may name."""


def _write_checkpoint(recipe: Recipe, seed: int, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    raw = dict(recipe.hf_config)
    model_type = raw.pop("model_type")
    if model_type not in _MODEL_CLASSES:
        raise ValueError(
            f"model_type={model_type!r} cannot be built; use one of {sorted(_MODEL_CLASSES)}"
        )
    config_name, model_name = _MODEL_CLASSES[model_type]
    config = getattr(transformers, config_name)(**raw)
    model = getattr(transformers, model_name)(config)
    if recipe.scale_state:
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
        vocab_size=VOCAB_SIZE,
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
