"""Async store/load jobs between canonical KV caches and a tier.

Runs in the worker process. A store's blocks go straight into the tier's own
memory when it has some (``Tier.memory()``, the CPU tier: ``in_place``), else
into the staging arena, from which worker threads call ``tier.put_many``. A
synchronous store (the default on CPU) copies before ``submit_store``
returns; an asynchronous one (CUDA) only records where the engine's compute
stands and returns, the copies run on the copier's stream after that compute,
and the engine must not reuse those blocks before ``fence`` says so. A load
borrows the blocks the tier's memory holds and scatters them from there;
the rest are read into staging reserved at submit, and only blocks read OK
are scattered. A load part may name the one tier of a ``TieredStore`` it is
read from (``TransferPart.tier_index``). Loads run before queued stores; a
worker reports a load once the next load's copies are enqueued behind its
own, so the link moves one while the host borrows the next, and never later
than before a read into staging, a store, or an idle wait
(``transfer.tier_worker``).
Every submitted job yields exactly one ``JobResult`` from ``poll_finished``.
A job past its timeout, or cancelled, is reported failed at once; its
staging stays reserved until the tier call returns, and a load's late bytes
are never scattered. A tier that frames objects in place in staging
(``Tier.register_staging``) gets header room in front of each block; while
it says a call it gave up on may still touch staging (``staging_busy``),
freed regions are parked, not reused.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Collection, Sequence

from hybridkv.layout import CanonicalKVCaches
from hybridkv.tiers.base import PutStatus, Tier, TierMemory
from hybridkv.transfer.copier import BlockCopier
from hybridkv.transfer.in_place import InPlaceCopies, StartedStore
from hybridkv.transfer.jobs import (
    Job,
    JobId,
    JobKind,
    JobOutcome,
    JobResult,
    JobState,
    TransferConfig,
    TransferPart,
    check_parts,
)
from hybridkv.transfer.ledger import JobLedger
from hybridkv.transfer.moves import JobMoves
from hybridkv.transfer.pinning import HostMemory, pageable_problem
from hybridkv.transfer.placement import StagingPlacement
from hybridkv.transfer.staging import PHASE_BYTES, StagingArena
from hybridkv.transfer.stats import TransferStats
from hybridkv.transfer.tier_worker import TierWorker

logger = logging.getLogger(__name__)

CPU_PIN = "set the cpu tier's pin_memory to true, or leave it null (pinned on CUDA)"
STAGING_PIN = "set TransferConfig.pin_memory to true, or leave it null (pinned on CUDA)"


class TransferEngine(TierWorker):
    """Moves blocks of ``caches`` to and from ``tier`` (see module doc)."""

    def __init__(
        self, caches: CanonicalKVCaches, tier: Tier, config: TransferConfig | None = None
    ) -> None:
        self.config = config or TransferConfig()
        self.caches = caches
        self.tier = tier
        self.copier = BlockCopier(
            caches,
            chunked=self.config.chunked_copies,
            chunk_bytes=self.config.device_chunk_bytes,
        )
        asynchronous = self.config.asynchronous
        self.asynchronous = self.copier.is_asynchronous if asynchronous is None else asynchronous
        memory = tier.memory()
        self.in_place = (
            None if memory is None else InPlaceCopies(memory, self.copier, tier.put_many)
        )
        pin = self.config.pin_memory
        if pin is None:
            pin = caches.device.type == "cuda"
        # On CPU the staging rows share the caches' offset within a page (see staging).
        phase = 0 if pin else caches.tensors[0].data_ptr() % PHASE_BYTES // 8 * 8
        self.arena = StagingArena(self.config.staging_bytes, pin_memory=pin, address_phase=phase)
        if caches.device.type == "cuda":
            self._warn_if_pageable(memory)
        room_bytes = tier.register_staging(self.arena.array)
        self.placement = StagingPlacement(self.arena, self.copier, room_bytes)
        self.moves = JobMoves(tier, self.copier, self.placement, self.in_place)
        self._ledger = JobLedger(self.arena, tier, self.copier.block_bytes)
        self._queue: queue.PriorityQueue[tuple[int, int, JobId | None]] = queue.PriorityQueue()
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"hybridkv-transfer-{i}", daemon=True)
            for i in range(self.config.num_workers)
        ]
        self._copies: queue.SimpleQueue[JobId | None] = queue.SimpleQueue()
        """Asynchronous stores, in submit order, for the copy thread."""
        if self.asynchronous:
            self._workers.append(
                threading.Thread(target=self._copy_stores, name="hybridkv-copies", daemon=True)
            )
        for worker in self._workers:
            worker.start()

    def _warn_if_pageable(self, memory: TierMemory | None) -> None:
        regions = [HostMemory("the staging arena", self.arena.tensor.is_pinned(), STAGING_PIN)]
        if memory is not None:
            regions.append(HostMemory("the cpu tier's arena", memory.memory.is_pinned(), CPU_PIN))
        problem = pageable_problem(self.caches.device.type, regions)
        if problem is not None:
            logger.warning("hybridkv: %s", problem)

    # ---- submit / poll -------------------------------------------------------------

    def submit_store(
        self, parts: Sequence[TransferPart], *, timeout_s: float | None = None
    ) -> JobId | None:
        """Copy the blocks out (now, or after the compute queued so far when asynchronous:
        see ``fence``) and write them to the tier. None: staging full, retry later."""
        return self._submit(JobKind.STORE, parts, timeout_s)

    def fence(self, block_ids: Collection[int]) -> int:
        """Before the engine writes ``block_ids`` again: make sure no store still copies
        them out (of any group: groups may share a block's memory, as vLLM's hybrid
        allocator lays them out). On CUDA the calling thread's current stream waits
        for those copies (the host waits only until the copy thread has enqueued
        them, and never past the deadline of a store it has not taken); elsewhere
        the call returns once they are done. Returns how many store jobs it waited
        for."""
        wanted = set(block_ids)
        with self._ledger.lock:
            pending = [
                job
                for job in self._ledger.jobs.values()
                if job.kind is JobKind.STORE
                and job.state is not JobState.ABANDONED
                and not (job.enqueued.is_set() and job.copies_mark is None)
                and not wanted.isdisjoint(job.block_ids)
            ]
        for job in pending:
            self._wait_enqueued(job)
            mark = job.copies_mark
            if self.copier.is_asynchronous:
                self.copier.hold_compute(mark)
            else:
                self.copier.wait_done(mark)
        with self._ledger.lock:
            self._ledger.stats.fences += len(pending)
        return len(pending)

    def _wait_enqueued(self, job: Job) -> None:
        """Until the copy thread has enqueued a store's copies, or the store is given
        up on (its copies then never run, and its ``copies_mark`` stays None). A store
        the copy thread has not taken by its deadline is given up on here, so the host
        never waits past it for a copy thread that is stuck; one it has taken is
        enqueued in the time that takes."""
        while not job.enqueued.wait(self._ledger.time_left(job)):
            with self._ledger.lock:
                self._ledger.expire(time.monotonic())
                if job.state is not JobState.QUEUED:
                    break
        job.enqueued.wait()

    def submit_load(
        self, parts: Sequence[TransferPart], *, timeout_s: float | None = None
    ) -> JobId | None:
        """Read from the tier and scatter async. None: staging full, retry later."""
        return self._submit(JobKind.LOAD, parts, timeout_s)

    def poll_finished(self) -> list[JobResult]:
        """Results of jobs finished, failed, timed out or cancelled since the last poll."""
        with self._ledger.lock:
            self._ledger.expire(time.monotonic())
            done, self._ledger.finished = self._ledger.finished, []
        return done

    def cancel(self, job_id: JobId) -> bool:
        """Stop a job; True when it will not touch the KV caches any more.

        A cancelled job is reported failed (all blocks) by the next poll. False
        when the job is copying blocks (wait for it) or already reported.
        """
        with self._ledger.lock:
            job = self._ledger.jobs.get(job_id)
            busy = (JobState.COPYING, JobState.SCATTERING, JobState.ABANDONED)
            if job is None or job.state in busy:
                return False
            self._ledger.stats.cancels += 1
            self._ledger.abandon(job, JobOutcome.CANCELLED, "cancelled")
            return True

    def wait(
        self, job_ids: Collection[JobId] | None = None, timeout_s: float | None = None
    ) -> bool:
        """Block until the jobs (default: all) have results; False on timeout."""

        def pending() -> bool:
            ids = self._ledger.jobs.keys() if job_ids is None else job_ids
            jobs = self._ledger.jobs
            return any(j in jobs and jobs[j].state is not JobState.ABANDONED for j in ids)

        return self._ledger.wait_until(pending, timeout_s)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job holds staging (abandoned tier calls included)."""
        return self._ledger.wait_until(
            lambda: bool(self._ledger.jobs or self._ledger.parked), timeout_s
        )

    @property
    def num_inflight_bytes(self) -> int:
        return self.arena.used_bytes

    @property
    def max_job_bytes(self) -> int:
        """The largest job (sum of its parts' block bytes, aligned) that can ever run."""
        return self.arena.total_bytes

    def stats(self) -> TransferStats:
        with self._ledger.lock:
            return self._ledger.stats.copy()

    def check_integrity(self) -> None:
        """Raise AssertionError if staging and job bookkeeping disagree.

        When no job is active the arena must be fully free.
        """
        self._ledger.check_integrity()

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel queued jobs, stop the workers. Idempotent; the tier stays open."""
        with self._ledger.lock:
            if self._closed:
                return
            self._closed = True
            for job in list(self._ledger.jobs.values()):
                if job.state is JobState.QUEUED:
                    self._ledger.abandon(job, JobOutcome.CLOSED, "transfer engine closed")
        self._copies.put(None)
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
        num_tiers = self.moves.num_tiers if kind is JobKind.LOAD else None
        num_groups = self.caches.model_groups.num_groups
        parts = check_parts(parts, num_groups, self.copier.check_block_ids, num_tiers=num_tiers)
        in_place = self.in_place is not None and kind is JobKind.STORE
        if in_place:  # no staging: the blocks go into the tier's memory, whatever their size
            offsets, total = (0,) * len(parts), 0
        else:
            offsets, total = self.placement.plan(parts)
        if timeout_s is None:
            is_load = kind is JobKind.LOAD
            timeout_s = self.config.load_timeout_s if is_load else self.config.store_timeout_s
        with self._ledger.lock:
            self._ledger.unpark()
            offset = self.arena.allocate(total) if total else None
            if total and offset is None:
                self._ledger.stats.backpressured += 1
                return None
            job_id = JobId(next(self._ids))
            self._ledger.num_unregistered += offset is not None
        job = Job(job_id, kind, parts, offsets, offset, timeout_s, in_place=in_place)
        job.compute_mark = self.copier.compute_mark()
        copied = False
        statuses: list[PutStatus] | None = None
        try:
            if not in_place:
                job.buffers = self.placement.buffers(job)
            if kind is JobKind.STORE and not self.asynchronous:
                statuses = self.moves.copy_out(job)  # before returning: the engine may reuse blocks
            copied = True
        finally:
            with self._ledger.lock:
                self._ledger.num_unregistered -= offset is not None
                if copied:
                    self._register(job, statuses)
                else:
                    self._ledger.release(job)
        return job_id

    def _register(self, job: Job, statuses: list[PutStatus] | None) -> None:
        if job.timeout_s is not None:
            job.deadline = time.monotonic() + job.timeout_s
        self._ledger.jobs[job.job_id] = job
        self._ledger.stats.count_submit(job.kind.value, sum(len(p.block_ids) for p in job.parts))
        if statuses is not None:  # stored in place
            self._ledger.report(job, statuses, JobOutcome.OK, None)
        elif job.staging_offset is None and not job.in_place:  # nothing to move
            self._ledger.report(job, [], JobOutcome.OK, None)
        elif self._closed:  # closed while this submit gathered: no worker will run it
            self._ledger.abandon(job, JobOutcome.CLOSED, "transfer engine closed")
        elif job.kind is JobKind.STORE and not job.enqueued.is_set():
            self._copies.put(job.job_id)
        else:
            self._queue_for_tier(job)

    def _queue_for_tier(self, job: Job) -> None:
        priority = 0 if job.kind is JobKind.LOAD else 1
        self._queue.put((priority, next(self._seq), job.job_id))

    # ---- the copy thread (asynchronous stores) ----------------------------------------

    def _copy_stores(self) -> None:
        """Take every store queued for copies at once: enqueue all their copies, then
        finish them in order. So the link moves one store while the next is reserved
        and enqueued, instead of idling between stores."""
        while True:
            batch = [self._copies.get()]
            while not self._copies.empty():
                batch.append(self._copies.get_nowait())
            started: list[tuple[Job, StartedStore]] = []
            for job_id in batch:
                if job_id is None:
                    continue
                job = self._claim_copies(job_id)
                if job is None:
                    continue
                try:
                    begun = self.moves.start_copy_out(job)
                except Exception as exc:  # a bug: never leave a job unreported
                    self._copied(job, None, exc)
                    continue
                if isinstance(begun, StartedStore):
                    started.append((job, begun))
                else:
                    self._copied(job, begun, None)
            for job, begun in started:
                try:
                    self._copied(job, self.moves.end_copy_out(job, begun), None)
                except Exception as exc:
                    self._copied(job, None, exc)
            if None in batch:
                return

    def _claim_copies(self, job_id: JobId) -> Job | None:
        with self._ledger.lock:
            job = self._ledger.jobs.get(job_id)
            if job is None or job.state is not JobState.QUEUED:
                return None  # abandoned before its copies started: they never run
            job.state = JobState.COPYING
            return job

    def _copied(self, job: Job, statuses: list[PutStatus] | None, exc: Exception | None) -> None:
        """Report a store whose copies are done (``statuses``: stored in the tier's
        memory; None: staged, for the tier call), or that failed with ``exc``."""
        if exc is not None:
            logger.error("store job %d: copy failed", job.job_id, exc_info=exc)
            job.enqueued.set()
        with self._ledger.lock:
            if exc is not None:
                self._ledger.report(
                    job, [], JobOutcome.ERROR, f"copy raised {type(exc).__name__}: {exc}"
                )
            elif statuses is not None:
                self._ledger.report(job, statuses, JobOutcome.OK, None)
            else:
                job.state = JobState.QUEUED
                self._queue_for_tier(job)
            self._ledger.changed.notify_all()
