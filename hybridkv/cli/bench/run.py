"""Running one setup of ``hybridkv bench``: engines started, phases replayed, counted.

CLI process. Per workload: ``long-doc-qa`` and ``multi-turn`` replay every
client at once in one phase ("run"); ``restart`` replays its requests cold,
again on the engine's own cache, again after the engine's cache is reset
(only hybridkv's tiers can serve them), then on a restarted engine;
``shared`` starts two engines and sends each request, in order, to the
engine it names (phases "engine0" and "engine1").
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hybridkv.cli.bench import counters
from hybridkv.cli.bench.offline import EngineLaunch, OfflineEngine
from hybridkv.cli.bench.replay import ClientRun, Record
from hybridkv.cli.bench.report import Phase
from hybridkv.cli.bench.server import ServerEngine
from hybridkv.cli.bench.setups import Setup, pool_for, tiers_for, transfer_config
from hybridkv.cli.bench.workloads import Client, Request, Workload, WorkloadKind
from hybridkv.connector.config import DISK_SUBDIR

RESTART_PHASES = ("cold", "engine-cache", "tiers", "restarted")


class Engine(Protocol):
    facts: dict[str, Any]

    def wait_ready(self, on_tick: Callable[[], None]) -> dict[str, Any]: ...

    def replay(
        self, clients: list[tuple[int, Client]], phase: str, on_done: Callable[[], None]
    ) -> list[Record]: ...

    def reset(self) -> None: ...

    def counters(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class Progress(Protocol):
    """How the bench shows what it is doing (progress bars on a terminal)."""

    def starting(self, label: str) -> Callable[[], None]:
        """A tick function to call while an engine starts."""
        ...

    def started(self, label: str, seconds: float) -> None: ...

    def replaying(self, label: str, num_requests: int) -> Callable[[], None]:
        """A function to call when a request finishes."""
        ...

    def replayed(self, label: str) -> None: ...


@dataclass(kw_only=True)
class SetupRun:
    setup: str
    phases: list[Phase] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    start_seconds: list[float] = field(default_factory=list)

    @property
    def records(self) -> list[Record]:
        return [r for phase in self.phases for r in phase.records]


@dataclass(frozen=True, kw_only=True)
class BenchContext:
    workload: Workload
    engine_kwargs: dict[str, Any]
    server: bool
    work_dir: Path
    """Engine logs, disk tiers, pool state; the default setup's cache directory."""
    progress: Progress
    keep_stored: bool = False
    """Keep what earlier runs stored on disk (otherwise every setup starts empty)."""


def run_setup(setup: Setup, ctx: BenchContext) -> SetupRun:
    disk_dir = ctx.work_dir / f"{setup.value}-disk"
    if not ctx.keep_stored:
        shutil.rmtree(disk_dir, ignore_errors=True)
        if setup is Setup.DEFAULT:
            shutil.rmtree(ctx.work_dir / DISK_SUBDIR, ignore_errors=True)
    result = SetupRun(setup=setup.value)
    with pool_for(setup, ctx.work_dir / f"{setup.value}-pool") as pool:
        params = ctx.workload.params
        tiers = tiers_for(
            setup, disk_dir, pool, params.cpu_tier_mib << 20, params.disk_tier_mib << 20
        )
        transfer = transfer_config(setup, tiers, ctx.work_dir)
        runner = _SetupRunner(setup, ctx, transfer, result)
        kind = ctx.workload.kind
        if kind is WorkloadKind.RESTART:
            runner.restart()
        elif kind is WorkloadKind.SHARED:
            runner.shared()
        elif ctx.workload.schedule:
            runner.in_order()
        else:
            runner.together()
    return result


class _SetupRunner:
    def __init__(
        self, setup: Setup, ctx: BenchContext, transfer: dict[str, Any] | None, result: SetupRun
    ) -> None:
        self.setup, self.ctx, self.transfer, self.result = setup, ctx, transfer, result
        self._started = 0

    def start(self) -> Engine:
        label = f"{self.setup.value} engine {self._started}"
        log_path = self.ctx.work_dir / f"{self.setup.value}-engine{self._started}.log"
        self._started += 1
        log_path.unlink(missing_ok=True)
        launch = EngineLaunch(
            engine_kwargs=self.ctx.engine_kwargs,
            transfer=self.transfer,
            log_path=log_path,
            env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
        )
        begin = time.perf_counter()
        engine: Engine = ServerEngine(launch) if self.ctx.server else OfflineEngine(launch)
        try:
            facts = engine.wait_ready(self.ctx.progress.starting(label))
        except BaseException:
            engine.close()
            raise
        seconds = time.perf_counter() - begin
        self.ctx.progress.started(label, seconds)
        self.result.facts = self.result.facts or facts
        self.result.start_seconds.append(seconds)
        return engine

    def replay(self, engine: Engine, clients: list[tuple[int, Client]], phase: str) -> Phase:
        label = f"{self.setup.value} {phase}"
        on_done = self.ctx.progress.replaying(label, sum(len(c.requests) for _, c in clients))
        before = engine.counters()
        begin = time.perf_counter()
        records = engine.replay(clients, phase, on_done)
        wall = time.perf_counter() - begin
        self.ctx.progress.replayed(label)
        for record in records:
            record.setup = self.setup.value
        delta = counters.delta(before, engine.counters())
        return Phase(
            setup=self.setup.value,
            name=phase,
            records=records,
            counters=delta,
            wall_s=wall,
        )

    def _clients(self) -> list[tuple[int, Client]]:
        return list(enumerate(self.ctx.workload.clients))

    def together(self) -> None:
        engine = self.start()
        try:
            self.result.phases.append(self.replay(engine, self._clients(), "run"))
        finally:
            engine.close()

    def in_order(self) -> None:
        """One request at a time, in the workload's ``schedule`` (each names a client,
        whose next request it sends, its history first), as one phase."""
        engine = self.start()
        try:
            workload = self.ctx.workload
            label = f"{self.setup.value} run"
            on_done = self.ctx.progress.replaying(label, workload.num_requests)
            runs = [ClientRun(c, client, 0.0) for c, client in enumerate(workload.clients)]
            before = engine.counters()
            begin = time.perf_counter()
            records: list[Record] = []
            for c in workload.schedule:
                index, request, prompt = runs[c].next_request()
                single = Request(prefix=tuple(prompt), question=(), max_tokens=request.max_tokens)
                (record,) = engine.replay([(c, Client(requests=(single,)))], "run", on_done)
                record.index, record.setup = index, self.setup.value
                records.append(record)
                runs[c].finish(prompt, record.output_token_ids, time.perf_counter())
            wall = time.perf_counter() - begin
            self.ctx.progress.replayed(label)
            delta = counters.delta(before, engine.counters())
            phase = Phase(
                setup=self.setup.value, name="run", records=records, counters=delta, wall_s=wall
            )
            self.result.phases.append(phase)
        finally:
            engine.close()

    def restart(self) -> None:
        engine = self.start()
        try:
            for phase in RESTART_PHASES[:3]:
                if phase == "tiers":
                    engine.reset()
                self.result.phases.append(self.replay(engine, self._clients(), phase))
        finally:
            engine.close()  # flushes the stores still in flight
        engine = self.start()
        try:
            self.result.phases.append(self.replay(engine, self._clients(), RESTART_PHASES[3]))
        finally:
            engine.close()

    def shared(self) -> None:
        engines = [self.start(), self.start()]
        try:
            names = [f"engine{e}" for e in range(len(engines))]
            label = f"{self.setup.value} engine0/engine1"
            phases = replay_across(engines, self.ctx, self.setup.value, names, label)
            self.result.phases += phases
        finally:
            for engine in engines:
                engine.close()


def replay_across(
    engines: Sequence[Engine], ctx: BenchContext, setup: str, names: list[str], label: str
) -> list[Phase]:
    """Every request of the workload's one client, in order, to the engine it names
    (``request.engine``); a phase per engine, called ``names[e]``. Records keep the
    phase name ``engine<e>``, so outputs compare request by request with the engine
    alone's."""
    (client,) = ctx.workload.clients
    before = [engine.counters() for engine in engines]
    records: list[list[Record]] = [[] for _ in engines]
    walls = [0.0 for _ in engines]
    on_done = ctx.progress.replaying(label, len(client.requests))
    for position, request in enumerate(client.requests):
        e = request.engine
        begin = time.perf_counter()
        single = [(position, Client(requests=(request,)))]
        records[e] += engines[e].replay(single, f"engine{e}", on_done)
        walls[e] += time.perf_counter() - begin
    ctx.progress.replayed(label)
    phases = []
    for e, engine in enumerate(engines):
        for record in records[e]:
            record.setup = setup
        delta = counters.delta(before[e], engine.counters())
        phases.append(
            Phase(
                setup=setup,
                name=names[e],
                records=records[e],
                counters=delta,
                wall_s=walls[e],
                engine=e,
            )
        )
    return phases
