"""File-system pieces of the disk tier: private directories, whole-buffer
positional I/O, preallocation, the one-writer lock and the quarantine.

Any process; no state beyond open descriptors. Kept apart from
``hybridkv.tiers.disk.tier`` so the tier reads as bookkeeping plus calls here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hybridkv.tiers.log_once import LogOnce

logger = logging.getLogger(__name__)

IOV_MAX = 1024
MAX_QUARANTINE_FILES = 1024
"""Beyond this many quarantined files, bad data is dropped instead of kept."""
MAX_QUARANTINE_COPY = 64 << 20


def io_all(
    io: Callable[[int, list[memoryview], int], int],
    fd: int,
    parts: Sequence[memoryview],
    offset: int,
) -> bool:
    """Run ``os.preadv``/``os.pwritev`` at ``offset`` until ``parts`` are done; False on EOF."""
    total = sum(map(len, parts))
    if len(parts) <= IOV_MAX:  # nearly always one call does it all
        done = io(fd, list(parts), offset)
        if done == total:
            return True
        if done == 0 and total:
            return False
    else:
        done = 0
    while done < total:
        skip, views = done, []
        for part in parts:
            if skip < len(part):
                views.append(part[skip:])
                if len(views) == IOV_MAX:
                    break
            skip = max(0, skip - len(part))
        got = io(fd, views, offset + done)
        if got == 0:
            return False
        done += got
    return True


class UnsafeCacheDir(PermissionError):
    """A cache directory another user could read or plant objects in."""


def make_private_dir(path: Path, *, symlink_ok: bool = True) -> None:
    """``path`` as a directory only its owner can use, created 0700 whatever the umask.

    An existing directory must be ours and not writable by group or others
    (anyone who can write it could plant objects or swap segment files); it is
    then narrowed to 0700. ``symlink_ok=False`` refuses a symbolic link in
    place of ``path`` (a directory inside the tier's own, which would lead out
    of it).
    """
    existed = os.path.lexists(path)
    if existed and not symlink_ok and path.is_symlink():
        raise UnsafeCacheDir(
            f"{path} is a symbolic link to {os.readlink(path)!r}; the disk tier never "
            f"follows links inside its directory; fix: remove the link (rm {path})"
        )
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if existed:
        check_private_dir(path)
    os.chmod(path, 0o700)  # the mode given to mkdir is masked by umask


def check_private_dir(path: Path) -> None:
    """UnsafeCacheDir unless ``path`` is owned by this user and writable by no one else."""
    found = path.stat()
    mode = stat.S_IMODE(found.st_mode)
    problems = []
    if found.st_uid != os.geteuid():
        problems.append(f"owned by uid {found.st_uid}, not this process's uid {os.geteuid()}")
    if mode & 0o022:
        problems.append(f"mode {mode:04o} lets group or others write it")
    if problems:
        raise UnsafeCacheDir(
            f"cache directory {path} is {' and '.join(problems)}; another user could read or "
            f"plant cached objects; fix: use a directory of your own (chown {os.geteuid()} "
            f"{path} && chmod 700 {path}), or another path"
        )


def create_private_file(path: str | Path, flags: int = os.O_RDWR) -> int:
    """A new file, 0600 whatever the umask; fails if ``path`` exists."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the mode given to open is masked by umask
    except OSError:
        os.close(fd)
        raise
    return fd


def preallocate(fd: int, size: int) -> None:
    """Reserve the blocks now: writing into them later is cheaper than growing a file."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: a sparse file


def prepare_file(
    temp: str,
    final: str,
    *,
    size: int,
    header: bytes,
    reuse: tuple[int, str] | None,
    sync_data: bool,
    sync_dir: bool,
) -> int:
    """A file of ``size`` bytes starting with ``header``, renamed to ``final`` once ready.

    ``reuse`` (fd, path) takes over an existing file instead of creating one:
    overwriting allocated blocks is cheaper than allocating new ones. Returns
    the open descriptor; on failure nothing is left under ``temp`` (the reused
    file, if it was renamed, goes too) and the descriptor is closed.
    """
    fd = -1
    try:
        if reuse is not None:
            fd = reuse[0]
            os.replace(reuse[1], temp)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
                preallocate(fd, size)
        else:
            fd = create_private_file(temp)
            preallocate(fd, size)
        os.pwrite(fd, header, 0)
        if sync_data:
            os.fdatasync(fd)
        os.replace(temp, final)
        if sync_dir:
            dir_fd = os.open(os.path.dirname(final), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except OSError:
        if fd >= 0:
            os.close(fd)
        for path in (temp, reuse[1] if reuse else None):
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        raise
    return fd


def unlink(path: str, log: LogOnce) -> bool:
    """Remove a file; False if it was not there or could not be removed (logged)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("unlink", "removing %s failed: %s", path, exc)
        return False
    return True


class DiskTierInUse(RuntimeError):
    """Another process (or instance) writes this directory."""


def take_writer_lock(path: Path, *, tier_name: str) -> int:
    """``flock`` the lock file for the caller's lifetime and record its pid in it.

    Closing the returned descriptor (or the process ending, however it ends)
    releases the lock.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UnsafeCacheDir(
            f"disk tier {tier_name}: {path} is a symbolic link; the disk tier never follows "
            f"links inside its directory; fix: remove it (rm {path})"
        ) from None
    try:
        os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskTierInUse(
            f"disk tier {tier_name}: {path.parent} is written by process {holder}; give "
            "each engine (and each tensor-parallel rank) its own path, or open it "
            "read_only for lookups"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class Quarantine:
    """Where bad files and copies of damaged objects go, named by their reason."""

    def __init__(self, directory: Path, log: LogOnce) -> None:
        self.directory = directory
        self._log = log
        make_private_dir(directory, symlink_ok=False)
        self.num_files = len(os.listdir(directory))

    def _target(self, name: str, reason: str) -> Path:
        slug = re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")[:40]
        return self.directory / f"{name}.{slug}.{time.time_ns()}"

    def move(self, path: str, name: str, reason: str) -> None:
        """Move a bad file here (or delete it once the quarantine is full)."""
        logger.warning("quarantining %s: %s", path, reason)
        if self.num_files >= MAX_QUARANTINE_FILES:
            unlink(path, self._log)
            return
        try:
            os.replace(path, self._target(name, reason))
            self.num_files += 1
        except OSError:
            unlink(path, self._log)

    def keep_copy(self, name: str, reason: str, read: Callable[[], bytes]) -> None:
        """Keep the bytes ``read`` returns, for a look later; nothing once full."""
        if self.num_files >= MAX_QUARANTINE_FILES:
            return
        try:
            data = read()
            fd = create_private_file(self._target(name, reason), os.O_WRONLY)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            self.num_files += 1
        except OSError as exc:
            self._log.warning("quarantine", "keeping a copy of %s: %s", name, exc)
