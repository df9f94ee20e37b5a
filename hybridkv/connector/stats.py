"""Monotonic counters of the scheduler and worker sides (per process, never reset).

Plain data. Each exported field declares its metric (``hybridkv.metric_fields``);
``hybridkv.connector.metrics`` builds the catalog and the samples from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.connector.metadata import LoadOutcome
from hybridkv.metric_fields import counter, counters, histogram

MAX_UNEXPORTED = 1 << 14
_GROUP = ("group", "kind")


@dataclass(kw_only=True)
class SchedulerStats:
    lookups: int = counter("Hit lookups (one per scheduling attempt of a request)")
    lookup_tokens: int = counter("Tokens looked up beyond the engine's own cache")
    lookup_hits: int = counter("Lookups that found tokens to load")
    hit_tokens: int = counter("Tokens the lookups found to load")
    loads_planned: int = counter(
        "Loads planned for the tokens a lookup found (every rank then finishes each)"
    )
    loads_unplanned: int = counter(
        "Loads the engine asked for but the connector could not plan (recomputed)"
    )
    state_handoffs: int = counter(
        "Recurrent states the engine handed over to store (Mamba groups whose states move)"
    )
    state_handoffs_not_stored: int = counter(
        "Of those, states not stored: their request finished or was preempted in the step, "
        "or no hit can read them (off the hit alignment)"
    )
    pool_sightings: int = counter(
        "Block hashes first seen by this engine and marked in the shared pool (admission reused)"
    )
    pool_sightings_before: int = counter(
        "Of those, hashes the pool held a mark of already (another engine, or a run "
        "before, reached them): admitted as reached twice"
    )


@dataclass(kw_only=True)
class GroupCounts:
    """Blocks and bytes of one KV cache group."""

    loaded_blocks: int = counter("Blocks loaded into the KV cache", labels=_GROUP)
    loaded_bytes: int = counter("Bytes loaded into the KV cache", labels=_GROUP)
    load_failed_blocks: int = counter("Blocks that failed to load", labels=_GROUP)
    stored_blocks: int = counter("Blocks stored (or already present)", labels=_GROUP)
    stored_bytes: int = counter("Bytes stored", labels=_GROUP)
    store_dropped_blocks: int = counter(
        "Blocks not stored (backpressure, a full or failing tier)", labels=_GROUP
    )
    refreshed_blocks: int = counter(
        "Blocks admitted after the first tier evicted them, stored again from the KV cache",
        labels=_GROUP,
    )


@dataclass(kw_only=True)
class WorkerStats:
    loads: dict[LoadOutcome, int] = counters(
        lambda: dict.fromkeys(LoadOutcome, 0),
        "Finished loads per rank, by outcome",
        labels=("outcome",),
    )
    load_store_waits: int = counter(
        "Load parts that waited for the store of their blocks (read-your-writes)"
    )
    unflushed_blocks: int = counter(
        "Blocks the worker ended without (shutdown, exit, SIGTERM): stores still copying "
        "and write-backs to the slower tiers still queued when exit_flush_timeout_s ran out"
    )
    unexported_load_seconds: list[float] = histogram(
        list, "Seconds from a load's start to its last block", name="load_seconds"
    )
    """Durations of finished loads not yet taken by a metrics exporter (bounded)."""
    load_seconds_sum: float = 0.0
    groups: list[GroupCounts] = field(default_factory=list)

    def add_load_seconds(self, seconds: float) -> None:
        self.load_seconds_sum += seconds
        if len(self.unexported_load_seconds) < MAX_UNEXPORTED:
            self.unexported_load_seconds.append(seconds)

    def take_load_seconds(self) -> list[float]:
        taken, self.unexported_load_seconds = self.unexported_load_seconds, []
        return taken

    @classmethod
    def for_groups(cls, num_groups: int) -> WorkerStats:
        return cls(groups=[GroupCounts() for _ in range(num_groups)])
