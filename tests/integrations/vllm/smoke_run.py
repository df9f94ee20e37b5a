"""Run HybridKVConnector in real vLLM and print what happened as JSON (test helper).

``python -m tests.integrations.vllm.smoke_run MODEL_DIR KIND:PHASE,PHASE... ...``: one
engine per ``KIND``, one after another, each running its phases in order:
``cold`` (generate), ``warm`` (reset vLLM's prefix cache, zero every KV block
when the engine is in this process, generate again). The connector config is
``$HYBRIDKV_SMOKE_EXTRA`` (JSON, default ``{}``: the embedded default). Prints
one JSON line per phase; asserts nothing.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from hybridkv.tools.models import TinyModelKind, build_tiny_model, default_prompt_token_ids

PROMPT_TOKENS = 150
MAX_TOKENS = 8


def main(argv: list[str]) -> int:
    model_dir = Path(argv[0])
    for item in argv[1:]:
        kind, _, phases = item.partition(":")
        run_engine(TinyModelKind(kind), model_dir, phases.split(","))
        gc.collect()
    return 0


def run_engine(kind: TinyModelKind, model_dir: Path, phases: list[str]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model = build_tiny_model(kind, model_dir)
    extra = json.loads(os.environ.get("HYBRIDKV_SMOKE_EXTRA", "{}"))
    llm = LLM(
        **model.engine_kwargs(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    prompt = default_prompt_token_ids(PROMPT_TOKENS, vocab_size=model.vocab_size, seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for phase in phases:
        wiped = 0
        if phase == "warm":
            llm.reset_prefix_cache()
            wiped = _wipe(llm)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        record: dict[str, Any] = {
            "phase": phase,
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": int(out.num_cached_tokens or 0),
            "wiped_bytes": wiped,
            "kind": kind.value,
        }
        print("SMOKE " + json.dumps(record), flush=True)
    llm.llm_engine.engine_core.shutdown()


def _wipe(llm: Any) -> int:
    """Zero the KV tensors of an in-process engine (so only a real load can be right)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        return 0
    runner = core.model_executor.driver_worker.worker.model_runner
    num_bytes = 0
    for layer in runner.compilation_config.static_forward_context.values():
        kv = getattr(layer, "kv_cache", None)
        for tensor in kv if isinstance(kv, list | tuple) else [kv]:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                tensor.zero_()
                num_bytes += tensor.numel() * tensor.element_size()
    return num_bytes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
