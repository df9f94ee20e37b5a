"""Async store/load jobs between canonical KV caches and a tier.

Runs in the worker process. A store gathers its blocks into the staging arena
before ``submit_store`` returns (the engine may reuse the blocks at once);
worker threads then call ``tier.put_many``. A load reserves staging at
submit; a worker calls ``tier.get_many_into`` and scatters only the blocks
read OK. Loads run before queued stores. Every submitted job yields exactly
one ``JobResult`` from ``poll_finished``. A job past its timeout, or
cancelled, is reported failed at once; its staging stays reserved until the
tier call returns, and a load's late bytes are never scattered. A tier that
frames objects in place in staging (``Tier.register_staging``) gets header
room in front of each block; while it says a call it gave up on may still
touch staging (``staging_busy``), freed regions are parked, not reused.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence

from hybridkv.layout import CanonicalKVCaches
from hybridkv.tiers.base import GetStatus, PutStatus, Tier
from hybridkv.transfer.copier import BlockCopier
from hybridkv.transfer.jobs import (
    Job,
    JobId,
    JobKind,
    JobOutcome,
    JobResult,
    JobState,
    TransferConfig,
    TransferPart,
    build_result,
    check_parts,
)
from hybridkv.transfer.placement import StagingPlacement
from hybridkv.transfer.staging import PHASE_BYTES, StagingArena
from hybridkv.transfer.stats import TransferStats

logger = logging.getLogger(__name__)


class TransferEngine:
    """Moves blocks of ``caches`` to and from ``tier`` (see module doc)."""

    def __init__(
        self, caches: CanonicalKVCaches, tier: Tier, config: TransferConfig | None = None
    ) -> None:
        self.config = config or TransferConfig()
        self.caches = caches
        self.tier = tier
        self.copier = BlockCopier(caches)
        pin = self.config.pin_memory
        if pin is None:
            pin = caches.device.type == "cuda"
        # On CPU the staging rows share the caches' offset within a page (see staging).
        phase = 0 if pin else caches.tensors[0].data_ptr() % PHASE_BYTES // 8 * 8
        self.arena = StagingArena(self.config.staging_bytes, pin_memory=pin, address_phase=phase)
        room_bytes = tier.register_staging(self.arena.array)
        self.placement = StagingPlacement(self.arena, self.copier, room_bytes)
        self._parked: list[int] = []
        """Offsets of freed regions a call the tier gave up on may still touch."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._jobs: dict[JobId, Job] = {}
        self._finished: list[JobResult] = []
        self._queue: queue.PriorityQueue[tuple[int, int, JobId | None]] = queue.PriorityQueue()
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._stats = TransferStats()
        self._num_unregistered = 0
        """Staging regions of submits still gathering (not yet in ``_jobs``)."""
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"hybridkv-transfer-{i}", daemon=True)
            for i in range(self.config.num_workers)
        ]
        for worker in self._workers:
            worker.start()

    # ---- submit / poll -------------------------------------------------------------

    def submit_store(
        self, parts: Sequence[TransferPart], *, timeout_s: float | None = None
    ) -> JobId | None:
        """Gather now, write to the tier async. None: staging full, retry later."""
        return self._submit(JobKind.STORE, parts, timeout_s)

    def submit_load(
        self, parts: Sequence[TransferPart], *, timeout_s: float | None = None
    ) -> JobId | None:
        """Read from the tier and scatter async. None: staging full, retry later."""
        return self._submit(JobKind.LOAD, parts, timeout_s)

    def poll_finished(self) -> list[JobResult]:
        """Results of jobs finished, failed, timed out or cancelled since the last poll."""
        with self._lock:
            self._expire(time.monotonic())
            done, self._finished = self._finished, []
        return done

    def cancel(self, job_id: JobId) -> bool:
        """Stop a job; True when it will not touch the KV caches any more.

        A cancelled job is reported failed (all blocks) by the next poll. False
        when the job is scattering (wait for it) or already reported.
        """
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state in (JobState.SCATTERING, JobState.ABANDONED):
                return False
            self._stats.cancels += 1
            self._abandon(job, JobOutcome.CANCELLED, "cancelled")
            return True

    def wait(
        self, job_ids: Collection[JobId] | None = None, timeout_s: float | None = None
    ) -> bool:
        """Block until the jobs (default: all) have results; False on timeout."""

        def pending() -> bool:
            ids = self._jobs.keys() if job_ids is None else job_ids
            jobs = self._jobs
            return any(j in jobs and jobs[j].state is not JobState.ABANDONED for j in ids)

        return self._wait_until(pending, timeout_s)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job holds staging (abandoned tier calls included)."""
        return self._wait_until(lambda: bool(self._jobs or self._parked), timeout_s)

    @property
    def num_inflight_bytes(self) -> int:
        return self.arena.used_bytes

    @property
    def max_job_bytes(self) -> int:
        """The largest job (sum of its parts' block bytes, aligned) that can ever run."""
        return self.arena.total_bytes

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats.copy()

    def check_integrity(self) -> None:
        """Raise AssertionError if staging and job bookkeeping disagree.

        When no job is active the arena must be fully free.
        """
        with self._lock:
            self.arena.check_integrity()
            held = {j.staging_offset for j in self._jobs.values() if j.staging_offset is not None}
            regions = len(held) + len(self._parked) + self._num_unregistered
            assert regions == self.arena.num_regions, (held, self.arena.num_regions)
            if not self._jobs and not self._num_unregistered and not self._parked:
                assert self.arena.used_bytes == 0, f"{self.arena.used_bytes} staging bytes leaked"

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel queued jobs, stop the workers. Idempotent; the tier stays open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for job in list(self._jobs.values()):
                if job.state is JobState.QUEUED:
                    self._abandon(job, JobOutcome.CLOSED, "transfer engine closed")
        for _ in self._workers:
            self._queue.put((2, next(self._seq), None))
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                logger.warning("%s still in a tier call after close", worker.name)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submit internals ---------------------------------------------------------------

    def _submit(
        self, kind: JobKind, parts: Sequence[TransferPart], timeout_s: float | None
    ) -> JobId | None:
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        parts = check_parts(parts, self.caches.layout.num_groups, self.copier.check_block_ids)
        offsets, total = self.placement.plan(parts)
        if timeout_s is None:
            is_load = kind is JobKind.LOAD
            timeout_s = self.config.load_timeout_s if is_load else self.config.store_timeout_s
        with self._lock:
            self._unpark()
            offset = self.arena.allocate(total) if total else None
            if total and offset is None:
                self._stats.backpressured += 1
                return None
            job_id = JobId(next(self._ids))
            self._num_unregistered += offset is not None
        job = Job(job_id, kind, parts, offsets, offset, timeout_s)
        gathered = False
        try:
            job.buffers = self.placement.buffers(job)
            if kind is JobKind.STORE:
                self.placement.gather(job)  # before returning: the engine may reuse the blocks
            gathered = True
        finally:
            with self._lock:
                self._num_unregistered -= offset is not None
                if gathered:
                    self._register(job)
                else:
                    self._release(job)
        return job_id

    def _register(self, job: Job) -> None:
        if job.timeout_s is not None:
            job.deadline = time.monotonic() + job.timeout_s
        self._jobs[job.job_id] = job
        self._stats.count_submit(job.kind.value, sum(len(p.block_ids) for p in job.parts))
        if job.staging_offset is None:  # nothing to move
            self._report(job, [], JobOutcome.OK, None)
        elif self._closed:  # closed while this submit gathered: no worker will run it
            self._abandon(job, JobOutcome.CLOSED, "transfer engine closed")
        else:
            priority = 0 if job.kind is JobKind.LOAD else 1
            self._queue.put((priority, next(self._seq), job.job_id))

    # ---- worker side --------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            _, _, job_id = self._queue.get()
            if job_id is None:
                return
            job = self._start(job_id)
            if job is None:
                continue
            try:
                statuses, error = self._call_tier(job)
                self._complete(job, statuses, error)
            except Exception as exc:  # a bug: never leave a job unreported
                logger.exception("%s job %d failed", job.kind.value, job.job_id)
                with self._lock:
                    if self._jobs.get(job.job_id) is not job:
                        continue
                    if job.state is JobState.ABANDONED:
                        self._release(job)
                    else:
                        self._report(job, [], JobOutcome.ERROR, f"transfer engine error: {exc!r}")

    def _start(self, job_id: JobId) -> Job | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state is not JobState.QUEUED:
                return None
            if job.deadline is not None and time.monotonic() > job.deadline:
                self._stats.timeouts += 1
                self._abandon(job, JobOutcome.TIMED_OUT, "timed out before it started")
                return None
            job.state = JobState.RUNNING
            return job

    def _call_tier(self, job: Job) -> tuple[list[GetStatus] | list[PutStatus], str | None]:
        keys = [key for part in job.parts for key in part.keys]
        try:
            statuses: list[GetStatus] | list[PutStatus]
            if job.kind is JobKind.STORE:
                statuses = self.tier.put_many(keys, job.buffers, checksums=job.checksums)
            else:
                statuses = self.tier.get_many_into(keys, job.buffers)
            if len(statuses) != len(keys):
                raise RuntimeError(f"tier returned {len(statuses)} statuses for {len(keys)} keys")
            return statuses, None
        except Exception as exc:
            logger.warning(
                "%s job %d: tier %s failed: %r", job.kind.value, job.job_id, self.tier.name, exc
            )
            return [], f"tier {self.tier.name} raised {type(exc).__name__}: {exc}"

    def _complete(
        self, job: Job, statuses: list[GetStatus] | list[PutStatus], error: str | None
    ) -> None:
        with self._lock:
            if job.state is JobState.ABANDONED:
                self._release(job)
                return
            if job.kind is JobKind.LOAD:
                job.state = JobState.SCATTERING
        if job.kind is JobKind.LOAD and statuses:
            error = self._scatter(job, statuses) or error
            if error:
                statuses = []
        with self._lock:
            outcome = JobOutcome.ERROR if error else JobOutcome.OK
            self._report(job, statuses, outcome, error)

    def _scatter(self, job: Job, statuses: Sequence[GetStatus | PutStatus]) -> str | None:
        try:
            self.placement.scatter(job, statuses)
        except Exception as exc:  # a bug, not an I/O failure; the loaded KV is suspect
            logger.exception("load job %d: scatter failed", job.job_id)
            return f"scatter raised {type(exc).__name__}: {exc}"
        return None

    # ---- bookkeeping (callers hold the lock) -------------------------------------------

    def _report(
        self,
        job: Job,
        statuses: Sequence[GetStatus | PutStatus],
        outcome: JobOutcome,
        detail: str | None,
    ) -> None:
        result, counts = build_result(job, statuses, outcome, detail)
        self._stats.count_result(job.kind.value, result.ok_block_ids, result.num_failed, counts)
        self._stats.bytes[job.kind.value] += sum(
            len(ids) * self.copier.block_bytes(g) for g, ids in result.ok_block_ids.items()
        )
        if not result.ok:
            log = logger.warning if set(counts) - {"miss", "full"} or not counts else logger.debug
            log(
                "%s job %d: %d blocks failed: %s",
                job.kind.value,
                job.job_id,
                result.num_failed,
                result.detail,
            )
        self._finished.append(result)
        if job.state is not JobState.ABANDONED:
            self._release(job)
        self._changed.notify_all()

    def _abandon(self, job: Job, outcome: JobOutcome, reason: str) -> None:
        """Report a job failed now; a running one keeps its staging until the tier returns."""
        running = job.state is JobState.RUNNING
        job.state = JobState.ABANDONED
        self._report(job, [], outcome, reason)
        if not running:
            self._release(job)

    def _release(self, job: Job) -> None:
        if job.staging_offset is not None:
            self._parked.append(job.staging_offset)
            job.staging_offset = None
            self._unpark()
        self._jobs.pop(job.job_id, None)
        self._changed.notify_all()

    def _unpark(self) -> None:
        if self._parked and not self.tier.staging_busy():
            for offset in self._parked:
                self.arena.free(offset)
            self._parked.clear()

    def _expire(self, now: float) -> None:
        self._unpark()
        for job in list(self._jobs.values()):
            late = job.deadline is not None and now > job.deadline
            if late and job.state in (JobState.QUEUED, JobState.RUNNING):
                self._stats.timeouts += 1
                self._abandon(job, JobOutcome.TIMED_OUT, f"timed out after {job.timeout_s} s")

    def _wait_until(self, busy: Callable[[], bool], timeout_s: float | None) -> bool:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while True:
                now = time.monotonic()
                self._expire(now)
                if not busy():
                    return True
                if end is not None and now >= end:
                    return False
                deadlines = [
                    j.deadline
                    for j in self._jobs.values()
                    if j.deadline is not None and j.state in (JobState.QUEUED, JobState.RUNNING)
                ]
                limits = [d - now for d in deadlines] + ([end - now] if end is not None else [])
                limits += [0.01] if self._parked else []  # the tier tells no one when it is done
                self._changed.wait(max(0.001, min(limits)) if limits else None)
