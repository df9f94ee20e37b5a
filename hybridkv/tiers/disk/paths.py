"""Where a disk tier keeps its files: its directory and every name in it.

Any process; no I/O. The directory is the configured ``path``, or, for a
tensor-parallel rank, the rank's own ``tp<rank>of<size>`` inside it
(``DiskConfig.for_rank``). In it: segment files ``<seq:016x>.seg``
(``disk.segments``), temporary files a segment is prepared under, the
writer's ``writer.lock`` and the ``quarantine/`` directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

LOCK_NAME = "writer.lock"
QUARANTINE_NAME = "quarantine"
TEMP_PREFIX = ".tmp."
SEGMENT_NAME = re.compile(r"^([0-9a-f]{16})\.seg$")


class TpRank(NamedTuple):
    """A tensor-parallel rank, which keeps its objects in a directory of its own."""

    tp_rank: int
    tp_size: int


@dataclass(frozen=True)
class DiskPaths:
    """The directory of one disk tier, and the paths of the files in it."""

    configured: Path
    """The directory the configuration names."""
    rank: TpRank | None = None
    """The rank whose directory inside ``configured`` the tier uses; None: ``configured``."""

    kept: ClassVar[frozenset[str]] = frozenset((LOCK_NAME, QUARANTINE_NAME))
    """Names in ``root`` that are neither segment nor temporary files."""

    @property
    def root(self) -> Path:
        if self.rank is None:
            return self.configured
        return self.configured / f"tp{self.rank.tp_rank}of{self.rank.tp_size}"

    @property
    def root_is_ours(self) -> bool:
        """Whether ``root`` is a directory the tier names inside the configured one: a
        symbolic link in its place leads out of the tier's directory and is refused."""
        return self.rank is not None

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def quarantine(self) -> Path:
        return self.root / QUARANTINE_NAME

    def segment(self, seq: int) -> str:
        return f"{self.root}/{segment_name(seq)}"

    def temp(self, pid: int, number: int) -> str:
        """A file being prepared by process ``pid`` (its ``number``-th)."""
        return f"{self.root}/{TEMP_PREFIX}{pid}.{number}"


def segment_name(seq: int) -> str:
    return f"{seq:016x}.seg"


def segment_seq(name: str) -> int | None:
    """The seq of a segment file's name; None for any other name."""
    match = SEGMENT_NAME.match(name)
    return None if match is None else int(match.group(1), 16)


def is_temp(name: str) -> bool:
    """Whether ``name`` is that of a file being prepared (``DiskPaths.temp``)."""
    return name.startswith(TEMP_PREFIX)
