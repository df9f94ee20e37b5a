"""What the scheduler side tells the worker side each step, and what comes back.

Plain picklable frozen dataclasses, built in the scheduler process and read in
the worker processes (one per tensor-parallel rank), or the reverse for
``WorkerReport``. The scheduler decides everything (which blocks, which engine
block ids) and names blocks by their rank-free ``BlockHash``; each worker
derives its own rank's store keys and only moves bytes. Reports name blocks
the same way, tagged with the rank that moved them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hybridkv.keys import BlockHash
from hybridkv.tiers.retention import StackMode


class BlockRef(NamedTuple):
    """One stored block, the same for every tensor-parallel rank."""

    group_id: int
    block_hash: BlockHash


class TierChange(NamedTuple):
    """One block one rank's tier stored or removed (for KV events)."""

    tier_index: int
    ref: BlockRef
    stored: bool
    """False: removed (evicted, deleted, found gone)."""


@dataclass(frozen=True, kw_only=True)
class BlockTransfer:
    """Blocks of one group of one request: ``block_hashes[i]`` <-> engine ``block_ids[i]``."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    block_indices: tuple[int, ...]
    """Position of each block in the group (block i = tokens [i * bs, (i + 1) * bs))."""

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.block_ids) == len(self.block_indices), self
        assert 0 not in self.block_ids, "the null block is never transferred"

    def picked(self, positions: Sequence[int]) -> BlockTransfer:
        """The blocks at these positions of this transfer."""
        return BlockTransfer(
            group_id=self.group_id,
            block_hashes=tuple(self.block_hashes[j] for j in positions),
            block_ids=tuple(self.block_ids[j] for j in positions),
            block_indices=tuple(self.block_indices[j] for j in positions),
        )


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    """Load a request's stored blocks so it can resume at ``num_tokens``.

    ``base_tokens`` is what the engine had before the load. ``planned=False``
    (no transfers) is a load the scheduler could not plan: workers report it
    failed at once so the engine recomputes.
    """

    req_id: str
    num_tokens: int
    base_tokens: int
    transfers: tuple[BlockTransfer, ...]
    planned: bool = True
    tier_index: int | None = None
    """Read every block from this tier (whole-request selection); None: the cheapest
    tier holding each block."""


@dataclass(frozen=True, kw_only=True)
class StorePlan:
    """Store a request's blocks computed this step (gathered before the step ends)."""

    req_id: str
    transfers: tuple[BlockTransfer, ...]
    refresh: tuple[BlockTransfer, ...] = ()
    """Blocks the engine's own cache served the request, admitted this step: stored
    again from it only where the first tier no longer holds them (evicted since)."""


@dataclass(frozen=True, kw_only=True)
class ConnectorMetadata:
    """One step's instructions for every worker."""

    loads: tuple[LoadPlan, ...] = ()
    stores: tuple[StorePlan, ...] = ()
    cancelled_req_ids: frozenset[str] = frozenset()
    """Requests preempted or finished: cancel their loads still in flight."""
    written_block_ids: tuple[int, ...] = ()
    """Blocks (of any group) this step's forward pass may write: a store still copying
    one out must finish first (``ConnectorWorker.fence``)."""
    admitted: tuple[BlockRef, ...] = ()
    """Blocks stored, or being stored, to send on to the slower tiers
    (``Admission.REUSED``; ``connector.admission``)."""
    mode: StackMode = StackMode.OWN_RULES
    """How the tiers keep and send on blocks this step: with ``Admission.REUSED`` the
    scheduler switches them to plain recency while most first sightings come back, and
    (with ``admission_keep_slower``) to keeping the slower tiers' blocks while most
    returning prefixes are lost (``connector.returns``)."""

    @property
    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.stores
            or self.cancelled_req_ids
            or self.written_block_ids
            or self.admitted
        )


class LoadOutcome(enum.Enum):
    """How one rank's load of one request ended."""

    OK = "ok"
    FAILED = "failed"
    """Some blocks were missing, corrupt or unreadable; their KV was not written."""
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    """The request was preempted or finished first."""
    UNPLANNED = "unplanned"
    """The scheduler could not plan it; nothing was loaded."""


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """How one request's load ended on one rank."""

    req_id: str
    outcome: LoadOutcome
    failed_block_ids: tuple[tuple[int, ...], ...] = ()
    """Per group, engine block ids whose KV was not written (every block of the load
    unless the outcome is OK or FAILED)."""

    @property
    def ok(self) -> bool:
        return self.outcome is LoadOutcome.OK


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one worker (rank) finished since its last report."""

    rank: int
    """The rank's index (``WorkerRank.index``: stage by stage, tensor-parallel ranks
    within)."""
    finished_loads: tuple[LoadResult, ...] = ()
    stored: tuple[BlockRef, ...] = ()
    """Blocks now held by this rank's tiers (stored, or already present)."""
    missing: tuple[BlockRef, ...] = ()
    """Blocks a load found missing or corrupt: lookups must stop offering them."""
    dropped: tuple[BlockRef, ...] = ()
    """Blocks a store skipped (backpressure, a full or failing tier): store them again."""
    tier_changes: tuple[TierChange, ...] = ()
    """What each tier stored and removed, in order (only when the engine publishes KV
    events)."""

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_loads or self.stored or self.missing or self.dropped or self.tier_changes
        )


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """The reports of one or several ranks, on their way to the scheduler."""

    ranks: tuple[RankReport, ...] = ()

    @property
    def is_empty(self) -> bool:
        return all(r.is_empty for r in self.ranks)

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(ranks=self.ranks + other.ranks)
