"""The disk tier: one checksummed file per object, an index rebuilt on start.

Runs in the worker process; a lookup-only instance may run in the scheduler
process on the same directory. Layout under ``root``: ``<xx>/<digest>.kv``
where ``digest`` is the hex xxh3-128 of the key (the same digest the header
carries) and ``xx`` its first two characters (256 fan-out directories), plus
``quarantine/`` for files that failed a check. A file is the codec header
followed by the payload, written to a temp file under the same root and
renamed into place, so a reader never sees a partial object. A put into a
full tier overwrites the file it evicted (renamed to a temp name first):
creating files, not writing bytes, is the slow part of a put on ext4 here.

The directory is the truth and the in-memory index (LRU order, byte counts) a
cache of it: a restarted process rebuilds the index by scanning (LRU order by
mtime, which every hit refreshes), and a key missing from the index is looked
up on disk, so objects written by another process are found (this is how
the scheduler's lookup-only instance sees the worker's stores). Files are
deleted only by the process that writes: capacity is enforced by each
writer over the files it knows, and an index grown by lookups forgets its
oldest entries instead of deleting their files.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Self, TypeVar

from hybridkv.tiers import codec
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
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError, key_digest
from hybridkv.tiers.registry import ConfigReader, value_problems

logger = logging.getLogger(__name__)
T = TypeVar("T")

_OBJECT_NAME = re.compile(r"^([0-9a-f]{32})\.kv$")
_TEMP_PREFIX = ".tmp."
_TEMP_MAX_AGE_S = 600.0
"""A temp file this old is an orphan even if its writer's pid is alive again."""
_MAX_QUARANTINE_FILES = 1024
"""Beyond this many quarantined files, bad files are deleted instead of kept."""
_FAN_OUT = [f"{i:02x}" for i in range(256)]
_MIN_BYTES = codec.HEADER_BYTES + 1


class FsyncPolicy(enum.Enum):
    NEVER = "never"
    """Page cache only. After a power loss recent objects may be missing or
    corrupt; corrupt ones are caught by the checksum and quarantined."""
    FILE = "file"
    """fsync each object's data before it becomes visible under its name."""
    ALWAYS = "always"
    """FILE plus fsync of the directory: an object is durable once put returns."""


_DISK_KEYS = {
    "path": "directory of the cache, created 0700 (required)",
    "capacity_bytes": 'bytes of files to keep, int or "64GiB" (required)',
    "fsync": "'never' | 'file' | 'always' (default 'never')",
    "load_weight": "relative cost of loading from this tier, > 0 (default 4.0)",
    "num_io_threads": "files of one batch moved in parallel, >= 1 (default 4)",
}


@dataclass(frozen=True, kw_only=True)
class DiskConfig:
    path: Path
    capacity_bytes: int
    """Header plus payload bytes of all files (quarantine excluded)."""
    fsync: FsyncPolicy = FsyncPolicy.NEVER
    load_weight: float = 4.0
    """Relative loading cost; lower is cheaper (see ``hybridkv.tiers.tiered``)."""
    num_io_threads: int = 4
    """Files of one batch written/read in parallel (1: in the caller's thread)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser())
        problems = value_problems(
            capacity_bytes=self.capacity_bytes, minimum=_MIN_BYTES, load_weight=self.load_weight
        )
        if not isinstance(self.fsync, FsyncPolicy):
            problems.append(f"fsync={self.fsync!r}: must be a FsyncPolicy")
        if not (isinstance(self.num_io_threads, int) and self.num_io_threads >= 1):
            problems.append(f"num_io_threads={self.num_io_threads!r}: must be an int >= 1")
        if problems:
            raise ValueError("invalid DiskConfig: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str) -> Self:
        reader = ConfigReader(raw, where=where, allowed=_DISK_KEYS)
        path = Path(reader.text("path"))
        capacity_bytes = reader.byte_size("capacity_bytes", minimum=_MIN_BYTES)
        fsync = reader.choice("fsync", FsyncPolicy, default=FsyncPolicy.NEVER)
        load_weight = reader.positive_float("load_weight", default=4.0)
        num_io_threads = reader.integer("num_io_threads", default=4)
        reader.finish()
        return cls(
            path=path,
            capacity_bytes=capacity_bytes,
            fsync=fsync,
            load_weight=load_weight,
            num_io_threads=num_io_threads,
        )

    def build(self) -> DiskTier:
        return DiskTier(self)


class _PutPlan(NamedTuple):
    digest: str
    temp: str
    recycled_bytes: int
    mtime_ns: int


class ScanReport(NamedTuple):
    """What the start-up scan found."""

    num_objects: int
    num_bytes: int
    num_quarantined: int
    num_temp_removed: int
    num_evicted: int


def _io_all(
    io: Callable[[int, list[memoryview], int], int], fd: int, parts: Sequence[memoryview]
) -> bool:
    """Run ``os.preadv``/``os.pwritev`` from offset 0 until ``parts`` are done; False on EOF."""
    total, done = sum(map(len, parts)), 0
    while done < total:
        skip, views = done, []
        for part in parts:
            if skip < len(part):
                views.append(part[skip:])
            skip = max(0, skip - len(part))
        got = io(fd, views, done)
        if got == 0:
            return False
        done += got
    return True


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # the mode given to mkdir is masked by umask


class DiskTier(Tier):
    """Objects as files; least recently used (put or hit) evicted first. Thread-safe.

    ``get_many_into`` reads straight into the caller's buffer and verifies it
    there: on CORRUPT the buffer holds unverified bytes and must not be used
    (the transfer engine never scatters a non-OK buffer).
    """

    def __init__(self, config: DiskConfig, *, name: str = "disk") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.capacity_bytes = config.capacity_bytes
        self.fsync = config.fsync
        self.root = config.path
        self.quarantine_dir = self.root / "quarantine"
        self._index: OrderedDict[str, int] = OrderedDict()
        """digest -> file bytes, least recently used first."""
        self._pending: dict[str, int] = {}
        """digest -> file bytes reserved by puts whose file is being written."""
        self._temps: set[str] = set()
        """Temp files of this process in use by puts."""
        self._reading: Counter[str] = Counter()
        """digest -> gets reading its file now."""
        self._used_bytes = 0
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._temp_ids = itertools.count()
        self._last_mtime_ns = 0
        self._logged: set[str] = set()
        self._closed = False
        self._pool = (
            ThreadPoolExecutor(config.num_io_threads, thread_name_prefix=f"hybridkv-{name}")
            if config.num_io_threads > 1
            else None
        )
        for directory in (self.root, self.quarantine_dir, *(self.root / d for d in _FAN_OUT)):
            _make_private_dir(directory)
        self._num_quarantine_files = len(os.listdir(self.quarantine_dir))
        self.scan_report = self._scan()

    def _path(self, digest: str) -> str:
        return f"{self.root}/{digest[:2]}/{digest}.kv"

    def _fan_out_entries(self) -> Iterator[os.DirEntry[str]]:
        for sub in _FAN_OUT:
            with os.scandir(self.root / sub) as it:
                yield from list(it)

    def _scan(self) -> ScanReport:
        found: list[tuple[int, str, int]] = []
        num_quarantined = num_temp_removed = 0
        for entry in self._fan_out_entries():
            if entry.name.startswith(_TEMP_PREFIX):
                if self._is_orphan_temp(entry):
                    self._unlink(entry.path)
                    num_temp_removed += 1
                continue
            match = _OBJECT_NAME.match(entry.name)
            problem = self._scan_problem(entry.path) if match else "foreign file"
            if problem is not None or match is None:
                self._move_to_quarantine(entry.path, entry.name, str(problem))
                num_quarantined += 1
                continue
            stat = entry.stat()
            found.append((stat.st_mtime_ns, match.group(1), stat.st_size))
        for _, digest, file_bytes in sorted(found):
            self._index[digest] = file_bytes
            self._used_bytes += file_bytes
        self._stats.corrupt += num_quarantined
        self._make_room(0)
        num_evicted = self._stats.evictions
        if num_quarantined or num_temp_removed:
            logger.warning(
                "disk tier %s: start-up scan quarantined %d bad files, removed %d temp files",
                self.name,
                num_quarantined,
                num_temp_removed,
            )
        return ScanReport(
            len(self._index), self._used_bytes, num_quarantined, num_temp_removed, num_evicted
        )

    @staticmethod
    def _scan_problem(path: str) -> str | None:
        """Checks that need no key: size, magic, version, length (the rest on get)."""
        try:
            with open(path, "rb") as file:
                header = file.read(HEADER_BYTES)
                file_bytes = os.fstat(file.fileno()).st_size
        except OSError as exc:
            return f"unreadable: {exc}"
        if len(header) < HEADER_BYTES:
            return str(HeaderError.TRUNCATED.value)
        length = codec.header_length(header)
        # An empty key cannot match the digest: this call checks magic and version only.
        problem = codec.verify_header(header, StoreKey(""), length)
        if problem is HeaderError.BAD_MAGIC or problem is HeaderError.BAD_VERSION:
            return str(problem.value)
        if HEADER_BYTES + length != file_bytes:
            return str(HeaderError.WRONG_LENGTH.value)
        return None

    @staticmethod
    def _is_orphan_temp(entry: os.DirEntry[str]) -> bool:
        parts = entry.name.split(".")  # "", "tmp", pid, n
        try:
            pid = int(parts[2])
            age_s = time.time() - entry.stat().st_mtime
        except (IndexError, ValueError, OSError):
            return True
        if pid == os.getpid() or age_s > _TEMP_MAX_AGE_S:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        digests = [key_digest(key).hex() for key in keys]
        with self._lock:
            self._check_open()
            found = [digest in self._index or self._adopt(digest) for digest in digests]
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
            self._stats.misses += len(keys) - sum(found)
        return found

    def put_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[PutStatus]:
        """Reserve room in batch order, write the files in parallel, commit in batch order."""
        check_batch(keys, buffers)
        with self._lock:
            self._check_open()
            plans = [self._plan_put(key, len(buf)) for key, buf in zip(keys, buffers, strict=True)]
        results = [plan if isinstance(plan, PutStatus) else PutStatus.OK for plan in plans]
        jobs = [(j, plan) for j, plan in enumerate(plans) if isinstance(plan, _PutPlan)]
        written = self._map(
            lambda i: self._write_file(jobs[i][1], keys[jobs[i][0]], buffers[jobs[i][0]]),
            list(range(len(jobs))),
        )
        with self._lock:
            for (j, plan), ok in zip(jobs, written, strict=True):
                results[j] = self._commit_put(plan, ok, len(buffers[j]))
        return results

    def _plan_put(self, key: StoreKey, num_bytes: int) -> _PutPlan | PutStatus:
        digest, file_bytes = key_digest(key).hex(), HEADER_BYTES + num_bytes
        if digest in self._pending or digest in self._index:
            if digest in self._index:
                self._index.move_to_end(digest)
            return PutStatus.EXISTS
        temp, recycled_bytes = None, 0
        if file_bytes <= self.capacity_bytes:
            temp, recycled_bytes = self._make_room(file_bytes, recycle=True)
        if self._used_bytes + file_bytes > self.capacity_bytes:
            if temp is not None:  # the rest is reserved by puts in flight
                self._temps.discard(temp)
                self._unlink(temp)
            self._stats.put_skipped_full += 1
            return PutStatus.FULL
        self._pending[digest] = file_bytes
        self._used_bytes += file_bytes
        temp = temp or self._new_temp(digest)
        return _PutPlan(digest, temp, recycled_bytes, self._next_mtime_ns())

    def _commit_put(self, plan: _PutPlan, written: bool, num_bytes: int) -> PutStatus:
        file_bytes = self._pending.pop(plan.digest)
        self._temps.discard(plan.temp)
        if not written:
            self._used_bytes -= file_bytes
            self._stats.errors += 1
            return PutStatus.ERROR
        self._index[plan.digest] = file_bytes
        self._stats.puts += 1
        self._stats.put_bytes += num_bytes
        return PutStatus.OK

    def _write_file(self, plan: _PutPlan, key: StoreKey, buf: Buffer) -> bool:
        """Write ``plan.temp`` (new, or an evicted file of ``recycled_bytes``), rename it."""
        digest, temp, recycled_bytes, mtime_ns = plan
        directory = f"{self.root}/{digest[:2]}"
        flags = os.O_WRONLY | os.O_CLOEXEC | (0 if recycled_bytes else os.O_CREAT | os.O_EXCL)
        try:
            fd = os.open(temp, flags, 0o600)
            try:
                os.fchmod(fd, 0o600)  # the mode given to open is masked by umask
                _io_all(os.pwritev, fd, [memoryview(codec.pack_header(key, buf)), buf.data])
                if recycled_bytes > HEADER_BYTES + len(buf):
                    os.ftruncate(fd, HEADER_BYTES + len(buf))
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                if self.fsync is not FsyncPolicy.NEVER:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, self._path(digest))
            if self.fsync is FsyncPolicy.ALWAYS:
                dir_fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            self._log_once("write", "disk tier %s: writing %s failed: %s", self.name, key, exc)
            self._unlink(temp)
            return False
        return True

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        digests = [key_digest(key).hex() for key in keys]
        with self._lock:
            self._check_open()
            todo = [j for j, d in enumerate(digests) if d in self._index or self._adopt(d)]
            mtimes = [self._next_mtime_ns() for _ in todo]
            self._reading.update(digests[j] for j in todo)  # no recycling under a reader
        outcomes = self._map(
            lambda i: self._read_file(digests[todo[i]], keys[todo[i]], buffers[todo[i]], mtimes[i]),
            list(range(len(todo))),
        )
        results = [GetStatus.MISS] * len(keys)
        with self._lock:
            self._reading.subtract(digests[j] for j in todo)
            self._reading = +self._reading
            for j, outcome in zip(todo, outcomes, strict=True):
                results[j] = self._finish_get(digests[j], keys[j], len(buffers[j]), outcome)
        return results

    def _finish_get(
        self, digest: str, key: StoreKey, num_bytes: int, outcome: HeaderError | OSError | None
    ) -> GetStatus:
        if isinstance(outcome, FileNotFoundError):
            if not os.path.exists(self._path(digest)):  # removed by another process
                self._forget(digest)
            return GetStatus.MISS
        if isinstance(outcome, OSError):
            self._log_once("read", "disk tier %s: reading %s: %s", self.name, key, outcome)
            self._stats.errors += 1
            return GetStatus.ERROR
        if outcome is not None:
            self._stats.corrupt += 1
            self._quarantine(digest, str(outcome.value))
            return GetStatus.CORRUPT
        if digest in self._index:
            self._index.move_to_end(digest)
        self._stats.gets += 1
        self._stats.get_bytes += num_bytes
        return GetStatus.OK

    def _read_file(
        self, digest: str, key: StoreKey, buf: Buffer, mtime_ns: int
    ) -> HeaderError | OSError | None:
        try:
            fd = os.open(self._path(digest), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return exc
        try:
            problem = self._read_verified(fd, key, buf)
            if problem is None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))  # persists the LRU order
            return problem
        except OSError as exc:
            return exc
        finally:
            os.close(fd)

    @staticmethod
    def _read_verified(fd: int, key: StoreKey, buf: Buffer) -> HeaderError | None:
        file_bytes = os.fstat(fd).st_size
        if file_bytes < HEADER_BYTES:
            return HeaderError.TRUNCATED
        header = memoryview(bytearray(HEADER_BYTES))
        if file_bytes != HEADER_BYTES + len(buf):
            if not _io_all(os.preadv, fd, [header]):
                return HeaderError.TRUNCATED
            short = file_bytes < HEADER_BYTES + len(buf)
            fallback = HeaderError.TRUNCATED if short else HeaderError.WRONG_LENGTH
            return codec.verify_header(header, key, len(buf)) or fallback
        if not _io_all(os.preadv, fd, [header, buf.data]):
            return HeaderError.TRUNCATED
        problem = codec.verify_header(header, key, len(buf))
        if problem is None and codec.header_checksum(header) != codec.checksum(buf):
            problem = HeaderError.BAD_CHECKSUM
        return problem

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        num_deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                digest = key_digest(key).hex()
                if digest in self._pending:
                    continue
                indexed = self._forget(digest)
                removed = self._unlink(self._path(digest))
                num_deleted += int(indexed or removed)
            self._stats.deletes += num_deleted
        return num_deleted

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                num_objects=len(self._index),
                used_bytes=self._used_bytes,
                capacity_bytes=self.capacity_bytes,
            )

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self._stats.as_dict())

    def _map(self, one: Callable[[int], T], ids: list[int]) -> list[T]:
        """Per-file I/O on the thread pool: file creation is slow here, so overlap it."""
        if self._pool is None or len(ids) < 2:
            return [one(i) for i in ids]
        return list(self._pool.map(one, ids))

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _adopt(self, digest: str) -> bool:
        """Index a file another process (or a past one) wrote; False if absent."""
        if digest in self._pending:
            return False
        try:
            file_bytes = os.stat(self._path(digest)).st_size
        except OSError:
            return False
        if file_bytes < HEADER_BYTES or file_bytes > self.capacity_bytes:
            return False
        self._make_room(file_bytes, forget_only=True)
        self._index[digest] = file_bytes
        self._used_bytes += file_bytes
        return True

    def _make_room(
        self, file_bytes: int, *, recycle: bool = False, forget_only: bool = False
    ) -> tuple[str | None, int]:
        """Evict LRU files until ``file_bytes`` more fit. With ``recycle``, the first
        victim is renamed to a temp path and returned with its size, for the caller to
        overwrite: creating files is the slow part of a put here. With ``forget_only``
        the files stay (the index of a lookup-only process never deletes)."""
        temp, recycled_bytes = None, 0
        while self._used_bytes + file_bytes > self.capacity_bytes and self._index:
            digest = next(iter(self._index))
            victim_bytes = self._index[digest]
            self._forget(digest)
            if forget_only:
                continue
            self._stats.evictions += 1
            if recycle and temp is None and digest not in self._reading:
                temp = self._new_temp(digest)
                try:
                    os.replace(self._path(digest), temp)
                    recycled_bytes = victim_bytes
                    continue
                except OSError:
                    self._temps.discard(temp)
                    temp = None
            self._unlink(self._path(digest))
        return temp, recycled_bytes

    def _new_temp(self, digest: str) -> str:
        temp = f"{self.root}/{digest[:2]}/{_TEMP_PREFIX}{os.getpid()}.{next(self._temp_ids)}"
        self._temps.add(temp)
        return temp

    def _forget(self, digest: str) -> bool:
        file_bytes = self._index.pop(digest, None)
        if file_bytes is None:
            return False
        self._used_bytes -= file_bytes
        return True

    def _quarantine(self, digest: str, reason: str) -> None:
        self._forget(digest)
        if digest not in self._pending:  # else a put is replacing the bad file
            self._move_to_quarantine(self._path(digest), f"{digest}.kv", reason)

    def _move_to_quarantine(self, path: str, name: str, reason: str) -> None:
        logger.warning("disk tier %s: quarantining %s: %s", self.name, path, reason)
        if self._num_quarantine_files >= _MAX_QUARANTINE_FILES:
            self._unlink(path)
            return
        slug = re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")[:40]
        target = self.quarantine_dir / f"{name}.{slug}.{time.time_ns()}"
        try:
            os.replace(path, target)
            self._num_quarantine_files += 1
        except OSError:
            self._unlink(path)

    def _next_mtime_ns(self) -> int:
        self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
        return self._last_mtime_ns

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

    def keys_lru_order(self) -> list[str]:
        """Indexed digests (hex xxh3-128 of the keys), least recently used first."""
        with self._lock:
            return list(self._index)

    def check_integrity(self) -> None:
        """Index vs counters vs the files on disk (files of other writers count as leaks)."""
        with self._lock:
            assert not self._index.keys() & self._pending.keys()
            assert len(self._temps) <= len(self._pending) and not +self._reading
            expected = sum(self._index.values()) + sum(self._pending.values())
            assert self._used_bytes == expected, f"used {self._used_bytes} != {expected}"
            assert self._used_bytes <= self.capacity_bytes
            on_disk: dict[str, int] = {}
            for entry in self._fan_out_entries():
                match = _OBJECT_NAME.match(entry.name)
                if match is not None:
                    on_disk[match.group(1)] = entry.stat().st_size
                elif entry.name.startswith(f"{_TEMP_PREFIX}{os.getpid()}."):
                    assert entry.path in self._temps, f"leaked temp file {entry.path}"
            for digest, file_bytes in self._index.items():
                assert on_disk.get(digest) == file_bytes, f"index/file mismatch for {digest}"
            leaked = on_disk.keys() - self._index.keys() - self._pending.keys()
            assert not leaked, f"{len(leaked)} files on disk are not indexed: {sorted(leaked)[:3]}"
