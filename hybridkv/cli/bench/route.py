"""``hybridkv bench route``: two engines sharing a pool, a router by cache hits against round-robin.

CLI process. The engine alone replays the ``route`` workload first: its outputs
are the reference. Then, for each policy, a fresh Valkey pool (``pool_mib``,
least recently used keys evicted) and two fresh engine processes, each with a
CPU tier of ``cpu_tier_mib`` in front of that pool, its card written for the
lookup and its KV events published to this process. Requests go one at a
time, in the workload's order:

* ``round-robin``: to engine 0, 1, 0, 1, ...
* ``hits``: to the engine whose lookup (``route.Engines``: the pool read
  directly, each engine's CPU tier and prefix cache from its events) answers
  the most usable tokens; on a tie, to the one that served fewer requests.

Per policy: hit tokens, reusable tokens computed again, TTFT p50/p90, outputs
against the engine alone's, and how often the router's answer for the engine
it chose was what that engine then reported cached. Targets: the router's hit
tokens >= 1.5x round-robin's, and a lower TTFT p50.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.cli.bench import say, work_dir_of
from hybridkv.cli.bench.models import build_model, engine_kwargs_for
from hybridkv.cli.bench.offline import EngineFailed, EngineLaunch, OfflineEngine, report_failure
from hybridkv.cli.bench.progress import Bars
from hybridkv.cli.bench.replay import ClientRun, Record
from hybridkv.cli.bench.report import compare_outputs, mark_reusable, percentile
from hybridkv.cli.bench.setups import Setup, transfer_config
from hybridkv.cli.bench.targets import Target
from hybridkv.cli.bench.workloads import (
    PRESETS,
    Client,
    Request,
    Workload,
    WorkloadKind,
    build_workload,
)
from hybridkv.cli.tables import format_table
from hybridkv.integrations.vllm.event_feed import EventFeed
from hybridkv.route.engines import Engines
from hybridkv.route.events import EventIndex
from hybridkv.route.lookup import EngineHits, HitQuery
from hybridkv.tools.pool import LocalPool

POLICIES = ("round-robin", "hits")
NUM_ENGINES = 2
PHASE = "route"
HIT_RATIO_GOAL = 1.5


@dataclass
class PolicyRun:
    policy: str
    records: list[Record] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)
    """The router's usable tokens for the engine it chose, per record (-1: not asked)."""
    per_engine: list[int] = field(default_factory=lambda: [0] * NUM_ENGINES)
    evicted_keys: int = 0
    alignment_tokens: int = 1
    """The engines' hit alignment (what a reusable prefix is cut to)."""


def run_route(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    if args.engine != "offline" or args.setups or args.plot:
        print(
            "[bench] route compares its own runs (alone, round-robin, hits) on offline "
            "engines: drop --engine, --setups and --plot",
            file=sys.stderr,
        )
        return 2
    params = PRESETS[WorkloadKind.ROUTE].replace(overrides)
    work_dir = work_dir_of(args)
    model = build_model(args.model, work_dir / "models", say)
    workload = build_workload(WorkloadKind.ROUTE, params, model.vocab_size)
    kwargs = engine_kwargs_for(model, workload)
    say(
        f"route: {params.clients} conversations x {params.rounds} rounds and "
        f"{params.documents} documents x {params.questions} questions, {workload.num_requests} "
        f"requests, {workload.unique_prompt_tokens} distinct prompt tokens; {NUM_ENGINES} "
        f"engines, each KV cache {params.kv_cache_mib} MiB and CPU tier "
        f"{params.cpu_tier_mib} MiB, sharing a Valkey pool of {params.pool_mib} MiB; "
        f"model {args.model}; logs in {work_dir}"
    )
    progress = Bars()
    try:
        alone = _run_alone(workload, kwargs, work_dir, progress)
        runs = [_run_policy(p, workload, kwargs, work_dir, progress) for p in POLICIES]
    except EngineFailed as exc:
        report_failure(exc, params.kv_cache_mib, kwargs)
        return 1
    exact = model.dtype == "float32"
    for run in [alone, *runs]:
        mark_reusable(run.records, run.alignment_tokens)
    rows, outputs = _rows(runs, alone, exact=exact)
    print(format_table(rows), flush=True)
    found = _targets(runs)
    print("\n" + format_table([["target", "measured", "limit", ""], *(t.row() for t in found)]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "workload": workload.to_json(),
            "model": args.model,
            "policies": {r.policy: _run_json(r, outputs[r.policy]) for r in runs},
            "targets": [dataclasses.asdict(t) | {"met": t.met} for t in found],
        }
        args.json.write_text(json.dumps(document, indent=1))
        say(f"results written to {args.json}")
    differ = sum(o.get("differ", 0) for o in outputs.values())
    if differ:
        print(f"[bench] FAILED: {differ} outputs differ from the engine alone's", file=sys.stderr)
    return 1 if differ else 0


def _run_alone(
    workload: Workload, kwargs: dict[str, Any], work_dir: Path, progress: Bars
) -> PolicyRun:
    launch = EngineLaunch(
        engine_kwargs=kwargs, transfer=None, log_path=_log(work_dir, "alone"), env={}
    )
    (engine,) = _start([launch], progress, "alone")
    try:
        run = PolicyRun("alone", alignment_tokens=_alignment(engine))
        _replay(workload, [engine], lambda prompt, served: (0, -1), run, progress)
        return run
    finally:
        engine.close()


def _run_policy(
    policy: str, workload: Workload, kwargs: dict[str, Any], work_dir: Path, progress: Bars
) -> PolicyRun:
    params = workload.params
    run_dir = work_dir / f"route-{policy}"
    pool = LocalPool.start(
        run_dir / "pool", valkey=True, mooncake=False, valkey_maxmemory_bytes=params.pool_mib << 20
    )
    indexes = [EventIndex() for _ in range(NUM_ENGINES)]
    feeds = [EventFeed(index.apply) for index in indexes]
    cards = {f"engine{e}": run_dir / f"engine{e}.json" for e in range(NUM_ENGINES)}
    engines: list[OfflineEngine] = []
    router = None
    try:
        launches = []
        for e, (name, card) in enumerate(cards.items()):
            card.unlink(missing_ok=True)
            cpu = {"kind": "cpu", "capacity_bytes": params.cpu_tier_mib << 20}
            tiers = [cpu, *(t for t in pool.tier_configs() if t["kind"] == "valkey")]
            transfer = transfer_config(Setup.VALKEY, tiers, run_dir)
            assert transfer is not None
            transfer["kv_connector_extra_config"]["engine_card"] = str(card)
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": feeds[e].endpoint,
                "topic": name,
            }
            launches.append(
                EngineLaunch(
                    engine_kwargs=kwargs,
                    transfer=transfer,
                    log_path=_log(work_dir, f"{policy}-{name}"),
                    env={},
                    events=events,
                )
            )
        engines = _start(launches, progress, policy)
        router = Engines(cards, events=dict(zip(cards, indexes, strict=True)))
        run = PolicyRun(policy, alignment_tokens=_alignment(engines[0]))
        choose = _round_robin() if policy == "round-robin" else _by_hits(router, feeds)
        _replay(workload, engines, choose, run, progress)
        run.evicted_keys = int(pool.status()["valkey_pool"].get("evicted_keys") or 0)
        return run
    finally:
        for engine in engines:
            engine.close()
        if router is not None:
            router.close()
        for feed in feeds:
            feed.close()
        pool.stop()


Choose = Callable[[Sequence[int], Sequence[int]], tuple[int, int]]
"""``choose(prompt, served_per_engine)``: the engine and the usable tokens the router
predicts there (-1: the policy asks no lookup)."""


def _round_robin() -> Choose:
    turn = iter(range(1 << 62))
    return lambda prompt, served: (next(turn) % NUM_ENGINES, -1)


def _by_hits(router: Engines, feeds: Sequence[EventFeed]) -> Choose:
    def choose(prompt: Sequence[int], served: Sequence[int]) -> tuple[int, int]:
        for feed in feeds:
            feed.settle()
        answers = router.find(HitQuery(token_ids=prompt))
        usable = [a.usable_tokens if isinstance(a, EngineHits) else 0 for a in answers]
        best = max(range(NUM_ENGINES), key=lambda e: (usable[e], -served[e], -e))
        return best, usable[best]

    return choose


def _replay(
    workload: Workload,
    engines: Sequence[OfflineEngine],
    choose: Choose,
    run: PolicyRun,
    progress: Bars,
) -> None:
    """Each request of the schedule in turn, to the engine ``choose`` names."""
    clients = [ClientRun(c, client, 0.0) for c, client in enumerate(workload.clients)]
    on_done = progress.replaying(run.policy, workload.num_requests)
    for c in workload.schedule:
        client = clients[c]
        index, request, prompt = client.next_request()
        e, predicted = choose(prompt, run.per_engine)
        single = Request(prefix=tuple(prompt), question=(), max_tokens=request.max_tokens)
        (record,) = engines[e].replay([(c, Client(requests=(single,)))], PHASE, on_done)
        record.index, record.engine, record.setup = index, e, run.policy
        run.records.append(record)
        run.predicted.append(predicted)
        run.per_engine[e] += 1
        client.finish(prompt, record.output_token_ids, time.perf_counter())
    progress.replayed(run.policy)


def _start(launches: Sequence[EngineLaunch], progress: Bars, label: str) -> list[OfflineEngine]:
    """Engine processes started together (their start-ups overlap), each ready."""
    engines = [OfflineEngine(launch) for launch in launches]
    try:
        for e, engine in enumerate(engines):
            name = f"{label} engine{e}"
            begin = time.perf_counter()
            engine.wait_ready(progress.starting(name))
            progress.started(name, time.perf_counter() - begin)
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


def _alignment(engine: OfflineEngine) -> int:
    return int(engine.facts.get("alignment_tokens") or 1)


def _log(work_dir: Path, name: str) -> Path:
    path = work_dir / f"route-{name}.log"
    path.unlink(missing_ok=True)
    return path


def _hit_tokens(run: PolicyRun) -> int:
    return sum(r.num_cached_tokens for r in run.records)


def _ttft_ms(run: PolicyRun, q: float) -> float:
    return percentile([r.ttft_s * 1000 for r in run.records], q)


def _exact_predictions(run: PolicyRun) -> tuple[int, int]:
    """(requests whose prediction equals the cached tokens, requests predicted)."""
    pairs = [(p, r.num_cached_tokens) for p, r in zip(run.predicted, run.records, strict=True)]
    asked = [(p, c) for p, c in pairs if p >= 0]
    return sum(p == c for p, c in asked), len(asked)


def _rows(
    runs: Sequence[PolicyRun], alone: PolicyRun, *, exact: bool
) -> tuple[list[list[str]], dict[str, dict[str, int]]]:
    rows = [
        [
            "policy",
            "reqs",
            "per engine",
            "hit tokens",
            "of prompt",
            "recomputed",
            "TTFT p50",
            "p90",
            "pool evictions",
            "router exact",
            "outputs",
        ]
    ]
    outputs = {}
    for run in [alone, *runs]:
        prompt = sum(r.num_prompt_tokens for r in run.records) or 1
        recomputed = sum(max(0, r.reusable_tokens - r.num_cached_tokens) for r in run.records)
        same, asked = _exact_predictions(run)
        compared = compare_outputs(run.records, alone.records, exact=exact)
        outputs[run.policy] = compared
        rows.append(
            [
                run.policy,
                str(len(run.records)),
                "/".join(map(str, run.per_engine)),
                str(_hit_tokens(run)),
                f"{_hit_tokens(run) / prompt:.0%}",
                str(recomputed),
                f"{_ttft_ms(run, 50):.0f} ms",
                f"{_ttft_ms(run, 90):.0f} ms",
                str(run.evicted_keys) if run.policy != "alone" else "-",
                f"{same}/{asked}" if asked else "-",
                ", ".join(f"{v} {k}" for k, v in compared.items() if v),
            ]
        )
    return rows, outputs


def _targets(runs: Sequence[PolicyRun]) -> list[Target]:
    by = {run.policy: run for run in runs}
    rr, hits = by["round-robin"], by["hits"]
    return [
        Target(
            name="router hit tokens / round-robin's",
            value=_hit_tokens(hits) / max(1, _hit_tokens(rr)),
            limit=HIT_RATIO_GOAL,
            at_most=False,
        ),
        Target(
            name="router TTFT p50 / round-robin's",
            value=_ttft_ms(hits, 50) / max(1e-9, _ttft_ms(rr, 50)),
            limit=1.0,
            at_most=True,
        ),
    ]


def _run_json(run: PolicyRun, outputs: dict[str, int]) -> dict[str, Any]:
    same, asked = _exact_predictions(run)
    return {
        "requests": len(run.records),
        "per_engine": run.per_engine,
        "hit_tokens": _hit_tokens(run),
        "prompt_tokens": sum(r.num_prompt_tokens for r in run.records),
        "ttft_ms": {"p50": _ttft_ms(run, 50), "p90": _ttft_ms(run, 90)},
        "pool_evicted_keys": run.evicted_keys,
        "router_exact": {"same": same, "asked": asked},
        "outputs": outputs,
        "records": [
            r.to_json() | {"predicted": p} for r, p in zip(run.records, run.predicted, strict=True)
        ],
    }
