"""Connector metrics through vLLM 0.32's stats plumbing (logs and Prometheus).

The scheduler and worker sides each turn their monotonic counters into
per-interval deltas (``CounterDeltas``); vLLM sums them across workers and
steps (``HybridKVStats.aggregate``), logs ``reduce()`` periodically and hands
the same data to ``HybridKVPromMetrics.observe`` in the API server process.
Names are flat: ``lookup.*``, ``load.*``, ``store.*`` and ``tier.<name>.*``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

PROM_PREFIX = "hybridkv_"
MAX_SUFFIX = "_max"
"""Gauges folded by max instead of sum."""

TIER_COUNTERS: tuple[str, ...] = (
    *("queries", "hits", "misses", "gets", "get_bytes", "puts", "put_bytes"),
    *("corrupt", "errors", "evictions", "hit_tokens"),
)

PROM_COUNTERS: dict[str, str] = {
    "lookup.lookups": "Hit lookups of requests",
    "lookup.lookup_tokens": "Prompt tokens looked up (beyond the engine's own cache)",
    "lookup.hits": "Lookups that found tokens to load",
    "lookup.hit_tokens": "Tokens found by lookups",
    "lookup.misses": "Lookups that found nothing beyond the engine's own cache",
    "load.loads": "Loads started",
    "load.loads_ok": "Loads that completed",
    "load.loads_failed": "Loads that failed or timed out (recomputed)",
    "load.loads_timed_out": "Loads that timed out",
    "load.load_blocks": "Blocks loaded",
    "load.load_failed_blocks": "Blocks that failed to load",
    "load.load_latency_s_sum": "Seconds loads took (sum)",
    "load.bytes": "Bytes loaded",
    "store.store_blocks": "Blocks queued for storing",
    "store.store_blocks_dropped": "Blocks not stored (backpressure, full or failing tier)",
    "store.bytes": "Bytes stored",
}


def flatten(prefix: str, counters: Mapping[str, float]) -> dict[str, float]:
    return {f"{prefix}.{name}": float(value) for name, value in counters.items()}


class CounterDeltas:
    """Turns monotonic counters into what changed since the previous call."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def delta(self, counters: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, value in counters.items():
            if name.endswith(MAX_SUFFIX):
                if value > self._last.get(name, 0.0):
                    out[name] = value
            elif value != self._last.get(name, 0.0):
                out[name] = value - self._last.get(name, 0.0)
            self._last[name] = value
        return out


class HybridKVStats(KVConnectorStats):  # type: ignore[misc]
    """Per-interval connector counters (a plain dict, serializable across processes)."""

    def reset(self) -> None:
        self.data: dict[str, float] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[str, float] = dict(self.data)
        for name, value in (other.data or {}).items():
            if name.endswith(MAX_SUFFIX):
                merged[name] = max(merged.get(name, 0.0), value)
            else:
                merged[name] = merged.get(name, 0.0) + value
        return HybridKVStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: int(value) if float(value).is_integer() else round(value, 6)
            for name, value in sorted(self.data.items())
        }
        loads = self.data.get("load.loads_ok", 0.0) + self.data.get("load.loads_failed", 0.0)
        if loads:
            out["load.latency_s_avg"] = round(
                self.data.get("load.load_latency_s_sum", 0.0) / loads, 6
            )
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HybridKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Counters ``hybridkv_<group>_<name>_total``, and per tier with a ``tier`` label."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        self._counters = {
            name: self._counter_cls(
                name=f"{PROM_PREFIX}{name.replace('.', '_')}_total",
                documentation=doc,
                labelnames=labelnames,
            )
            for name, doc in PROM_COUNTERS.items()
        }
        self._tier_counters = {
            name: self._counter_cls(
                name=f"{PROM_PREFIX}tier_{name}_total",
                documentation=f"Tier {name.replace('_', ' ')}, per tier",
                labelnames=[*labelnames, "tier"],
            )
            for name in TIER_COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for name, value in transfer_stats_data.items():
            if value <= 0 or name.endswith(MAX_SUFFIX):
                continue
            if name in self._counters:
                self._counters[name].labels(*labels).inc(value)
            elif name.startswith("tier."):
                tier, _, counter = name[len("tier.") :].rpartition(".")
                if counter in self._tier_counters:
                    self._tier_counters[counter].labels(*labels, tier).inc(value)


def _unregister_previous() -> None:
    """Drop our collectors of an earlier engine in this process (vLLM does the same for
    its ``vllm:`` metrics); registering a name twice is an error."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PROM_PREFIX):
            REGISTRY.unregister(collector)
