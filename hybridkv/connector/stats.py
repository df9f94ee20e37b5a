"""Monotonic counters of the scheduler and worker sides (per process, never reset).

Plain data. ``hybridkv.connector.metrics`` names them for export.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.connector.metadata import LoadOutcome

MAX_UNEXPORTED = 1 << 14


@dataclass(kw_only=True)
class SchedulerStats:
    lookups: int = 0
    lookup_tokens: int = 0
    """Tokens asked about (beyond what the engine had)."""
    lookup_hits: int = 0
    """Lookups that found tokens to load."""
    hit_tokens: int = 0
    loads_planned: int = 0
    loads_unplanned: int = 0
    """The engine asked for a load the lookup could not back: recomputed."""


@dataclass(kw_only=True)
class GroupCounts:
    """Blocks and bytes of one KV cache group."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failed_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_dropped_blocks: int = 0


@dataclass(kw_only=True)
class WorkerStats:
    loads: dict[LoadOutcome, int] = field(default_factory=lambda: dict.fromkeys(LoadOutcome, 0))
    """Finished loads by outcome."""
    load_seconds_sum: float = 0.0
    load_store_waits: int = 0
    """Load parts that waited for the store of their blocks (read-your-writes)."""
    unexported_load_seconds: list[float] = field(default_factory=list)
    """Durations of finished loads not yet taken by a metrics exporter (bounded)."""
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
