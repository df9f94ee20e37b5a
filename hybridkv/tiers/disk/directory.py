"""The disk tier's directory: its segment files, start-up scan, following the writer.

Runs wherever a ``DiskTier`` runs; ``DiskTier`` calls it under its lock
(``open`` and ``write`` run outside it, on segments reserved for the caller).

A put's segment file is prepared here (a new preallocated file, or an evicted
one taken over), payloads and then slots are written (a killed writer leaves
invisible payloads, never a wrong object), and a segment no longer appended
to is sealed. On start the index is rebuilt from the slot tables, LRU order
from the segments' mtimes (every hit touches its segment); damaged slots and
files are counted, copied or moved to ``quarantine/`` and never served.

One process writes a directory: it holds ``writer.lock`` (``flock``) for its
lifetime. Read-only instances never write; they rescan the directory when
asked for a key they do not know, and at least every second, so they see
what the writer stores and forget what it evicts.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

from hybridkv.tiers.base import TierStats
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.config import DiskConfig, FsyncPolicy
from hybridkv.tiers.disk.files import (
    MAX_QUARANTINE_COPY,
    Quarantine,
    make_private_dir,
    prepare_file,
    take_writer_lock,
    unlink,
)
from hybridkv.tiers.disk.index import MAX_OFFSET
from hybridkv.tiers.disk.paths import DiskPaths, is_temp, segment_seq
from hybridkv.tiers.disk.records import Entry, FileWork, Segment
from hybridkv.tiers.disk.scan import ScanReport, SlotScan, scan_slots
from hybridkv.tiers.disk.segments import SLOT_BYTES, SlotState, slot_offset
from hybridkv.tiers.disk.table import SegmentTable
from hybridkv.tiers.log_once import LogOnce

logger = logging.getLogger(__name__)

RESCAN_EVERY_S = 1.0


class SegmentDirectory:
    """Segment files of one directory, and the scans that index them into ``table``."""

    def __init__(
        self,
        config: DiskConfig,
        *,
        name: str,
        paths: DiskPaths,
        table: SegmentTable,
        stats: TierStats,
        log: LogOnce,
    ) -> None:
        self.name = name
        self.paths = paths
        self.read_only = config.read_only
        self.fsync = config.fsync
        self.capacity_bytes = config.capacity_bytes
        self.table = table
        self.stats = stats
        """The tier's counters: scans count damaged objects in ``corrupt``."""
        self.log = log
        self.lost: set[Segment] = set()
        """Dropped segments whose fd waits for its last reader or writer."""
        self.temp_ids = itertools.count()
        self.last_rescan = 0.0
        self.last_sweep = time.monotonic()
        self.last_mtime_ns = 0
        make_private_dir(paths.root, symlink_ok=not paths.root_is_ours)
        self.lock_fd = None if self.read_only else take_writer_lock(paths.lock, tier_name=name)
        self.quarantine = Quarantine(paths.quarantine, log)

    def scan(self) -> ScanReport:
        listing = segments.list_root(self.paths.root, keep=self.paths.kept)
        num_temp = 0
        if not self.read_only:  # the writer lock says no one else is writing
            num_temp = sum(unlink(path, self.log) for path in listing.temps)
        bad: list[tuple[str, str, str]] = []
        for entry in listing.others:
            if entry.is_dir():
                self.log.warning("dir", "leaving directory %s alone", entry.path)
            else:
                bad.append((entry.path, entry.name, "foreign file"))
        found: list[tuple[int, int, Segment]] = []
        for seq, path in listing.segments.items():
            loaded = self.load(seq, path)
            if isinstance(loaded, str):
                bad.append((path, os.path.basename(path), loaded))
            else:
                loaded.mtime_ns = os.fstat(loaded.fd).st_mtime_ns
                found.append((loaded.mtime_ns, seq, loaded))
        if not self.read_only:
            for path, name, reason in bad:
                self.quarantine.move(path, name, reason)
        num_bad = len(bad)
        ordered = [segment for *_, segment in sorted(found, key=lambda t: t[:2])]  # LRU first
        for segment in ordered:
            self.last_mtime_ns = max(self.last_mtime_ns, segment.mtime_ns)
            self.table.add(segment)
        read = [self.read_slots(segment) for segment in ordered]
        num_live = sum(len(slots.live) for slots in read if slots is not None)
        self.table.index.reserve(num_live)  # exact size
        num_bad_slots = 0
        for segment, slots in zip(ordered, read, strict=True):
            if slots:
                num_bad_slots += self.scan_slots(segment, slots)
        self.stats.corrupt += num_bad + num_bad_slots
        if not self.read_only:
            self.take_over()
        if num_bad or num_bad_slots or num_temp:
            logger.warning(
                "disk tier %s: start-up scan found %d bad files and %d damaged objects, "
                "removed %d temp files",
                self.name,
                num_bad,
                num_bad_slots,
                num_temp,
            )
        self.last_rescan = time.monotonic()
        return ScanReport(
            num_objects=len(self.table.index),
            num_bytes=self.table.allocated,
            num_segments=len(self.table.segments),
            num_quarantined=num_bad + num_bad_slots,
            num_temp_removed=num_temp,
            num_evicted=self.table.num_evicted,
        )

    def take_over(self) -> None:
        """The writer's start: old segments are never appended to again, and a
        capacity smaller than what is on disk evicts as a put would (``table.victims``:
        segments holding nothing reused first)."""
        for segment in self.table.segments.values():
            self.table.supersede(segment)
            self.restore_size(segment)
            if not segment.sealed:
                self.seal(segment)
        for victim in self.table.victims(0) or []:
            self.table.evict(victim)
            self.discard_file(victim)

    def load(self, seq: int, path: str) -> Segment | str:
        """A segment file found on disk, or what is wrong with it."""
        opened = segments.open_segment_file(path, seq, writable=not self.read_only)
        if isinstance(opened, str):
            return opened
        fd, header = opened
        if header.size > min(max(os.fstat(fd).st_size, self.capacity_bytes), MAX_OFFSET):
            os.close(fd)  # restoring that size would fill the disk, or fail
            return "header claims more bytes than the file and the capacity (or 16 TiB)"
        segment = Segment(
            header, path, fd, sealed=header.sealed, reused=header.reused, hit=header.hit
        )
        segment.ready.set()
        return segment

    def scan_slots(self, segment: Segment, read: SlotScan | None = None) -> int:
        """Index the live slots of ``segment`` not handled yet (``read``: its slots, if
        read already); returns the damaged ones."""
        if read is None:
            read = self.read_slots(segment)
        if read is None:
            return 0
        damaged = self.table.index_scan(segment, read)
        for index, reason in damaged:
            self.damaged(segment, index, reason)
        return len(damaged)

    def read_slots(self, segment: Segment) -> SlotScan | None:
        """Its slots from ``next_slot`` on; None if they could not be read (logged)."""
        try:
            file_bytes = os.fstat(segment.fd).st_size
            return scan_slots(segment.fd, segment.header, segment.next_slot, file_bytes)
        except OSError as exc:
            self.log.warning("scan", "scanning %s: %s", segment.path, exc)
            return None

    def maybe_rescan(self, *, missing: bool) -> bool:
        """Read-only: rescan on a miss or after a while; True if it rescanned."""
        if not self.read_only:
            return False
        if not missing and time.monotonic() - self.last_rescan < RESCAN_EVERY_S:
            return False
        self.rescan()
        return True

    def rescan(self) -> None:
        """Follow the writer: drop segments gone from disk, add new ones, read new slots."""
        self.last_rescan = time.monotonic()
        on_disk = segments.list_root(self.paths.root).segments
        table = self.table
        for seq, segment in list(table.segments.items()):
            if seq not in on_disk and segment.readers == 0:
                table.evict(segment, count=False)
                self.close_fd(segment)
        for seq, path in sorted(on_disk.items()):
            if seq not in table.segments:
                loaded = self.load(seq, path)
                if isinstance(loaded, Segment):
                    table.add(loaded)
                    self.stats.corrupt += self.scan_slots(loaded)  # after its header
        for segment in table.segments.values():
            if segment.sealed:  # read before its last scan: that scan saw every slot
                continue
            try:
                header = segments.read_segment_header(segment.fd)
            except OSError:
                continue
            if isinstance(header, str) or header.seq != segment.seq:
                continue  # being reused: gone from disk by the next rescan
            self.stats.corrupt += self.scan_slots(segment)
            segment.sealed = header.sealed  # sealed before this scan: nothing more to come

    @staticmethod
    def removed(segment: Segment) -> bool:
        """Whether the segment's file lost its last link (removed from outside); marks it."""
        if os.fstat(segment.fd).st_nlink == 0:
            segment.lost = True
        return segment.lost

    @staticmethod
    def restore_size(segment: Segment) -> None:
        """A segment file cut short or grown gets its size back, so its geometry holds
        again (and the capacity counts what is on disk)."""
        if os.fstat(segment.fd).st_size != segment.size:
            os.ftruncate(segment.fd, segment.size)

    def drop_if_lost(self, segment: Segment) -> None:
        if not segment.lost:
            return
        if self.table.holds(segment):
            self.log.warning("lost", "%s was removed from outside", segment.path)
            self.table.evict(segment, count=False)
            self.lost.add(segment)
            # Readers see the writer's evictions this way; a writer sees only damage.
            self.stats.corrupt += not self.read_only
        if segment.pending == 0 and segment.readers == 0:
            self.close_fd(segment)
            self.lost.discard(segment)

    def sweep(self) -> None:
        """Writer, at most every ``RESCAN_EVERY_S``: files dropped in from outside (a
        segment name no segment of ours has, any other file) go to quarantine, counted
        corrupt, as the start-up scan does."""
        if self.read_only or time.monotonic() - self.last_sweep < RESCAN_EVERY_S:
            return
        self.last_sweep = time.monotonic()
        listing = segments.list_root(self.paths.root, keep=self.paths.kept)
        ours: set[int] = set()
        for segment in self.table.segments.values():
            ours.add(segment.seq)
            if not segment.ready.is_set():
                ours.add(segment.reuse_seq)  # the file it is taking over
        bad = [path for seq, path in listing.segments.items() if seq not in ours]
        bad += [e.path for e in listing.others if e.is_file(follow_symlinks=False)]
        for path in bad:
            self.quarantine.move(path, os.path.basename(path), "foreign file")
        self.stats.corrupt += len(bad)

    def open(self, segment: Segment) -> None:
        """Prepare a new segment's file (a new one, or an evicted one taken over)."""
        temp = self.paths.temp(os.getpid(), next(self.temp_ids))
        reuse = segment.reuse
        if reuse is not None:
            reuse_fd = reuse.fd
            reuse.fd = -1  # the new segment owns the file now
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
            self.log.warning("open", "preparing %s: %s", segment.path, exc)
            segment.failed = True
        finally:
            segment.reuse = None
            segment.ready.set()

    def write(self, segment: Segment, run: list[segments.Placed]) -> bool:
        """Write one run of reserved slots (``segments.write_run``); False on failure."""
        if segment.failed:
            return False
        try:
            if self.removed(segment):
                return False
            segments.write_run(
                segment.fd,
                segment.seq,
                run,
                sync_data=self.fsync is not FsyncPolicy.NEVER,
                sync_slots=self.fsync is FsyncPolicy.ALWAYS,
            )
        except OSError as exc:
            self.log.warning("write", "writing %s: %s", segment.path, exc)
            return False
        return True

    def seal(self, segment: Segment) -> None:
        """Tell read-only instances no slot of this segment will be filled any more."""
        segment.sealed = True
        self._write_flags(segment)
        self.touch(segment, again=True)

    def after_reserve(self, work: FileWork) -> None:
        """The file work reservations left that needs the lock held: evicted files go,
        superseded idle segments are sealed (else by the commit that idles them), and
        segments passed over lose their hit and are stamped most recent on disk too."""
        for segment in work.discarded:
            self.discard_file(segment)
        for segment in work.superseded:
            if segment.idle and segment.fd >= 0 and not segment.sealed:
                self.seal(segment)
        for segment in work.passed:
            self._write_flags(segment)
            self.touch(segment)

    def mark_reused(self, segment: Segment) -> None:
        """``table.mark_reused``, kept in the header for a restarted writer (best effort:
        a mark lost to an error only makes the segment evicted sooner)."""
        if self.table.mark_reused(segment):
            self._write_flags(segment)

    def used(self, segment: Segment) -> None:
        """A get read objects of a held ``segment``: it is the most recently used, and
        hit if it was marked reused (``table.mark_hit``, kept as ``mark_reused``)."""
        self.table.use(segment)
        self.touch(segment)
        if self.table.mark_hit(segment):
            self._write_flags(segment)

    def _write_flags(self, segment: Segment) -> None:
        """The header's flags as the segment is now (sealed, marks)."""
        if segment.fd < 0 or segment.failed:
            return
        try:
            segments.write_flags(
                segment.fd, sealed=segment.sealed, reused=segment.reused, hit=segment.hit
            )
        except OSError as exc:
            self.log.warning("flags", "writing the flags of %s: %s", segment.path, exc)

    def damaged(
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
        self.mark_dead(segment, slot)
        try:
            self.restore_size(segment)
        except OSError as exc:
            self.log.warning("restore", "%s: %s", segment.path, exc)

        def read() -> bytes:
            data = os.pread(segment.fd, SLOT_BYTES, slot_offset(slot))
            if entry is None:
                return data
            stored = segments.parse_slot(data, segment.header, segment.size)  # dead by now
            length = stored.length if isinstance(stored, segments.Slot) else entry.length
            return data + os.pread(segment.fd, min(length, MAX_QUARANTINE_COPY), entry.offset)

        name = f"{digest}.kv" if digest else f"{os.path.basename(segment.path)}.slot{slot}"
        self.quarantine.keep_copy(name, reason, read)

    def mark_dead(self, segment: Segment, slot: int) -> None:
        try:
            segments.write_slot_state(segment.fd, slot, SlotState.DEAD)
        except OSError as exc:
            self.log.warning("dead", "%s: %s", segment.path, exc)
        self.touch(segment, again=True)

    def close_files(self) -> None:
        for segment in [*self.table.segments.values(), *self.lost]:
            self.close_fd(segment)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the writer lock
            self.lock_fd = None

    def discard_file(self, segment: Segment) -> None:
        self.close_fd(segment)
        unlink(segment.path, self.log)

    def touch(self, segment: Segment, *, again: bool = False) -> None:
        """Persist the LRU order: the next start sorts segments by mtime. Stamps are
        explicit and increasing (the kernel's own are coarse); ``again`` restores the
        last stamp after a metadata write that moved it."""
        if not again:
            self.last_mtime_ns = max(time.time_ns(), self.last_mtime_ns + 1)
            segment.mtime_ns = self.last_mtime_ns
        if segment.fd < 0 or not segment.mtime_ns:
            return
        try:
            os.utime(segment.fd, ns=(segment.mtime_ns, segment.mtime_ns))
        except OSError as exc:
            self.log.warning("touch", "%s: %s", segment.path, exc)

    @staticmethod
    def close_fd(segment: Segment) -> None:
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def check_files(self) -> None:
        """Segment files on disk vs the table (under the lock). A put may be
        preparing segments right now; those and the files they take over are
        checked once ready, which is decided before listing the directory."""
        assert self.table.allocated <= self.capacity_bytes
        now = list(self.table.segments.values())
        opening = [s for s in now if not s.ready.is_set()]
        skip = {s.seq for s in opening} | {s.reuse_seq for s in opening}
        names = os.listdir(self.paths.root)
        on_disk = {
            seq: os.stat(self.paths.segment(seq)).st_size
            for name in names
            if (seq := segment_seq(name)) is not None and seq not in skip
        }
        known = {s.seq: s.size for s in now if s not in opening and not s.failed}
        assert on_disk == known, (
            f"segment files {on_disk} != segments {known}; files of no segment: "
            f"{segments.describe_files(self.paths, set(on_disk) - set(known))}"
        )
        temps = [name for name in names if is_temp(name)]
        assert len(temps) <= len(opening), f"leaked temp files {temps}"
