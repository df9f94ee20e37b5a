"""Reading stored objects back: slots checked, payloads read and verified.

Runs wherever a disk tier serves gets (the writer, and read-only followers).
A get goes in three steps per run of objects in consecutive slots:

* ``plan_run``: the arrays the native read takes (no I/O);
* ``read_planned``: one native call (``preads.read_run``) that reads the
  run's slots, checks each against the index, reads each payload whose
  slot holds and compares its hash, taken right after its read while it is
  in the CPU's cache, with the slot's checksum; without the GIL;
* ``verify_run``: the outcome per object. Where the native call found all
  well, nothing more; anything else is decided here, in Python, from the
  slot bytes it read: whether the slot was freed, the file taken over by a
  later life, or what is wrong.

The tier runs the first and last steps on the calling thread and only the
native reads on its I/O threads: Python work there waits for the GIL that
the other threads' Python work holds, and the reads of two runs then took
turns instead of overlapping (two I/O threads got no more than one).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hybridkv.tiers import codec
from hybridkv.tiers.base import Buffer, buffer_address
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

Outcome = HeaderError | OSError | str | None
"""Per object: None (read and verified), ``GONE``, an I/O error or what is wrong."""


class Wanted(NamedTuple):
    """One object of a read: its slot, where its payload starts, its key's digest
    (``codec.key_digest``) and the buffer it goes into."""

    slot: int
    offset: int
    digest: bytes
    out: Buffer


class PlannedRun(NamedTuple):
    """A run of objects in consecutive slots of one segment file, ready to read."""

    fd: int
    header: SegmentHeader
    wanted: Sequence[Wanted]
    offsets: np.ndarray
    lengths: np.ndarray
    addresses: np.ndarray
    digests: bytes


def plan_run(fd: int, header: SegmentHeader, run: Sequence[Wanted]) -> PlannedRun:
    assert all(w.slot == run[0].slot + i for i, w in enumerate(run)), "slots not consecutive"
    count = len(run)
    return PlannedRun(
        fd,
        header,
        run,
        offsets=np.fromiter((w.offset for w in run), np.int64, count),
        lengths=np.fromiter((len(w.out) for w in run), np.int64, count),
        addresses=np.fromiter((buffer_address(w.out) for w in run), np.int64, count),
        digests=b"".join(w.digest for w in run),
    )


def read_planned(planned: PlannedRun) -> preads.RunRead:
    """Check the run's slots and read what they hold (native, without the GIL)."""
    first = slot_offset(planned.wanted[0].slot) if planned.wanted else 0
    return preads.read_run(
        planned.fd,
        planned.header,
        first,
        planned.offsets,
        planned.lengths,
        planned.digests,
        planned.addresses,
    )


def read_any(planned: PlannedRun | Outcome) -> preads.RunRead | None:
    """``read_planned`` of a planned run; None for one not planned (its outcome is known)."""
    return read_planned(planned) if isinstance(planned, PlannedRun) else None


def outcomes(
    planned: PlannedRun | Outcome, read: preads.RunRead | None, count: int, *, reader: bool
) -> list[Outcome]:
    """``verify_run`` of a planned run; for one not planned, its outcome ``count`` times."""
    if not isinstance(planned, PlannedRun):
        return [planned] * count
    assert read is not None
    return verify_run(planned, read, reader=reader)


def verify_run(planned: PlannedRun, read: preads.RunRead, *, reader: bool) -> list[Outcome]:
    """Per object of the run: None when its slot holds what was indexed and its payload
    was read whole and matches the slot's checksum, else what went wrong.

    ``reader``: a read-only instance, whose writer may have taken the file over since
    it was indexed; the writer's own files change only by its hand.
    """
    status = read.status
    if not status.any():  # all OK
        return [None] * len(status)
    slots = read.slots
    if slots is None:  # reading the slots failed: again from Python, which raises
        try:
            slots = os.pread(
                planned.fd, len(status) * SLOT_BYTES, slot_offset(planned.wanted[0].slot)
            )
        except OSError as exc:
            return [exc] * len(status)
        # It worked this time: every slot is checked, and every payload read, from here.
    outcomes: list[Outcome] = []
    for i, (wanted, code) in enumerate(zip(planned.wanted, status.tolist(), strict=True)):
        if code == preads.OK:
            outcomes.append(None)
            continue
        raw = slots[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]
        slot = _checked_slot(planned.fd, planned.header, raw, wanted, reader)
        if not isinstance(slot, Slot):
            outcomes.append(slot)
        elif code == preads.SHORT:
            outcomes.append(HeaderError.TRUNCATED)
        elif code == preads.BAD_CHECKSUM:
            outcomes.append(HeaderError.BAD_CHECKSUM)
        else:  # the read failed (or the native check did not pass a slot Python does)
            outcomes.append(_read_in_python(planned.fd, wanted, slot))
    return outcomes


def _read_in_python(fd: int, wanted: Wanted, slot: Slot) -> Outcome:
    """Read and verify one payload from Python, which raises what went wrong."""
    try:
        if not io_all(os.preadv, fd, [wanted.out.data], wanted.offset):
            return HeaderError.TRUNCATED
    except OSError as exc:
        return exc
    return None if codec.checksum(wanted.out) == slot.checksum else HeaderError.BAD_CHECKSUM


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
    if slot.digest != wanted.digest:
        return HeaderError.WRONG_KEY
    if slot.length != len(wanted.out):
        return HeaderError.WRONG_LENGTH
    return slot
