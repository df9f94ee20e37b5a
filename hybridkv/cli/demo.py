"""``hybridkv demo``: a tiny hybrid model run cold, warm and after an engine restart.

The CLI process builds the model, prints progress and the table; each engine
session runs in a spawned child process (vLLM in-process there, its log in
``<cache-dir>/demo-engine.log``) and sends stage lines and per-run reports
back over a pipe. Session one runs cold (stores) and warm (vLLM's prefix
cache reset, so hits come from our tiers); session two is a new process whose
CPU tier is empty, so its hits come from the disk tier. Exit status 1 when a
run's outputs differ from the cold run or a warm run loaded nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridkv.cli.demo_report import RunReport, format_table, report_rows, verdict
from hybridkv.tools.models import (
    TinyModel,
    TinyModelKind,
    build_tiny_model,
    default_prompt_token_ids,
)

DEFAULT_CACHE_DIR = Path(".hybridkv-cache")
ENGINE_LOG = "demo-engine.log"
MODELS_SUBDIR = "models"
SESSIONS = (("cold", "warm"), ("restart",))
"""Runs per engine session; each session is a new process."""
TOP_LOGPROBS = 5


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    model: TinyModelKind
    cache_dir: Path
    keep_cache: bool = False
    num_prompts: int = 4
    prefix_tokens: int = 352
    suffix_tokens: int = 40
    max_tokens: int = 16
    verbose: bool = False


def configure_parser(parser: argparse.ArgumentParser) -> None:
    kinds = [k.value for k in TinyModelKind]
    parser.add_argument("--model", default="gemma3", choices=kinds, help="tiny model to build")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help=f"where the disk tier and the tiny model live (default {DEFAULT_CACHE_DIR})",
    )
    parser.add_argument(
        "--keep-cache", action="store_true", help="keep KV stored by earlier demo runs"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the reports here")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        model=TinyModelKind(args.model),
        cache_dir=Path(args.cache_dir).expanduser().resolve(),
        keep_cache=bool(args.keep_cache),
        verbose=bool(getattr(args, "verbose", False)),
    )


def demo_prompts(config: DemoConfig, vocab_size: int) -> list[list[int]]:
    """One shared prefix (a document) followed by a different question per prompt."""
    prefix = default_prompt_token_ids(config.prefix_tokens, vocab_size=vocab_size, seed=7)
    return [
        prefix + default_prompt_token_ids(config.suffix_tokens, vocab_size=vocab_size, seed=8 + i)
        for i in range(config.num_prompts)
    ]


def stage(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    stage(f"building tiny model {config.model.value} (random weights, local)...")
    if not config.keep_cache:
        clear_stored_kv(config.cache_dir)
    model = build_tiny_model(config.model, config.cache_dir / MODELS_SUBDIR)
    groups = ", ".join(
        f"{i}: {g.kind.value} x{len(g.layer_names)}" for i, g in enumerate(model.groups)
    )
    stage(f"model at {model.path}; KV cache groups {groups}")
    reports: list[RunReport] = []
    for runs in SESSIONS:
        session = run_session(config, model, runs)
        if session is None:
            return 1
        reports += session
    exact = model.dtype == "float32"
    print(format_table(report_rows(reports, model.groups, exact=exact)), flush=True)
    if all(r.group_blocks is None for r in reports):
        print("* per group: from each request's hit and its group's kind", flush=True)
    problems = verdict(reports, exact=exact)
    if args.json is not None:
        Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=1))
    for problem in problems:
        print(f"[demo] FAILED: {problem}", file=sys.stderr, flush=True)
    if not problems:
        stage("outputs of every run match the cold run; warm and restart runs loaded from tiers")
    return 1 if problems else 0


def clear_stored_kv(cache_dir: Path) -> None:
    """Remove what earlier demo runs stored; the tiny model is kept (it is cached by digest)."""
    from hybridkv.connector.config import DISK_SUBDIR

    shutil.rmtree(cache_dir / DISK_SUBDIR, ignore_errors=True)
    (cache_dir / ENGINE_LOG).unlink(missing_ok=True)


def run_session(
    config: DemoConfig, model: TinyModel, runs: Sequence[str]
) -> list[RunReport] | None:
    """Run ``runs`` in one new engine process; None (after saying why) when it fails."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    spec = {
        "engine_kwargs": model.engine_kwargs(),
        "cache_dir": str(config.cache_dir),
        "prompts": demo_prompts(config, model.vocab_size),
        "max_tokens": config.max_tokens,
        "runs": list(runs),
        "log_path": None if config.verbose else str(config.cache_dir / ENGINE_LOG),
    }
    process = context.Process(target=_session_main, args=(spec, sender), name="hybridkv-demo")
    process.start()
    sender.close()
    reports: list[RunReport] = []
    error = None
    while True:
        try:
            kind, payload = receiver.recv()
        except EOFError:
            break
        if kind == "stage":
            stage(payload)
        elif kind == "report":
            reports.append(RunReport(**payload))
        elif kind == "error":
            error = payload
    process.join()
    if error is None and process.exitcode == 0 and len(reports) == len(runs):
        return reports
    log = "" if config.verbose else f"; engine log: {config.cache_dir / ENGINE_LOG}"
    print(f"[demo] engine session {list(runs)} failed{log}", file=sys.stderr, flush=True)
    if error:
        print(error, file=sys.stderr, flush=True)
    return None


def _session_main(spec: dict[str, Any], conn: Any) -> None:
    """Child process: one engine, the runs of ``spec``, a report per run."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec["log_path"]:
        log_fd = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
    try:
        conn.send(("stage", "starting engine (about 20 s)..."))
        start = time.perf_counter()
        llm = _make_llm(spec)
        conn.send(("stage", f"engine ready in {time.perf_counter() - start:.1f} s"))
        _warm_up(llm)
        for index, name in enumerate(spec["runs"]):
            if index:
                llm.reset_prefix_cache()  # hits must now come from our tiers
            conn.send(("stage", f"{name} run: {len(spec['prompts'])} prompts..."))
            conn.send(("report", asdict(_run_once(llm, name, spec))))
        llm.llm_engine.engine_core.shutdown()  # flushes stores still in flight
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _sampling_params(*, max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=TOP_LOGPROBS,
    )


def _warm_up(llm: Any) -> None:
    """One short request, so the first measured run does not pay one-off costs.

    Shorter than a block: nothing is stored, nothing can hit. It asks for
    log-probabilities like the runs do: their first use costs about 1.5 s.
    """
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(range(3, 19)))
    llm.generate([prompt], _sampling_params(max_tokens=2), use_tqdm=False)


def _make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"cache_dir": spec["cache_dir"]},
    )
    return LLM(**spec["engine_kwargs"], kv_transfer_config=transfer, disable_log_stats=False)


def _run_once(llm: Any, name: str, spec: dict[str, Any]) -> RunReport:
    from vllm.inputs import TokensPrompt

    params = _sampling_params(max_tokens=spec["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    before = read_counters(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    delta = {k: v - before.get(k, 0.0) for k, v in read_counters(llm).items()}
    ttft_count = delta.get("vllm:time_to_first_token_seconds.count", 0.0)
    ttft_sum = delta.get("vllm:time_to_first_token_seconds.sum", 0.0)
    return RunReport(
        name=name,
        num_prompt_tokens=sum(len(ids) for ids in spec["prompts"]),
        num_cached_tokens=sum(int(o.num_cached_tokens or 0) for o in outputs),
        num_external_tokens=int(delta.get("vllm:external_prefix_cache_hits", 0.0)),
        loaded_blocks=int(_summed(delta, "hybridkv_loaded_blocks")),
        load_bytes=int(_summed(delta, "hybridkv_loaded_bytes")),
        store_bytes=int(_summed(delta, "hybridkv_stored_bytes")),
        ttft_s=ttft_sum / ttft_count if ttft_count else 0.0,
        output_token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        top_logprobs=[
            [
                {str(t): float(lp.logprob) for t, lp in pos.items()}
                for pos in o.outputs[0].logprobs or []
            ]
            for o in outputs
        ],
        cached_tokens_per_request=[int(o.num_cached_tokens or 0) for o in outputs],
        group_blocks=_group_values(delta, "hybridkv_loaded_blocks"),
        tier_get_bytes={
            k.split("tier=")[1].rstrip("}"): int(v)
            for k, v in delta.items()
            if k.startswith("hybridkv_tier_read_bytes{") and v
        },
    )


def read_counters(llm: Any) -> dict[str, float]:
    """vLLM's counters and TTFT histogram, and the connector's Prometheus counters.

    The connector's metrics are not ``vllm:`` names, which ``llm.get_metrics()``
    leaves out; they are read from this process's registry.
    """
    from prometheus_client import REGISTRY

    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if hasattr(metric, "value") and isinstance(metric.value, (int, float)):
            values[metric.name] = values.get(metric.name, 0.0) + float(metric.value)
        elif metric.name == "vllm:time_to_first_token_seconds":
            for part in ("count", "sum"):
                key = f"{metric.name}.{part}"
                values[key] = values.get(key, 0.0) + float(getattr(metric, part))
    for family in REGISTRY.collect():
        if not family.name.startswith("hybridkv"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                labels = {k: v for k, v in sample.labels.items() if k in ("tier", "group")}
                suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                key = sample.name.removesuffix("_total") + (f"{{{suffix}}}" if suffix else "")
                values[key] = values.get(key, 0.0) + float(sample.value)
    return values


def _summed(delta: dict[str, float], name: str) -> float:
    return sum(v for k, v in delta.items() if k == name or k.startswith(name + "{"))


def _group_values(delta: dict[str, float], name: str) -> list[int] | None:
    found = {
        int(k.split("group=")[1].split(",")[0].rstrip("}")): int(v)
        for k, v in delta.items()
        if k.startswith(name + "{") and "group=" in k
    }
    return [found.get(g, 0) for g in range(max(found) + 1)] if found else None
