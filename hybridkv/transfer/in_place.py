"""Copies straight into and out of a tier's own memory, with no staging between.

Worker process, under the transfer engine. When the tier keeps objects in
this process's memory (``Tier.memory()``: the CPU tier), a store reserves
room for each block there, gathers the blocks into it and commits what was
copied; a load borrows the blocks the tier holds, scatters them from there
and releases them once the copies are done (the tier never evicts or reuses
a borrowed object). Each block is copied once, cache to tier or tier to
cache; blocks the tier does not hold are read through staging as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, TierMemory
from hybridkv.transfer.copier import BlockCopier, HostRows
from hybridkv.transfer.jobs import Job

logger = logging.getLogger(__name__)

Borrowed = list[int | GetStatus]
"""Per key of a load: the object's offset in the tier's memory, or why not there."""


class InPlaceCopies:
    def __init__(self, memory: TierMemory, copier: BlockCopier) -> None:
        self.memory = memory
        self.copier = copier

    def store(self, job: Job) -> list[PutStatus]:
        """Reserve, gather, commit; a status per key. Marks the job enqueued once its
        copies are (``job.copies_mark``), then waits for them before committing."""
        keys = job_keys(job)
        try:
            reserved = self.memory.reserve_many(keys, self._sizes(job))
        except Exception as exc:  # the tier's failure costs these blocks, never the engine
            logger.warning("store job %d: reserving in the tier failed: %r", job.job_id, exc)
            job.enqueued.set()
            return [PutStatus.ERROR] * len(keys)
        written = [isinstance(r, int) for r in reserved]
        held = [key for key, w in zip(keys, written, strict=True) if w]
        try:
            for group_id, block_ids, offsets in _placed(job, reserved):
                rows = HostRows(self.memory.memory, offsets)
                self.copier.gather_at(group_id, block_ids, rows, after=job.compute_mark)
            job.copies_mark = self.copier.copies_mark()
            job.enqueued.set()
            self.copier.wait_done(job.copies_mark)
            job.copies_mark = None
        except BaseException:
            self.copier.wait_done(self.copier.copies_mark())  # none may land in freed room
            job.enqueued.set()
            self.memory.commit_many(held, [False] * len(held))
            raise
        try:
            self.memory.commit_many(held, [True] * len(held))
        except Exception as exc:
            logger.warning("store job %d: committing in the tier failed: %r", job.job_id, exc)
            return [PutStatus.ERROR if isinstance(r, int) else r for r in reserved]
        return [PutStatus.OK if isinstance(r, int) else r for r in reserved]

    def borrow(self, job: Job) -> Borrowed:
        return self.memory.borrow_many(job_keys(job), self._sizes(job))

    def _sizes(self, job: Job) -> list[int]:
        return [self.copier.block_bytes(p.group_id) for p in job.parts for _ in p.keys]

    def scatter(self, job: Job, borrowed: Borrowed) -> None:
        """Copy the borrowed blocks into the caches (enqueued on CUDA: wait for
        ``copier.copies_mark()`` before releasing them)."""
        for group_id, block_ids, offsets in _placed(job, borrowed):
            rows = HostRows(self.memory.memory, offsets)
            self.copier.scatter_at(group_id, block_ids, rows, after=job.compute_mark)

    def release(self, job: Job, borrowed: Borrowed) -> None:
        keys = job_keys(job)
        held = [key for key, b in zip(keys, borrowed, strict=True) if isinstance(b, int)]
        if held:
            self.memory.release_many(held)


def _placed(
    job: Job, answers: Sequence[object]
) -> Iterator[tuple[int, list[int], npt.NDArray[np.int64]]]:
    """Per part: the blocks whose answer is an offset in the tier's memory, and those
    offsets (``answers`` holds one answer per key of the job, in job order)."""
    start = 0
    for part in job.parts:
        mine = answers[start : start + len(part.block_ids)]
        start += len(part.block_ids)
        rows = [k for k, answer in enumerate(mine) if isinstance(answer, int)]
        if rows:
            offsets = np.array([mine[k] for k in rows], np.int64)
            yield part.group_id, [part.block_ids[k] for k in rows], offsets


def job_keys(job: Job) -> list[StoreKey]:
    return [key for part in job.parts for key in part.keys]


def merge_statuses(borrowed: Borrowed, staged: Sequence[GetStatus]) -> list[GetStatus]:
    """A load's status per key: OK where borrowed, else what staging's read answered."""
    rest = iter(staged)
    return [GetStatus.OK if isinstance(b, int) else next(rest) for b in borrowed]
