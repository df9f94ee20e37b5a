"""The demo's pure parts: arguments, its table and its verdict.

The whole demo (model build, engines, four runs) is ``tests/e2e/test_demo_e2e.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from hybridkv.cli import demo
from hybridkv.cli.bench.report import Summary
from hybridkv.cli.demo_report import RUN_NAMES, demo_rows, verdict

MATCH = {"match": 2, "near_tie": 0, "differ": 0, "not_compared": 0}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.configure_parser(parser)
    return parser.parse_args(list(argv))


def summary(phase: str, ttft_ms: float, **sources: float) -> Summary:
    rates = {"device": 0.0, "host": 0.0, "disk": 0.0, "p2p": 0.0, **sources}
    fields: dict[str, Any] = dict(
        setup="default", phase=phase, requests=2, ttft_ms={"p50": ttft_ms, "p90": 0, "p99": 0},
        latency_p50_ms=0.0, prompt_tokens_per_s=0.0, output_tokens_per_s=0.0,
        prompt_tokens=8192, cached_tokens=0, hit_rate_by_source=rates,
        loaded_blocks_by_group={"0": 32, "5": 254} if sum(sources.values()) else {},
        loaded_bytes=(3 << 20) if sum(sources.values()) else 0, bytes_per_hit_token=0.0,
        recomputed_tokens=0, reusable_tokens=0, cached_tokens_of_repeats=0,
    )  # fmt: skip
    return Summary(**fields)


def test_defaults_are_gemma3_270m_with_4k_prompts() -> None:
    args = parse()
    assert (args.model, args.prompt_tokens, args.prompts) == ("gemma3-270m", 4096, 2)
    assert not args.keep_cache
    assert parse("--model", "tiny-qwen3-next").model == "tiny-qwen3-next"
    with pytest.raises(SystemExit):
        parse("--model", "llama")


def test_rows_show_ttft_speedup_sources_and_outputs() -> None:
    summaries = [
        summary("cold", 5000.0),
        summary("engine-cache", 200.0, device=0.99),
        summary("tiers", 250.0, host=0.99),
        summary("restarted", 500.0, disk=0.5, host=0.49),
    ]
    outputs = {"engine-cache": MATCH, "tiers": MATCH, "restarted": MATCH}
    header, cold, own, tiers, restarted = demo_rows(summaries, outputs)
    assert header[:3] == ["run", "TTFT", "speedup"]
    assert cold[:3] == [RUN_NAMES["cold"], "5000 ms", "-"] and cold[-1] == "reference"
    assert tiers[1:3] == ["250 ms", "20.0x"]
    assert tiers[3] == "0/8110/0 of 8192" and tiers[4] == "32/254" and tiers[5] == "3.0 MiB"
    assert restarted[2] == "10.0x" and restarted[3] == "0/4014/4096 of 8192"
    assert own[3] == "8110/0/0 of 8192" and own[-1] == "match"
    assert verdict(summaries, outputs) == []


def test_verdict_names_runs_that_differ_or_loaded_nothing() -> None:
    differ = {"match": 1, "near_tie": 0, "differ": 1, "not_compared": 0}
    near = {"match": 1, "near_tie": 1, "differ": 0, "not_compared": 0}
    summaries = [summary("cold", 5000.0), summary("tiers", 5000.0),
                 summary("restarted", 300.0, disk=0.9)]  # fmt: skip
    problems = verdict(summaries, {"tiers": near, "restarted": differ})
    assert problems == [
        f"{RUN_NAMES['tiers']}: loaded nothing from hybridkv's tiers",
        f"{RUN_NAMES['restarted']}: outputs differ from the cold run",
    ]
    assert demo_rows(summaries, {"tiers": near})[2][-1] == "match (1 near-tie)"
    assert verdict([], {}) == ["no runs finished"]
