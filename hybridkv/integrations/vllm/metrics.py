"""The connector's metrics through vLLM 0.32's stats plumbing (logs and Prometheus).

Each side (scheduler, every worker) turns its monotonic totals and its
gauges into per-step deltas (``CounterDeltas``; a gauge's delta may be
negative, and deltas add up across steps and ranks like a counter's) plus
the load durations since its last report; vLLM merges them across ranks
and steps (``HybridKVStats.aggregate``), logs ``reduce()`` every few
seconds and hands the merged data to
``HybridKVPromMetrics.observe`` in the frontend process (the API server).
Metric names, types and labels come from ``hybridkv.connector.metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from hybridkv.connector.metrics import CATALOG, Sample
from hybridkv.metric_fields import PREFIX, MetricType

COUNTERS = "counters"
"""``data[COUNTERS]``: ``[[name, [label values], delta], ...]``."""
LOAD_SECONDS = "load_seconds"
"""``data[LOAD_SECONDS]``: durations of the loads finished in the interval."""
LOAD_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class CounterDeltas:
    """Turns monotonic samples into what changed since the previous call."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def delta(self, samples: Iterable[Sample]) -> list[list[Any]]:
        out: list[list[Any]] = []
        for sample in samples:
            key = (sample.name, sample.labels)
            change = sample.value - self._last.get(key, 0.0)
            self._last[key] = sample.value
            if change:
                out.append([sample.name, list(sample.labels), change])
        return out


def stats_data(counters: list[list[Any]], load_seconds: list[float]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if counters:
        data[COUNTERS] = counters
    if load_seconds:
        data[LOAD_SECONDS] = load_seconds
    return data


class HybridKVStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's counter deltas and load durations (plain lists: they cross processes)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[tuple[str, tuple[str, ...]], float] = {}
        for data in (self.data, other.data or {}):
            for name, labels, value in data.get(COUNTERS, ()):
                key = (name, tuple(labels))
                merged[key] = merged.get(key, 0.0) + value
        counters = [[name, list(labels), value] for (name, labels), value in merged.items()]
        seconds = [*self.data.get(LOAD_SECONDS, ()), *(other.data or {}).get(LOAD_SECONDS, ())]
        return HybridKVStats(data=stats_data(counters, seconds))

    def reduce(self) -> dict[str, int | float]:
        """Totals per metric (labels summed) and the mean load time, for vLLM's log line."""
        totals: dict[str, float] = {}
        for name, _, value in self.data.get(COUNTERS, ()):
            totals[name] = totals.get(name, 0.0) + value
        out: dict[str, int | float] = {
            name: int(value) if float(value).is_integer() else round(value, 6)
            for name, value in sorted(totals.items())
        }
        seconds = self.data.get(LOAD_SECONDS, ())
        if seconds:
            out["load_seconds_avg"] = round(sum(seconds) / len(seconds), 6)
        return out

    def is_empty(self) -> bool:
        return not self.data.get(COUNTERS) and not self.data.get(LOAD_SECONDS)


class HybridKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Every metric of the catalog, with vLLM's engine labels in front of its own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        self._counters: dict[str, Any] = {}
        self._gauges: dict[str, Any] = {}
        self._load_seconds: Any = None
        for metric in CATALOG:
            names = [*labelnames, *metric.labels]
            if metric.type is MetricType.HISTOGRAM:
                self._load_seconds = self._histogram_cls(
                    name=metric.exported_name,
                    documentation=metric.help,
                    labelnames=names,
                    buckets=list(LOAD_SECONDS_BUCKETS),
                )
            elif metric.type is MetricType.GAUGE:
                self._gauges[metric.name] = self._gauge_cls(
                    name=metric.exported_name,
                    documentation=metric.help,
                    labelnames=names,
                    multiprocess_mode="sum",
                )
            else:
                # prometheus_client adds "_total" to a counter's name itself.
                self._counters[metric.name] = self._counter_cls(
                    name=metric.exported_name.removesuffix("_total"),
                    documentation=metric.help,
                    labelnames=names,
                )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = self.per_engine_labelvalues.get(engine_idx, [])
        for name, labels, value in transfer_stats_data.get(COUNTERS, ()):
            counter = self._counters.get(name)
            gauge = self._gauges.get(name)
            if counter is not None and value > 0:
                counter.labels(*engine_labels, *labels).inc(value)
            elif gauge is not None:
                gauge.labels(*engine_labels, *labels).inc(value)
        if self._load_seconds is not None:
            histogram = self._load_seconds.labels(*engine_labels)
            for seconds in transfer_stats_data.get(LOAD_SECONDS, ()):
                histogram.observe(seconds)


def _unregister_previous() -> None:
    """Drop our collectors of an earlier engine in this process (vLLM does the same for
    its ``vllm:`` metrics); registering a name twice is an error."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)
