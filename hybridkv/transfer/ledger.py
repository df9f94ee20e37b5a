"""The transfer engine's ledger: its jobs, their results, and the staging they hold.

Worker process. One lock guards it; methods other than ``wait_until`` and
``check_integrity`` expect the caller to hold it. A job is reported once
(``report``, or ``abandon`` when given up on); its staging region is released
when no call still uses it, and parked, not reused, while the tier says a
call it gave up on may still touch staging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from hybridkv.tiers.base import GetStatus, PutStatus, Tier
from hybridkv.transfer.jobs import Job, JobId, JobOutcome, JobResult, JobState, build_result
from hybridkv.transfer.staging import StagingArena
from hybridkv.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

EXPIRY_MARGIN_S = 0.001
"""Waits for a deadline end this much past it, where ``expire`` finds the job late."""


class JobLedger:
    def __init__(self, arena: StagingArena, tier: Tier, block_bytes: Callable[[int], int]) -> None:
        self.arena = arena
        self.tier = tier
        self.block_bytes = block_bytes
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.jobs: dict[JobId, Job] = {}
        self.finished: list[JobResult] = []
        self.stats = TransferStats()
        self.parked: list[int] = []
        """Offsets of freed regions a call the tier gave up on may still touch."""
        self.num_unregistered = 0
        """Staging regions of submits still copying (not yet in ``jobs``)."""

    def report(
        self,
        job: Job,
        statuses: Sequence[GetStatus | PutStatus],
        outcome: JobOutcome,
        detail: str | None,
    ) -> None:
        result, counts = build_result(job, statuses, outcome, detail)
        self.stats.count_result(job.kind.value, result.ok_block_ids, result.num_failed, counts)
        self.stats.bytes[job.kind.value] += sum(
            len(ids) * self.block_bytes(g) for g, ids in result.ok_block_ids.items()
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
        self.finished.append(result)
        if job.state is not JobState.ABANDONED:
            self.release(job)
        self.changed.notify_all()

    def abandon(self, job: Job, outcome: JobOutcome, reason: str) -> None:
        """Report a job failed now; a running one keeps its staging until the tier returns.

        Only queued and running jobs are given up on: a store's copies are then done or
        never start, so a fence waiting for them to be enqueued may go on."""
        running = job.state is JobState.RUNNING
        job.state = JobState.ABANDONED
        job.enqueued.set()
        self.report(job, [], outcome, reason)
        if not running:
            self.release(job)

    def release(self, job: Job) -> None:
        if job.staging_offset is not None:
            self.parked.append(job.staging_offset)
            job.staging_offset = None
            self.unpark()
        self.jobs.pop(job.job_id, None)
        self.changed.notify_all()

    def unpark(self) -> None:
        if self.parked and not self.tier.staging_busy():
            for offset in self.parked:
                self.arena.free(offset)
            self.parked.clear()

    def expire(self, now: float) -> None:
        self.unpark()
        for job in list(self.jobs.values()):
            late = job.deadline is not None and now > job.deadline
            if late and job.state in (JobState.QUEUED, JobState.RUNNING):
                self.stats.timeouts += 1
                self.abandon(job, JobOutcome.TIMED_OUT, f"timed out after {job.timeout_s} s")

    @staticmethod
    def time_left(job: Job) -> float | None:
        """Seconds until ``expire`` gives the job up (None: no deadline)."""
        if job.deadline is None:
            return None
        return max(0.0, job.deadline - time.monotonic()) + EXPIRY_MARGIN_S

    def wait_until(self, busy: Callable[[], bool], timeout_s: float | None) -> bool:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self.changed:
            while True:
                now = time.monotonic()
                self.expire(now)
                if not busy():
                    return True
                if end is not None and now >= end:
                    return False
                deadlines = [
                    j.deadline
                    for j in self.jobs.values()
                    if j.deadline is not None and j.state in (JobState.QUEUED, JobState.RUNNING)
                ]
                limits = [d - now for d in deadlines] + ([end - now] if end is not None else [])
                limits += [0.01] if self.parked else []  # the tier tells no one when it is done
                self.changed.wait(max(0.001, min(limits)) if limits else None)

    def check_integrity(self) -> None:
        with self.lock:
            self.arena.check_integrity()
            held = {j.staging_offset for j in self.jobs.values() if j.staging_offset is not None}
            regions = len(held) + len(self.parked) + self.num_unregistered
            assert regions == self.arena.num_regions, (held, self.arena.num_regions)
            if not self.jobs and not self.num_unregistered and not self.parked:
                assert self.arena.used_bytes == 0, f"{self.arena.used_bytes} staging bytes leaked"
