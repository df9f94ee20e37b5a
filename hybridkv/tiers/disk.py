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

import enum
import fcntl
import itertools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Self, TypeVar

from hybridkv.tiers import codec, segments
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
from hybridkv.tiers.registry import ConfigReader, value_problems
from hybridkv.tiers.segments import (
    PAGE,
    SLOT_BYTES,
    Geometry,
    SegmentHeader,
    Slot,
    SlotState,
    align_up,
    slot_offset,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

LOCK_NAME = "writer.lock"
QUARANTINE_NAME = "quarantine"
_TEMP_PREFIX = ".tmp."
_MAX_QUARANTINE_FILES = 1024
"""Beyond this many quarantined files, bad data is dropped instead of kept."""
_MAX_QUARANTINE_COPY = 64 << 20
_MIN_BYTES = 3 * PAGE
_AUTO_SEGMENTS = 32
_AUTO_MIN_SEGMENT = 1 << 20
_AUTO_MAX_SEGMENT = 256 << 20
_MIN_CHUNK_BYTES = 1 << 20
"""Runs of a batch are split across I/O threads in pieces of at least this size."""
_IOV_MAX = 1024
_REFRESH_EVERY_S = 1.0
_ZEROS = memoryview(bytes(PAGE))


class FsyncPolicy(enum.Enum):
    NEVER = "never"
    """Page cache only. After a power loss recent objects may be missing or
    corrupt; corrupt ones are caught by the checksum and quarantined."""
    FILE = "file"
    """fdatasync a batch's payloads before their slots are written."""
    ALWAYS = "always"
    """FILE plus fdatasync of the slots: an object is durable once put returns."""


_DISK_KEYS = {
    "path": "directory of the cache, created 0700 (required)",
    "capacity_bytes": 'bytes of segment files to keep, int or "64GiB" (required)',
    "fsync": "'never' | 'file' | 'always' (default 'never')",
    "load_weight": "relative cost of loading from this tier, > 0 (default 4.0)",
    "num_io_threads": "parts of one batch moved in parallel, >= 1 (default 4)",
    "segment_bytes": "size of one segment file, the unit of eviction (default: "
    "capacity / 32, within 1 MiB..256 MiB)",
}


def default_segment_bytes(capacity_bytes: int) -> int:
    wanted = min(_AUTO_MAX_SEGMENT, max(_AUTO_MIN_SEGMENT, capacity_bytes // _AUTO_SEGMENTS))
    return min(wanted, capacity_bytes) // PAGE * PAGE


@dataclass(frozen=True, kw_only=True)
class DiskConfig:
    path: Path
    capacity_bytes: int
    """Bytes of all segment files (quarantine excluded)."""
    fsync: FsyncPolicy = FsyncPolicy.NEVER
    load_weight: float = 4.0
    """Relative loading cost; lower is cheaper (see ``hybridkv.tiers.tiered``)."""
    num_io_threads: int = 4
    """Parts of one batch written/read in parallel (1: in the caller's thread)."""
    segment_bytes: int | None = None
    """Size of a segment file; None picks ``default_segment_bytes(capacity_bytes)``.
    Eviction frees a whole segment; an object bigger than one gets its own."""
    read_only: bool = False
    """Never write: lookups and loads of what the directory's writer stores."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser())
        problems = value_problems(
            capacity_bytes=self.capacity_bytes, minimum=_MIN_BYTES, load_weight=self.load_weight
        )
        if not isinstance(self.fsync, FsyncPolicy):
            problems.append(f"fsync={self.fsync!r}: must be a FsyncPolicy")
        if not (isinstance(self.num_io_threads, int) and self.num_io_threads >= 1):
            problems.append(f"num_io_threads={self.num_io_threads!r}: must be an int >= 1")
        segment = self.segment_bytes
        if segment is not None and not (
            isinstance(segment, int)
            and not isinstance(segment, bool)
            and _MIN_BYTES <= segment <= max(self.capacity_bytes, _MIN_BYTES)
        ):
            problems.append(
                f"segment_bytes={segment!r}: must be an int in [{_MIN_BYTES}, capacity_bytes]"
            )
        if problems:
            raise ValueError("invalid DiskConfig: " + "; ".join(problems))

    @property
    def segment_size(self) -> int:
        if self.segment_bytes is not None:
            return self.segment_bytes // PAGE * PAGE
        return default_segment_bytes(self.capacity_bytes)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str) -> Self:
        reader = ConfigReader(raw, where=where, allowed=_DISK_KEYS)
        path = Path(reader.text("path"))
        capacity_bytes = reader.byte_size("capacity_bytes", minimum=_MIN_BYTES)
        fsync = reader.choice("fsync", FsyncPolicy, default=FsyncPolicy.NEVER)
        load_weight = reader.positive_float("load_weight", default=4.0)
        num_io_threads = reader.integer("num_io_threads", default=4)
        segment_bytes = reader.byte_size("segment_bytes", minimum=_MIN_BYTES, default=0)
        reader.finish()
        return cls(
            path=path,
            capacity_bytes=capacity_bytes,
            fsync=fsync,
            load_weight=load_weight,
            num_io_threads=num_io_threads,
            segment_bytes=segment_bytes or None,
        )

    def build(self) -> DiskTier:
        return DiskTier(self)


class DiskTierInUse(RuntimeError):
    """Another process (or instance) writes this directory."""


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


@dataclass(eq=False)
class _Segment:
    header: SegmentHeader
    path: str
    fd: int = -1
    next_slot: int = 0
    """Writer: next free slot. Reader: first slot that may still be filled."""
    cursor: int = 0
    """Writer: next free data offset (page aligned)."""
    digests: set[str] = field(default_factory=set)
    pending: int = 0
    """Reservations whose bytes are being written."""
    readers: int = 0
    superseded: bool = False
    """Writer: no new reservations (another segment is active)."""
    sealed: bool = False
    """The header says so: every slot that will ever be filled is."""
    failed: bool = False
    lost: bool = False
    """Its file was removed from outside (no links left): dropped, fd closed when idle."""
    mtime_ns: int = 0
    """Writer: the last use, stamped on the file (metadata writes would move it)."""
    reuse: _Segment | None = None
    """Writer, while opening: the evicted segment whose file this one takes over."""
    seen_slots: set[int] = field(default_factory=set)
    """Reader: filled slots already handled (rescans skip them)."""
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


class _Entry(NamedTuple):
    segment: _Segment
    slot: int
    offset: int
    length: int


class _Reservation(NamedTuple):
    item: int
    """Index of the object in its put batch."""
    digest: str
    segment: _Segment
    slot: int
    offset: int
    length: int


_GONE = "gone"
"""A read found the slot dead or reused: a miss, not damage."""
_ReadOutcome = HeaderError | OSError | str | None


def _io_all(
    io: Callable[[int, list[memoryview], int], int],
    fd: int,
    parts: Sequence[memoryview],
    offset: int,
) -> bool:
    """Run ``os.preadv``/``os.pwritev`` at ``offset`` until ``parts`` are done; False on EOF."""
    total, done = sum(map(len, parts)), 0
    while done < total:
        skip, views = done, []
        for part in parts:
            if skip < len(part):
                views.append(part[skip:])
                if len(views) == _IOV_MAX:
                    break
            skip = max(0, skip - len(part))
        got = io(fd, views, offset + done)
        if got == 0:
            return False
        done += got
    return True


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # the mode given to mkdir is masked by umask


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks now: writing into them later is cheaper than growing a file."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == 28:  # ENOSPC: the caller fails this segment
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: a sparse file


def _chunks(run: list[_Reservation], num_parts: int) -> list[list[_Reservation]]:
    """Split a run of consecutive slots into up to ``num_parts`` runs of similar bytes."""
    total = sum(r.length for r in run)
    num_parts = max(1, min(num_parts, len(run), total // _MIN_CHUNK_BYTES))
    target, current_bytes = total / num_parts, 0
    parts: list[list[_Reservation]] = []
    current: list[_Reservation] = []
    for r in run:
        current.append(r)
        current_bytes += r.length
        if current_bytes >= target and len(parts) < num_parts - 1:
            parts.append(current)
            current, current_bytes = [], 0
    if current:
        parts.append(current)
    return parts


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
        self.quarantine_dir = self.root / QUARANTINE_NAME
        self.geometry = Geometry.standard(config.segment_size)
        self._num_io_threads = config.num_io_threads
        self._segments: OrderedDict[int, _Segment] = OrderedDict()
        """seq -> segment, least recently used first."""
        self._index: dict[str, _Entry] = {}
        """Hex key digest -> where its object lives."""
        self._pending: set[str] = set()
        """Digests of puts being written."""
        self._allocated = 0
        self._active: _Segment | None = None
        self._lost: set[_Segment] = set()
        """Dropped segments whose fd waits for its last reader or writer."""
        self._next_seq = 1
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._temp_ids = itertools.count()
        self._logged: set[str] = set()
        self._closed = False
        self._last_refresh = 0.0
        self._last_mtime_ns = 0
        self._lock_fd: int | None = None
        for directory in (self.root, self.quarantine_dir):
            _make_private_dir(directory)
        if not self.read_only:
            self._take_writer_lock()
        self._num_quarantine_files = len(os.listdir(self.quarantine_dir))
        self._pool = (
            ThreadPoolExecutor(config.num_io_threads, thread_name_prefix=f"hybridkv-{name}")
            if config.num_io_threads > 1
            else None
        )
        with self._lock:
            self.scan_report = self._scan()

    # ----------------------------------------------------------------- start-up

    def _take_writer_lock(self) -> None:
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DiskTierInUse(
                f"disk tier {self.name}: {self.root} is written by process {holder}; give "
                "each engine (and each tensor-parallel rank) its own path, or open it "
                "read_only for lookups"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _scan(self) -> ScanReport:
        num_bad = num_temp = 0
        found: list[tuple[int, int, _Segment]] = []
        with os.scandir(self.root) as it:
            entries = list(it)
        for entry in entries:
            if entry.name in (QUARANTINE_NAME, LOCK_NAME):
                continue
            if entry.name.startswith(_TEMP_PREFIX):
                if not self.read_only:  # the writer lock says no one else is writing
                    num_temp += self._unlink(entry.path)
                continue
            match = segments.SEGMENT_NAME.match(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                if entry.is_dir(follow_symlinks=False):
                    self._log_once(
                        "dir", "disk tier %s: leaving directory %s alone", self.name, entry.path
                    )
                    continue
                num_bad += 1
                if not self.read_only:
                    self._move_to_quarantine(entry.path, entry.name, "foreign file")
                continue
            segment = self._load_segment(int(match.group(1), 16), entry.path)
            if isinstance(segment, str):
                num_bad += 1
                if not self.read_only:
                    self._move_to_quarantine(entry.path, entry.name, segment)
                continue
            found.append((os.fstat(segment.fd).st_mtime_ns, segment.seq, segment))
        num_bad_slots = 0
        for mtime_ns, _, segment in sorted(found, key=lambda t: t[:2]):
            segment.mtime_ns = mtime_ns
            self._last_mtime_ns = max(self._last_mtime_ns, mtime_ns)
            self._segments[segment.seq] = segment
            self._allocated += segment.size
            num_bad_slots += self._scan_slots(segment)
            self._next_seq = max(self._next_seq, segment.seq + 1)
            if not self.read_only and os.fstat(segment.fd).st_size < segment.size:
                os.ftruncate(segment.fd, segment.size)  # cut short: restore its geometry
        self._stats.corrupt += num_bad + num_bad_slots
        if not self.read_only:
            for segment in self._segments.values():
                segment.superseded = True  # never appended to again
                if not segment.sealed:
                    self._seal(segment)
            while self._allocated > self.capacity_bytes and self._segments:
                victim = next(iter(self._segments.values()))
                self._evict(victim)
                self._close_fd(victim)
                self._unlink(victim.path)
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
        return ScanReport(
            len(self._index),
            self._allocated,
            len(self._segments),
            num_bad + num_bad_slots,
            num_temp,
            self._stats.evictions,
        )

    def _load_segment(self, seq: int, path: str) -> _Segment | str:
        """Open a segment file and read its header; what is wrong with it otherwise."""
        flags = (os.O_RDONLY if self.read_only else os.O_RDWR) | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            return f"unreadable: {exc}"
        try:
            header = segments.read_segment_header(fd)
        except OSError as exc:
            header = f"unreadable: {exc}"
        if isinstance(header, SegmentHeader) and header.seq != seq:
            header = "header names another segment"
        if isinstance(header, str):
            os.close(fd)
            return header
        segment = _Segment(header, path, fd, sealed=header.sealed)
        segment.ready.set()
        return segment

    def _scan_slots(self, segment: _Segment) -> int:
        """Index the live slots of ``segment`` not handled yet; returns damaged ones."""
        num_bad = 0
        try:
            file_bytes = os.fstat(segment.fd).st_size
            slots = list(
                segments.read_slots(segment.fd, segment.header, segment.next_slot, file_bytes)
            )
        except OSError as exc:
            self._log_once("scan", "disk tier %s: scanning %s: %s", self.name, segment.path, exc)
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
                continue
            digest = slot.digest.hex()
            if slot.state is SlotState.LIVE and digest not in self._index:
                self._index[digest] = _Entry(segment, index, slot.offset, slot.length)
                segment.digests.add(digest)
        last = slots[-1][0] + 1 if slots else segment.next_slot
        segment.next_slot = last if first_empty is None else first_empty
        return num_bad

    # --------------------------------------------------------------- lookups

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        digests = [key_digest(key).hex() for key in keys]
        with self._lock:
            self._check_open()
            found = [digest in self._index for digest in digests]
            if self._maybe_refresh(missing=not all(found)) or self._any_lost(digests):
                found = [digest in self._index for digest in digests]
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
            self._stats.misses += len(keys) - sum(found)
        return found

    def _any_lost(self, digests: Sequence[str]) -> bool:
        """Drop the segments of these digests whose files were removed from outside."""
        lost = False
        for segment in {e.segment for d in digests if (e := self._index.get(d)) is not None}:
            try:
                segment.lost = os.fstat(segment.fd).st_nlink == 0
            except OSError:
                segment.lost = True
            lost |= segment.lost
            self._drop_if_lost(segment)
        return lost

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
        on_disk: dict[int, str] = {}
        with os.scandir(self.root) as it:
            for entry in it:
                match = segments.SEGMENT_NAME.match(entry.name)
                if match is not None:
                    on_disk[int(match.group(1), 16)] = entry.path
        for seq, segment in list(self._segments.items()):
            if seq not in on_disk and segment.readers == 0:
                self._evict(segment, count=False)
                self._close_fd(segment)
        for seq, path in sorted(on_disk.items()):
            if seq not in self._segments:
                loaded = self._load_segment(seq, path)
                if isinstance(loaded, _Segment):
                    self._segments[seq] = loaded
                    self._allocated += loaded.size
                    self._stats.corrupt += self._scan_slots(loaded)  # after its header
        for segment in self._segments.values():
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

    # ------------------------------------------------------------------ puts

    def put_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[PutStatus]:
        """Reserve in batch order, write runs of slots in parallel, commit in batch order."""
        check_batch(keys, buffers)
        self._check_writable("put")
        results: list[PutStatus] = [PutStatus.OK] * len(keys)
        reservations: list[_Reservation] = []
        to_open: list[_Segment] = []
        with self._lock:
            self._check_open()
            for item, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
                reserved = self._reserve(item, key, len(buf), to_open)
                if isinstance(reserved, PutStatus):
                    results[item] = reserved
                else:
                    reservations.append(reserved)
        for segment in to_open:
            self._open_segment(segment)
        parts: list[list[_Reservation]] = []
        for run in self._runs(reservations):
            run[0].segment.ready.wait()
            parts.extend(_chunks(run, self._num_io_threads))
        written = self._map(lambda i: self._write_part(parts[i], keys, buffers), len(parts))
        with self._lock:
            for part, ok in zip(parts, written, strict=True):
                for reservation in part:
                    results[reservation.item] = self._commit(reservation, ok)
            for segment in {r.segment for r in reservations}:
                if self._segments.get(segment.seq) is segment:
                    self._touch(segment)
        return results

    def _reserve(
        self, item: int, key: StoreKey, num_bytes: int, to_open: list[_Segment]
    ) -> _Reservation | PutStatus:
        digest = key_digest(key).hex()
        entry = self._index.get(digest)
        if entry is not None:
            self._segments.move_to_end(entry.segment.seq)
            return PutStatus.EXISTS
        if digest in self._pending:
            return PutStatus.EXISTS
        if num_bytes > self.geometry.data_bytes:
            segment = self._new_segment(Geometry.dedicated(num_bytes), to_open)
            if segment is not None:
                segment.superseded = True  # holds this object only
        else:
            segment = self._active
            if segment is None or not segment.fits(num_bytes):
                if segment is not None:
                    self._supersede(segment)
                segment = self._active = self._new_segment(self.geometry, to_open)
        if segment is None:
            self._stats.put_skipped_full += 1
            return PutStatus.FULL
        slot, offset = segment.next_slot, segment.cursor
        segment.next_slot += 1
        segment.cursor = offset + align_up(num_bytes)
        segment.pending += 1
        self._pending.add(digest)
        self._segments.move_to_end(segment.seq)
        return _Reservation(item, digest, segment, slot, offset, num_bytes)

    def _new_segment(self, geometry: Geometry, to_open: list[_Segment]) -> _Segment | None:
        """Make room (evicting least recently used idle segments) and add a segment."""
        if geometry.size > self.capacity_bytes:
            return None
        reuse: _Segment | None = None
        while self._allocated + geometry.size > self.capacity_bytes:
            victim = next(
                (s for s in self._segments.values() if s.idle and s is not self._active), None
            )
            if victim is None:
                if reuse is not None:
                    self._close_fd(reuse)
                    self._unlink(reuse.path)
                return None
            self._evict(victim)
            if reuse is None:
                reuse = victim  # its file becomes the new segment's
            else:
                self._close_fd(victim)
                self._unlink(victim.path)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        header = SegmentHeader(seq, geometry.size, geometry.num_slots, geometry.data_offset, False)
        segment = _Segment(header, f"{self.root}/{segments.segment_name(seq)}", reuse=reuse)
        segment.cursor = geometry.data_offset
        self._segments[seq] = segment
        self._allocated += geometry.size
        to_open.append(segment)
        return segment

    def _open_segment(self, segment: _Segment) -> None:
        """Create (or take over an evicted file) under a temp name, then rename into place."""
        temp = f"{self.root}/{_TEMP_PREFIX}{os.getpid()}.{next(self._temp_ids)}"
        reuse, fd = segment.reuse, -1
        try:
            if reuse is not None:
                fd, reuse.fd = reuse.fd, -1
                os.replace(reuse.path, temp)
                if os.fstat(fd).st_size != segment.size:
                    os.ftruncate(fd, segment.size)
                    _preallocate(fd, segment.size)
            else:
                fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                os.fchmod(fd, 0o600)  # the mode given to open is masked by umask
                _preallocate(fd, segment.size)
            os.pwrite(fd, segment.header.pack(), 0)
            if self.fsync is not FsyncPolicy.NEVER:
                os.fdatasync(fd)
            os.replace(temp, segment.path)
            if self.fsync is FsyncPolicy.ALWAYS:
                self._fsync_dir()
            segment.fd = fd
        except OSError as exc:
            self._log_once("open", "disk tier %s: preparing %s: %s", self.name, segment.path, exc)
            segment.failed = True
            if fd >= 0:
                os.close(fd)
            self._unlink(temp)
            if reuse is not None:
                self._unlink(reuse.path)  # if the rename never happened
        finally:
            segment.reuse = None
            segment.ready.set()

    @staticmethod
    def _runs(reservations: list[_Reservation]) -> list[list[_Reservation]]:
        """Reservations grouped into runs of consecutive slots of one segment."""
        runs: list[list[_Reservation]] = []
        for r in sorted(reservations, key=lambda r: (r.segment.seq, r.slot)):
            last = runs[-1][-1] if runs else None
            if last is not None and last.segment is r.segment and last.slot + 1 == r.slot:
                runs[-1].append(r)
            else:
                runs.append([r])
        return runs

    def _write_part(
        self, part: list[_Reservation], keys: Sequence[StoreKey], buffers: Sequence[Buffer]
    ) -> bool:
        """Payloads of consecutive slots in one ``pwritev``, then their slots."""
        segment = part[0].segment
        if segment.failed:
            return False
        try:
            if os.fstat(segment.fd).st_nlink == 0:
                segment.lost = True
                return False
            headers = [codec.pack_header(keys[r.item], buffers[r.item]) for r in part]
            views: list[memoryview] = []
            position = part[0].offset
            for r in part:
                if r.offset > position:  # whole pages: no read-modify-write of a reused file
                    views.append(_ZEROS[: r.offset - position])
                views.append(buffers[r.item].data)
                position = r.offset + r.length
            if align_up(position) > position:
                views.append(_ZEROS[: align_up(position) - position])
            _io_all(os.pwritev, segment.fd, views, part[0].offset)
            if self.fsync is not FsyncPolicy.NEVER:
                os.fdatasync(segment.fd)
            table = b"".join(
                segments.pack_slot(segment.seq, r.offset, SlotState.LIVE, header)
                for r, header in zip(part, headers, strict=True)
            )
            _io_all(os.pwritev, segment.fd, [memoryview(table)], slot_offset(part[0].slot))
            if self.fsync is FsyncPolicy.ALWAYS:
                os.fdatasync(segment.fd)
        except OSError as exc:
            self._log_once("write", "disk tier %s: writing %s: %s", self.name, segment.path, exc)
            return False
        return True

    def _commit(self, reservation: _Reservation, written: bool) -> PutStatus:
        segment = reservation.segment
        segment.pending -= 1
        self._pending.discard(reservation.digest)
        status = PutStatus.ERROR
        if written and self._segments.get(segment.seq) is segment:
            entry = _Entry(segment, reservation.slot, reservation.offset, reservation.length)
            self._index[reservation.digest] = entry
            segment.digests.add(reservation.digest)
            self._stats.puts += 1
            self._stats.put_bytes += reservation.length
            status = PutStatus.OK
        else:
            self._stats.errors += 1
        if segment.pending == 0:
            if segment.failed and self._segments.get(segment.seq) is segment:
                self._evict(segment, count=False)
            elif segment.superseded and not segment.sealed and not segment.lost:
                self._seal(segment)
        self._drop_if_lost(segment)
        return status

    def _drop_if_lost(self, segment: _Segment) -> None:
        if not segment.lost:
            return
        if self._segments.get(segment.seq) is segment:
            self._log_once("lost", "disk tier %s: %s was removed", self.name, segment.path)
            self._evict(segment, count=False)
            self._lost.add(segment)
        if segment.pending == 0 and segment.readers == 0:
            self._close_fd(segment)
            self._lost.discard(segment)

    def _supersede(self, segment: _Segment) -> None:
        segment.superseded = True
        if self._active is segment:
            self._active = None
        if segment.pending == 0 and not segment.failed and segment.fd >= 0:
            self._seal(segment)

    def _seal(self, segment: _Segment) -> None:
        try:
            segments.write_sealed_flag(segment.fd)
        except OSError as exc:
            self._log_once("seal", "disk tier %s: sealing %s: %s", self.name, segment.path, exc)
        segment.sealed = True
        self._touch(segment, again=True)

    # ------------------------------------------------------------------ gets

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        digests = [key_digest(key).hex() for key in keys]
        with self._lock:
            self._check_open()
            entries = [self._index.get(digest) for digest in digests]
            if self._maybe_refresh(missing=None in entries):
                entries = [self._index.get(digest) for digest in digests]
            todo = [j for j, entry in enumerate(entries) if entry is not None]
            for j in todo:
                entries[j].segment.readers += 1  # type: ignore[union-attr]
        outcomes = self._map(
            lambda i: self._read(entries[todo[i]], keys[todo[i]], buffers[todo[i]]),  # type: ignore[arg-type]
            len(todo),
        )
        results = [GetStatus.MISS] * len(keys)
        touched: set[_Segment] = set()
        with self._lock:
            for j, outcome in zip(todo, outcomes, strict=True):
                entry = entries[j]
                assert entry is not None
                entry.segment.readers -= 1
                results[j] = self._finish_get(digests[j], entry, keys[j], len(buffers[j]), outcome)
                if results[j] is GetStatus.OK:
                    touched.add(entry.segment)
                self._drop_if_lost(entry.segment)
            if not self.read_only:
                for segment in touched:
                    if self._segments.get(segment.seq) is segment:
                        self._segments.move_to_end(segment.seq)
                        self._touch(segment)
        return results

    def _read(self, entry: _Entry, key: StoreKey, buf: Buffer) -> _ReadOutcome:
        segment = entry.segment
        try:
            if os.fstat(segment.fd).st_nlink == 0:
                segment.lost = True
                return _GONE
            raw = os.pread(segment.fd, SLOT_BYTES, slot_offset(entry.slot))
            slot = segments.parse_slot(raw, segment.header, segment.size)
            if slot is None or (isinstance(slot, Slot) and slot.state is not SlotState.LIVE):
                return _GONE
            if isinstance(slot, str):
                return slot
            if slot.offset != entry.offset:
                return _GONE
            problem = codec.verify_header(raw[SLOT_BYTES - codec.HEADER_BYTES :], key, len(buf))
            if problem is not None:
                return problem
            if not _io_all(os.preadv, segment.fd, [buf.data], entry.offset):
                return HeaderError.TRUNCATED
            if codec.checksum(buf) != slot.checksum:
                return HeaderError.BAD_CHECKSUM
            return None
        except OSError as exc:
            return exc

    def _finish_get(
        self, digest: str, entry: _Entry, key: StoreKey, num_bytes: int, outcome: _ReadOutcome
    ) -> GetStatus:
        if outcome is None:
            self._stats.gets += 1
            self._stats.get_bytes += num_bytes
            return GetStatus.OK
        if outcome == _GONE:
            self._forget(digest, entry)
            return GetStatus.MISS
        if isinstance(outcome, OSError):
            self._log_once("read", "disk tier %s: reading %s: %s", self.name, key, outcome)
            self._stats.errors += 1
            return GetStatus.ERROR
        self._stats.corrupt += 1
        self._forget(digest, entry)
        reason = outcome.value if isinstance(outcome, HeaderError) else outcome
        self._damaged(entry.segment, entry.slot, str(reason), digest=digest, entry=entry)
        return GetStatus.CORRUPT

    # ---------------------------------------------------------------- deletes

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        self._check_writable("delete")
        num_deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                digest = key_digest(key).hex()
                entry = self._index.get(digest)
                if entry is None or digest in self._pending:
                    continue
                self._forget(digest, entry)
                self._mark_dead(entry.segment, entry.slot)
                num_deleted += 1
            self._stats.deletes += num_deleted
        return num_deleted

    # ------------------------------------------------------------ bookkeeping

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                num_objects=len(self._index),
                used_bytes=self._allocated,
                capacity_bytes=self.capacity_bytes,
            )

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self._stats.as_dict())

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
            for segment in [*self._segments.values(), *self._lost]:
                self._close_fd(segment)
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the writer lock
                self._lock_fd = None

    def _evict(self, segment: _Segment, *, count: bool = True) -> None:
        """Forget a segment and its objects (its file is the caller's business)."""
        for digest in segment.digests:
            self._index.pop(digest, None)
        if count:
            self._stats.evictions += len(segment.digests)
        segment.digests.clear()
        del self._segments[segment.seq]
        self._allocated -= segment.size
        if self._active is segment:
            self._active = None

    def _forget(self, digest: str, entry: _Entry) -> None:
        if self._index.get(digest) is entry:
            del self._index[digest]
            entry.segment.digests.discard(digest)

    def _mark_dead(self, segment: _Segment, slot: int) -> None:
        try:
            segments.write_slot_state(segment.fd, slot, SlotState.DEAD)
        except OSError as exc:
            self._log_once("dead", "disk tier %s: %s: %s", self.name, segment.path, exc)
        self._touch(segment, again=True)

    def _damaged(
        self,
        segment: _Segment,
        slot: int,
        reason: str,
        *,
        digest: str = "",
        entry: _Entry | None = None,
    ) -> None:
        """A damaged object: the writer copies it to quarantine and marks its slot dead."""
        logger.warning(
            "disk tier %s: damaged object in %s slot %d: %s", self.name, segment.path, slot, reason
        )
        if self.read_only:
            return
        self._mark_dead(segment, slot)
        try:
            if os.fstat(segment.fd).st_size < segment.size:
                os.ftruncate(segment.fd, segment.size)  # cut short: restore its geometry
        except OSError as exc:
            self._log_once("restore", "disk tier %s: %s: %s", self.name, segment.path, exc)
        if self._num_quarantine_files >= _MAX_QUARANTINE_FILES:
            return
        name = f"{digest}.kv" if digest else f"{os.path.basename(segment.path)}.slot{slot}"
        target = self._quarantine_target(name, reason)
        try:
            data = os.pread(segment.fd, SLOT_BYTES, slot_offset(slot))
            if entry is not None:
                data += os.pread(segment.fd, min(entry.length, _MAX_QUARANTINE_COPY), entry.offset)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, data)
            finally:
                os.close(fd)
            self._num_quarantine_files += 1
        except OSError as exc:
            self._log_once("quarantine", "disk tier %s: quarantine: %s", self.name, exc)

    def _quarantine_target(self, name: str, reason: str) -> Path:
        slug = re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")[:40]
        return self.quarantine_dir / f"{name}.{slug}.{time.time_ns()}"

    def _move_to_quarantine(self, path: str, name: str, reason: str) -> None:
        logger.warning("disk tier %s: quarantining %s: %s", self.name, path, reason)
        if self._num_quarantine_files >= _MAX_QUARANTINE_FILES:
            self._unlink(path)
            return
        try:
            os.replace(path, self._quarantine_target(name, reason))
            self._num_quarantine_files += 1
        except OSError:
            self._unlink(path)

    def _touch(self, segment: _Segment, *, again: bool = False) -> None:
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
            self._log_once("touch", "disk tier %s: %s: %s", self.name, segment.path, exc)

    def _fsync_dir(self) -> None:
        dir_fd = os.open(self.root, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _close_fd(segment: _Segment) -> None:
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def _unlink(self, path: str) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._log_once("unlink", "disk tier %s: removing %s failed: %s", self.name, path, exc)
            return False
        return True

    def _log_once(self, what: str, message: str, *args: object) -> None:
        level = logging.DEBUG if what in self._logged else logging.WARNING
        self._logged.add(what)
        logger.log(level, message, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier {self.name} is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise RuntimeError(f"disk tier {self.name} at {self.root} is read-only: cannot {what}")

    def check_integrity(self) -> None:
        """Index vs segments vs counters vs the slot tables and files on disk."""
        with self._lock:
            assert len(self._pending) == sum(s.pending for s in self._segments.values())
            assert not any(s.readers for s in self._segments.values())
            for digest, entry in self._index.items():
                assert self._segments.get(entry.segment.seq) is entry.segment, digest
                assert digest in entry.segment.digests, digest
            assert sum(len(s.digests) for s in self._segments.values()) == len(self._index)
            expected = sum(s.size for s in self._segments.values())
            assert self._allocated == expected, f"allocated {self._allocated} != {expected}"
            on_disk = {
                int(m.group(1), 16): os.stat(self.root / name).st_size
                for name in os.listdir(self.root)
                if (m := segments.SEGMENT_NAME.match(name))
            }
            if not self.read_only:
                assert self._allocated <= self.capacity_bytes
                known = {s.seq: s.size for s in self._segments.values() if not s.failed}
                assert on_disk == known, f"segment files {on_disk} != segments {known}"
                temps = [n for n in os.listdir(self.root) if n.startswith(_TEMP_PREFIX)]
                assert not temps, f"leaked temp files {temps}"
            for digest, entry in self._index.items():
                segment = entry.segment
                raw = os.pread(segment.fd, SLOT_BYTES, slot_offset(entry.slot))
                slot = segments.parse_slot(raw, segment.header, segment.size)
                assert isinstance(slot, Slot) and slot.state is SlotState.LIVE, (digest, slot)
                assert (slot.digest.hex(), slot.offset, slot.length) == (
                    digest,
                    entry.offset,
                    entry.length,
                ), digest
