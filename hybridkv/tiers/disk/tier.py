"""The disk tier: objects appended to preallocated segment files, whole files evicted.

Runs in the worker process (the one writer of a directory) and, read-only,
in the scheduler process for lookups. Creating a file per object costs more
than writing its bytes on ext4, while writing into a preallocated or reused
file costs less than a plain write into a new one; so objects live in
segment files (format: ``disk.segments``; files and scans: ``disk.directory``
and ``disk.scan``; bookkeeping: ``disk.table`` and its key index ``disk.index``,
numpy rows, no Python object per object; runs of slots: ``disk.batches``).

A put reserves a slot and a page-aligned data range in the active segment
(under the lock), writes the payloads of a batch with one ``pwritev`` per
contiguous run, and then their slots. A full tier evicts whole segments,
least recently used first (a put or a hit uses a segment; those holding
objects admitted as reused, and of those the ones hit since, go last:
``disk.table``), and reuses the evicted file for the next segment.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    TierStats,
    check_batch,
)
from hybridkv.tiers.books import BookkeepingTier
from hybridkv.tiers.codec import HeaderError, key_digest, key_digests
from hybridkv.tiers.digest_table import Digests, digest_words
from hybridkv.tiers.disk import index, preads, reads, segments
from hybridkv.tiers.disk.batches import read_tasks, runs
from hybridkv.tiers.disk.config import DiskConfig, FsyncPolicy
from hybridkv.tiers.disk.directory import SegmentDirectory
from hybridkv.tiers.disk.files import DiskTierInUse, Quarantine
from hybridkv.tiers.disk.records import Entry, FileWork, Reservation, Segment
from hybridkv.tiers.disk.scan import ScanReport
from hybridkv.tiers.disk.segments import SLOT_BYTES, Geometry, Slot, SlotState, slot_offset
from hybridkv.tiers.disk.table import SegmentTable
from hybridkv.tiers.log_once import LogOnce
from hybridkv.tiers.retention import TierRetention

__all__ = ["DiskConfig", "DiskTier", "DiskTierInUse", "FsyncPolicy", "ScanReport"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DiskTier(BookkeepingTier):
    """Objects in segment files; least recently used segment evicted first. Thread-safe.

    ``get_many_into`` reads straight into the caller's buffer and verifies it
    there: on CORRUPT the buffer holds unverified bytes and must not be used
    (the transfer engine never scatters a non-OK buffer).
    """

    local_usage = True

    def __init__(self, config: DiskConfig, *, name: str = "disk") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.capacity_bytes = config.capacity_bytes
        self.fsync = config.fsync
        self.read_only = config.read_only
        self.paths = config.paths
        self.geometry = Geometry.standard(config.segment_size)
        # More parts than CPUs to run them on only adds hand-offs between threads.
        self._num_io_threads = min(config.num_io_threads, len(os.sched_getaffinity(0)))
        self._table = SegmentTable(self.paths, config.capacity_bytes, self.geometry)
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._log = LogOnce(logger, name)
        self._closed = False
        self._dir = SegmentDirectory(
            config, name=name, paths=self.paths, table=self._table, stats=self._stats, log=self._log
        )
        try:
            with self._lock:
                self.scan_report = self._dir.scan()
        except BaseException:
            self._closed = True
            self._dir.close_files()
            raise
        preads.warm_up()  # compiled (or loaded) now, not on the first get
        index.warm_up()
        self._pool = (
            ThreadPoolExecutor(self._num_io_threads, thread_name_prefix=f"hybridkv-{name}")
            if self._num_io_threads > 1
            else None
        )

    @functools.cached_property
    def retention(self) -> DiskRetention:
        return DiskRetention(self)

    @property
    def quarantine(self) -> Quarantine:
        return self._dir.quarantine

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        digests = digest_words(key_digests(keys))
        with self._lock:
            self._check_open()
            rows = self._table.index.find(digests).tolist()
            found = [row for row in rows if row >= 0]
            if self._dir.maybe_rescan(missing=len(found) < len(rows)) or self._any_lost(found):
                rows = self._table.index.find(digests).tolist()
                found = [row for row in rows if row >= 0]
            self._stats.queries += len(keys)
            self._stats.hits += len(found)
        return [row >= 0 for row in rows]

    def _any_lost(self, rows: list[int]) -> bool:
        """Drop the segments of these index rows whose files were removed from outside."""
        lost = False
        for segment in self._table.segments_at(rows):
            try:
                self._dir.removed(segment)
            except OSError:
                segment.lost = True
            lost |= segment.lost
            self._dir.drop_if_lost(segment)
        return lost

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Reserve in batch order, write runs of slots in parallel, commit in batch order."""
        return self._put(keys, buffers, checksums, reused=False)

    def _put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None,
        *,
        reused: bool,
    ) -> list[PutStatus]:
        check_batch(keys, buffers, checksums)
        self._check_writable("put")
        results: list[PutStatus] = [PutStatus.OK] * len(keys)
        reservations: list[Reservation] = []
        work = FileWork()
        joined = key_digests(keys)
        digests = [joined[i : i + 16] for i in range(0, len(joined), 16)]
        with self._lock:
            self._check_open()
            self._dir.sweep()
            # A key whose file was removed from outside is stored again.
            rows = self._table.index.find(digest_words(joined))
            if self._any_lost([row for row in rows.tolist() if row >= 0]):
                rows = self._table.index.find(digest_words(joined))
            sizes = [len(buf) for buf in buffers]
            reserved_all = self._table.reserve_many(digests, sizes, rows, work, reused=reused)
            for item, reserved in enumerate(reserved_all):
                if isinstance(reserved, Reservation):
                    reservations.append(reserved)
                elif reserved == "full":
                    self._stats.put_skipped_full += 1
                    results[item] = PutStatus.FULL
                else:
                    results[item] = PutStatus.EXISTS
            self._dir.after_reserve(work)
        for segment in work.to_open:
            self._dir.open(segment)
        # A part per run of slots, never less: the kernel serializes buffered writes to
        # one file, so two threads writing halves of a run take turns and only add
        # hand-offs. Runs in other segment files go to the I/O threads.
        parts = runs(reservations)
        for run in parts:
            run[0].segment.ready.wait()  # another call may be preparing it
        sums = [None] * len(keys) if checksums is None else checksums

        def write(part: list[Reservation]) -> bool:
            run = [
                segments.Placed(r.slot, r.offset, keys[r.item], buffers[r.item], sums[r.item])
                for r in part
            ]
            return self._dir.write(part[0].segment, run)

        written = self._map(lambda i: write(parts[i]), len(parts))
        with self._lock:
            for part, ok in zip(parts, written, strict=True):
                self._commit(part, ok, results)
            if self._table.changes is not None:  # before _finish_writes may evict them
                ok_keys = [k for k, r in zip(keys, results, strict=True) if r is PutStatus.OK]
                self._table.changes.stored(ok_keys)
            for segment in dict.fromkeys(part[0].segment for part in parts):  # batch order
                self._finish_writes(segment)
        return results

    def _commit(self, part: list[Reservation], written: bool, results: list[PutStatus]) -> None:
        """Index one part's objects (all in one segment) and set their results."""
        if self._table.commit_part(part, written):
            self._stats.puts += len(part)
            self._stats.put_bytes += sum(r.length for r in part)
            status = PutStatus.OK
        else:
            self._stats.errors += len(part)
            status = PutStatus.ERROR
        for reservation in part:
            results[reservation.item] = status

    def _finish_writes(self, segment: Segment) -> None:
        """After a put's parts in ``segment`` are committed: stamp its use; evict it if its
        file failed, seal it once superseded and idle, drop it if removed from outside."""
        if self._table.holds(segment):
            self._dir.touch(segment)
        if segment.pending == 0:
            if segment.failed and self._table.holds(segment):
                self._table.evict(segment, count=False)
            elif segment.superseded and not segment.sealed and not segment.lost:
                self._dir.seal(segment)
        self._dir.drop_if_lost(segment)

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        """Runs are planned and outcomes decided on the calling thread; only the native
        reads (slots checked, payloads read and hashed) go to the I/O threads (see
        ``disk.reads``)."""
        check_batch(keys, buffers)
        joined = key_digests(keys)
        digests = [joined[i : i + 16] for i in range(0, len(joined), 16)]
        words = digest_words(joined)
        lengths = [len(buf) for buf in buffers]
        with self._lock:
            self._check_open()
            found = self._table.entries(words, lengths)
            if self._dir.maybe_rescan(missing=None in found):
                found = self._table.entries(words, lengths)
            todo = [(j, entry) for j, entry in enumerate(found) if entry is not None]
            for _, entry in todo:
                entry.segment.readers += 1
        tasks = read_tasks(todo, self._num_io_threads)
        planned = [[self._plan(run, digests, buffers) for run in task] for task in tasks]
        done = self._map(lambda i: [reads.read_any(run) for run in planned[i]], len(tasks))
        outcome_of = {
            j: outcome
            for task, task_planned, task_done in zip(tasks, planned, done, strict=True)
            for run, run_planned, read in zip(task, task_planned, task_done, strict=True)
            for (j, _), outcome in zip(
                run, reads.outcomes(run_planned, read, len(run), reader=self.read_only), strict=True
            )
        }
        results = [GetStatus.MISS] * len(keys)
        touched: set[Segment] = set()
        with self._lock:
            for j, entry in todo:
                outcome = outcome_of[j]
                entry.segment.readers -= 1
                results[j] = self._finish_get(digests[j], entry, keys[j], len(buffers[j]), outcome)
                if results[j] is GetStatus.OK:
                    touched.add(entry.segment)
                self._dir.drop_if_lost(entry.segment)
            if not self.read_only:
                for segment in touched:
                    if self._table.holds(segment):
                        self._dir.used(segment)
        return results

    def _plan(
        self, run: list[tuple[int, Entry]], digests: Sequence[bytes], buffers: Sequence[Buffer]
    ) -> reads.PlannedRun | reads.Outcome:
        """One run (objects of consecutive slots of one segment) ready to read, or the
        outcome of all its objects when its file is gone."""
        segment = run[0][1].segment
        try:
            if self._dir.removed(segment):
                return segments.GONE
        except OSError as exc:
            return exc
        wanted = [reads.Wanted(e.slot, e.offset, digests[j], buffers[j]) for j, e in run]
        return reads.plan_run(segment.fd, segment.header, wanted)

    def _finish_get(
        self, digest: bytes, entry: Entry, key: StoreKey, num_bytes: int, outcome: reads.Outcome
    ) -> GetStatus:
        if outcome is None:
            self._stats.gets += 1
            self._stats.get_bytes += num_bytes
            return GetStatus.OK
        if outcome == segments.GONE:
            self._table.forget(digest, entry)
            return GetStatus.MISS
        if isinstance(outcome, OSError):
            self._log.warning("read", "reading %s: %s", key, outcome)
            self._stats.errors += 1
            return GetStatus.ERROR
        self._stats.corrupt += 1
        self._table.forget(digest, entry)
        reason = outcome.value if isinstance(outcome, HeaderError) else outcome
        self._dir.damaged(entry.segment, entry.slot, str(reason), digest=digest.hex(), entry=entry)
        return GetStatus.CORRUPT

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        self._check_writable("delete")
        num_deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                digest = key_digest(key)
                entry = self._table.entry(digest)
                if entry is None or digest in self._table.pending:
                    continue
                self._table.forget(digest, entry)
                self._dir.mark_dead(entry.segment, entry.slot)
                num_deleted += 1
        return num_deleted

    def _map(self, one: Callable[[int], T], count: int) -> list[T]:
        """``one`` of each index; the calling thread takes the first itself."""
        if self._pool is None or count < 2:
            return [one(i) for i in range(count)]
        others = [self._pool.submit(one, i) for i in range(1, count)]
        first = one(0)
        return [first, *(future.result() for future in others)]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            self._dir.close_files()

    def _books(self) -> SegmentTable:
        return self._table

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier {self.name} is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise RuntimeError(
                f"disk tier {self.name} at {self.paths.root} is read-only: cannot {what}"
            )

    def check_integrity(self) -> None:
        """Index vs segments vs counters vs the slot tables and files on disk."""
        with self._lock:
            self._table.check()
            if not self.read_only:
                self._dir.check_files()
            for digest, entry in self._table.items():
                segment = entry.segment
                raw = os.pread(segment.fd, SLOT_BYTES, slot_offset(entry.slot))
                slot = segments.parse_slot(raw, segment.header, segment.size)
                assert isinstance(slot, Slot) and slot.state is SlotState.LIVE, (digest, slot)
                assert (slot.digest, slot.offset) == (digest, entry.offset), digest.hex()


class DiskRetention(TierRetention):
    """``DiskTier.retention``: by segment. Touched segments become the most recent;
    objects admitted as reused go into segments of their own, which are evicted after
    all others (``SegmentTable``)."""

    tier: DiskTier

    def __init__(self, tier: DiskTier) -> None:
        super().__init__(tier)

    def note_reused(self, keys: Sequence[StoreKey]) -> None:
        """Mark the segments holding these keys: they are evicted after all others, and
        admission sends no store that was not reused on where it would evict them."""
        tier = self.tier
        digests = digest_words(key_digests(keys))
        with tier._lock:
            tier._check_open()
            for segment in self._segments_holding(digests):
                tier._dir.mark_reused(segment)

    def put_reused(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Into segments of their own, so that no unreused object shares their protection."""
        results = self.tier._put(keys, buffers, checksums, reused=True)
        stored = [key for key, r in zip(keys, results, strict=True) if r is PutStatus.EXISTS]
        if stored:
            self.note_reused(stored)  # stored already, in other segments
        return results

    def touch(self, keys: Sequence[StoreKey], passes: int | None = None) -> None:
        """Segments holding these keys become the most recently used, ordered by the last
        key each holds. A chain touched last block first so keeps the segment of its
        first blocks, which every hit reads, longest; left in write order, the disk
        would evict a prompt's first blocks first and keep its tail, which no hit can
        use without them. ``passes`` are ignored: the disk passes over whole segments,
        those hit since marked reused (``SegmentTable``)."""
        tier = self.tier
        if tier.read_only:
            return
        digests = digest_words(key_digests(keys))
        with tier._lock:
            tier._check_open()
            for segment in self._segments_holding(digests):
                if tier._table.holds(segment):
                    tier._table.use(segment)
                    tier._dir.touch(segment)

    def _segments_holding(self, digests: Digests) -> list[Segment]:
        """The segments holding the stored ones of these keys (``digest_words``), in the
        order of the last key each holds; the tier's lock is held."""
        table = self.tier._table
        rows = [row for row in table.index.find(digests).tolist() if row >= 0]
        return table.segments_at(rows)

    def use_plain_lru(self, on: bool) -> None:
        """While ``on``, segments go least recently used first, marks or not (kept)."""
        with self.tier._lock:
            self.tier._table.plain_lru = on

    def evicts_reused(self, num_bytes: int) -> bool | None:
        """Whether ``num_bytes`` more find no room without evicting a segment that holds
        an object noted reused (or without waiting for busy ones)."""
        tier = self.tier
        with tier._lock:
            tier._check_open()
            geometry = tier._table.geometry  # whole segments, each of one data area
            victims = tier._table.victims(-(-num_bytes // geometry.data_bytes) * geometry.size)
            return victims is None or any(victim.reused for victim in victims)
