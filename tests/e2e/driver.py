"""Run a plan of vLLM engine steps in this process and record what happened.

Usage: ``python -m tests.e2e.driver PLAN.json RESULTS.jsonl``. The plan lists
engines, created one after another in this process (in-process engine core,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``engine_kwargs`` override the tiny
model's engine settings; ``kv_events``: vLLM's ``KVEventsConfig`` fields), each
with steps: ``groups``, ``generate``,
``next_turn`` (prompts that continue an earlier step's conversations, in this
or an earlier engine), ``reset``, ``zero_group``, ``integrity``, ``tier_blocks``
(which tiers hold each block of an earlier step's prompts and outputs),
``valkey_command`` (one command to a valkey-server on loopback), ``await``
(hand over to the test, which injects a fault, then go on), ``native`` (the
numba functions compiled so far), ``exit`` (end the process without shutting
the engine down); between
engines, ``corrupt_files`` and ``swap_dirs``. Every step
appends one JSON line to RESULTS (outputs, cached tokens, metric deltas,
connector stats, seconds), so a crash still leaves the steps before it. The
tests assert on the records; this script asserts nothing.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hybridkv.tools.models import TinyModelKind, build_tiny_model
from tests.e2e import engine_tools
from tests.support.corrupt import corrupt_files

CONNECTOR_CLASS = "HybridKVConnector"
CONNECTOR_MODULE = "hybridkv.vllm"
TOP_LOGPROBS = 5


def make_llm(engine: dict[str, Any]) -> Any:
    """The engine of a plan entry: on the tiny model ``engine["kind"]``, or on the real
    model's shape ``engine["shape"]`` (a ``ShapeKind`` value) when given."""
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    from hybridkv.tools.models import ShapeKind, build_shape_model

    model_dir, seed = Path(engine["model_dir"]), engine.get("seed", 0)
    if "shape" in engine:
        shape = build_shape_model(ShapeKind(engine["shape"]), model_dir, seed=seed)
        # Prompts are ids: the tokenizer beside a shape knows 512 of its 32768 ids.
        kwargs = {**shape.engine_kwargs(), "skip_tokenizer_init": True}
    else:
        tiny = build_tiny_model(TinyModelKind(engine["kind"]), model_dir, seed=seed)
        kwargs = tiny.engine_kwargs()
    kwargs.update(engine.get("engine_kwargs", {}))
    kwargs["disable_log_stats"] = False
    if "kv_events" in engine:
        kwargs["kv_events_config"] = KVEventsConfig(**engine["kv_events"])
    extra = engine.get("connector")
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    return LLM(**kwargs)


def generate(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=step["max_tokens"],
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=TOP_LOGPROBS,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in step["prompts"]]
    metrics_before = engine_tools.metric_totals(llm)
    stats_before = engine_tools.connector_stats(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "top_logprobs": [_top_logprobs(o.outputs[0].logprobs) for o in outputs],
        "num_prompt_tokens": [len(o.prompt_token_ids or []) for o in outputs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outputs],
        "prompts": [list(o.prompt_token_ids or []) for o in outputs],
        "metrics": engine_tools.metric_delta(metrics_before, engine_tools.metric_totals(llm)),
        "connector": engine_tools.stats_delta(stats_before, engine_tools.connector_stats(llm)),
        "seconds": seconds,
    }


def _top_logprobs(positions: Any) -> list[dict[str, float]]:
    """Per generated position: the top tokens' log-probabilities (plus the chosen one)."""
    return [{str(t): float(lp.logprob) for t, lp in pos.items()} for pos in positions or []]


def next_turn(step: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """A ``generate`` step whose prompts continue a conversation: each prompt of the
    earlier turn, then what the engine answered to it, then the new question."""
    prompts = [
        [*prompt, *answer, *question]
        for prompt, answer, question in zip(
            earlier["prompts"], earlier["output_token_ids"], step["questions"], strict=True
        )
    ]
    return {**step, "op": "generate", "prompts": prompts}


def run_step(llm: Any, step: dict[str, Any], done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    op = step["op"]
    if op == "next_turn":
        return generate(llm, next_turn(step, done[step["after"]]))
    if op == "groups":
        return engine_tools.kv_cache_facts(llm)
    if op == "generate":
        return generate(llm, step)
    if op == "reset":
        ok = llm.reset_prefix_cache()
        return {"reset_ok": bool(ok), "wiped_bytes": engine_tools.wipe_kv_cache(llm)}
    if op == "settle":
        return engine_tools.settle_connector(llm)
    if op == "integrity":  # after the write-backs, so nothing is in flight
        settled = engine_tools.settle_connector(llm)
        return {**settled, "integrity": engine_tools.check_connector_integrity(llm)}
    if op == "valkey_command":
        return {"reply": valkey_command(step["port"], step["args"])}
    if op == "sleep":  # wall time passing between steps (a link's TCP retries, say)
        time.sleep(step["seconds"])
        return {"slept_s": step["seconds"]}
    if op == "tier_blocks":
        earlier = done[step["after"]]
        sequences = [
            [*prompt, *output]
            for prompt, output in zip(earlier["prompts"], earlier["output_token_ids"], strict=True)
        ]
        return engine_tools.tier_blocks(llm, sequences)
    if op == "zero_group":
        return {"num_blocks_zeroed": engine_tools.zero_cached_blocks(llm, step["group_id"])}
    if op == "await":
        return await_test(step)
    if op == "native":
        return {"signatures": engine_tools.native_signatures()}
    if op == "exit":
        end_process(step["how"])
    raise ValueError(f"unknown engine step op {op!r}")


def end_process(how: str) -> None:
    """End the process here, the engine never shut down: ``return`` as a script whose
    main returns (the interpreter exits, its ``atexit`` hooks run), ``sigterm`` as one
    told to stop by its supervisor."""
    if how == "return":
        raise SystemExit(0)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(600)  # the signal ends the process before this does
    raise ValueError(f"exit how={how!r}: 'return' or 'sigterm'")


def valkey_command(port: int, args: list[str]) -> str:
    """Send one command to the valkey-server on 127.0.0.1:``port``; its first reply line."""
    import socket

    request = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request.encode())
        return conn.recv(4096).decode().split("\r\n", 1)[0]


def await_test(step: dict[str, Any]) -> dict[str, Any]:
    """Write ``<dir>/<name>.ready`` (holding this pid), then wait for ``<dir>/<name>.go``
    (JSON: what the test did meanwhile, e.g. injected a fault into a tier; the test
    renames it into place whole)."""
    sync_dir, name = Path(step["dir"]), step["name"]
    ready = sync_dir / f"{name}.ready"
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").replace(ready)
    go = sync_dir / f"{name}.go"
    start = time.perf_counter()
    while not go.exists():
        if time.perf_counter() - start > step.get("timeout_s", 300):
            raise TimeoutError(f"no {go} after {step.get('timeout_s', 300)} s")
        time.sleep(0.01)
    return {"waited_s": time.perf_counter() - start, "test": json.loads(go.read_text())}


def swap_dirs(spec: dict[str, Any]) -> dict[str, Any]:
    """Exchange two directories (two tensor-parallel ranks' disk tiers, say)."""
    a, b = Path(spec["a"]), Path(spec["b"])
    parked = a.with_name(a.name + ".swap")
    a.rename(parked)
    b.rename(a)
    parked.rename(b)
    return {"swapped": [str(a), str(b)]}


def run_plan(plan: dict[str, Any], results_path: Path) -> None:
    done: dict[str, dict[str, Any]] = {}
    """Labelled steps of every engine so far (a later engine may continue them)."""
    with results_path.open("a") as results:

        def record(entry: dict[str, Any]) -> None:
            results.write(json.dumps(entry) + "\n")
            results.flush()

        for engine in plan["engines"]:
            if engine.get("op") == "corrupt_files":
                record({"engine": None, "op": "corrupt_files", **corrupt_files(engine)})
                continue
            if engine.get("op") == "swap_dirs":
                record({"engine": None, "op": "swap_dirs", **swap_dirs(engine)})
                continue
            start = time.perf_counter()
            llm = make_llm(engine)
            record(
                {"engine": engine["label"], "op": "start", "seconds": time.perf_counter() - start}
            )
            for step in engine["steps"]:
                entry = {"engine": engine["label"], "op": step["op"], "label": step.get("label")}
                result = run_step(llm, step, done)
                if step.get("label"):
                    done[step["label"]] = {**step, **result}
                record({**entry, **result})
            start = time.perf_counter()
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            record(
                {"engine": engine["label"], "op": "stop", "seconds": time.perf_counter() - start}
            )


def main(argv: list[str]) -> int:
    # Scheduler and worker in this process: the tools reach both.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    plan_path, results_path = Path(argv[0]), Path(argv[1])
    plan = json.loads(plan_path.read_text())
    try:
        run_plan(plan, results_path)
    except Exception:
        with results_path.open("a") as results:
            results.write(json.dumps({"op": "error", "traceback": traceback.format_exc()}) + "\n")
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
