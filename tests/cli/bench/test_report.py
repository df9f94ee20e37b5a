"""The bench's summaries: percentiles, reusable and recomputed tokens, output comparison."""

from __future__ import annotations

import math

import pytest

from hybridkv.cli.bench.replay import Record
from hybridkv.cli.bench.report import (
    Phase,
    compare_outputs,
    mark_reusable,
    percentile,
    summarize,
    summary_rows,
)


def record(prompt: list[int], output: list[int], *, sent: float, latency: float = 1.0,
           cached: int = 0, client: int = 0, index: int = 0, **kw: object) -> Record:  # fmt: skip
    fields: dict[str, object] = dict(
        setup="s", client=client, index=index, engine=0, phase="run",
        num_prompt_tokens=len(prompt), num_cached_tokens=cached, sent_s=sent, sent_at=sent,
        ttft_s=0.1, latency_s=latency, output_token_ids=output, prompt_token_ids=prompt,
    )  # fmt: skip
    fields.update(kw)
    return Record(**fields)  # type: ignore[arg-type]


def test_percentiles_interpolate() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_reusable_counts_what_finished_requests_computed_at_the_alignment() -> None:
    doc = list(range(100, 170))  # 70 tokens
    first = record([*doc, 1, 2], [7, 8, 9], sent=0.0, latency=1.0)
    # Sent while the first still ran: nothing of it was computed yet.
    during = record([*doc, 3], [5], sent=0.5, latency=1.0, client=1)
    after = record([*doc, 4, 5], [6], sent=2.0, client=2)
    # A second turn: the first prompt and the answer tokens that were computed (all
    # but the last, which was sampled and never fed back).
    turn = record(doc + [1, 2, 7, 8, 9, 11] + [0] * 30, [1], sent=3.0, client=3)
    mark_reusable([after, during, first, turn], alignment_tokens=8)
    assert first.reusable_tokens == 0
    assert during.reusable_tokens == 0
    assert after.reusable_tokens == 64  # 70 shared tokens, cut to the alignment
    assert turn.reusable_tokens == 72  # doc + [1, 2] + [7, 8] = 74 computed -> 72
    # The same prompt again: all but its last token (the engine always computes it).
    again = record(list(first.prompt_token_ids), [7], sent=4.0, client=4)
    exact = record(list(range(64)), [1], sent=0.0, latency=0.5, client=5)
    exact_again = record(list(range(64)), [1], sent=1.0, client=6)
    mark_reusable([first, again], alignment_tokens=8)
    mark_reusable([exact, exact_again], alignment_tokens=8)
    assert again.reusable_tokens == 64  # 71 of 72 tokens -> 64
    assert exact_again.reusable_tokens == 56  # on the alignment, the last block is left


def test_outputs_compare_exactly_or_within_near_ties() -> None:
    lp = [{"5": -1.0, "6": -1.02}, {"7": -0.5, "8": -3.0}]
    ref = [record([1, 2], [5, 7], sent=0, top_logprobs=lp),
           record([1, 3], [5, 7], sent=0, index=1, top_logprobs=lp),
           record([1, 4], [5, 7], sent=0, index=2, top_logprobs=lp)]  # fmt: skip
    tie = [{"5": -1.02, "6": -1.0}, {"7": -0.5}]
    far = [{"8": -0.1, "5": -4.0}, {"7": -0.5}]
    got = [record([1, 2], [5, 7], sent=0, top_logprobs=lp),
           record([1, 3], [6, 7], sent=0, index=1, top_logprobs=tie),
           record([1, 4], [8, 7], sent=0, index=2, top_logprobs=far),
           record([9, 9], [5, 7], sent=0, index=3, top_logprobs=lp)]  # fmt: skip
    counts = compare_outputs(got, ref, exact=False)
    assert counts == {"match": 1, "near_tie": 1, "differ": 1, "not_compared": 1}
    assert compare_outputs(got[:2], ref, exact=True)["differ"] == 1


def test_summary_reads_hits_by_source_groups_and_bytes_from_the_counters() -> None:
    records = [
        record(list(range(100)), [1] * 10, sent=0.0, latency=2.0, cached=64),
        record(list(range(100)), [1] * 10, sent=2.0, latency=2.0, cached=96),
    ]
    records[0].reusable_tokens, records[1].reusable_tokens = 96, 96
    counters = {
        "vllm:prompt_tokens_cached_by_source{source=host}": 100.0,
        "vllm:prompt_tokens_cached_by_source{source=device}": 60.0,
        "vllm:external_prefix_cache_hits": 100.0,
        "hybridkv_loaded_bytes{group=0,kind=sliding_window}": 1000.0,
        "hybridkv_loaded_bytes{group=1,kind=full}": 3000.0,
        "hybridkv_loaded_blocks{group=0,kind=sliding_window}": 2.0,
        "hybridkv_loaded_blocks{group=1,kind=full}": 6.0,
    }
    summary = summarize(Phase(setup="cpu", name="run", records=records, counters=counters,
                              wall_s=4.0))  # fmt: skip
    assert summary.hit_rate_by_source == {"device": 0.3, "host": 0.5, "disk": 0.0, "p2p": 0.0}
    assert summary.loaded_blocks_by_group == {"0": 2, "1": 6}
    assert summary.bytes_per_hit_token == 40.0
    assert summary.recomputed_tokens == 32
    assert summary.cached_tokens_of_repeats == 64 + 96
    assert summary.output_tokens_per_s == 5.0 and summary.prompt_tokens_per_s == 50.0
    (header, row) = summary_rows([summary])
    assert row[header.index("hit device/host/disk/p2p")] == "30/50/0/0 %"
    assert row[header.index("loaded per group")] == "2/6"
    assert row[header.index("outputs")] == "reference"
