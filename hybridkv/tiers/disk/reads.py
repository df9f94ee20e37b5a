"""Reading stored objects back: slots checked, payloads read and verified.

Runs wherever a disk tier serves gets (the writer, and read-only followers).
A get goes in three steps per run of objects in consecutive slots:

* ``check_run``: one ``pread`` for the slots and a check of each in Python;
* ``read_payloads``: one native call (``preads.read_hashed``) that reads
  every payload and hashes it right after its read, while it is still in
  the CPU's cache (checking a whole batch after reading it all reads every
  byte from memory twice), without the GIL;
* ``verify_run``: each checksum compared with its slot's.

The tier runs the first and last steps of every run on the calling thread
and only the native reads on its I/O threads: Python work there would wait
for the GIL that the other threads' Python work holds, and the reads of two
runs then took turns instead of overlapping (two I/O threads got no more
than one).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybridkv.tiers import codec
from hybridkv.tiers.base import Buffer, buffer_address
from hybridkv.tiers.codec import HeaderError
from hybridkv.tiers.disk import preads
from hybridkv.tiers.disk.files import io_all
from hybridkv.tiers.disk.preads import ReadHashed
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


_NONE = np.zeros(0, np.int64)


@dataclass
class CheckedRun:
    """A run whose slots were checked: an outcome per object, where None means "to
    read", and what the native read needs for those."""

    fd: int
    wanted: Sequence[Wanted]
    outcomes: list[Outcome]
    checksums: list[int] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)
    offsets: np.ndarray = field(default_factory=lambda: _NONE)
    lengths: np.ndarray = field(default_factory=lambda: _NONE)
    addresses: np.ndarray = field(default_factory=lambda: _NONE)

    @classmethod
    def failed(cls, run: Sequence[Wanted], outcome: Outcome) -> CheckedRun:
        """A run with nothing to read: every object has ``outcome``."""
        assert outcome is not None
        return cls(-1, run, [outcome] * len(run))


def check_run(fd: int, header: SegmentHeader, run: Sequence[Wanted], *, reader: bool) -> CheckedRun:
    """Check the slots of objects in consecutive slots, with one ``pread``.

    ``reader``: a read-only instance, whose writer may have taken the file over since
    it was indexed; the writer's own files change only by its hand.
    """
    assert all(w.slot == run[0].slot + i for i, w in enumerate(run)), "slots not consecutive"
    raw = os.pread(fd, len(run) * SLOT_BYTES, slot_offset(run[0].slot))
    outcomes: list[Outcome] = []
    checksums: list[int] = []
    for i, wanted in enumerate(run):
        slot = _checked_slot(fd, header, raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES], wanted, reader)
        outcomes.append(None if isinstance(slot, Slot) else slot)
        checksums.append(slot.checksum if isinstance(slot, Slot) else 0)
    todo = [i for i, outcome in enumerate(outcomes) if outcome is None]
    return CheckedRun(
        fd,
        run,
        outcomes,
        checksums,
        todo,
        offsets=np.fromiter((run[i].offset for i in todo), np.int64, len(todo)),
        lengths=np.fromiter((len(run[i].out) for i in todo), np.int64, len(todo)),
        addresses=np.fromiter((buffer_address(run[i].out) for i in todo), np.int64, len(todo)),
    )


def read_payloads(checked: CheckedRun) -> ReadHashed:
    """Read and hash the payloads ``check_run`` left to read (native, without the GIL)."""
    return preads.read_hashed(checked.fd, checked.offsets, checked.lengths, checked.addresses)


def verify_run(checked: CheckedRun, read: ReadHashed) -> list[Outcome]:
    """Per object of the run: None when its payload was read whole and matches its
    slot's checksum, else what went wrong."""
    outcomes = list(checked.outcomes)
    for i, num_bytes, value in zip(
        checked.todo, read.got.tolist(), read.hashes.tolist(), strict=True
    ):
        wanted = checked.wanted[i]
        # An error: read again from Python, which raises what went wrong.
        if num_bytes < 0:
            try:
                if io_all(os.preadv, checked.fd, [wanted.out.data], wanted.offset):
                    value, num_bytes = codec.checksum(wanted.out), len(wanted.out)
            except OSError as exc:
                outcomes[i] = exc
                continue
        if num_bytes < len(wanted.out):
            outcomes[i] = HeaderError.TRUNCATED
        elif value != checked.checksums[i]:
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
    if slot.digest != wanted.digest:
        return HeaderError.WRONG_KEY
    if slot.length != len(wanted.out):
        return HeaderError.WRONG_LENGTH
    return slot
