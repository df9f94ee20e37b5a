"""Reading stored objects back: slots checked, payloads read and verified.

Runs wherever a disk tier serves gets (the writer, and read-only followers).
A run of objects in consecutive slots costs one ``pread`` for the slots, a
check of each slot in Python, and one native call (``preads.read_hashed``)
that reads every payload and hashes it right after its read, while it is
still in the CPU's cache (checking a whole batch after reading it all reads
every byte from memory twice), without the GIL.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hybridkv.tiers import codec
from hybridkv.tiers.base import Buffer, StoreKey, buffer_address
from hybridkv.tiers.codec import HeaderError
from hybridkv.tiers.disk import preads
from hybridkv.tiers.disk.files import io_all
from hybridkv.tiers.disk.segments import (
    GONE,
    SLOT_BYTES,
    SegmentHeader,
    Slot,
    SlotState,
    parse_slot,
    read_segment_header,
    slot_offset,
)


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
    what is wrong. Their slots come in one ``pread``, the payloads in one native call.

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
    offsets = np.fromiter((run[i].offset for i in todo), np.int64, len(todo))
    lengths = np.fromiter((len(run[i].out) for i in todo), np.int64, len(todo))
    addresses = np.fromiter((buffer_address(run[i].out) for i in todo), np.int64, len(todo))
    got, hashes = preads.read_hashed(fd, offsets, lengths, addresses)
    for i, num_bytes, value in zip(todo, got.tolist(), hashes.tolist(), strict=True):
        wanted = run[i]
        # An error: read again from Python, which raises what went wrong.
        if num_bytes < 0 and io_all(os.preadv, fd, [wanted.out.data], wanted.offset):
            value, num_bytes = codec.checksum(wanted.out), len(wanted.out)
        if num_bytes < len(wanted.out):
            outcomes[i] = HeaderError.TRUNCATED
        elif value != checksums[i]:
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
