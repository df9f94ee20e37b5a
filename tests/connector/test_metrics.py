"""The catalog is built from the stats fields that declare a metric, and each side's
samples are exactly those metrics, labelled as declared."""

from __future__ import annotations

from hybridkv.connector.metadata import LoadOutcome
from hybridkv.connector.metrics import (
    CATALOG,
    METRICS,
    SCHEDULER_STATE_ENTRIES,
    Sample,
    scheduler_samples,
    worker_samples,
)
from hybridkv.connector.stats import GroupCounts, SchedulerStats, WorkerStats
from hybridkv.groups import GroupKind
from hybridkv.metric_fields import MetricType, declared
from hybridkv.tiers.base import TierStats
from hybridkv.tools.sim.shapes import make_groups


def test_every_metric_is_declared_once() -> None:
    stats_types = (SchedulerStats, WorkerStats, GroupCounts, TierStats)
    names = [d.metric.name for cls in stats_types for d in declared(cls)]
    assert len(names) == len(set(names)), names
    assert [m.name for m in CATALOG] == [*names, SCHEDULER_STATE_ENTRIES.name]
    assert METRICS["tier_reads"].labels == ("tier",)  # named apart from its field (gets)
    assert METRICS["load_seconds"].type is MetricType.HISTOGRAM
    assert METRICS["lookups"].exported_name == "hybridkv_lookups_total"


def _check(samples: list[Sample]) -> set[str]:
    for sample in samples:
        assert len(sample.labels) == len(METRICS[sample.name].labels), sample
    keys = [sample.key for sample in samples]
    assert len(keys) == len(set(keys)), keys
    return {sample.name for sample in samples}


def test_samples_carry_each_declared_value_with_its_labels() -> None:
    model_groups = make_groups([GroupKind.FULL, GroupKind.SLIDING_WINDOW])
    scheduler = SchedulerStats(lookups=3, loads_planned=2)
    worker = WorkerStats.for_groups(model_groups.num_groups)
    worker.loads[LoadOutcome.OK] = 5
    worker.groups[1].stored_bytes = 4096
    worker.add_load_seconds(0.5)
    tiers = {"cpu": TierStats(gets=7), "disk": TierStats(pending_loads=2)}

    on_scheduler = list(scheduler_samples(scheduler, {"requests": 1}))
    on_worker = list(worker_samples(worker, model_groups, tiers))
    names = _check(on_scheduler) | _check(on_worker)
    # Every metric is sampled, but the histogram: its exporter takes the observations.
    assert names == {m.name for m in CATALOG if m.type is not MetricType.HISTOGRAM}
    values = {sample.key: sample.value for sample in on_scheduler + on_worker}
    assert values["lookups"] == 3 and values["loads_planned"] == 2
    assert values["scheduler_state_entries{entry=requests}"] == 1
    assert values[f"loads{{outcome={LoadOutcome.OK.value}}}"] == 5
    assert values["stored_bytes{group=1,kind=sliding_window}"] == 4096
    assert values["tier_reads{tier=cpu}"] == 7 and values["tier_reads{tier=disk}"] == 0
    assert values["tier_pending_loads{tier=disk}"] == 2
    assert worker.take_load_seconds() == [0.5]
