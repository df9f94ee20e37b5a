"""``hybridkv demo``: long prompts on Gemma 3 270M's shape, cold, warm and after a restart.

CLI process. Builds the model locally (random weights, Gemma 3 270M's
layers: five sliding-window layers to one full-attention layer), then runs
the bench's ``restart`` workload on hybridkv's embedded default (no tiers
configured: a CPU tier and a disk tier under ``--cache-dir``): each prompt
cold, again on vLLM's own prefix cache, again after vLLM's cache is reset
(hits from hybridkv's CPU tier) and on a restarted engine (hits from the
disk tier). Prints TTFT and the speedup over the cold run per run, where the
hit tokens came from and whether the greedy outputs equal the cold run's.
Exit status 1 when they do not, or a tier run loaded nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridkv.cli.bench import machine
from hybridkv.cli.bench import say as bench_say
from hybridkv.cli.bench.models import MODELS, build_model, engine_kwargs_for
from hybridkv.cli.bench.offline import EngineFailed
from hybridkv.cli.bench.progress import Bars
from hybridkv.cli.bench.report import compare_outputs, summarize, to_json
from hybridkv.cli.bench.run import BenchContext, run_setup
from hybridkv.cli.bench.setups import Setup
from hybridkv.cli.bench.workloads import WorkloadKind, WorkloadParams, build_workload
from hybridkv.cli.demo_report import demo_rows, verdict
from hybridkv.cli.tables import format_table
from hybridkv.tools.models import ShapeKind

DEFAULT_CACHE_DIR = Path(".hybridkv-cache")
QUESTION_TOKENS = 32
ANSWER_TOKENS = 16


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=ShapeKind.GEMMA3_270M.value,
        choices=MODELS,
        help="random-weight model built locally (default gemma3-270m)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per run")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help=f"model, disk tier and engine logs (default {DEFAULT_CACHE_DIR})",
    )
    parser.add_argument(
        "--keep-cache", action="store_true", help="keep KV stored by earlier demo runs"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens <= QUESTION_TOKENS or args.prompts < 1:
        raise ValueError(
            f"--prompt-tokens must be > {QUESTION_TOKENS} and --prompts >= 1 "
            f"(got {args.prompt_tokens} and {args.prompts})"
        )
    cache_dir = Path(args.cache_dir).expanduser().resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model, cache_dir / "models", say)
    groups = ", ".join(f"{g.kind.value} x{len(g.layer_names)}" for g in model.groups)
    say(f"model at {model.path}; vLLM makes {len(model.groups)} KV cache groups: {groups}")
    params = WorkloadParams(
        documents=args.prompts,
        document_tokens=args.prompt_tokens - QUESTION_TOKENS,
        question_tokens=QUESTION_TOKENS,
        answer_tokens=ANSWER_TOKENS,
        questions=1,
    )
    workload = build_workload(WorkloadKind.RESTART, params, model.vocab_size)
    engine_kwargs = engine_kwargs_for(model, workload)
    say(
        f"{args.prompts} prompts of {args.prompt_tokens} tokens; hybridkv's embedded default "
        f"(CPU tier + disk tier in {cache_dir}); engine logs in {cache_dir}"
    )
    ctx = BenchContext(
        workload=workload,
        engine_kwargs=engine_kwargs,
        server=False,
        work_dir=cache_dir,
        progress=Bars(),
        keep_stored=bool(args.keep_cache),
    )
    try:
        result = run_setup(Setup.DEFAULT, ctx)
    except EngineFailed as exc:
        print(f"[demo] FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    summaries = [summarize(phase) for phase in result.phases]
    cold = next(p for p in result.phases if p.name == "cold")
    exact = model.dtype == "float32"
    outputs = {
        p.name: compare_outputs(p.records, cold.records, exact=exact, same_phase=False)
        for p in result.phases
        if p.name != "cold"
    }
    print(format_table(demo_rows(summaries, outputs)), flush=True)
    problems = verdict(summaries, outputs)
    if args.json is not None:
        document = {
            "machine": machine(),
            "model": args.model,
            "engine_facts": result.facts,
            "summaries": [to_json(s) for s in summaries],
            "outputs": outputs,
            "records": [r.to_json() for r in result.records],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(document, indent=1))
    for problem in problems:
        print(f"[demo] FAILED: {problem}", file=sys.stderr, flush=True)
    if not problems:
        say("outputs of every run match the cold run; hits came from vLLM, then hybridkv's tiers")
        bench_say("for serving workloads: hybridkv bench multi-turn (see docs/PERFORMANCE.md)")
    return 1 if problems else 0
