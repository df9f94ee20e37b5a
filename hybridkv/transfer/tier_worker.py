"""A transfer engine's worker threads: tier calls, and loads reported in order.

Worker process. ``TierWorker`` is the part of ``TransferEngine`` that runs
queued jobs on its worker threads: a store's tier call (its copies into
staging were done by the copy thread), or a load's tier call (borrowing what
the tier's memory holds, reading the rest into staging) and its copies into
the KV cache. A load's copies are only enqueued; the load is reported, and
its borrowed blocks released, once the next load's copies are enqueued
behind them, so the link moves one load while the host borrows the next. A
load is reported before anything else can delay it: before this thread reads
a block into staging (a disk or pool read takes milliseconds), runs a store,
waits for a job, or stops.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import NamedTuple

from hybridkv.tiers.base import GetStatus, PutStatus
from hybridkv.transfer.copier import BlockCopier
from hybridkv.transfer.in_place import Borrowed
from hybridkv.transfer.jobs import Job, JobId, JobKind, JobOutcome, JobState
from hybridkv.transfer.ledger import JobLedger
from hybridkv.transfer.moves import JobMoves, StartedScatter

logger = logging.getLogger("hybridkv.transfer.engine")


class _Finishing(NamedTuple):
    """A job whose tier call returned, to report once its load copies (``started``;
    None: none) are done; then its borrowed blocks are released."""

    job: Job
    statuses: list[GetStatus] | list[PutStatus]
    error: str | None
    borrowed: Borrowed
    started: StartedScatter | None


class TierWorker:
    """Mixin of ``TransferEngine``: the loop of its worker threads (module doc)."""

    copier: BlockCopier
    moves: JobMoves
    _ledger: JobLedger
    _queue: queue.PriorityQueue[tuple[int, int, JobId | None]]

    def _work(self) -> None:
        """Run jobs from the queue, holding at most one load to report (module doc)."""
        pending: list[_Finishing] = []

        def finish_pending() -> None:
            while pending:
                self._finish(pending.pop())

        try:
            while True:
                try:
                    _, _, job_id = self._queue.get_nowait()
                except queue.Empty:
                    finish_pending()  # never hold a result while idle
                    _, _, job_id = self._queue.get()
                if job_id is None:
                    return
                job = self._start(job_id)
                if job is None:
                    continue
                if job.kind is not JobKind.LOAD:
                    finish_pending()
                began = self._begin(job, finish_pending)
                finish_pending()  # in order, after this job's copies are enqueued
                if began is not None and began.started is not None:
                    pending.append(began)
                else:
                    self._finish(began)
        finally:
            finish_pending()

    def _start(self, job_id: JobId) -> Job | None:
        with self._ledger.lock:
            job = self._ledger.jobs.get(job_id)
            if job is None or job.state is not JobState.QUEUED:
                return None
            if job.deadline is not None and time.monotonic() > job.deadline:
                self._ledger.stats.timeouts += 1
                self._ledger.abandon(job, JobOutcome.TIMED_OUT, "timed out before it started")
                return None
            job.state = JobState.RUNNING
            return job

    def _begin(self, job: Job, before_read: Callable[[], None]) -> _Finishing | None:
        """The tier call (``before_read`` runs before it reads into staging), and for a
        load the start of its copies; None when the job was given up on meanwhile or
        failed (reported either way)."""
        borrowed: Borrowed = []
        try:
            statuses, error, borrowed = self.moves.call_tier(job, before_read)
            with self._ledger.lock:
                abandoned = job.state is JobState.ABANDONED
                if abandoned:
                    self._ledger.release(job)
                elif job.kind is JobKind.LOAD:
                    job.state = JobState.SCATTERING  # from now on only _finish reports it
            if abandoned:  # reported already; no copy of it started
                self._release_borrows(job, borrowed)
                return None
            started = None
            if job.kind is JobKind.LOAD and statuses:
                started = self.moves.start_scatter(job, borrowed)
            return _Finishing(job, statuses, error, borrowed, started)
        except Exception as exc:  # a bug: never leave a job unreported
            if self._fail(job, exc):
                self._release_borrows(job, borrowed)
            return None

    def _finish(self, finishing: _Finishing | None) -> None:
        """Report a job begun by ``_begin`` once its copies are done, then end its borrows."""
        if finishing is None:
            return
        job, statuses, error, borrowed, started = finishing
        try:
            if started is not None:
                error = self.moves.end_scatter(started) or error
                if error:
                    statuses = []
            with self._ledger.lock:
                outcome = JobOutcome.ERROR if error else JobOutcome.OK
                self._ledger.report(job, statuses, outcome, error)
        except Exception as exc:  # a bug: never leave a job unreported
            if not self._fail(job, exc):
                return
        self._release_borrows(job, borrowed)

    def _fail(self, job: Job, exc: Exception) -> bool:
        """Report a job that raised (unless reported already); True when none of its
        copies can still run, so its borrowed blocks may be released."""
        logger.error("%s job %d failed", job.kind.value, job.job_id, exc_info=exc)
        done = True
        if job.state is JobState.SCATTERING:  # copies of it may have been enqueued
            try:
                self.copier.wait_done(self.copier.copies_mark())
            except Exception:
                logger.exception("load job %d: copies not known done; borrows kept", job.job_id)
                done = False
        with self._ledger.lock:
            if self._ledger.jobs.get(job.job_id) is not job:
                return done
            if job.state is JobState.ABANDONED:
                self._ledger.release(job)
            else:
                self._ledger.report(job, [], JobOutcome.ERROR, f"transfer engine error: {exc!r}")
        return done

    def _release_borrows(self, job: Job, borrowed: Borrowed) -> None:
        try:
            self.moves.release(job, borrowed)
        except Exception:  # the tier's bookkeeping; the job is reported already
            logger.exception("load job %d: releasing borrowed blocks failed", job.job_id)
