"""Where a job's blocks lie in the staging arena, and the copies in and out of them.

Runs in the worker process, under the transfer engine (not thread-safe by
itself). Without header room, a part's blocks are consecutive rows, copied in
one call per part. With room (a tier that frames objects in place asks for
it, ``Tier.register_staging``), every block sits ``room_bytes`` behind the
start of its own aligned slot (rows ``stride`` bytes apart, still one copier
call per part): the tier then writes its header into the room and moves
header and payload as one slice, with no copy of its own. The gather then
also hands it each block's checksum, taken while the block was in cache, so
the tier need not read the payload again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus
from hybridkv.transfer.copier import BlockCopier, HostRows
from hybridkv.transfer.jobs import Job, TransferPart
from hybridkv.transfer.staging import STAGING_ALIGN_BYTES, StagingArena


def _aligned(nbytes: int) -> int:
    return -(-nbytes // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES


class StagingPlacement:
    def __init__(self, arena: StagingArena, copier: BlockCopier, room_bytes: int) -> None:
        if isinstance(room_bytes, bool) or not isinstance(room_bytes, int) or room_bytes < 0:
            raise ValueError(
                f"tier asked for header room {room_bytes!r}; register_staging must return "
                "an int >= 0 (0: no room)"
            )
        self.arena = arena
        self.copier = copier
        self.room_bytes = _aligned(room_bytes)
        """Bytes in front of each block's payload (aligned up, so payloads stay aligned)."""

    def stride(self, group_id: int) -> int:
        """Bytes from one block of the group to the next within a part."""
        block_bytes = self.copier.block_bytes(group_id)
        return _aligned(self.room_bytes + block_bytes) if self.room_bytes else block_bytes

    def plan(self, parts: Sequence[TransferPart]) -> tuple[tuple[int, ...], int]:
        """Each part's offset within the job's region, and the region's size."""
        offsets: list[int] = []
        total = 0
        for part in parts:
            offsets.append(total)
            total += self.arena.region_bytes(len(part.block_ids) * self.stride(part.group_id))
        if total > self.arena.total_bytes:
            raise ValueError(
                f"job needs {total} staging bytes but the arena has {self.arena.total_bytes}; "
                "split the job or raise TransferConfig.staging_bytes"
            )
        return tuple(offsets), total

    def buffers(self, job: Job) -> list[Buffer]:
        """One payload view per block, in job order."""
        return [view for i, part in enumerate(job.parts) for view in self._blocks(job, i, part)]

    def gather(self, job: Job) -> None:
        """Copy the job's blocks into staging, after ``job.compute_mark``; return once they
        are there. With header room, also take each block's checksum (``job.checksums``,
        for the tier's header): on CPU while the block is in cache."""
        hashed = bool(self.room_bytes)
        checksums: list[int] = []
        for i, part in enumerate(job.parts):
            if part.block_ids:
                hashes = self.copier.gather_at(
                    part.group_id,
                    part.block_ids,
                    self._host_rows(job, i, part),
                    after=job.compute_mark,
                    hashed=hashed,
                )
                checksums += [] if hashes is None else hashes.tolist()
        job.copies_mark = self.copier.copies_mark()
        job.enqueued.set()
        self.copier.wait_done(job.copies_mark)
        job.copies_mark = None
        job.checksums = checksums if hashed else None

    def scatter(self, job: Job, statuses: Sequence[GetStatus | PutStatus]) -> None:
        """Enqueue the copies back of the blocks answered OK, and only those (done on
        return where copies are synchronous; the caller waits for the copier's mark)."""
        start = 0
        for i, part in enumerate(job.parts):
            part_statuses = statuses[start : start + len(part.block_ids)]
            start += len(part.block_ids)
            ok_rows = [r for r, s in enumerate(part_statuses) if s is GetStatus.OK]
            if not ok_rows:
                continue
            rows = self._host_rows(job, i, part)
            if len(ok_rows) < len(part_statuses):
                rows = rows._replace(offsets=rows.offsets[ok_rows])
            block_ids = [part.block_ids[r] for r in ok_rows]
            self.copier.scatter_at(part.group_id, block_ids, rows, after=job.compute_mark)

    def _host_rows(self, job: Job, index: int, part: TransferPart) -> HostRows:
        """Where a part's block payloads lie in the arena (the header room between them
        is the tier's to write after the copy)."""
        assert job.staging_offset is not None
        stride = self.stride(part.group_id)
        first = job.staging_offset + job.part_offsets[index] + self.room_bytes
        offsets = first + np.arange(len(part.block_ids), dtype=np.int64) * stride
        return HostRows(self.arena.tensor, offsets, scratch_gaps=True)

    def _blocks(self, job: Job, index: int, part: TransferPart) -> list[Buffer]:
        assert job.staging_offset is not None or not part.block_ids
        block_bytes = self.copier.block_bytes(part.group_id)
        stride = self.stride(part.group_id)
        first = (job.staging_offset or 0) + job.part_offsets[index] + self.room_bytes
        return [
            self.arena.view(first + k * stride, block_bytes) for k in range(len(part.block_ids))
        ]
