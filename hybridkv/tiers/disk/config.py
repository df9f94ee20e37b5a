"""Configuration of the disk tier (``kind: disk``).

Any process; no I/O. The tier itself is ``hybridkv.tiers.disk.tier``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from hybridkv.tiers.disk.segments import PAGE
from hybridkv.tiers.registry import ConfigReader, value_problems

if TYPE_CHECKING:
    from hybridkv.tiers.disk.tier import DiskTier

MIN_BYTES = 3 * PAGE
"""A segment header, a slot table page and one data page."""
_AUTO_SEGMENTS = 32
_AUTO_MIN_SEGMENT = 1 << 20
_AUTO_MAX_SEGMENT = 256 << 20


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
    """Relative loading cost; lower is cheaper (see ``hybridkv.tiers.tiered.store``)."""
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
            capacity_bytes=self.capacity_bytes, minimum=MIN_BYTES, load_weight=self.load_weight
        )
        if not isinstance(self.fsync, FsyncPolicy):
            problems.append(f"fsync={self.fsync!r}: must be a FsyncPolicy")
        if not (isinstance(self.num_io_threads, int) and self.num_io_threads >= 1):
            problems.append(f"num_io_threads={self.num_io_threads!r}: must be an int >= 1")
        segment = self.segment_bytes
        if segment is not None and not (
            isinstance(segment, int)
            and not isinstance(segment, bool)
            and MIN_BYTES <= segment <= max(self.capacity_bytes, MIN_BYTES)
        ):
            problems.append(
                f"segment_bytes={segment!r}: must be an int in [{MIN_BYTES}, capacity_bytes]"
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
        capacity_bytes = reader.byte_size("capacity_bytes", minimum=MIN_BYTES)
        fsync = reader.choice("fsync", FsyncPolicy, default=FsyncPolicy.NEVER)
        load_weight = reader.positive_float("load_weight", default=4.0)
        num_io_threads = reader.integer("num_io_threads", default=4)
        segment_bytes = reader.byte_size("segment_bytes", minimum=MIN_BYTES, default=0)
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
        from hybridkv.tiers.disk.tier import DiskTier

        return DiskTier(self)
