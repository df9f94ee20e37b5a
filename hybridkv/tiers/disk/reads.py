"""Reading stored objects back: slots checked, payloads read and verified.

Runs wherever a disk tier serves gets (the writer, and read-only followers).
A run of objects in consecutive slots costs one ``pread`` for the slots and
one ``preadv`` per stretch of payloads that follow one another on disk
(up to ``STRETCH_BYTES``), each verified right after its read.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import NamedTuple

from hybridkv.tiers import codec
from hybridkv.tiers.base import Buffer, StoreKey
from hybridkv.tiers.codec import HeaderError
from hybridkv.tiers.disk.files import io_all
from hybridkv.tiers.disk.segments import (
    GONE,
    SLOT_BYTES,
    SegmentHeader,
    Slot,
    SlotState,
    align_up,
    parse_slot,
    read_segment_header,
    slot_offset,
)

STRETCH_BYTES = 1 << 20
"""Payload bytes read by one ``preadv`` at most: each stretch is verified right
after its read, while it is still in the CPU's cache (checking a whole batch
after reading it all reads every byte from memory twice)."""


class Wanted(NamedTuple):
    """One object of a read: its slot, where its payload starts, its key and buffer."""

    slot: int
    offset: int
    key: StoreKey
    out: Buffer


def read_run(
    fd: int, header: SegmentHeader, run: Sequence[Wanted], *, reader: bool
) -> list[HeaderError | str | None]:
    """Read and verify the objects of consecutive slots: per object None, ``GONE`` or
    what is wrong. Their slots come in one ``pread`` and the payloads that follow one
    another on disk in one ``preadv`` (per-object calls cost more than the copy of a
    few hundred KiB from the page cache).

    ``reader``: a read-only instance, whose writer may have taken the file over since
    it was indexed; the writer's own files change only by its hand.
    """
    assert all(w.slot == run[0].slot + i for i, w in enumerate(run)), "slots not consecutive"
    raw = os.pread(fd, len(run) * SLOT_BYTES, slot_offset(run[0].slot))
    outcomes: list[HeaderError | str | None] = []
    checksums: list[int] = []
    for i, wanted in enumerate(run):
        slot = _checked_slot(fd, header, raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES], wanted, reader)
        outcomes.append(None if isinstance(slot, Slot) else slot)
        checksums.append(slot.checksum if isinstance(slot, Slot) else 0)
    todo = [i for i, outcome in enumerate(outcomes) if outcome is None]
    for stretch in stretches(run, todo):
        if not io_all(os.preadv, fd, _with_gaps([run[i] for i in stretch]), run[stretch[0]].offset):
            for i in stretch:  # which object the file ends in: one at a time
                if not io_all(os.preadv, fd, [run[i].out.data], run[i].offset):
                    outcomes[i] = HeaderError.TRUNCATED
        for i in stretch:  # while the bytes are still in cache
            if outcomes[i] is None and codec.checksum(run[i].out) != checksums[i]:
                outcomes[i] = HeaderError.BAD_CHECKSUM
    return outcomes


def _checked_slot(
    fd: int, header: SegmentHeader, raw: bytes, wanted: Wanted, reader: bool
) -> Slot | HeaderError | str:
    """The slot, when it still holds ``wanted``'s object; else GONE or what is wrong."""
    slot = parse_slot(raw, header, header.size)
    if isinstance(slot, str):
        return slot
    if slot is not None and slot.state is SlotState.DEAD:
        return GONE
    if slot is None or slot.offset != wanted.offset:
        # A live slot never changes within one life of the file: either a later life
        # took the file over (a miss), or the slot was damaged since it was indexed.
        current = read_segment_header(fd)
        if reader and isinstance(current, SegmentHeader) and current.seq != header.seq:
            return GONE
        return "slot damaged since it was indexed"
    # parse_slot checked magic and version; the rest of codec.verify_header:
    if slot.digest != codec.key_digest(wanted.key):
        return HeaderError.WRONG_KEY
    if slot.length != len(wanted.out):
        return HeaderError.WRONG_LENGTH
    return slot


def stretches(run: Sequence[Wanted], picked: list[int]) -> list[list[int]]:
    """``picked`` objects of the run grouped where each starts at the page after the
    previous one ends, a stretch closed once it holds ``STRETCH_BYTES``."""
    grouped: list[list[int]] = []
    num_bytes = 0
    for i in picked:
        last = run[grouped[-1][-1]] if grouped else None
        if (
            last is not None
            and num_bytes < STRETCH_BYTES
            and run[i].offset == align_up(last.offset + len(last.out))
        ):
            grouped[-1].append(i)
        else:
            grouped.append([i])
            num_bytes = 0
        num_bytes += len(run[i].out)
    return grouped


def _with_gaps(stretch: Sequence[Wanted]) -> list[memoryview]:
    """The stretch's buffers, with scratch for the padding up to each next page."""
    views: list[memoryview] = []
    for previous, wanted in itertools.pairwise(stretch):
        views.append(previous.out.data)
        gap = wanted.offset - previous.offset - len(previous.out)
        if gap:
            views.append(memoryview(bytearray(gap)))
    views.append(stretch[-1].out.data)
    return views


def read_object(
    fd: int,
    header: SegmentHeader,
    slot_index: int,
    offset: int,
    key: StoreKey,
    out: Buffer,
    *,
    reader: bool,
) -> HeaderError | str | None:
    """Read one object into ``out`` and verify it: None, ``GONE`` or what is wrong."""
    return read_run(fd, header, [Wanted(slot_index, offset, key, out)], reader=reader)[0]
