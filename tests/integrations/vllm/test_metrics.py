"""The connector's metrics through vLLM 0.32's stats and Prometheus classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import VllmConfig

from hybridkv.connector.metrics import CATALOG, Sample
from hybridkv.integrations.vllm.metrics import (
    COUNTERS,
    LOAD_SECONDS,
    CounterDeltas,
    HybridKVPromMetrics,
    HybridKVStats,
)

LABELS = {"model_name": "m", "engine": "0"}


def test_deltas_report_only_what_changed() -> None:
    deltas = CounterDeltas()
    first = [Sample("loads", ("ok",), 2), Sample("hit_tokens", (), 64)]
    assert deltas.delta(first) == [["loads", ["ok"], 2], ["hit_tokens", [], 64]]
    assert deltas.delta(first) == []
    later = [Sample("loads", ("ok",), 5), Sample("hit_tokens", (), 64)]
    assert deltas.delta(later) == [["loads", ["ok"], 3]]
    gauge = [Sample("scheduler_state_entries", ("requests",), 4)]
    assert deltas.delta(gauge) == [["scheduler_state_entries", ["requests"], 4]]
    emptied = [Sample("scheduler_state_entries", ("requests",), 0)]
    assert deltas.delta(emptied) == [["scheduler_state_entries", ["requests"], -4]]


def test_stats_merge_across_ranks_and_steps() -> None:
    a = HybridKVStats(data={COUNTERS: [["loads", ["ok"], 1], ["hit_tokens", [], 32]]})
    b = HybridKVStats(
        data={COUNTERS: [["loads", ["ok"], 2], ["loads", ["failed"], 1]], LOAD_SECONDS: [0.5]}
    )
    merged = a.aggregate(b).aggregate(HybridKVStats(data={LOAD_SECONDS: [0.1]}))
    assert sorted(merged.data[COUNTERS]) == [
        ["hit_tokens", [], 32],
        ["loads", ["failed"], 1],
        ["loads", ["ok"], 3],
    ]
    assert merged.data[LOAD_SECONDS] == [0.5, 0.1]
    summary = merged.reduce()
    assert summary["loads"] == 4 and summary["hit_tokens"] == 32
    assert summary["load_seconds_avg"] == pytest.approx(0.3)
    assert not merged.is_empty() and HybridKVStats(data={}).is_empty()


def _registry_bound(registry: CollectorRegistry) -> dict[type, type]:
    def bound(cls: type) -> type:
        def init(self: object, *args: object, **kwargs: object) -> None:
            cls.__init__(self, *args, registry=registry, **kwargs)  # type: ignore[misc]

        return type(cls.__name__, (cls,), {"__init__": init})

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_prometheus_names_labels_and_histogram() -> None:
    registry = CollectorRegistry()
    metrics = HybridKVPromMetrics(
        VllmConfig(), _registry_bound(registry), ["model_name", "engine"], {0: ["m", "0"]}
    )
    metrics.observe(
        {
            COUNTERS: [
                ["hit_tokens", [], 64],
                ["loaded_blocks", ["1", "full"], 5],
                ["tier_read_bytes", ["disk"], 4096],
                ["loads", ["timed_out"], 1],
            ],
            LOAD_SECONDS: [0.02, 3.0],
        }
    )
    metrics.observe({COUNTERS: [["hit_tokens", [], 32]]})
    value = registry.get_sample_value
    assert value("hybridkv_hit_tokens_total", LABELS) == 96
    assert value("hybridkv_loaded_blocks_total", {**LABELS, "group": "1", "kind": "full"}) == 5
    assert value("hybridkv_tier_read_bytes_total", {**LABELS, "tier": "disk"}) == 4096
    assert value("hybridkv_loads_total", {**LABELS, "outcome": "timed_out"}) == 1
    assert value("hybridkv_load_seconds_count", LABELS) == 2
    assert value("hybridkv_load_seconds_sum", LABELS) == pytest.approx(3.02)
    assert value("hybridkv_load_seconds_bucket", {**LABELS, "le": "0.025"}) == 1
    metrics.observe({COUNTERS: [["scheduler_state_entries", ["requests"], 3]]})
    metrics.observe({COUNTERS: [["scheduler_state_entries", ["requests"], -2]]})
    assert value("hybridkv_scheduler_state_entries", {**LABELS, "entry": "requests"}) == 1
    metrics.observe({COUNTERS: [["scheduler_state_entries", ["requests"], -1]]})
    assert value("hybridkv_scheduler_state_entries", {**LABELS, "entry": "requests"}) == 0
    exported = {m.name for m in registry.collect()}
    assert {m.exported_name.removesuffix("_total") for m in CATALOG} <= exported


def test_a_second_engine_in_the_process_registers_its_metrics_again() -> None:
    from prometheus_client import REGISTRY

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    for _ in range(2):  # the second would be a duplicate registration without cleanup
        metrics = HybridKVPromMetrics(
            VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]}
        )
        metrics.observe({COUNTERS: [["lookups", [], 1]]})
        assert REGISTRY.get_sample_value("hybridkv_lookups_total", LABELS) == 1
