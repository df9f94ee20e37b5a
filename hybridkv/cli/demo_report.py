"""The demo's table and verdict: TTFT and speedup per run, where hits came from.

CLI process; pure functions over the bench's ``Summary``s and output comparisons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.cli.bench.report import Summary
from hybridkv.cli.tables import format_bytes

RUN_NAMES = {
    "cold": "cold: computed, stored",
    "engine-cache": "vLLM's own prefix cache",
    "tiers": "hybridkv CPU tier (vLLM's cache reset)",
    "restarted": "hybridkv disk tier (engine restarted)",
}
"""The bench's restart phases, as the demo names them."""
TIER_PHASES = ("tiers", "restarted")


def _cell_outputs(counts: Mapping[str, int] | None) -> str:
    if counts is None:
        return "reference"
    if counts["differ"] or counts["not_compared"]:
        return f"DIFFER ({counts['differ'] + counts['not_compared']})"
    return "match" + (f" ({counts['near_tie']} near-tie)" if counts["near_tie"] else "")


def demo_rows(
    summaries: Sequence[Summary], outputs: Mapping[str, Mapping[str, int]]
) -> list[list[str]]:
    """A header, then one row per run; ``outputs``: per phase, its comparison with cold."""
    cold = next((s for s in summaries if s.phase == "cold"), None)
    header = [
        "run",
        "TTFT",
        "speedup",
        "tokens from vLLM/CPU/disk",
        "blocks loaded per group",
        "bytes loaded",
        "outputs vs cold",
    ]
    rows = [header]
    for s in summaries:
        ttft = s.ttft_ms["p50"]
        speedup = cold.ttft_ms["p50"] / ttft if cold is not None and ttft else 0.0
        sources = "/".join(
            str(round(s.hit_rate_by_source[src] * s.prompt_tokens))
            for src in ("device", "host", "disk")
        )
        blocks = "/".join(str(n) for n in s.loaded_blocks_by_group.values()) or "-"
        rows.append(
            [
                RUN_NAMES.get(s.phase, s.phase),
                f"{ttft:.0f} ms",
                "-" if s.phase == "cold" else f"{speedup:.1f}x",
                f"{sources} of {s.prompt_tokens}",
                blocks,
                format_bytes(s.loaded_bytes) if s.loaded_bytes else "-",
                _cell_outputs(outputs.get(s.phase)),
            ]
        )
    return rows


def verdict(summaries: Sequence[Summary], outputs: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Why the demo failed, if it did: outputs that differ, tier runs that loaded nothing."""
    if not summaries:
        return ["no runs finished"]
    problems = []
    for s in summaries:
        counts = outputs.get(s.phase)
        if counts is not None and (counts["differ"] or counts["not_compared"]):
            problems.append(f"{RUN_NAMES.get(s.phase, s.phase)}: outputs differ from the cold run")
        loaded = s.hit_rate_by_source["host"] + s.hit_rate_by_source["disk"]
        if s.phase in TIER_PHASES and not loaded:
            problems.append(f"{RUN_NAMES[s.phase]}: loaded nothing from hybridkv's tiers")
    return problems
