"""Which model the bench and the demo run, and the engine settings a workload needs.

CLI process. Models are built locally (random weights): the real models'
shapes, or the tiny test models (``tiny-<kind>``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.cli.bench.workloads import Workload
from hybridkv.tools.models import (
    LocalModel,
    ShapeKind,
    TinyModelKind,
    build_shape_model,
    build_tiny_model,
)

TINY_PREFIX = "tiny-"
MODELS = [k.value for k in ShapeKind] + [TINY_PREFIX + k.value for k in TinyModelKind]
MAX_MODEL_LEN_STEP = 256


def build_model(name: str, models_dir: Path, say: Callable[[str], None]) -> LocalModel:
    """Build (or reuse) the model ``name`` (one of ``MODELS``) under ``models_dir``."""
    say(f"building {name} (random weights, built here; reused when built before)...")
    if name.startswith(TINY_PREFIX):
        return build_tiny_model(TinyModelKind(name.removeprefix(TINY_PREFIX)), models_dir)
    return build_shape_model(ShapeKind(name), models_dir, progress=say)


def engine_kwargs_for(model: LocalModel, workload: Workload) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``workload`` on ``model``: its KV cache memory
    and prefill chunk, ``max_model_len`` just above its longest request, prompts as ids."""
    longest, params = workload.longest_sequence, workload.params
    if longest > model.max_model_len:
        raise ValueError(
            f"the workload's longest request needs {longest} tokens; this model takes "
            f"{model.max_model_len}: use shorter documents, fewer rounds or shorter answers"
        )
    step = MAX_MODEL_LEN_STEP
    kwargs = model.engine_kwargs(kv_cache_memory_bytes=params.kv_cache_mib << 20)
    kwargs.update(
        max_model_len=min(-(-longest // step) * step, model.max_model_len),
        max_num_batched_tokens=params.max_num_batched_tokens,
        max_num_seqs=max(16, params.clients),
        skip_tokenizer_init=True,  # prompts are token ids
    )
    return kwargs
