"""The disk tier: objects appended to preallocated segment files, whole files evicted.

Runs in the worker process (the one writer of a directory) and, read-only,
in the scheduler process for lookups. The on-disk format is in
``hybridkv.tiers.segments``: creating a file per object costs more than
writing its bytes on ext4, while writing into a preallocated or reused file
costs less than a plain sequential write into a new one.

A put reserves a slot and a page-aligned data range in the active segment
(under the lock), writes the payloads of a batch with one ``pwritev`` per
contiguous run, and then their slots, so a slot never names bytes that were
not written (a killed writer leaves invisible payloads, never a wrong
object). A full tier evicts whole segments, least recently used first (a put
or a hit uses a segment), and reuses the evicted file for the next segment.
On start the index is rebuilt from the slot tables, LRU order from the
segments' mtimes (every hit touches its segment); damaged slots and files are
counted, copied or moved to ``quarantine/`` and never served.

One process writes a directory: it holds ``writer.lock`` (``flock``) for its
lifetime, so a second writer fails at start with the pid of the first.
Read-only instances (``DiskConfig.read_only``) never write; they rescan the
directory when asked for a key they do not know, and at least every second,
so they see what the writer stores and forget what it evicts.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

from hybridkv.tiers import segments
from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierStats,
    TierUsage,
    check_batch,
)
from hybridkv.tiers.codec import HeaderError, key_digest
from hybridkv.tiers.disk_config import DiskConfig, FsyncPolicy
from hybridkv.tiers.disk_files import (
    MAX_QUARANTINE_COPY,
    TEMP_PREFIX,
    DiskTierInUse,
    Quarantine,
    make_private_dir,
    prepare_file,
    take_writer_lock,
    unlink,
)
from hybridkv.tiers.disk_table import (
    Entry,
    FileWork,
    Reservation,
    Segment,
    SegmentTable,
    runs,
    split,
)
from hybridkv.tiers.remote import LogOnce
from hybridkv.tiers.segments import (
    SLOT_BYTES,
    Geometry,
    Slot,
    SlotState,
    slot_offset,
)

__all__ = ["DiskConfig", "DiskTier", "DiskTierInUse", "FsyncPolicy", "ScanReport"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

LOCK_NAME = "writer.lock"
QUARANTINE_NAME = "quarantine"
_REFRESH_EVERY_S = 1.0


class ScanReport(NamedTuple):
    """What the start-up scan found."""

    num_objects: int
    num_bytes: int
    """Bytes of the segment files indexed."""
    num_segments: int
    num_quarantined: int
    """Bad files plus damaged slots (counted in ``stats().corrupt`` too)."""
    num_temp_removed: int
    num_evicted: int
    """Objects evicted to fit a capacity smaller than what was on disk."""


_ReadOutcome = HeaderError | OSError | str | None


class DiskTier(Tier):
    """Objects in segment files; least recently used segment evicted first. Thread-safe.

    ``get_many_into`` reads straight into the caller's buffer and verifies it
    there: on CORRUPT the buffer holds unverified bytes and must not be used
    (the transfer engine never scatters a non-OK buffer).
    """

    def __init__(self, config: DiskConfig, *, name: str = "disk") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.capacity_bytes = config.capacity_bytes
        self.fsync = config.fsync
        self.read_only = config.read_only
        self.root = config.path
        self.geometry = Geometry.standard(config.segment_size)
        self._num_io_threads = config.num_io_threads
        self._table = SegmentTable(str(self.root), config.capacity_bytes, self.geometry)
        self._lost: set[Segment] = set()
        """Dropped segments whose fd waits for its last reader or writer."""
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._log = LogOnce(logger, name)
        self._temp_ids = itertools.count()
        self._closed = False
        self._last_refresh = 0.0
        self._last_mtime_ns = 0
        make_private_dir(self.root)
        self._lock_fd = (
            None if self.read_only else take_writer_lock(self.root / LOCK_NAME, tier_name=name)
        )
        try:
            self.quarantine = Quarantine(self.root / QUARANTINE_NAME, self._log)
            with self._lock:
                self.scan_report = self._scan()
        except BaseException:
            self._closed = True
            self._close_files()
            raise
        self._pool = (
            ThreadPoolExecutor(config.num_io_threads, thread_name_prefix=f"hybridkv-{name}")
            if config.num_io_threads > 1
            else None
        )

    # ------------------------------------------------------- start-up and scans

    def _scan(self) -> ScanReport:
        listing = segments.list_root(self.root, keep=frozenset((QUARANTINE_NAME, LOCK_NAME)))
        num_temp = 0
        if not self.read_only:  # the writer lock says no one else is writing
            num_temp = sum(unlink(path, self._log) for path in listing.temps)
        bad = [(e.path, e.name, "foreign file") for e in listing.others if not e.is_dir()]
        for entry in listing.others:
            if entry.is_dir():
                self._log.warning("dir", "leaving directory %s alone", entry.path)
        found: list[tuple[int, int, Segment]] = []
        for seq, path in listing.segments.items():
            loaded = self._load(seq, path)
            if isinstance(loaded, str):
                bad.append((path, os.path.basename(path), loaded))
            else:
                found.append((os.fstat(loaded.fd).st_mtime_ns, seq, loaded))
        if not self.read_only:
            for path, name, reason in bad:
                self.quarantine.move(path, name, reason)
        num_bad = len(bad)
        num_bad_slots = 0
        for mtime_ns, _, segment in sorted(found, key=lambda t: t[:2]):  # LRU first
            segment.mtime_ns = mtime_ns
            self._last_mtime_ns = max(self._last_mtime_ns, mtime_ns)
            self._table.add(segment)
            num_bad_slots += self._scan_slots(segment)
        self._stats.corrupt += num_bad + num_bad_slots
        if not self.read_only:
            self._take_over()
        if num_bad or num_bad_slots or num_temp:
            logger.warning(
                "disk tier %s: start-up scan found %d bad files and %d damaged objects, "
                "removed %d temp files",
                self.name,
                num_bad,
                num_bad_slots,
                num_temp,
            )
        self._last_refresh = time.monotonic()
        table = self._table
        return ScanReport(
            len(table.index),
            table.allocated,
            len(table.segments),
            num_bad + num_bad_slots,
            num_temp,
            table.num_evicted,
        )

    def _take_over(self) -> None:
        """The writer's start: old segments are never appended to again, and a
        capacity smaller than what is on disk evicts the oldest."""
        for segment in self._table.segments.values():
            self._table.supersede(segment)
            self._restore_size(segment)
            if not segment.sealed:
                self._seal(segment)
        while self._table.allocated > self.capacity_bytes and self._table.segments:
            victim = next(iter(self._table.segments.values()))
            self._table.evict(victim)
            self._discard_file(victim)

    def _load(self, seq: int, path: str) -> Segment | str:
        """A segment file found on disk, or what is wrong with it."""
        opened = segments.open_segment_file(path, seq, writable=not self.read_only)
        if isinstance(opened, str):
            return opened
        fd, header = opened
        segment = Segment(header, path, fd, sealed=header.sealed)
        segment.ready.set()
        return segment

    def _scan_slots(self, segment: Segment) -> int:
        """Index the live slots of ``segment`` not handled yet; returns damaged ones."""
        num_bad = 0
        try:
            file_bytes = os.fstat(segment.fd).st_size
            slots = list(
                segments.read_slots(segment.fd, segment.header, segment.next_slot, file_bytes)
            )
        except OSError as exc:
            self._log.warning("scan", "scanning %s: %s", segment.path, exc)
            return 0
        first_empty = None
        for index, slot in slots:
            if slot is None:
                first_empty = index if first_empty is None else first_empty
                continue
            if index in segment.seen_slots:
                continue
            if self.read_only:
                segment.seen_slots.add(index)
            if isinstance(slot, str):
                num_bad += 1
                self._damaged(segment, index, slot)
            elif slot.state is SlotState.LIVE:
                entry = Entry(segment, index, slot.offset, slot.length)
                self._table.index_slot(slot.digest.hex(), entry)
        last = slots[-1][0] + 1 if slots else segment.next_slot
        segment.next_slot = last if first_empty is None else first_empty
        return num_bad

    def _maybe_refresh(self, *, missing: bool) -> bool:
        """Read-only: rescan on a miss or after a while; True if it rescanned."""
        if not self.read_only:
            return False
        if not missing and time.monotonic() - self._last_refresh < _REFRESH_EVERY_S:
            return False
        self._refresh()
        return True

    def _refresh(self) -> None:
        """Follow the writer: drop segments gone from disk, add new ones, read new slots."""
        self._last_refresh = time.monotonic()
        on_disk = segments.list_root(self.root).segments
        table = self._table
        for seq, segment in list(table.segments.items()):
            if seq not in on_disk and segment.readers == 0:
                table.evict(segment, count=False)
                self._close_fd(segment)
        for seq, path in sorted(on_disk.items()):
            if seq not in table.segments:
                loaded = self._load(seq, path)
                if isinstance(loaded, Segment):
                    table.add(loaded)
                    self._stats.corrupt += self._scan_slots(loaded)  # after its header
        for segment in table.segments.values():
            if segment.sealed:  # read before its last scan: that scan saw every slot
                continue
            try:
                header = segments.read_segment_header(segment.fd)
            except OSError:
                continue
            if isinstance(header, str) or header.seq != segment.seq:
                continue  # being reused: gone from disk by the next refresh
            self._stats.corrupt += self._scan_slots(segment)
            segment.sealed = header.sealed  # sealed before this scan: nothing more to come

    # ------------------------------------------------------------------ lookups

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        digests = [key_digest(key).hex() for key in keys]
        with self._lock:
            self._check_open()
            index = self._table.index
            found = [digest in index for digest in digests]
            if self._maybe_refresh(missing=not all(found)) or self._any_lost(digests):
                found = [digest in index for digest in digests]
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
            self._stats.misses += len(keys) - sum(found)
        return found

    def _any_lost(self, digests: Sequence[str]) -> bool:
        """Drop the segments of these digests whose files were removed from outside."""
        index, lost = self._table.index, False
        for segment in {e.segment for d in digests if (e := index.get(d)) is not None}:
            try:
                self._removed(segment)
            except OSError:
                segment.lost = True
            lost |= segment.lost
            self._drop_if_lost(segment)
        return lost

    @staticmethod
    def _removed(segment: Segment) -> bool:
        """Whether the segment's file lost its last link (removed from outside); marks it."""
        if os.fstat(segment.fd).st_nlink == 0:
            segment.lost = True
        return segment.lost

    @staticmethod
    def _restore_size(segment: Segment) -> None:
        """A segment file cut short gets its size back, so its geometry holds again."""
        if os.fstat(segment.fd).st_size < segment.size:
            os.ftruncate(segment.fd, segment.size)

    def _drop_if_lost(self, segment: Segment) -> None:
        if not segment.lost:
            return
        if self._table.holds(segment):
            self._log.warning("lost", "%s was removed from outside", segment.path)
            self._table.evict(segment, count=False)
            self._lost.add(segment)
        if segment.pending == 0 and segment.readers == 0:
            self._close_fd(segment)
            self._lost.discard(segment)

    # --------------------------------------------------------------------- puts

    def put_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[PutStatus]:
        """Reserve in batch order, write runs of slots in parallel, commit in batch order."""
        check_batch(keys, buffers)
        self._check_writable("put")
        results: list[PutStatus] = [PutStatus.OK] * len(keys)
        reservations: list[Reservation] = []
        work = FileWork()
        with self._lock:
            self._check_open()
            for item, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
                reserved = self._table.reserve(item, key_digest(key).hex(), len(buf), work)
                if isinstance(reserved, Reservation):
                    reservations.append(reserved)
                elif reserved == "full":
                    self._stats.put_skipped_full += 1
                    results[item] = PutStatus.FULL
                else:
                    results[item] = PutStatus.EXISTS
            for segment in work.discarded:
                self._discard_file(segment)
            for segment in work.superseded:  # else sealed by the commit that idles it
                if segment.idle and segment.fd >= 0 and not segment.sealed:
                    self._seal(segment)
        for segment in work.to_open:
            self._open(segment)
        parts: list[list[Reservation]] = []
        for run in runs(reservations):
            run[0].segment.ready.wait()  # another call may be preparing it
            parts.extend(split(run, self._num_io_threads))
        written = self._map(lambda i: self._write(parts[i], keys, buffers), len(parts))
        with self._lock:
            for part, ok in zip(parts, written, strict=True):
                for reservation in part:
                    results[reservation.item] = self._commit(reservation, ok)
            for segment in {r.segment for r in reservations}:
                if self._table.holds(segment):
                    self._touch(segment)
        return results

    def _open(self, segment: Segment) -> None:
        """Prepare a new segment's file (a new one, or an evicted one taken over)."""
        temp = f"{self.root}/{TEMP_PREFIX}{os.getpid()}.{next(self._temp_ids)}"
        reuse = segment.reuse
        if reuse is not None:
            reuse_fd, reuse.fd = reuse.fd, -1
        try:
            segment.fd = prepare_file(
                temp,
                segment.path,
                size=segment.size,
                header=segment.header.pack(),
                reuse=None if reuse is None else (reuse_fd, reuse.path),
                sync_data=self.fsync is not FsyncPolicy.NEVER,
                sync_dir=self.fsync is FsyncPolicy.ALWAYS,
            )
        except OSError as exc:
            self._log.warning("open", "preparing %s: %s", segment.path, exc)
            segment.failed = True
        finally:
            segment.reuse = None
            segment.ready.set()

    def _write(
        self, part: list[Reservation], keys: Sequence[StoreKey], buffers: Sequence[Buffer]
    ) -> bool:
        segment = part[0].segment
        if segment.failed:
            return False
        try:
            if self._removed(segment):
                return False
            run = [segments.Placed(r.slot, r.offset, keys[r.item], buffers[r.item]) for r in part]
            segments.write_run(
                segment.fd,
                segment.seq,
                run,
                sync_data=self.fsync is not FsyncPolicy.NEVER,
                sync_slots=self.fsync is FsyncPolicy.ALWAYS,
            )
        except OSError as exc:
            self._log.warning("write", "writing %s: %s", segment.path, exc)
            return False
        return True

    def _commit(self, reservation: Reservation, written: bool) -> PutStatus:
        segment = reservation.segment
        if self._table.commit(reservation, written):
            self._stats.puts += 1
            self._stats.put_bytes += reservation.length
            status = PutStatus.OK
        else:
            self._stats.errors += 1
            status = PutStatus.ERROR
        if segment.pending == 0:
            if segment.failed and self._table.holds(segment):
                self._table.evict(segment, count=False)
            elif segment.superseded and not segment.sealed and not segment.lost:
                self._seal(segment)
        self._drop_if_lost(segment)
        return status

    def _seal(self, segment: Segment) -> None:
        """Tell read-only instances no slot of this segment will be filled any more."""
        try:
            segments.write_sealed_flag(segment.fd)
        except OSError as exc:
            self._log.warning("seal", "sealing %s: %s", segment.path, exc)
        segment.sealed = True
        self._touch(segment, again=True)

    # --------------------------------------------------------------------- gets

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        digests = [key_digest(key).hex() for key in keys]
        with self._lock:
            self._check_open()
            index = self._table.index
            found = [index.get(digest) for digest in digests]
            if self._maybe_refresh(missing=None in found):
                found = [index.get(digest) for digest in digests]
            todo = [(j, entry) for j, entry in enumerate(found) if entry is not None]
            for _, entry in todo:
                entry.segment.readers += 1
        outcomes = self._map(
            lambda i: self._read(todo[i][1], keys[todo[i][0]], buffers[todo[i][0]]), len(todo)
        )
        results = [GetStatus.MISS] * len(keys)
        touched: set[Segment] = set()
        with self._lock:
            for (j, entry), outcome in zip(todo, outcomes, strict=True):
                entry.segment.readers -= 1
                results[j] = self._finish_get(digests[j], entry, keys[j], len(buffers[j]), outcome)
                if results[j] is GetStatus.OK:
                    touched.add(entry.segment)
                self._drop_if_lost(entry.segment)
            if not self.read_only:
                for segment in touched:
                    if self._table.holds(segment):
                        self._table.use(segment)
                        self._touch(segment)
        return results

    def _read(self, entry: Entry, key: StoreKey, buf: Buffer) -> _ReadOutcome:
        segment = entry.segment
        try:
            if self._removed(segment):
                return segments.GONE
            return segments.read_object(
                segment.fd, segment.header, entry.slot, entry.offset, key, buf
            )
        except OSError as exc:
            return exc

    def _finish_get(
        self, digest: str, entry: Entry, key: StoreKey, num_bytes: int, outcome: _ReadOutcome
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
        self._damaged(entry.segment, entry.slot, str(reason), digest=digest, entry=entry)
        return GetStatus.CORRUPT

    def _damaged(
        self,
        segment: Segment,
        slot: int,
        reason: str,
        *,
        digest: str = "",
        entry: Entry | None = None,
    ) -> None:
        """A damaged object: the writer keeps a copy in quarantine and marks its slot dead."""
        logger.warning(
            "disk tier %s: damaged object in %s slot %d: %s", self.name, segment.path, slot, reason
        )
        if self.read_only:
            return
        self._mark_dead(segment, slot)
        try:
            self._restore_size(segment)
        except OSError as exc:
            self._log.warning("restore", "%s: %s", segment.path, exc)

        def read() -> bytes:
            data = os.pread(segment.fd, SLOT_BYTES, slot_offset(slot))
            if entry is None:
                return data
            return data + os.pread(segment.fd, min(entry.length, MAX_QUARANTINE_COPY), entry.offset)

        name = f"{digest}.kv" if digest else f"{os.path.basename(segment.path)}.slot{slot}"
        self.quarantine.keep_copy(name, reason, read)

    # ------------------------------------------------------------------ deletes

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        self._check_writable("delete")
        num_deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                digest = key_digest(key).hex()
                entry = self._table.index.get(digest)
                if entry is None or digest in self._table.pending:
                    continue
                self._table.forget(digest, entry)
                self._mark_dead(entry.segment, entry.slot)
                num_deleted += 1
            self._stats.deletes += num_deleted
        return num_deleted

    def _mark_dead(self, segment: Segment, slot: int) -> None:
        try:
            segments.write_slot_state(segment.fd, slot, SlotState.DEAD)
        except OSError as exc:
            self._log.warning("dead", "%s: %s", segment.path, exc)
        self._touch(segment, again=True)

    # -------------------------------------------------------------- bookkeeping

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                num_objects=len(self._table.index),
                used_bytes=self._table.allocated,
                capacity_bytes=self.capacity_bytes,
            )

    def stats(self) -> TierStats:
        with self._lock:
            stats = TierStats(**self._stats.as_dict())
            stats.evictions = self._table.num_evicted
            return stats

    def _map(self, one: Callable[[int], T], count: int) -> list[T]:
        if self._pool is None or count < 2:
            return [one(i) for i in range(count)]
        return list(self._pool.map(one, range(count)))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            self._close_files()

    def _close_files(self) -> None:
        for segment in [*self._table.segments.values(), *self._lost]:
            self._close_fd(segment)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = None

    def _discard_file(self, segment: Segment) -> None:
        self._close_fd(segment)
        unlink(segment.path, self._log)

    def _touch(self, segment: Segment, *, again: bool = False) -> None:
        """Persist the LRU order: the next start sorts segments by mtime. Stamps are
        explicit and increasing (the kernel's own are coarse); ``again`` restores the
        last stamp after a metadata write that moved it."""
        if not again:
            self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
            segment.mtime_ns = self._last_mtime_ns
        if segment.fd < 0 or not segment.mtime_ns:
            return
        try:
            os.utime(segment.fd, ns=(segment.mtime_ns, segment.mtime_ns))
        except OSError as exc:
            self._log.warning("touch", "%s: %s", segment.path, exc)

    @staticmethod
    def _close_fd(segment: Segment) -> None:
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier {self.name} is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise RuntimeError(f"disk tier {self.name} at {self.root} is read-only: cannot {what}")

    def check_integrity(self) -> None:
        """Index vs segments vs counters vs the slot tables and files on disk."""
        with self._lock:
            self._table.check()
            if not self.read_only:
                self._check_files()
            for digest, entry in self._table.index.items():
                segment = entry.segment
                raw = os.pread(segment.fd, SLOT_BYTES, slot_offset(entry.slot))
                slot = segments.parse_slot(raw, segment.header, segment.size)
                assert isinstance(slot, Slot) and slot.state is SlotState.LIVE, (digest, slot)
                found = (slot.digest.hex(), slot.offset, slot.length)
                assert found == (digest, entry.offset, entry.length), digest

    def _check_files(self) -> None:
        """Segment files on disk vs the table (under the lock). A put may be
        preparing segments right now; those and the files they take over are
        checked once ready, which is decided before listing the directory."""
        assert self._table.allocated <= self.capacity_bytes
        now = list(self._table.segments.values())
        opening = [s for s in now if not s.ready.is_set()]
        skip = {s.seq for s in opening} | {s.reuse_seq for s in opening}
        names = os.listdir(self.root)
        on_disk = {
            seq: os.stat(self.root / name).st_size
            for name in names
            if (m := segments.SEGMENT_NAME.match(name)) and (seq := int(m.group(1), 16)) not in skip
        }
        known = {s.seq: s.size for s in now if s not in opening and not s.failed}
        assert on_disk == known, f"segment files {on_disk} != segments {known}"
        temps = [name for name in names if name.startswith(TEMP_PREFIX)]
        assert len(temps) <= len(opening), f"leaked temp files {temps}"
