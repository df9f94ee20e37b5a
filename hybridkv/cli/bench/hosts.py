"""``hybridkv bench hosts``: the shared workload, the pool and each engine on a host of its own.

CLI process, as root. Three network namespaces joined by a bridge stand for
three machines (``hybridkv.tools.netns``): the Mooncake pool (master + storage
daemon) on "pool", engine 0 on "a", engine 1 on "b". Each engine is a process
spawned inside its namespace, with ``MC_TCP_BIND_ADDRESS`` and the tier's
``local_hostname`` set to its host's address, a CPU tier in front of the pool.
The engine alone runs first, as the reference. Prints the bench's table, then
per engine host its hit rate, what the pool served, the mean load latency
(from a load's start to its last block) and the median of one Mooncake read
by a fresh client on that host
(``hybridkv.tools.pool_probe``), against the same read on the pool's own host:
the network's share, apart from the engine's. Exit status 2 with the reason
where namespaces cannot be made; 1 when an output differs from the engine
alone's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hybridkv.cli.bench import counters, say, work_dir_of
from hybridkv.cli.bench.models import build_model, engine_kwargs_for
from hybridkv.cli.bench.offline import EngineFailed, EngineLaunch, OfflineEngine, report_failure
from hybridkv.cli.bench.progress import Bars
from hybridkv.cli.bench.report import Phase, compare_outputs, mark_reusable, summarize, summary_rows
from hybridkv.cli.bench.run import BenchContext, replay_across, run_setup
from hybridkv.cli.bench.setups import CPU_TIER_BYTES, POOL_BYTES, Setup, transfer_config
from hybridkv.cli.bench.workloads import PRESETS, WorkloadKind, build_workload
from hybridkv.cli.tables import format_bytes, format_table
from hybridkv.tools.netns import Network, unavailable_reason
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.pool_probe import time_reads

SUBNET = "10.213.71.0/24"
"""Addresses exist only inside the namespaces this mode makes and removes."""
ENGINE_HOSTS = ("a", "b")
SETUP = "hosts"


def run_hosts(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    reason = unavailable_reason()
    if reason:
        print(f"[bench] FAILED: hosts needs network namespaces: {reason}", file=sys.stderr)
        return 2
    params = PRESETS[WorkloadKind.SHARED].replace(overrides)
    work_dir = work_dir_of(args)
    model = build_model(args.model, work_dir / "models", say)
    workload = build_workload(WorkloadKind.SHARED, params, model.vocab_size)
    ctx = BenchContext(
        workload=workload,
        engine_kwargs=engine_kwargs_for(model, workload),
        server=False,
        work_dir=work_dir,
        progress=Bars(),
    )
    say(f"hosts: pool on 'pool', engines on {ENGINE_HOSTS} in {SUBNET}; logs in {work_dir}")
    try:
        alone = run_setup(Setup.ALONE, ctx)
        with Network.create(["pool", *ENGINE_HOSTS], subnet=SUBNET) as network:
            pool = network.start_pool("pool", work_dir / "hosts-pool", segment_bytes=POOL_BYTES)
            try:
                phases, alignment = _replay_across(ctx, network, pool)
                read_ms = _read_ms(network, pool)
            finally:
                pool.stop()
    except EngineFailed as exc:
        report_failure(exc, params.kv_cache_mib, ctx.engine_kwargs)
        return 1
    exact = model.dtype == "float32"
    mark_reusable(alone.records, int(alone.facts.get("alignment_tokens") or 1))
    mark_reusable([r for p in phases for r in p.records], alignment)
    summaries = [summarize(p) for p in alone.phases]
    for phase in phases:
        summary = summarize(phase)
        summary.outputs = compare_outputs(phase.records, alone.records, exact=exact)
        summaries.append(summary)
    print(format_table(summary_rows(summaries)), flush=True)
    print("\n" + format_table(host_rows(phases, read_ms)), flush=True)
    print(f"one read on the pool's own host (no bridge): {read_ms['pool']:.2f} ms", flush=True)
    differ = sum(s.outputs.get("differ", 0) for s in summaries)
    if differ:
        print(f"[bench] FAILED: {differ} outputs differ from the engine alone's", file=sys.stderr)
    return 1 if differ else 0


def _replay_across(ctx: BenchContext, network: Network, pool: LocalPool) -> tuple[list[Phase], int]:
    """Every request, in order, to the engine on the host it names; a phase per host."""
    engines = [_start(ctx, network, pool, host) for host in ENGINE_HOSTS]
    try:
        names = [f"engine{e}@{host}" for e, host in enumerate(ENGINE_HOSTS)]
        phases = replay_across(engines, ctx, SETUP, names, "hosts a/b")
        return phases, int(engines[0].facts.get("alignment_tokens") or 1)
    finally:
        for engine in engines:
            engine.close()


def _read_ms(network: Network, pool: LocalPool) -> dict[str, float]:
    """Per host (the pool's own, then each engine's): median ms of a one-object read."""
    say("timing one-object reads from each host")
    hosts = ["pool", *ENGINE_HOSTS]
    return {h: time_reads(pool.master_address, network.hosts[h]).median_ms for h in hosts}


def _start(ctx: BenchContext, network: Network, pool: LocalPool, host: str) -> OfflineEngine:
    """An engine process spawned inside ``host``'s namespace, bound to its address."""
    address = network.hosts[host].address
    cpu = {"kind": "cpu", "capacity_bytes": CPU_TIER_BYTES}
    tiers = [cpu, *(t for t in network.tier_configs(pool, host) if t["kind"] == "mooncake")]
    log_path: Path = ctx.work_dir / f"hosts-engine-{host}.log"
    log_path.unlink(missing_ok=True)
    launch = EngineLaunch(
        engine_kwargs=ctx.engine_kwargs,
        transfer=transfer_config(Setup.MOONCAKE, tiers, ctx.work_dir),
        log_path=log_path,
        env={"MC_TCP_BIND_ADDRESS": address},
    )
    with network.entered(host):
        engine = OfflineEngine(launch)
    label = f"engine on host {host} ({address})"
    begin = time.perf_counter()
    try:
        engine.wait_ready(ctx.progress.starting(label))
    except BaseException:
        engine.close()
        raise
    ctx.progress.started(label, time.perf_counter() - begin)
    return engine


def host_rows(phases: list[Phase], read_ms: dict[str, float]) -> list[list[str]]:
    """Per engine host: hit rate, bytes the pool served, loads, their mean latency and
    the median of one pool read from that host."""
    rows = [["engine@host", "hit rate", "from pool", "loads", "mean load ms", "one read ms"]]
    for phase, host in zip(phases, ENGINE_HOSTS, strict=True):
        c = phase.counters
        prompt_tokens = sum(r.num_prompt_tokens for r in phase.records) or 1
        num_loads = counters.total(c, "hybridkv_load_seconds_count")
        load_s = counters.total(c, "hybridkv_load_seconds_sum")
        rows.append(
            [
                phase.name,
                f"{counters.total(c, 'hybridkv_hit_tokens') / prompt_tokens:.0%}",
                format_bytes(int(counters.total(c, "hybridkv_tier_read_bytes", tier="mooncake"))),
                f"{num_loads:.0f}",
                f"{load_s / num_loads * 1000:.1f}" if num_loads else "-",
                f"{read_ms[host]:.2f}",
            ]
        )
    return rows
