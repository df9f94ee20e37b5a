"""What the disk tier's table holds: a segment's state in memory, where an object
lives, a put's reservation, and the file work reservations leave.

No I/O (``disk.table`` keeps these under ``DiskTier``'s lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from hybridkv.tiers.digest_table import NONE, Rows
from hybridkv.tiers.disk.segments import SegmentHeader

SEEN = -2
"""In ``Segment.rows``: a slot read and handled with nothing indexed (dead, damaged,
forgotten, or its key indexed from another slot)."""


def no_rows() -> npt.NDArray[np.int32]:
    return np.zeros(0, np.int32)


@dataclass(eq=False)
class Segment:
    header: SegmentHeader
    path: str
    fd: int = -1
    next_slot: int = 0
    """Writer: next free slot. Read-only: first slot that may still be filled."""
    cursor: int = 0
    """Writer: next free data offset (page aligned)."""
    number: int = NONE
    """Its number in the index while the table holds it; NONE after."""
    rows: npt.NDArray[np.int32] = field(default_factory=no_rows)
    """Per slot (as far as any is known): the index row of its object, ``SEEN``, or
    NONE (empty, or not read yet: a read-only instance reads it again)."""
    pending: int = 0
    """Reservations whose bytes are being written."""
    readers: int = 0
    superseded: bool = False
    """Writer: takes no new reservations (another segment is active)."""
    sealed: bool = False
    """The header says so: every slot that will ever be filled is."""
    failed: bool = False
    """Its file could not be prepared."""
    lost: bool = False
    """Its file was removed from outside (no links left)."""
    mtime_ns: int = 0
    """Writer: its last use, as stamped on the file."""
    reused: bool = False
    """Holds an object noted reused (``SegmentTable.mark_reused``; the header's flag on
    disk)."""
    hit: bool = False
    """Marked reused, and one of its objects was read since (``SegmentTable.mark_hit``;
    a header flag too)."""
    reuse: Segment | None = None
    """While opening: the evicted segment whose file this one takes over."""
    reuse_seq: int = 0
    """The seq of that segment (0: a new file), kept for integrity checks."""
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def seq(self) -> int:
        return self.header.seq

    @property
    def size(self) -> int:
        return self.header.size

    def fits(self, num_bytes: int) -> bool:
        return self.next_slot < self.header.num_slots and self.cursor + num_bytes <= self.size

    @property
    def kept(self) -> int:
        """How long eviction keeps it: 0 (nothing reused), 1 (reused), 2 (and hit since)."""
        return int(self.reused) + int(self.hit)

    @property
    def idle(self) -> bool:
        return self.pending == 0 and self.readers == 0 and self.ready.is_set()

    def handled(self, slots: Rows) -> npt.NDArray[np.bool_]:
        """Whether each slot was read and handled before (``rows`` knows it)."""
        known = np.zeros(len(slots), np.bool_)
        inside = slots < len(self.rows)
        known[inside] = self.rows[slots[inside]] != NONE
        return known

    def live_slots(self) -> Rows:
        return np.flatnonzero(self.rows >= 0).astype(np.int64)

    def mark(self, slots: Rows, values: Rows | int) -> None:
        """Set ``rows`` of these slots, growing it (by doubling, within the table)."""
        if not len(slots):
            return
        needed = int(slots.max()) + 1
        if needed > len(self.rows):
            size = min(self.header.num_slots, max(needed, 2 * len(self.rows)))
            self.rows = np.concatenate([self.rows, np.full(size - len(self.rows), NONE, np.int32)])
        self.rows[slots] = values


class Entry(NamedTuple):
    """Where a get finds one object."""

    segment: Segment
    slot: int
    offset: int
    length: int
    """The payload's size as the get expects it (its buffer's): the slot on disk says
    whether it holds that many."""


class Reservation(NamedTuple):
    item: int
    """Index of the object in its put batch."""
    digest: bytes
    segment: Segment
    slot: int
    offset: int
    length: int


@dataclass
class FileWork:
    """What reservations left for the caller to do on disk, outside the lock."""

    to_open: list[Segment] = field(default_factory=list)
    """New segments to prepare (create, or take over ``segment.reuse``'s file)."""
    discarded: list[Segment] = field(default_factory=list)
    """Evicted segments whose files go."""
    superseded: list[Segment] = field(default_factory=list)
    """Segments that stopped taking reservations (to seal once idle)."""
    passed: list[Segment] = field(default_factory=list)
    """Hit segments an eviction passed over: no longer hit (their header flags to
    rewrite)."""
