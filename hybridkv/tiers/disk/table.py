"""The disk tier's bookkeeping: which object lives where, segments in LRU order.

No I/O: ``DiskTier`` holds its lock around every call and does the file work
the answers ask for (open a segment, unlink or reuse an evicted file, seal).
A put reserves a slot and a page-aligned data range in the active segment;
a new segment first evicts idle segments, least recently used first, and
hands the first victim's file over for reuse.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from hybridkv.tiers.disk.paths import DiskPaths
from hybridkv.tiers.disk.segments import Geometry, SegmentHeader, align_up

MIN_PART_BYTES = 1 << 20
"""A get is cut into tasks for its I/O threads of at least this size."""


@dataclass(eq=False)
class Segment:
    header: SegmentHeader
    path: str
    fd: int = -1
    next_slot: int = 0
    """Writer: next free slot. Read-only: first slot that may still be filled."""
    cursor: int = 0
    """Writer: next free data offset (page aligned)."""
    digests: set[str] = field(default_factory=set)
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
    reuse: Segment | None = None
    """While opening: the evicted segment whose file this one takes over."""
    reuse_seq: int = 0
    """The seq of that segment (0: a new file), kept for integrity checks."""
    seen_slots: set[int] = field(default_factory=set)
    """Read-only: filled slots already handled (rescans skip them)."""
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
    def idle(self) -> bool:
        return self.pending == 0 and self.readers == 0 and self.ready.is_set()


class Entry(NamedTuple):
    segment: Segment
    slot: int
    offset: int
    length: int


class Reservation(NamedTuple):
    item: int
    """Index of the object in its put batch."""
    digest: str
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


class SegmentTable:
    """Segments (least recently used first), the key index and bytes allocated."""

    def __init__(self, paths: DiskPaths, capacity_bytes: int, geometry: Geometry) -> None:
        self.paths = paths
        self.capacity_bytes = capacity_bytes
        self.geometry = geometry
        self.segments: OrderedDict[int, Segment] = OrderedDict()
        self.index: dict[str, Entry] = {}
        """Hex key digest -> where its object lives."""
        self.pending: set[str] = set()
        """Digests of puts being written."""
        self.allocated = 0
        self.active: Segment | None = None
        self.next_seq = 1
        self.num_evicted = 0
        """Objects dropped with their segments."""

    def add(self, segment: Segment) -> None:
        """A segment found on disk, as the most recently used."""
        self.segments[segment.seq] = segment
        self.allocated += segment.size
        self.next_seq = max(self.next_seq, segment.seq + 1)

    def holds(self, segment: Segment) -> bool:
        return self.segments.get(segment.seq) is segment

    def use(self, segment: Segment) -> None:
        if self.holds(segment):
            self.segments.move_to_end(segment.seq)

    def index_slot(self, digest: str, entry: Entry) -> bool:
        """Index a live slot found by a scan; False if the key is indexed already."""
        if digest in self.index:
            return False
        self.index[digest] = entry
        entry.segment.digests.add(digest)
        return True

    def reserve(self, item: int, digest: str, num_bytes: int, work: FileWork) -> Reservation | str:
        """Room for one object, or "exists" / "full"; file work goes into ``work``."""
        entry = self.index.get(digest)
        if entry is not None:
            self.use(entry.segment)
            return "exists"
        if digest in self.pending:
            return "exists"
        if num_bytes > self.geometry.data_bytes:
            segment = self._new_segment(Geometry.dedicated(num_bytes), work)
            if segment is not None:
                segment.superseded = True  # holds this object only
        else:
            segment = self.active
            if segment is None or not segment.fits(num_bytes):
                if segment is not None:
                    self.supersede(segment)
                    work.superseded.append(segment)
                segment = self.active = self._new_segment(self.geometry, work)
        if segment is None:
            return "full"
        slot, offset = segment.next_slot, segment.cursor
        segment.next_slot += 1
        segment.cursor = offset + align_up(num_bytes)
        segment.pending += 1
        self.pending.add(digest)
        seq = segment.header.seq  # ``use``, inlined: this runs once per object put
        if self.segments.get(seq) is segment:
            self.segments.move_to_end(seq)
        return Reservation(item, digest, segment, slot, offset, num_bytes)

    def supersede(self, segment: Segment) -> None:
        segment.superseded = True
        if self.active is segment:
            self.active = None

    def _new_segment(self, geometry: Geometry, work: FileWork) -> Segment | None:
        if geometry.size > self.capacity_bytes:
            return None
        victims: list[Segment] = []
        while self.allocated + geometry.size > self.capacity_bytes:
            victim = self.lru_idle()
            if victim is None:  # the rest is busy: no room now
                work.discarded.extend(victims)
                return None
            self.evict(victim)
            victims.append(victim)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        header = SegmentHeader(seq, geometry.size, geometry.num_slots, geometry.data_offset, False)
        segment = Segment(header, self.paths.segment(seq))
        segment.cursor = geometry.data_offset
        if victims:
            segment.reuse, segment.reuse_seq = victims[0], victims[0].seq  # its file is ours
        self.segments[seq] = segment
        self.allocated += geometry.size
        work.to_open.append(segment)
        work.discarded.extend(victims[1:])
        return segment

    def commit_part(self, part: list[Reservation], written: bool) -> int:
        """Index the reservations of one written part (all of one segment, or none
        written); returns how many were indexed."""
        pending, index = self.pending, self.index
        for r in part:
            r.segment.pending -= 1
            pending.discard(r.digest)
        if not written or not part or not self.holds(part[0].segment):
            return 0
        segment = part[0].segment
        digests = segment.digests
        for r in part:
            index[r.digest] = Entry(segment, r.slot, r.offset, r.length)
            digests.add(r.digest)
        return len(part)

    def evict(self, segment: Segment, *, count: bool = True) -> None:
        """Forget a segment and its objects (its file is the caller's business)."""
        for digest in segment.digests:
            self.index.pop(digest, None)
        if count:
            self.num_evicted += len(segment.digests)
        segment.digests.clear()
        del self.segments[segment.seq]
        self.allocated -= segment.size
        if self.active is segment:
            self.active = None

    def forget(self, digest: str, entry: Entry) -> None:
        if self.index.get(digest) is entry:
            del self.index[digest]
            entry.segment.digests.discard(digest)

    def lru_idle(self) -> Segment | None:
        return next((s for s in self.segments.values() if s.idle), None)

    def check(self) -> None:
        """Raise AssertionError if index, segments and counters disagree."""
        assert len(self.pending) == sum(s.pending for s in self.segments.values())
        assert all(s.readers >= 0 and s.pending >= 0 for s in self.segments.values())
        for digest, entry in self.index.items():
            assert self.holds(entry.segment), digest
            assert digest in entry.segment.digests, digest
        assert sum(len(s.digests) for s in self.segments.values()) == len(self.index)
        expected = sum(s.size for s in self.segments.values())
        assert self.allocated == expected, f"allocated {self.allocated} != {expected}"


def follows(last: Entry | Reservation | None, this: Entry | Reservation) -> bool:
    """Whether ``this`` is in the slot after ``last``'s, in the same segment."""
    return last is not None and last.segment is this.segment and last.slot + 1 == this.slot


def runs(reservations: list[Reservation]) -> list[list[Reservation]]:
    """Reservations grouped into runs of consecutive slots of one segment."""
    grouped: list[list[Reservation]] = []
    for r in sorted(reservations, key=lambda r: (r.segment.seq, r.slot)):
        if follows(grouped[-1][-1] if grouped else None, r):
            grouped[-1].append(r)
        else:
            grouped.append([r])
    return grouped


def read_tasks(
    found: list[tuple[int, Entry]], num_tasks: int
) -> list[list[list[tuple[int, Entry]]]]:
    """(item, entry) pairs of a get cut into up to ``num_tasks`` tasks of similar bytes,
    one per I/O thread; a task is a list of runs of consecutive slots of one segment
    (a run cut where one task ends goes on in the next). One task per thread, not one
    per run: with a task per run, a run of two objects at a segment's end was a task
    of its own, and one thread often read both big ones after it."""
    ordered = sorted(found, key=lambda pair: (pair[1].segment.seq, pair[1].slot))
    total = sum(entry.length for _, entry in ordered)
    num_tasks = max(1, min(num_tasks, len(ordered), total // MIN_PART_BYTES))
    tasks: list[list[list[tuple[int, Entry]]]] = [[] for _ in range(num_tasks)]
    before = 0
    for item, entry in ordered:
        task = tasks[before * num_tasks // total] if total else tasks[0]
        if follows(task[-1][-1][1] if task else None, entry):
            task[-1].append((item, entry))
        else:
            task.append([(item, entry)])
        before += entry.length
    return [task for task in tasks if task]
