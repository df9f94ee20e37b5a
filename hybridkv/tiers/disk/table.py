"""The disk tier's bookkeeping: which object lives where, segments in LRU order.

No I/O: ``DiskTier`` holds its lock around every call and does the file work
the answers ask for (open a segment, unlink or reuse an evicted file, seal).
A put reserves a slot and a page-aligned data range in an active segment
(one for objects admitted as reused, one for the rest, so that the two never
share a segment); a new segment first evicts idle segments and hands the
first victim's file over for reuse. Victims come least recently used first,
segments holding nothing reused before any that holds some, and those before
reused segments hit since they were marked (``Segment.kept``). Objects are found
by key digest in a ``DigestIndex`` (numpy rows, no Python object per object);
each segment keeps the index row of each of its slots, to forget them all
when it goes. The records themselves: ``disk.records``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from hybridkv.tiers.base import TierChanges
from hybridkv.tiers.digest_table import NONE, Digests, Rows, digest_words
from hybridkv.tiers.disk.index import MAX_OFFSET, DigestIndex
from hybridkv.tiers.disk.paths import DiskPaths
from hybridkv.tiers.disk.records import SEEN, Entry, FileWork, Reservation, Segment, no_rows
from hybridkv.tiers.disk.scan import SlotScan
from hybridkv.tiers.disk.segments import Geometry, SegmentHeader, align_up


class SegmentTable:
    """Segments (least recently used first), the key index and bytes allocated."""

    def __init__(self, paths: DiskPaths, capacity_bytes: int, geometry: Geometry) -> None:
        self.paths = paths
        self.capacity_bytes = capacity_bytes
        self.geometry = geometry
        self.segments: OrderedDict[int, Segment] = OrderedDict()
        self.index = DigestIndex()
        """Key digest -> segment number, slot and payload offset."""
        self._numbered: list[Segment | None] = []
        """Segment number -> the segment the table holds under it."""
        self._free_numbers: list[int] = []
        self.pending: set[bytes] = set()
        """Digests of puts being written."""
        self.allocated = 0
        self.reused_bytes = 0
        """Allocated to segments marked reused."""
        self.plain_lru = False
        """Victims least recently used first, whatever their marks (``victims``)."""
        self.active: Segment | None = None
        self.active_reused: Segment | None = None
        """Where objects admitted as reused go (``active``: the others)."""
        self.next_seq = 1
        self.num_evicted = 0
        """Objects dropped with their segments."""
        self.changes: TierChanges | None = None
        """Told of every object removed, by digest (``Tier.log_changes``)."""

    def add(self, segment: Segment) -> None:
        """A segment found on disk, as the most recently used."""
        self._hold(segment)
        self.next_seq = max(self.next_seq, segment.seq + 1)

    def _hold(self, segment: Segment) -> None:
        if self._free_numbers:
            segment.number = self._free_numbers.pop()
            self._numbered[segment.number] = segment
        else:
            segment.number = len(self._numbered)
            self._numbered.append(segment)
        self.segments[segment.seq] = segment
        self.allocated += segment.size
        if segment.reused:
            self.reused_bytes += segment.size

    def holds(self, segment: Segment) -> bool:
        return self.segments.get(segment.seq) is segment

    def use(self, segment: Segment) -> None:
        if self.holds(segment):
            self.segments.move_to_end(segment.seq)

    # Lookups --------------------------------------------------------------------

    def entries(self, digests: Digests, lengths: list[int]) -> list[Entry | None]:
        """Where each digest's object lives (``lengths``: the sizes the get expects)."""
        return self.entries_at(self.index.find(digests), lengths)

    def entries_at(self, rows: Rows, lengths: list[int]) -> list[Entry | None]:
        """The entry of each index row (NONE: None)."""
        index, numbered = self.index, self._numbered
        # Whole columns, NONE rows too (they read the last row): one call each.
        columns = zip(
            rows.tolist(),
            index.segment(rows).tolist(),
            index.slot(rows).tolist(),
            index.offset(rows).tolist(),
            lengths,
            strict=True,
        )
        return [
            None if row < 0 else Entry(_held(numbered, number), slot, offset, length)
            for row, number, slot, offset, length in columns
        ]

    def entry(self, digest: bytes, length: int = 0) -> Entry | None:
        return self.entries(digest_words(digest), [length])[0]

    def segments_at(self, rows: list[int]) -> list[Segment]:
        """The segments holding the objects of these index rows, each once, in the order
        of the last row each holds (made most recent in that order, the segment of the
        last row ends the most recent)."""
        numbers = self.index.segment(np.array(rows, np.int64)).tolist()
        last = {number: i for i, number in enumerate(numbers)}
        ordered = sorted(last, key=last.__getitem__)
        return [s for s in (self._numbered[n] for n in ordered) if s is not None]

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """Every indexed object (for integrity checks; ``length`` is 0: not kept)."""
        rows = self.index.rows()
        numbers, slots = self.index.segment(rows).tolist(), self.index.slot(rows).tolist()
        offsets = self.index.offset(rows).tolist()
        for row, number, slot, offset in zip(rows.tolist(), numbers, slots, offsets, strict=True):
            segment = self._numbered[number]
            assert segment is not None, f"row {row} names no segment"
            yield self.index.digest(row), Entry(segment, slot, offset, 0)

    # Scans ----------------------------------------------------------------------

    def index_scan(self, segment: Segment, read: SlotScan) -> list[tuple[int, str]]:
        """Index the live slots a scan of ``segment`` read (a key indexed already keeps
        its object), leaving out slots handled before (a read-only instance reads slots
        past a gap again); returns the damaged slots among the rest, for the caller."""
        new = ~segment.handled(read.live)
        self._index(segment, read.live[new], read.digests[new], read.offsets[new])
        bad = np.array([i for i, _ in read.damaged], np.int64)
        new_bad = ~segment.handled(bad)
        segment.mark(np.concatenate([read.dead[~segment.handled(read.dead)], bad[new_bad]]), SEEN)
        segment.next_slot = read.next_slot
        return [d for d, new in zip(read.damaged, new_bad.tolist(), strict=True) if new]

    def _index(self, segment: Segment, slots: Rows, digests: Digests, offsets: Rows) -> None:
        rows = self.index.insert(digests, segment.number, slots, offsets)
        segment.mark(slots, np.where(rows >= 0, rows, SEEN))

    # Puts -----------------------------------------------------------------------

    def reserve_many(
        self,
        digests: list[bytes],
        sizes: list[int],
        rows: Rows,
        work: FileWork,
        *,
        reused: bool = False,
    ) -> list[Reservation | str]:
        """``reserve`` of each object in turn, with one lookup for them all (``rows``,
        from ``index.find``): no object is indexed in between, and one evicted since
        was found in a segment gone."""
        found = self.entries_at(rows, sizes)
        items = enumerate(zip(digests, sizes, found, strict=True))
        return [
            self._reserve(i, digest, size, work, entry, reused)
            for i, (digest, size, entry) in items
        ]

    def reserve(
        self, item: int, digest: bytes, num_bytes: int, work: FileWork, *, reused: bool = False
    ) -> Reservation | str:
        """Room for one object, or "exists" / "full"; file work goes into ``work``.
        ``reused``: admitted as reused, it goes into a segment marked so."""
        return self._reserve(item, digest, num_bytes, work, self.entry(digest), reused)

    def _reserve(
        self,
        item: int,
        digest: bytes,
        num_bytes: int,
        work: FileWork,
        entry: Entry | None,
        reused: bool,
    ) -> Reservation | str:
        if entry is not None and self.holds(entry.segment):
            self.use(entry.segment)
            return "exists"
        if digest in self.pending:
            return "exists"
        if num_bytes > self.geometry.data_bytes:
            segment = self._new_segment(Geometry.dedicated(num_bytes), work, reused)
            if segment is not None:
                segment.superseded = True  # holds this object only
        else:
            segment = self.active_reused if reused else self.active
            if segment is None or not segment.fits(num_bytes):
                if segment is not None:
                    self.supersede(segment)
                    work.superseded.append(segment)
                segment = self._new_segment(self.geometry, work, reused)
                if reused:
                    self.active_reused = segment
                else:
                    self.active = segment
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
        self._deactivate(segment)
        marked = np.flatnonzero(segment.rows != NONE)
        end = max(segment.next_slot, int(marked[-1]) + 1 if len(marked) else 0)
        segment.rows = segment.rows[:end].copy()  # no more slots come: no slack

    def _deactivate(self, segment: Segment) -> None:
        if self.active is segment:
            self.active = None
        if self.active_reused is segment:
            self.active_reused = None

    def _new_segment(self, geometry: Geometry, work: FileWork, reused: bool) -> Segment | None:
        if geometry.size > min(self.capacity_bytes, MAX_OFFSET):
            return None
        victims = self.victims(geometry.size)
        if victims is None:  # the rest is busy: no room now
            return None
        self._pass_over(victims, work)
        for victim in victims:
            self.evict(victim)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        header = SegmentHeader(
            seq, geometry.size, geometry.num_slots, geometry.data_offset, False, reused, False
        )
        segment = Segment(header, self.paths.segment(seq), reused=reused)
        segment.cursor = geometry.data_offset
        if victims:
            segment.reuse, segment.reuse_seq = victims[0], victims[0].seq  # its file is ours
        self._hold(segment)
        work.to_open.append(segment)
        work.discarded.extend(victims[1:])
        return segment

    def commit_part(self, part: list[Reservation], written: bool) -> int:
        """Index the reservations of one written part (all of one segment, or none
        written); returns how many were indexed."""
        for r in part:
            r.segment.pending -= 1
            self.pending.discard(r.digest)
        if not written or not part or not self.holds(part[0].segment):
            return 0
        segment = part[0].segment
        slots = np.array([r.slot for r in part], np.int64)
        offsets = np.array([r.offset for r in part], np.int64)
        digests = digest_words(b"".join(r.digest for r in part))
        self._index(segment, slots, digests, offsets)
        return len(part)

    # Removals -------------------------------------------------------------------

    def evict(self, segment: Segment, *, count: bool = True) -> None:
        """Forget a segment and its objects (its file is the caller's business)."""
        rows = segment.rows[segment.rows >= 0].astype(np.int64)
        self._remove(rows)
        if count:
            self.num_evicted += len(rows)
        segment.rows = no_rows()
        del self.segments[segment.seq]
        self._numbered[segment.number] = None
        self._free_numbers.append(segment.number)
        segment.number = NONE
        self.allocated -= segment.size
        if segment.reused:
            self.reused_bytes -= segment.size
        self._deactivate(segment)

    def forget(self, digest: bytes, entry: Entry) -> None:
        """Drop the object of ``digest`` if it is still the one ``entry`` found."""
        now = self.entry(digest)
        if now is None or (now.segment, now.slot) != (entry.segment, entry.slot):
            return
        row = entry.segment.rows[entry.slot : entry.slot + 1].astype(np.int64)
        self._remove(row)
        entry.segment.rows[entry.slot] = SEEN

    def _remove(self, rows: Rows) -> None:
        if self.changes is not None and len(rows):
            self.changes.removed_digests(b"".join(self.index.digest(int(r)) for r in rows))
        self.index.remove(rows)

    def mark_reused(self, segment: Segment) -> bool:
        """``segment`` holds an object admitted as reused; whether that is new (a held
        segment only)."""
        if segment.reused or not self.holds(segment):
            return False
        segment.reused = True
        self.reused_bytes += segment.size
        return True

    def mark_hit(self, segment: Segment) -> bool:
        """An object of ``segment`` was read; whether that makes a reused segment hit (a
        held one only). A segment not marked reused stays as it is: where nothing is
        admitted as reused (``admission: all``) eviction stays least recently used."""
        if segment.hit or not segment.reused or not self.holds(segment):
            return False
        segment.hit = True
        return True

    def _pass_over(self, victims: list[Segment], work: FileWork) -> None:
        """A second chance: hit segments less recently used than the newest reused victim
        lose their hit and become the most recently used (a clock over reused segments:
        what was hit once is not kept for ever, so newer reused blocks find room too)."""
        if self.plain_lru or not any(victim.reused for victim in victims):
            return  # nothing reused goes (always so with ``admission: all``): no pass
        gone = {victim.seq for victim in victims}
        order = list(self.segments.values())
        passed = [i for i, s in enumerate(order) if s.reused and s.seq in gone]
        for segment in order[: passed[-1] if passed else 0]:
            if segment.hit and segment.idle and segment.seq not in gone:
                segment.hit = False
                self.segments.move_to_end(segment.seq)
                work.passed.append(segment)

    def victims(self, num_bytes: int) -> list[Segment] | None:
        """The idle segments to evict for ``num_bytes`` more (none while free room is
        left): least recently used first among those holding nothing reused, then among
        reused ones not hit since, then the rest (``Segment.kept``; a reused block that
        was only written again, a document asked twice, goes before one read back since,
        a system prompt); None when too few are idle. Admission sends a store that was not
        reused on only where this picks no marked segment (``DiskRetention.evicts_reused``);
        one that comes anyway (``admission: all``, marks left from an earlier run) still
        finds room. (Segmented LRU without a cap on the protected part: a part kept for
        first sightings would cost more reused hits than it wins second sightings.)
        ``plain_lru``: least recently used first,
        marks or not (while most first sightings come back, ``connector.returns``)."""
        needed = self.allocated + num_bytes - self.capacity_bytes
        if needed <= 0:
            return []
        idle = [segment for segment in self.segments.values() if segment.idle]
        picked: list[Segment] = []
        ordered = idle if self.plain_lru else sorted(idle, key=lambda s: s.kept)
        for segment in ordered:  # a stable sort: LRU within each level
            if needed <= 0:
                break
            picked.append(segment)
            needed -= segment.size
        return picked if needed <= 0 else None

    @property
    def num_objects(self) -> int:
        return len(self.index)

    @property
    def used_bytes(self) -> int:
        """The segments' bytes (``allocated``): a segment's room is used until it goes."""
        return self.allocated

    def check(self) -> None:
        """Raise AssertionError if index, segments and counters disagree."""
        held = list(self.segments.values())
        assert len(self.pending) == sum(s.pending for s in held)
        assert all(s.readers >= 0 and s.pending >= 0 for s in held)
        self.index.check()
        numbered = {n: s for n, s in enumerate(self._numbered) if s is not None}
        assert numbered == {s.number: s for s in held}, "segment numbers differ from segments"
        assert sorted(self._free_numbers) == [n for n, s in enumerate(self._numbered) if s is None]
        num_live = 0
        for segment in held:
            slots = segment.live_slots()
            rows = segment.rows[slots].astype(np.int64)
            assert np.all(self.index.segment(rows) == segment.number), segment.path
            assert np.array_equal(self.index.slot(rows), slots), segment.path
            num_live += len(slots)
        assert num_live == len(self.index), f"{num_live} live slots, {len(self.index)} indexed"
        expected = sum(s.size for s in held)
        assert self.allocated == expected, f"allocated {self.allocated} != {expected}"
        reused = sum(s.size for s in held if s.reused)
        assert self.reused_bytes == reused, f"reused {self.reused_bytes} != {reused}"


def _held(numbered: list[Segment | None], number: int) -> Segment:
    segment = numbered[number]
    assert segment is not None, f"an index row names segment number {number}, which is free"
    return segment
