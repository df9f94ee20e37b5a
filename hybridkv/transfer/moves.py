"""What a job does with the bytes: copy a store out, put it into the tier, read a load
and scatter it.

Worker process, on whichever thread runs the job; the transfer engine owns the
threads, the job states and the staging accounting. A store's blocks go into
the tier's own memory when it has some (``in_place``), else into staging for
``Tier.put_many``. A load borrows the blocks the tier's memory holds and reads
the rest into staging; only blocks read OK are scattered, and borrowed ones
are released once their copies are done (``start_scatter`` enqueues them,
``end_scatter`` waits: a thread may start the next load in between). A load
part with a chosen tier (``TransferPart.tier_index``) is read from that tier
of a ``TieredStore`` only, and borrowed only when it is the first (whose
memory that is). A tier that raises fails the job's blocks; it never reaches
the engine's threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, Tier
from hybridkv.transfer.copier import BlockCopier, CopyMark
from hybridkv.transfer.in_place import (
    Borrowed,
    InPlaceCopies,
    StartedStore,
    job_tier_indexes,
    merge_statuses,
)
from hybridkv.transfer.jobs import Job, JobKind
from hybridkv.transfer.placement import StagingPlacement

logger = logging.getLogger(__name__)


class StartedScatter(NamedTuple):
    """A load's copies, enqueued: done once ``mark`` is (``BlockCopier.copies_mark``);
    ``error`` when enqueuing them failed part way (the mark still covers what was)."""

    mark: CopyMark
    error: str | None


class JobMoves:
    def __init__(
        self,
        tier: Tier,
        copier: BlockCopier,
        placement: StagingPlacement,
        in_place: InPlaceCopies | None,
    ) -> None:
        self.tier = tier
        self.copier = copier
        self.placement = placement
        self.in_place = in_place

    @property
    def num_tiers(self) -> int:
        """How many tiers a load part may choose from (``TransferPart.tier_index``)."""
        return self.tier.num_tiers

    def copy_out(self, job: Job) -> list[PutStatus] | None:
        """A store's copies: into the tier's memory (statuses: the store is done), or
        into staging (None: the tier call follows)."""
        started = self.start_copy_out(job)
        return started if not isinstance(started, StartedStore) else self.end_copy_out(job, started)

    def start_copy_out(self, job: Job) -> StartedStore | list[PutStatus] | None:
        """Begin a store's copies. Into the tier's memory they are only enqueued
        (``end_copy_out`` finishes them), unless reserving failed (the statuses);
        into staging they are done on return (None: the tier call follows)."""
        if self.in_place is not None and job.in_place:
            return self.in_place.start_store(job)
        self.placement.gather(job)  # marks the job enqueued
        return None

    def end_copy_out(self, job: Job, started: StartedStore) -> list[PutStatus]:
        """Finish an in-place store begun by ``start_copy_out``: its statuses."""
        assert self.in_place is not None
        return self.in_place.end_store(job, started)

    def call_tier(
        self, job: Job, before_read: Callable[[], None] | None = None
    ) -> tuple[list[GetStatus] | list[PutStatus], str | None, Borrowed]:
        """The tier's answers (empty, with the error, when it raised), and for a load the
        blocks borrowed from the tier's memory (to release once scattered).
        ``before_read`` runs before a load reads blocks into staging (none: it never
        runs)."""
        keys = [key for part in job.parts for key in part.keys]
        borrowed: Borrowed = []
        try:
            statuses: list[GetStatus] | list[PutStatus]
            if job.kind is JobKind.STORE:
                statuses = self.tier.put_many(keys, job.buffers, checksums=job.checksums)
            else:
                if self.in_place is not None:
                    borrowed = self.in_place.borrow(job)
                statuses = self._read_staged(job, keys, borrowed, before_read)
            if len(statuses) != len(keys):
                raise RuntimeError(f"tier returned {len(statuses)} statuses for {len(keys)} keys")
            return statuses, None, borrowed
        except Exception as exc:
            logger.warning(
                "%s job %d: tier %s failed: %r", job.kind.value, job.job_id, self.tier.name, exc
            )
            return [], f"tier {self.tier.name} raised {type(exc).__name__}: {exc}", borrowed

    def _read_staged(
        self,
        job: Job,
        keys: Sequence[StoreKey],
        borrowed: Borrowed,
        before_read: Callable[[], None] | None,
    ) -> list[GetStatus]:
        """Read what was not borrowed into staging; every key's status."""
        tier_indexes = job_tier_indexes(job)
        if before_read is not None and (
            not borrowed or any(not isinstance(b, int) for b in borrowed)
        ):
            before_read()
        if not borrowed:
            job.staged_statuses = self._read(keys, job.buffers, tier_indexes)
            return job.staged_statuses
        rest = [j for j, b in enumerate(borrowed) if not isinstance(b, int)]
        answers = self._read(
            [keys[j] for j in rest], [job.buffers[j] for j in rest], [tier_indexes[j] for j in rest]
        )
        staged = [GetStatus.MISS] * len(keys)  # borrowed blocks are not scattered from staging
        for j, status in zip(rest, answers, strict=True):
            staged[j] = status
        job.staged_statuses = staged
        return merge_statuses(borrowed, answers)

    def _read(
        self, keys: Sequence[StoreKey], buffers: Sequence[Buffer], tier_indexes: list[int | None]
    ) -> list[GetStatus]:
        """Read each key from its chosen tier (None: the cheapest tier holding it)."""
        if not keys:
            return []
        if all(index is None for index in tier_indexes):
            statuses = self.tier.get_many_into(keys, buffers)
        else:
            statuses = [GetStatus.MISS] * len(keys)
            for index in dict.fromkeys(tier_indexes):
                picked = [j for j, i in enumerate(tier_indexes) if i == index]
                picked_keys, picked_buffers = (
                    [keys[j] for j in picked],
                    [buffers[j] for j in picked],
                )
                if index is None:
                    answers = self.tier.get_many_into(picked_keys, picked_buffers)
                else:
                    answers = self.tier.get_many_from(index, picked_keys, picked_buffers)
                if len(answers) != len(picked):
                    raise RuntimeError(f"tier returned {len(answers)} statuses for {len(picked)}")
                for j, status in zip(picked, answers, strict=True):
                    statuses[j] = status
        if len(statuses) != len(keys):
            raise RuntimeError(f"tier returned {len(statuses)} statuses for {len(keys)} keys")
        return statuses

    def scatter(self, job: Job, borrowed: Borrowed) -> str | None:
        """Scatter the borrowed blocks and those read OK into staging; return once every
        copy is done (the borrowed blocks may be released then)."""
        return self.end_scatter(self.start_scatter(job, borrowed))

    def start_scatter(self, job: Job, borrowed: Borrowed) -> StartedScatter:
        """Enqueue a load's copies: the borrowed blocks and those read OK into staging
        (done on return where copies are synchronous). ``end_scatter`` finishes them."""
        try:
            if borrowed and self.in_place is not None:
                self.in_place.scatter(job, borrowed)
            if job.staged_statuses is not None:
                self.placement.scatter(job, job.staged_statuses)
        except Exception as exc:  # a bug, not an I/O failure; the loaded KV is suspect
            logger.exception("load job %d: scatter failed", job.job_id)
            # Copies enqueued before the failure may still run: the mark covers them.
            error = f"scatter raised {type(exc).__name__}: {exc}"
            return StartedScatter(self.copier.copies_mark(), error)
        return StartedScatter(self.copier.copies_mark(), None)

    def end_scatter(self, started: StartedScatter) -> str | None:
        """Wait until a load's copies are done (its borrowed blocks may be released
        then); the error, if starting them failed."""
        self.copier.wait_done(started.mark)
        return started.error

    def release(self, job: Job, borrowed: Borrowed) -> None:
        """End a load's borrows (after its copies are done, or when it was given up on)."""
        if borrowed and self.in_place is not None:
            self.in_place.release(job, borrowed)
