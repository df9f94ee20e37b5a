"""Loads back to back through a real engine over a real CPU tier: a worker enqueues
the next load's copies before it reports the previous one.

Each scenario records, per job, when its copies were enqueued (``start``) and
waited for (``end``), when it was reported and when its borrowed blocks were
released, and checks: bytes exact, every job reported once and in submission
order, each after its copies and before its borrows end, a lone load reported
without another behind it, and the engine's and tier's integrity.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import JobResult, TransferConfig, TransferEngine, TransferPart
from hybridkv.transfer.jobs import JobId, JobOutcome

NUM_BLOCKS = 96
PAGE = 1024
BLOCKS_PER_JOB = 4
WAIT_S = 20.0

MODES = {
    "sync": {},
    "async-chunked": {"asynchronous": True, "chunked_copies": True},
}


def spec() -> ModelGroups:
    full = KVGroup(
        kind=GroupKind.FULL, block_size=16, page_size_bytes=PAGE, layer_names=("f.0", "f.1")
    )
    window = KVGroup(
        kind=GroupKind.SLIDING_WINDOW,
        block_size=16,
        page_size_bytes=PAGE,
        layer_names=("s.0", "s.1"),
        sliding_window=64,
    )
    return ModelGroups(groups=(full, window))


def keys(group_id: int, ids: list[int]) -> list[StoreKey]:
    return [StoreKey(f"pipelined/{group_id}/{b}") for b in ids]


def parts_of(ids: list[int]) -> list[TransferPart]:
    return [TransferPart(g, ids, keys(g, ids)) for g in range(2)]


@dataclass
class Trace:
    """What happened to each load job, in the order it happened."""

    events: list[tuple[str, int]] = field(default_factory=list)
    borrows_at_report: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, job_id: int) -> None:
        with self.lock:
            self.events.append((what, job_id))

    def at(self, what: str, job_id: int) -> int:
        return self.events.index((what, job_id))

    def count(self, what: str, job_id: int) -> int:
        return self.events.count((what, job_id))


@dataclass
class Rig:
    engine: TransferEngine
    cpu: CpuTier
    buffer: torch.Tensor
    trace: Trace
    gate: threading.Event
    """Set: tier calls run; clear: the next load's tier call waits for it."""
    calling: threading.Event = field(default_factory=threading.Event)
    """Set when a tier call begins."""
    fail_scatter: set[int] = field(default_factory=set)
    """Job ids whose copies raise part way (a bug in the copies)."""


def _wrap(obj: object, name: str, around: Callable[..., Any]) -> None:
    inner = getattr(obj, name)
    setattr(obj, name, lambda *a, **k: around(inner, *a, **k))


def _instrument(rig: Rig) -> None:
    engine, trace = rig.engine, rig.trace
    in_place = engine.in_place
    assert in_place is not None

    def call_tier(inner: Callable[..., Any], job: Any, *a: Any) -> Any:
        rig.calling.set()
        assert rig.gate.wait(WAIT_S)
        return inner(job, *a)

    def start(inner: Callable[..., Any], job: Any, borrowed: Any) -> Any:
        trace.add("start", job.job_id)
        started = inner(job, borrowed)
        return started._replace(mark=(job.job_id, started.mark))

    def end(inner: Callable[..., Any], started: Any) -> Any:
        job_id, mark = started.mark
        error = inner(started._replace(mark=mark))
        trace.add("end", job_id)
        return error

    def scatter(inner: Callable[..., Any], job: Any, borrowed: Any) -> Any:
        inner(job, borrowed)
        if job.job_id in rig.fail_scatter:
            raise RuntimeError("copy failed")

    def report(inner: Callable[..., Any], job: Any, *a: Any) -> Any:
        trace.borrows_at_report[job.job_id] = rig.cpu.outstanding().num_borrows
        trace.add("report", job.job_id)
        return inner(job, *a)

    def release(inner: Callable[..., Any], job: Any, borrowed: Any) -> Any:
        trace.add("release", job.job_id)
        return inner(job, borrowed)

    _wrap(engine.moves, "call_tier", call_tier)
    _wrap(engine.moves, "start_scatter", start)
    _wrap(engine.moves, "end_scatter", end)
    _wrap(in_place, "scatter", scatter)
    _wrap(engine._ledger, "report", report)
    _wrap(in_place, "release", release)


@pytest.fixture(params=list(MODES))
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    model_groups = spec()
    alloc = allocate_kv_caches(model_groups, NUM_BLOCKS, kind=KVLayoutKind.LAYER_MAJOR)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    cpu = CpuTier(CpuConfig(capacity_bytes=4 << 20, pin_memory=False))
    config = TransferConfig(staging_bytes=4 << 20, **MODES[request.param])  # type: ignore[arg-type]
    engine = TransferEngine(alloc.canonical, TieredStore([cpu]), config)
    gate = threading.Event()
    gate.set()
    stored = list(range(1, NUM_BLOCKS))
    store = engine.submit_store(parts_of(stored))
    assert store is not None and engine.wait([store], WAIT_S)
    assert all(r.ok for r in engine.poll_finished())
    rig = Rig(engine, cpu, alloc.buffer, Trace(), gate)
    _instrument(rig)
    yield rig
    gate.set()
    engine.close()
    engine.check_integrity()
    cpu.check_integrity()
    assert cpu.outstanding().num_borrows == 0, "a load kept tier memory borrowed"


def _wipe(rig: Rig, ids: list[int]) -> torch.Tensor:
    saved = rig.buffer.clone()
    for tensor in rig.engine.caches.tensors:
        tensor[ids] = 0
    return saved


def _jobs(num_jobs: int, seed: int) -> list[list[int]]:
    ids = random.Random(seed).sample(range(1, NUM_BLOCKS), num_jobs * BLOCKS_PER_JOB)
    return [ids[i * BLOCKS_PER_JOB : (i + 1) * BLOCKS_PER_JOB] for i in range(num_jobs)]


def _submit_behind_a_held_load(rig: Rig, jobs: list[list[int]]) -> list[JobId]:
    """Submit every load while the first one's tier call waits, so they queue back to
    back; then let them run."""
    rig.gate.clear()
    rig.calling.clear()
    job_ids = []
    for ids in jobs:
        job_id = rig.engine.submit_load(parts_of(ids))
        assert job_id is not None
        job_ids.append(job_id)
        assert rig.calling.wait(WAIT_S)
    return job_ids


def _results(rig: Rig, job_ids: list[JobId]) -> list[JobResult]:
    assert rig.engine.wait(job_ids, WAIT_S), "a load was never reported"
    results = rig.engine.poll_finished()
    assert sorted(r.job_id for r in results) == sorted(job_ids), "each job reported once"
    return results


def _check_order(rig: Rig, job_ids: list[JobId]) -> None:
    """Each scattered job: reported once, after its copies were waited for and before
    its borrows ended (held at report time); reports in submission order."""
    trace = rig.trace
    for job_id in job_ids:
        assert trace.count("report", job_id) == 1
        if trace.count("start", job_id):
            assert trace.count("end", job_id) == trace.count("release", job_id) == 1
            assert trace.at("start", job_id) < trace.at("end", job_id) < trace.at("report", job_id)
            assert trace.at("report", job_id) < trace.at("release", job_id)
            assert trace.borrows_at_report[job_id] >= 2 * BLOCKS_PER_JOB
    reports = [job_id for what, job_id in trace.events if what == "report" and job_id in job_ids]
    assert reports == job_ids


def test_loads_back_to_back_are_pipelined_exact_and_in_order(rig: Rig) -> None:
    jobs = _jobs(16, seed=1)
    saved = _wipe(rig, [b for ids in jobs for b in ids])
    job_ids = _submit_behind_a_held_load(rig, jobs)
    rig.gate.set()
    results = _results(rig, job_ids)
    assert [r.job_id for r in results] == job_ids, "reported in submission order"
    assert all(r.outcome is JobOutcome.OK for r in results)
    assert torch.equal(rig.buffer, saved)
    _check_order(rig, job_ids)
    # Pipelined: each job after the first is enqueued before the one ahead is reported.
    trace = rig.trace
    for before, after in itertools.pairwise(job_ids):
        assert trace.at("start", after) < trace.at("report", before)
    rig.engine.check_integrity()


def test_a_lone_load_is_reported_without_a_job_behind_it(rig: Rig) -> None:
    for round_ in range(3):  # the worker blocks on an empty queue between them
        (ids,) = _jobs(1, seed=10 + round_)
        saved = _wipe(rig, ids)
        job_id = rig.engine.submit_load(parts_of(ids))
        assert job_id is not None
        (result,) = _results(rig, [job_id])
        assert result.ok and torch.equal(rig.buffer, saved)
        _check_order(rig, [job_id])
        assert rig.trace.at("release", job_id) == len(rig.trace.events) - 1
    rig.engine.check_integrity()


def test_a_job_cancelled_behind_a_pending_load_is_reported_once(rig: Rig) -> None:
    jobs = _jobs(8, seed=2)
    _wipe(rig, jobs[3])  # the cancelled job's blocks stay wiped
    saved = _wipe(rig, [b for ids in jobs for b in ids])
    job_ids = _submit_behind_a_held_load(rig, jobs)
    cancelled = job_ids[3]
    assert rig.engine.cancel(cancelled)
    rig.gate.set()
    results = {r.job_id: r for r in _results(rig, job_ids)}
    assert results[cancelled].outcome is JobOutcome.CANCELLED
    assert rig.trace.count("start", cancelled) == 0, "a cancelled load never copies"
    assert all(results[j].outcome is JobOutcome.OK for j in job_ids if j != cancelled)
    assert torch.equal(rig.buffer, saved)
    _check_order(rig, [j for j in job_ids if j != cancelled])
    rig.engine.check_integrity()


def test_a_job_cancelled_while_its_copies_are_pending_is_still_loaded(rig: Rig) -> None:
    """Cancel refuses a load whose copies may run (it is pending): it is reported OK."""
    jobs = _jobs(2, seed=3)
    saved = _wipe(rig, [b for ids in jobs for b in ids])
    first_started = threading.Event()
    hold = threading.Event()

    def end(inner: Callable[..., Any], started: Any) -> Any:
        first_started.set()
        assert hold.wait(WAIT_S)
        return inner(started)

    _wrap(rig.engine.moves, "end_scatter", end)
    job_ids = _submit_behind_a_held_load(rig, jobs)
    rig.gate.set()
    assert first_started.wait(WAIT_S)
    assert not rig.engine.cancel(job_ids[0]), "its copies are enqueued"
    hold.set()
    results = _results(rig, job_ids)
    assert [r.outcome for r in results] == [JobOutcome.OK, JobOutcome.OK]
    assert torch.equal(rig.buffer, saved)
    _check_order(rig, job_ids)


def test_a_load_whose_copies_raise_leaves_the_others_reported(rig: Rig) -> None:
    jobs = _jobs(6, seed=4)
    _wipe(rig, [b for ids in jobs for b in ids])
    job_ids = _submit_behind_a_held_load(rig, jobs)
    rig.fail_scatter.add(job_ids[2])
    rig.gate.set()
    results = {r.job_id: r for r in _results(rig, job_ids)}
    assert results[job_ids[2]].outcome is JobOutcome.ERROR
    assert all(results[j].outcome is JobOutcome.OK for j in job_ids if j != job_ids[2])
    _check_order(rig, job_ids)
    rig.engine.check_integrity()


def test_close_finishes_a_pending_load(rig: Rig) -> None:
    """Closed while the first load's tier call runs: the queued ones are reported
    closed, and the first, pending when the worker stops, is still finished."""
    jobs = _jobs(3, seed=5)
    saved = _wipe(rig, jobs[0])
    job_ids = _submit_behind_a_held_load(rig, jobs)
    rig.engine.close(timeout_s=0.1)  # the worker waits in the first tier call
    rig.gate.set()
    for worker in rig.engine._workers:
        worker.join(WAIT_S)
        assert not worker.is_alive()
    results = {r.job_id: r for r in rig.engine.poll_finished()}
    assert sorted(results) == job_ids, "each job reported once"
    assert results[job_ids[0]].outcome is JobOutcome.OK
    assert all(results[j].outcome is JobOutcome.CLOSED for j in job_ids[1:])
    assert torch.equal(rig.buffer, saved)
    _check_order(rig, job_ids[:1])


def test_staged_loads_and_a_store_between_them_over_a_disk_tier(tmp_path: Path) -> None:
    """A tier without memory of its own: loads scatter from staging, each reported
    before the next one's read into staging begins (a disk read must not delay it),
    and a store queued among them is written too."""
    model_groups = spec()
    alloc = allocate_kv_caches(model_groups, NUM_BLOCKS, kind=KVLayoutKind.LAYER_MAJOR)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    disk = DiskTier(DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=16 << 20))
    assert disk.memory() is None
    jobs = _jobs(12, seed=6)
    loaded, stored_later = jobs[:10], jobs[10:]
    with TransferEngine(alloc.canonical, disk, TransferConfig(staging_bytes=4 << 20)) as engine:
        first = engine.submit_store(parts_of([b for ids in loaded for b in ids]))
        assert first is not None and engine.wait([first], WAIT_S)
        assert [r.ok for r in engine.poll_finished()] == [True]
        saved = alloc.buffer.clone()
        for tensor in engine.caches.tensors:
            tensor[[b for ids in loaded for b in ids]] = 0
        events: list[object] = []
        _wrap(engine.moves, "_read", lambda inner, *a: events.append("read") or inner(*a))
        _wrap(
            engine._ledger,
            "report",
            lambda inner, job, *a: events.append(job.job_id) or inner(job, *a),
        )
        job_ids = [engine.submit_load(parts_of(ids)) for ids in loaded[:5]]
        store = engine.submit_store(parts_of([b for ids in stored_later for b in ids]))
        job_ids += [engine.submit_load(parts_of(ids)) for ids in loaded[5:]]
        assert store is not None and None not in job_ids
        assert engine.wait(None, WAIT_S)
        results = engine.poll_finished()
        assert all(r.outcome is JobOutcome.OK for r in results)
        assert sorted(r.job_id for r in results) == sorted([*job_ids, store])  # type: ignore[type-var]
        loads = [r.job_id for r in results if r.job_id != store]
        assert loads == job_ids, "loads reported in submission order"
        reads = [i for i, e in enumerate(events) if e == "read"]
        assert len(reads) == len(job_ids)
        for job_id, next_read in zip(job_ids, reads[1:], strict=False):
            assert events.index(job_id) < next_read, f"load {job_id} waited for a read: {events}"
        assert torch.equal(alloc.buffer, saved)
        assert all(disk.contains_many(keys(0, [b for ids in stored_later for b in ids])))
        engine.check_integrity()
    disk.check_integrity()
    disk.close()
