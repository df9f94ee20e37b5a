"""``hybridkv bench hosts``'s per-host figures, from the counters an engine reports."""

from __future__ import annotations

from hybridkv.cli.bench.hosts import host_rows
from hybridkv.cli.bench.replay import Record
from hybridkv.cli.bench.report import Phase


def _record(num_prompt_tokens: int) -> Record:
    return Record(setup="hosts", client=0, index=0, engine=1, phase="engine1",
                  num_prompt_tokens=num_prompt_tokens, num_cached_tokens=0, sent_s=0.0,
                  sent_at=0.0, ttft_s=0.1, latency_s=0.2, output_token_ids=[1])  # fmt: skip


def test_hit_rate_pool_bytes_load_latency_and_read_time_per_host() -> None:
    loading = Phase(
        setup="hosts",
        name="engine1@b",
        records=[_record(600), _record(400)],
        counters={
            "hybridkv_hit_tokens": 250.0,
            "hybridkv_tier_read_bytes{tier=mooncake}": 3072.0,
            "hybridkv_tier_read_bytes{tier=cpu}": 1024.0,
            "hybridkv_load_seconds_count": 4.0,
            "hybridkv_load_seconds_sum": 0.1,
        },
        wall_s=1.0,
    )
    storing = Phase(setup="hosts", name="engine0@a", records=[_record(10)], counters={},
                    wall_s=1.0)  # fmt: skip
    read_ms = {"pool": 0.25, "a": 0.3, "b": 1.234}
    header, first, second = host_rows([storing, loading], read_ms)
    assert header[0] == "engine@host" and header[-1] == "one read ms"
    assert first == ["engine0@a", "0%", "0 B", "0", "-", "0.30"]
    # 250 of 1000 prompt tokens; only the pool's bytes; 0.1 s over 4 loads; b's read.
    assert second == ["engine1@b", "25%", "3.0 KiB", "4", "25.0", "1.23"]
