"""Where a disk tier keeps its files: its directory and every name in it.

Any process; no I/O. The directory is the configured ``path``, or, for one of
several ranks, the rank's own directory inside it, named by its label
(``tp<rank>of<size>``, ``pp<stage>of<stages>-tp<rank>of<size>`` with pipeline
parallel; ``DiskConfig.for_rank``). In it: segment files ``<seq:016x>.seg``
(``disk.segments``), temporary files a segment is prepared under, the
writer's ``writer.lock`` and the ``quarantine/`` directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from hybridkv.tiers.ranks import WorkerRank

LOCK_NAME = "writer.lock"
QUARANTINE_NAME = "quarantine"
TEMP_PREFIX = ".tmp."
SEGMENT_NAME = re.compile(r"^([0-9a-f]{16})\.seg$")


@dataclass(frozen=True)
class DiskPaths:
    """The directory of one disk tier, and the paths of the files in it."""

    configured: Path
    """The directory the configuration names."""
    rank: WorkerRank | None = None
    """The rank whose directory inside ``configured`` the tier uses; None: ``configured``."""

    kept: ClassVar[frozenset[str]] = frozenset((LOCK_NAME, QUARANTINE_NAME))
    """Names in ``root`` that are neither segment nor temporary files."""

    @property
    def root(self) -> Path:
        if self.rank is None:
            return self.configured
        return self.configured / self.rank.label

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
