"""The connector's metrics: one catalog, and samples of them taken from each side.

Any process. Every metric is declared once, on the stats field it reports
(``hybridkv.metric_fields``): ``CATALOG`` lists those of the scheduler's,
the worker's and each tier's stats, plus the scheduler's state gauge.
Exporters (``hybridkv.integrations.vllm.metrics``) and the metrics table of
docs/METRICS.md are built from it. ``scheduler_samples`` and ``worker_samples`` read
the monotonic totals (and the gauges) of one side; exporters turn them into
deltas. Names follow Prometheus conventions: base units, ``_total`` for
counters (added by the exporter), labels for groups, kinds, tiers and outcomes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from hybridkv.connector.stats import GroupCounts, SchedulerStats, WorkerStats
from hybridkv.groups import ModelGroups
from hybridkv.metric_fields import Metric, MetricType, declared, label_value
from hybridkv.tiers.base import TierStats

SCHEDULER_STATE_ENTRIES = Metric(
    "scheduler_state_entries",
    MetricType.GAUGE,
    "Per-request entries the scheduler side holds (all 0 once every request finished)",
    ("entry",),
)
"""Sampled from ``ConnectorScheduler.state_sizes()``, not from a stats field."""

_STATS = (SchedulerStats, WorkerStats, GroupCounts, TierStats)
CATALOG: tuple[Metric, ...] = (
    *(declaration.metric for stats in _STATS for declaration in declared(stats)),
    SCHEDULER_STATE_ENTRIES,
)
METRICS = {m.name: m for m in CATALOG}


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
    yield from samples_of(stats)
    for entry, size in state_sizes.items():
        yield Sample(SCHEDULER_STATE_ENTRIES.name, (entry,), size)


def worker_samples(
    stats: WorkerStats, model_groups: ModelGroups, tiers: dict[str, TierStats]
) -> Iterator[Sample]:
    yield from samples_of(stats)
    for group_id, (group, counts) in enumerate(zip(model_groups.groups, stats.groups, strict=True)):
        yield from samples_of(counts, (str(group_id), group.kind.value))
    for tier, tier_stats in tiers.items():
        yield from samples_of(tier_stats, (tier,))


def samples_of(stats: object, labels: tuple[str, ...] = ()) -> Iterator[Sample]:
    """Every declared field of a stats object but histograms (their exporter takes the
    observations), ``labels`` first; a dict of counters gives one sample per key."""
    for field, metric in declared(type(stats)):
        value = getattr(stats, field)
        if metric.type is MetricType.HISTOGRAM:
            continue
        if isinstance(value, dict):
            for key, count in value.items():
                yield Sample(metric.name, (*labels, label_value(key)), count)
        else:
            yield Sample(metric.name, labels, value)


def markdown_table() -> str:
    """The table of metrics in docs/METRICS.md."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in CATALOG:
        labels = ", ".join(f"`{label}`" for label in m.labels)
        rows.append(f"| `{m.exported_name}` | {m.type.value} | {labels} | {m.help} |")
    return "\n".join(rows)
