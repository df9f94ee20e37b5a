"""What the scheduler side tells the worker side each step, and what comes back.

Plain picklable frozen dataclasses, built in the scheduler process and read in
the worker process (or the reverse for ``WorkerReport``). The scheduler
decides everything (which keys, which engine block ids); the worker only
moves bytes and reports what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.tiers.base import StoreKey


@dataclass(frozen=True, kw_only=True)
class BlockTransfer:
    """Blocks of one group of one request: ``keys[i]`` <-> engine block ``block_ids[i]``."""

    group_id: int
    keys: tuple[StoreKey, ...]
    block_ids: tuple[int, ...]
    block_indices: tuple[int, ...]
    """Position of each block in the group (block i = tokens [i * bs, (i + 1) * bs))."""

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.block_ids) == len(self.block_indices), self
        assert 0 not in self.block_ids, "the null block is never transferred"


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Load a request's stored blocks so it can resume at ``num_tokens``.

    ``fallback_tokens`` is where it resumes if any block fails (the tokens the
    engine already had before the load). An empty ``transfers`` with
    ``planned=False`` is a load the scheduler could not plan: it is reported
    failed at once so the engine recomputes.
    """

    req_id: str
    num_tokens: int
    fallback_tokens: int
    transfers: tuple[BlockTransfer, ...]
    planned: bool = True
    tier_index: int | None = None
    """Read every block from this tier (whole-request selection); None: the cheapest
    tier holding each block."""


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """Store a request's blocks computed this step (gathered before the step ends)."""

    req_id: str
    transfers: tuple[BlockTransfer, ...]


@dataclass(frozen=True, kw_only=True)
class ConnectorMetadata:
    """One step's instructions for the worker side."""

    loads: tuple[LoadSpec, ...] = ()
    stores: tuple[StoreSpec, ...] = ()
    cancelled_req_ids: frozenset[str] = frozenset()
    """Requests preempted or finished: cancel their loads still in flight."""

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.cancelled_req_ids)


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """How one request's load ended."""

    req_id: str
    failed_block_ids: tuple[tuple[int, ...], ...] = ()
    """Per group, engine block ids that were not loaded (all empty when all loaded)."""
    timed_out: bool = False
    cancelled: bool = False
    unplanned: bool = False
    """The scheduler could not plan it: nothing was loaded."""

    @property
    def ok(self) -> bool:
        failed = self.timed_out or self.cancelled or self.unplanned
        return not failed and not any(self.failed_block_ids)


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What the worker side finished since its last report."""

    finished_loads: tuple[LoadResult, ...] = ()
    stored_keys: tuple[StoreKey, ...] = ()
    """Keys now held by the worker's tiers (stored, or already present)."""
    missing_keys: tuple[StoreKey, ...] = ()
    """Keys a load found missing or corrupt: lookups must stop offering them."""
    dropped_keys: tuple[StoreKey, ...] = ()
    """Keys a store skipped (backpressure, a full or failing tier): send them again."""

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_loads or self.stored_keys or self.missing_keys or self.dropped_keys
        )

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Combine the reports of several workers (tensor-parallel ranks)."""
        return WorkerReport(
            finished_loads=self.finished_loads + other.finished_loads,
            stored_keys=self.stored_keys + other.stored_keys,
            missing_keys=self.missing_keys + other.missing_keys,
            dropped_keys=self.dropped_keys + other.dropped_keys,
        )
