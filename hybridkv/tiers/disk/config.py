"""Configuration of the disk tier (``kind: disk``).

Any process; no I/O. The tier itself is ``hybridkv.tiers.disk.tier``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Self

from pydantic import Field, StrictBool, StrictInt
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, ByteSize, UserPath
from hybridkv.tiers.base import TierMedium, TierReach
from hybridkv.tiers.config import LoadWeight, TierConfigBase
from hybridkv.tiers.disk.paths import DiskPaths
from hybridkv.tiers.disk.segments import PAGE
from hybridkv.tiers.ranks import WorkerRank

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


def default_segment_bytes(capacity_bytes: int) -> int:
    wanted = min(_AUTO_MAX_SEGMENT, max(_AUTO_MIN_SEGMENT, capacity_bytes // _AUTO_SEGMENTS))
    return min(wanted, capacity_bytes) // PAGE * PAGE


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class DiskConfig(TierConfigBase):
    """``kind: disk``: a directory on a local file system."""

    kind: Literal["disk"] = "disk"
    path: Annotated[
        UserPath,
        Field(
            description=(
                "directory of the cache, created 0700; refused if another user owns it or "
                "group or others can write it; with several ranks each uses its subdirectory "
                "tp<rank>of<size> (pp<stage>of<stages>-tp<rank>of<size> with pipeline "
                "parallel)"
            )
        ),
    ]
    capacity_bytes: Annotated[
        ByteSize, Field(ge=MIN_BYTES, description="bytes of segment files to keep")
    ]
    fsync: Annotated[
        FsyncPolicy,
        Field(
            description=(
                "never: page cache only; file: sync a batch's payloads before their "
                "slots; always: an object is durable once stored"
            )
        ),
    ] = FsyncPolicy.NEVER
    load_weight: LoadWeight = 4.0
    num_io_threads: Annotated[
        StrictInt,
        Field(
            ge=1,
            description=(
                "threads moving one batch: a put writes runs in different segment files "
                "in parallel, a get reads shares of similar bytes (at most one per CPU the "
                "process may run on)"
            ),
        ),
    ] = 4
    segment_bytes: Annotated[
        ByteSize | None,
        Field(
            ge=MIN_BYTES,
            description=(
                "size of one segment file, the unit of eviction; null: capacity / 32 "
                "within 1 MiB..256 MiB"
            ),
        ),
    ] = None
    read_only: Annotated[
        StrictBool, Field(description="never write: follow what the directory's writer stores")
    ] = False
    rank: WorkerRank | None = dataclasses.field(default=None, init=False)
    """Set by ``for_rank``, never by users: the rank whose own directory inside ``path``
    the tier uses (``DiskPaths``)."""

    reach: ClassVar[TierReach] = TierReach.HOST
    medium: ClassVar[TierMedium] = TierMedium.DISK

    def build(self) -> DiskTier:
        from hybridkv.tiers.disk.tier import DiskTier  # it imports this module

        return DiskTier(self)

    def __post_init__(self) -> None:
        segment = self.segment_bytes
        if segment is not None and segment > max(self.capacity_bytes, MIN_BYTES):
            raise ValueError(
                f"segment_bytes={segment} must not exceed capacity_bytes={self.capacity_bytes}"
            )

    @property
    def segment_size(self) -> int:
        if self.segment_bytes is not None:
            return self.segment_bytes // PAGE * PAGE
        return default_segment_bytes(self.capacity_bytes)

    @property
    def paths(self) -> DiskPaths:
        return DiskPaths(self.path, self.rank)

    def lookup_only(self) -> Self:
        return self._copy(rank=self.rank, read_only=True)

    def for_rank(self, rank: WorkerRank) -> Self:
        if rank.world_size == 1:
            return self
        return self._copy(rank=rank, read_only=self.read_only)

    def _copy(self, *, rank: WorkerRank | None, read_only: bool) -> Self:
        """``rank`` is no constructor argument (users never set it), so
        ``dataclasses.replace`` alone would drop it."""
        copied = dataclasses.replace(self, read_only=read_only)
        object.__setattr__(copied, "rank", rank)
        return copied
