"""What ``hybridkv bench`` reports: per setup and phase, a summary; the targets as ratios.

CLI process; pure functions over ``Record``s and counter deltas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.cli.bench import counters
from hybridkv.cli.bench.replay import Record
from hybridkv.cli.tables import format_bytes
from hybridkv.tools.models import greedy_mismatch

SOURCES = ("device", "host", "disk", "p2p")
"""vLLM's sources of cached prompt tokens: its own cache, then offloaded tiers."""


@dataclass(kw_only=True)
class Phase:
    """One replay of one setup: its requests and what the engine counted meanwhile."""

    setup: str
    name: str
    records: list[Record]
    counters: dict[str, float]
    wall_s: float
    engine: int = 0


@dataclass(kw_only=True)
class Summary:
    setup: str
    phase: str
    requests: int
    ttft_ms: dict[str, float]
    latency_p50_ms: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate_by_source: dict[str, float]
    loaded_blocks_by_group: dict[str, int]
    loaded_bytes: int
    bytes_per_hit_token: float
    recomputed_tokens: int
    """Reusable prompt tokens (computed by an earlier request) that were computed again."""
    reusable_tokens: int
    cached_tokens_of_repeats: int
    """Cached tokens, at most the reusable ones, of requests with reusable tokens."""
    outputs: dict[str, int] = field(default_factory=dict)
    """match / near_tie / differ / not_compared, against the engine alone."""


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mark_reusable(records: Sequence[Record], alignment_tokens: int) -> None:
    """Set each record's ``reusable_tokens``: the longest prefix of its prompt (but its
    last token) that a request finished before it was sent had computed, cut to the
    hit alignment."""
    align = max(1, alignment_tokens)
    seen: set[int] = set()
    finished = sorted(records, key=lambda r: r.sent_at + r.latency_s)
    next_finished = 0
    for record in sorted(records, key=lambda r: r.sent_at):
        while (
            next_finished < len(finished)
            and finished[next_finished].sent_at + finished[next_finished].latency_s
            <= record.sent_at
        ):
            done = finished[next_finished]
            seen.update(_chain(done.prompt_token_ids + done.output_token_ids[:-1], align))
            next_finished += 1
        # The engine computes a prompt's last token whatever it has cached.
        links = _chain(record.prompt_token_ids[:-1], align)
        whole = next((n for n, link in enumerate(links) if link not in seen), len(links))
        record.reusable_tokens = whole * align


def _chain(tokens: Sequence[int], align: int) -> list[int]:
    """One hash per whole ``align``-token block, each covering all blocks before it."""
    links, link = [], 0
    for end in range(align, len(tokens) + 1, align):
        link = hash((link, tuple(tokens[end - align : end])))
        links.append(link)
    return links


def compare_outputs(
    records: Sequence[Record],
    reference: Sequence[Record],
    *,
    exact: bool,
    same_phase: bool = True,
) -> dict[str, int]:
    """How each request's greedy output compares with the same request's in ``reference``
    (the same phase, client and position; any phase when not ``same_phase``).

    ``near_tie``: the first differing token was a near-tie in both runs (bfloat16
    noise; later rounds of that conversation are then ``not_compared``).
    """

    def key(r: Record) -> tuple[str, int, int]:
        return r.key if same_phase else ("", r.client, r.index)

    by_key = {key(r): r for r in reference}
    counts = dict.fromkeys(("match", "near_tie", "differ", "not_compared"), 0)
    for record in records:
        want = by_key.get(key(record))
        if want is None or want.prompt_token_ids != record.prompt_token_ids:
            counts["not_compared"] += 1
            continue
        if want.output_token_ids == record.output_token_ids:
            counts["match"] += 1
            continue
        why = greedy_mismatch(
            want.output_token_ids,
            want.top_logprobs,
            record.output_token_ids,
            record.top_logprobs,
            exact=exact,
        )
        counts["differ" if why else "near_tie"] += 1
    return counts


def summarize(phase: Phase) -> Summary:
    records = phase.records
    prompt_tokens = sum(r.num_prompt_tokens for r in records)
    output_tokens = sum(len(r.output_token_ids) for r in records)
    c = phase.counters
    by_source = counters.by_label(c, "vllm:prompt_tokens_cached_by_source", "source")
    external = counters.total(c, "vllm:external_prefix_cache_hits")
    loaded_bytes = int(counters.total(c, "hybridkv_loaded_bytes"))
    blocks = counters.by_label(c, "hybridkv_loaded_blocks", "group")
    wall = max(phase.wall_s, 1e-9)
    return Summary(
        setup=phase.setup,
        phase=phase.name,
        requests=len(records),
        ttft_ms={f"p{q}": percentile([r.ttft_s * 1000 for r in records], q) for q in (50, 90, 99)},
        latency_p50_ms=percentile([r.latency_s * 1000 for r in records], 50),
        prompt_tokens_per_s=prompt_tokens / wall,
        output_tokens_per_s=output_tokens / wall,
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(r.num_cached_tokens for r in records),
        hit_rate_by_source={
            s: by_source.get(s, 0.0) / prompt_tokens if prompt_tokens else 0.0 for s in SOURCES
        },
        loaded_blocks_by_group={g: int(v) for g, v in sorted(blocks.items(), key=_group_order)},
        loaded_bytes=loaded_bytes,
        bytes_per_hit_token=loaded_bytes / external if external else 0.0,
        recomputed_tokens=sum(max(0, r.reusable_tokens - r.num_cached_tokens) for r in records),
        reusable_tokens=sum(r.reusable_tokens for r in records),
        cached_tokens_of_repeats=sum(
            min(r.num_cached_tokens, r.reusable_tokens) for r in records if r.reusable_tokens
        ),
    )


def _group_order(item: tuple[str, float]) -> int:
    return int(item[0]) if item[0].isdigit() else 0


def summary_rows(summaries: Sequence[Summary]) -> list[list[str]]:
    header = [
        "setup",
        "phase",
        "reqs",
        "TTFT p50",
        "p90",
        "p99",
        "latency p50",
        "prompt tok/s",
        "gen tok/s",
        "hit device/host/disk/p2p",
        "loaded per group",
        "B/hit tok",
        "recomputed",
        "outputs",
    ]
    rows = [header]
    for s in summaries:
        rates = "/".join(f"{100 * s.hit_rate_by_source[src]:.0f}" for src in SOURCES) + " %"
        groups = "/".join(str(n) for n in s.loaded_blocks_by_group.values()) or "-"
        rows.append(
            [
                s.setup,
                s.phase,
                str(s.requests),
                _ms(s.ttft_ms["p50"]),
                _ms(s.ttft_ms["p90"]),
                _ms(s.ttft_ms["p99"]),
                _ms(s.latency_p50_ms),
                f"{s.prompt_tokens_per_s:.0f}",
                f"{s.output_tokens_per_s:.1f}",
                rates,
                groups,
                format_bytes(s.bytes_per_hit_token) if s.bytes_per_hit_token else "-",
                str(s.recomputed_tokens),
                _outputs_cell(s.outputs),
            ]
        )
    return rows


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f} ms"


def _outputs_cell(outputs: dict[str, int]) -> str:
    if not outputs:
        return "reference"
    if outputs["differ"]:
        return f"DIFFER {outputs['differ']}"
    extra = [
        f"{outputs[k]} {k.replace('_', ' ')}" for k in ("near_tie", "not_compared") if outputs[k]
    ]
    return "match" + (f" ({', '.join(extra)})" if extra else "")


def to_json(summary: Summary) -> dict[str, Any]:
    return {k: v for k, v in vars(summary).items()}
