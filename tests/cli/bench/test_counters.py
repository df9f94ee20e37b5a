"""Flat counter keys from a real registry and a real /metrics page."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hybridkv.cli.bench import counters


def test_registry_and_text_give_the_same_keys() -> None:
    registry = CollectorRegistry()
    hits = Counter("vllm:prompt_tokens_cached_by_source", "", ["engine", "model_name", "source"],
                   registry=registry)  # fmt: skip
    hits.labels("0", "m", "host").inc(96)
    hits.labels("1", "m", "host").inc(4)
    hits.labels("0", "m", "disk").inc(32)
    loaded = Counter("hybridkv_loaded_blocks", "", ["group", "kind"], registry=registry)
    loaded.labels("1", "full").inc(3)
    Gauge("vllm:num_requests_running", "", registry=registry).set(5)
    Histogram("hybridkv_load_seconds", "", registry=registry).observe(0.25)
    Counter("other_total_things", "", registry=registry).inc()
    flat = counters.flatten(registry.collect())
    assert flat == counters.from_text(generate_latest(registry).decode())
    assert flat["vllm:prompt_tokens_cached_by_source{source=host}"] == 100
    assert flat["hybridkv_loaded_blocks{group=1,kind=full}"] == 3
    assert flat["hybridkv_load_seconds_count"] == 1 and flat["hybridkv_load_seconds_sum"] == 0.25
    assert not any(k.startswith(("vllm:num_requests", "other")) for k in flat)
    assert counters.total(flat, "vllm:prompt_tokens_cached_by_source") == 132
    assert counters.total(flat, "vllm:prompt_tokens_cached_by_source", source="disk") == 32
    assert counters.by_label(flat, "vllm:prompt_tokens_cached_by_source", "source") == {
        "host": 100, "disk": 32}  # fmt: skip
    assert counters.delta({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 5.0, "c": 1.0}) == {
        "b": 3.0, "c": 1.0}  # fmt: skip
