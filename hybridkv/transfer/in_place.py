"""Copies straight into and out of a tier's own memory, with no staging between.

Worker process, under the transfer engine. When the tier keeps objects in
this process's memory (``Tier.memory()``: the CPU tier), a store reserves
room for each block there, gathers the blocks into it and commits what was
copied; a load borrows the blocks the tier holds, scatters them from there
and releases them once the copies are done (the tier never evicts or reuses
a borrowed object). Each block is copied once, cache to tier or tier to
cache; blocks the tier does not hold are read through staging as before, and
blocks its memory has no room for (all of it being written or read) are
copied out and handed to the tier's ``put_many``, so a tiered store still
sends them to its slower tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, TierMemory
from hybridkv.transfer.copier import BlockCopier, HostRows
from hybridkv.transfer.jobs import Job

logger = logging.getLogger(__name__)

Borrowed = list[int | GetStatus]
"""Per key of a load: the object's offset in the tier's memory, or why not there."""


Put = Callable[[list[StoreKey], list[Buffer]], list[PutStatus]]
"""The tier's ``put_many``: where blocks the tier's memory has no room for go."""


class StartedStore(NamedTuple):
    """A store whose copies are enqueued and not yet committed (``start_store``)."""

    keys: list[StoreKey]
    reserved: list[int | PutStatus]
    """Per key: its offset in the tier's memory, or why it has none."""
    held: list[StoreKey]
    """The keys reserved, to commit once the copies are done."""
    spilled: list[int]
    """Indexes of the keys the memory had no room for."""
    buffers: list[Buffer]
    """Their copies, in ``spilled`` order (filled once the copies are done)."""


class InPlaceCopies:
    def __init__(self, memory: TierMemory, copier: BlockCopier, put: Put) -> None:
        self.memory = memory
        self.copier = copier
        self.put = put

    def store(self, job: Job) -> list[PutStatus]:
        """Reserve, gather, commit; a status per key (``start_store`` then ``end_store``)."""
        started = self.start_store(job)
        return started if isinstance(started, list) else self.end_store(job, started)

    def start_store(self, job: Job) -> StartedStore | list[PutStatus]:
        """Reserve room and enqueue the copies into it; marks the job enqueued
        (``job.copies_mark``) and returns without waiting for them, or returns every
        key's status when reserving failed (nothing is copied then)."""
        keys = job_keys(job)
        try:
            reserved = self.memory.reserve_many(keys, self._sizes(job))
        except Exception as exc:  # the tier's failure costs these blocks, never the engine
            logger.warning("store job %d: reserving in the tier failed: %r", job.job_id, exc)
            job.enqueued.set()
            return [PutStatus.ERROR] * len(keys)
        written = [isinstance(r, int) for r in reserved]
        held = [key for key, w in zip(keys, written, strict=True) if w]
        spilled = [j for j, r in enumerate(reserved) if r is PutStatus.FULL]
        try:
            for group_id, block_ids, offsets in _placed(job, reserved):
                rows = HostRows(self.memory.memory, offsets)
                self.copier.gather_at(group_id, block_ids, rows, after=job.compute_mark)
            buffers = self._gather_spilled(job, spilled)
            job.copies_mark = self.copier.copies_mark()
            job.enqueued.set()
        except BaseException:
            self.copier.wait_done(self.copier.copies_mark())  # none may land in freed room
            job.enqueued.set()
            self.memory.commit_many(held, [False] * len(held))
            raise
        return StartedStore(keys, reserved, held, spilled, buffers)

    def end_store(self, job: Job, started: StartedStore) -> list[PutStatus]:
        """Wait for the store's copies, commit what they wrote and hand the spilled
        blocks to the tier's ``put_many``; a status per key."""
        self.copier.wait_done(job.copies_mark)
        job.copies_mark = None
        keys, reserved, held = started.keys, started.reserved, started.held
        statuses = [PutStatus.OK if isinstance(r, int) else r for r in reserved]
        try:
            self.memory.commit_many(held, [True] * len(held))
        except Exception as exc:
            logger.warning("store job %d: committing in the tier failed: %r", job.job_id, exc)
            statuses = [PutStatus.ERROR if isinstance(r, int) else r for r in reserved]
        spilled = started.spilled
        put = self._put_spilled(job, keys, spilled, started.buffers)
        for j, status in zip(spilled, put, strict=True):
            statuses[j] = status
        return statuses

    def _gather_spilled(self, job: Job, spilled: list[int]) -> list[Buffer]:
        """Copies of the blocks the tier's memory had no room for (it was full of
        objects being written or read), in ``spilled`` order."""
        wanted = set(spilled)
        buffers: list[Buffer] = []
        start = 0
        for part in job.parts:
            rows = [k for k in range(len(part.block_ids)) if start + k in wanted]
            start += len(part.block_ids)
            if not rows:
                continue
            block_bytes = self.copier.block_bytes(part.group_id)
            out = np.empty(len(rows) * block_bytes, np.uint8)
            offsets = np.arange(len(rows), dtype=np.int64) * block_bytes
            block_ids = [part.block_ids[k] for k in rows]
            target = HostRows(torch.from_numpy(out), offsets)
            self.copier.gather_at(part.group_id, block_ids, target, after=job.compute_mark)
            buffers += [out[int(o) : int(o) + block_bytes] for o in offsets]
        return buffers

    def _put_spilled(
        self, job: Job, keys: list[StoreKey], spilled: list[int], buffers: list[Buffer]
    ) -> list[PutStatus]:
        """Hand the spilled blocks to the tier's ``put_many``: a tiered store still
        sends them to its slower tiers."""
        if not spilled:
            return []
        try:
            return self.put([keys[j] for j in spilled], buffers)
        except Exception as exc:
            logger.warning(
                "store job %d: putting %d blocks failed: %r", job.job_id, len(spilled), exc
            )
            return [PutStatus.ERROR] * len(spilled)

    def borrow(self, job: Job) -> Borrowed:
        """Borrow what the memory holds of the blocks it may serve: those of parts with
        no chosen tier or the first (the memory is the first tier's); MISS for others."""
        keys, sizes = job_keys(job), self._sizes(job)
        here = [j for j, index in enumerate(job_tier_indexes(job)) if index in (None, 0)]
        answers: Borrowed = [GetStatus.MISS] * len(keys)
        borrowed = self.memory.borrow_many([keys[j] for j in here], [sizes[j] for j in here])
        for j, answer in zip(here, borrowed, strict=True):
            answers[j] = answer
        return answers

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


def job_tier_indexes(job: Job) -> list[int | None]:
    """Each key's chosen tier (its part's ``tier_index``)."""
    return [part.tier_index for part in job.parts for _ in part.keys]


def merge_statuses(borrowed: Borrowed, staged: Sequence[GetStatus]) -> list[GetStatus]:
    """A load's status per key: OK where borrowed, else what staging's read answered."""
    rest = iter(staged)
    return [GetStatus.OK if isinstance(b, int) else next(rest) for b in borrowed]
