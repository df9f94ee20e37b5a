"""The connector's metrics: one catalog, and samples of them taken from each side.

Any process. ``CATALOG`` declares every metric once (name, type, labels,
help); exporters (``hybridkv.integrations.vllm.metrics``) and the README's
metrics table are built from it. ``scheduler_samples`` and ``worker_samples``
read the monotonic totals (and the gauges) of one side; exporters turn them
into deltas. Names follow Prometheus conventions: base units, ``_total`` for
counters (added by the exporter), labels for groups, kinds, tiers and outcomes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from hybridkv.connector.metadata import LoadOutcome
from hybridkv.connector.stats import SchedulerStats, WorkerStats
from hybridkv.spec import KVLayoutSpec
from hybridkv.tiers.base import TierStats

PREFIX = "hybridkv_"


class MetricType(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exported_name(self) -> str:
        suffix = "_total" if self.type is MetricType.COUNTER else ""
        return f"{PREFIX}{self.name}{suffix}"


_GROUP = ("group", "kind")

CATALOG: tuple[Metric, ...] = (
    Metric("lookups", MetricType.COUNTER, "Hit lookups (one per scheduling attempt of a request)"),
    Metric("lookup_tokens", MetricType.COUNTER, "Tokens looked up beyond the engine's own cache"),
    Metric("lookup_hits", MetricType.COUNTER, "Lookups that found tokens to load"),
    Metric("hit_tokens", MetricType.COUNTER, "Tokens the lookups found to load"),
    Metric(
        "loads_unplanned",
        MetricType.COUNTER,
        "Loads the engine asked for but the connector could not plan (recomputed)",
    ),
    Metric("loads", MetricType.COUNTER, "Finished loads per rank, by outcome", ("outcome",)),
    Metric(
        "load_store_waits",
        MetricType.COUNTER,
        "Load parts that waited for the store of their blocks (read-your-writes)",
    ),
    Metric("load_seconds", MetricType.HISTOGRAM, "Seconds from a load's start to its last block"),
    Metric("loaded_blocks", MetricType.COUNTER, "Blocks loaded into the KV cache", _GROUP),
    Metric("loaded_bytes", MetricType.COUNTER, "Bytes loaded into the KV cache", _GROUP),
    Metric("load_failed_blocks", MetricType.COUNTER, "Blocks that failed to load", _GROUP),
    Metric("stored_blocks", MetricType.COUNTER, "Blocks stored (or already present)", _GROUP),
    Metric("stored_bytes", MetricType.COUNTER, "Bytes stored", _GROUP),
    Metric(
        "store_dropped_blocks",
        MetricType.COUNTER,
        "Blocks not stored (backpressure, a full or failing tier)",
        _GROUP,
    ),
    Metric("tier_lookup_keys", MetricType.COUNTER, "Keys asked about", ("tier",)),
    Metric("tier_hits", MetricType.COUNTER, "Keys a lookup found", ("tier",)),
    Metric("tier_reads", MetricType.COUNTER, "Objects read", ("tier",)),
    Metric("tier_read_bytes", MetricType.COUNTER, "Bytes read", ("tier",)),
    Metric("tier_writes", MetricType.COUNTER, "Objects written", ("tier",)),
    Metric("tier_written_bytes", MetricType.COUNTER, "Bytes written", ("tier",)),
    Metric("tier_full_skips", MetricType.COUNTER, "Writes skipped: no room", ("tier",)),
    Metric(
        "tier_corrupt_objects",
        MetricType.COUNTER,
        "Objects that failed their checksum (never loaded)",
        ("tier",),
    ),
    Metric("tier_errors", MetricType.COUNTER, "Calls that failed (answered as misses)", ("tier",)),
    Metric("tier_evictions", MetricType.COUNTER, "Objects or segments evicted", ("tier",)),
    Metric("tier_hit_tokens", MetricType.COUNTER, "Tokens of whole-request hits served", ("tier",)),
    Metric(
        "scheduler_state_entries",
        MetricType.GAUGE,
        "Per-request entries the scheduler side holds (all 0 once every request finished)",
        ("entry",),
    ),
)
METRICS = {m.name: m for m in CATALOG}

_TIER_FIELDS = {
    "tier_lookup_keys": "queries",
    "tier_hits": "hits",
    "tier_reads": "gets",
    "tier_read_bytes": "get_bytes",
    "tier_writes": "puts",
    "tier_written_bytes": "put_bytes",
    "tier_full_skips": "put_skipped_full",
    "tier_corrupt_objects": "corrupt",
    "tier_errors": "errors",
    "tier_evictions": "evictions",
    "tier_hit_tokens": "hit_tokens",
}


class Sample(NamedTuple):
    """One labelled value: a counter's monotonic total or a gauge's current value."""

    name: str
    labels: tuple[str, ...]
    value: float

    @property
    def key(self) -> str:
        """``name{label=value,...}``: a readable name for logs and tests."""
        metric = METRICS[self.name]
        if not metric.labels:
            return self.name
        pairs = ",".join(f"{k}={v}" for k, v in zip(metric.labels, self.labels, strict=True))
        return f"{self.name}{{{pairs}}}"


def scheduler_samples(stats: SchedulerStats, state_sizes: dict[str, int]) -> Iterator[Sample]:
    """The counters, and ``state_sizes`` (``ConnectorScheduler.state_sizes()``) as gauges."""
    yield Sample("lookups", (), stats.lookups)
    yield Sample("lookup_tokens", (), stats.lookup_tokens)
    yield Sample("lookup_hits", (), stats.lookup_hits)
    yield Sample("hit_tokens", (), stats.hit_tokens)
    yield Sample("loads_unplanned", (), stats.loads_unplanned)
    for entry, size in state_sizes.items():
        yield Sample("scheduler_state_entries", (entry,), size)


def worker_samples(
    stats: WorkerStats, layout: KVLayoutSpec, tiers: dict[str, TierStats]
) -> Iterator[Sample]:
    for outcome in LoadOutcome:
        yield Sample("loads", (outcome.value,), stats.loads[outcome])
    yield Sample("load_store_waits", (), stats.load_store_waits)
    for group_id, (group, counts) in enumerate(zip(layout.groups, stats.groups, strict=True)):
        labels = (str(group_id), group.kind.value)
        for name in (
            "loaded_blocks",
            "loaded_bytes",
            "load_failed_blocks",
            "stored_blocks",
            "stored_bytes",
            "store_dropped_blocks",
        ):
            yield Sample(name, labels, getattr(counts, name))
    for tier, tier_stats in tiers.items():
        for name, field in _TIER_FIELDS.items():
            yield Sample(name, (tier,), getattr(tier_stats, field))


def markdown_table() -> str:
    """The README's table of metrics."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in CATALOG:
        labels = ", ".join(f"`{label}`" for label in m.labels)
        rows.append(f"| `{m.exported_name}` | {m.type.value} | {labels} | {m.help} |")
    return "\n".join(rows)
