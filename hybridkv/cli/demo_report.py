"""What the demo measured in each run, and the table and verdict it prints.

CLI process; pure functions over ``RunReport``s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.tools.models import GroupShape, greedy_mismatch


@dataclass(kw_only=True)
class RunReport:
    """What one run of the prompts did, measured in the engine process."""

    name: str
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens vLLM did not compute (all external here: its cache was reset)."""
    num_external_tokens: int
    loaded_blocks: int
    load_bytes: int
    store_bytes: int
    ttft_s: float
    output_token_ids: list[list[int]]
    top_logprobs: list[list[dict[str, float]]] = field(default_factory=list)
    """Per request and generated position: the top tokens' log-probabilities."""
    cached_tokens_per_request: list[int] = field(default_factory=list)
    group_blocks: list[int] | None = None
    """Blocks loaded per KV cache group, when the connector reports them."""
    tier_get_bytes: dict[str, int] = field(default_factory=dict)


def _blocks_cell(report: RunReport) -> str:
    blocks = report.group_blocks or []
    return "/".join(str(n) for n in blocks) + f" = {sum(blocks)}" if blocks else "0"


def format_bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def mismatched_requests(report: RunReport, reference: RunReport, *, exact: bool) -> list[int]:
    """Requests whose greedy output differs from the reference run's."""
    return [
        i
        for i, want in enumerate(reference.output_token_ids)
        if greedy_mismatch(
            want,
            [] if exact else reference.top_logprobs[i],
            report.output_token_ids[i],
            [] if exact else report.top_logprobs[i],
            exact=exact,
        )
    ]


def report_rows(
    reports: Sequence[RunReport], groups: Sequence[GroupShape], *, exact: bool = True
) -> list[list[str]]:
    """Table rows: a header, then one row per run."""
    group_names = "/".join(f"g{i} {g.kind.value}" for i, g in enumerate(groups))
    header = [
        "run",
        "prompt tokens",
        "loaded tokens",
        f"blocks loaded ({group_names})",
        "bytes loaded",
        "bytes stored",
        "TTFT ms",
        "outputs",
    ]
    rows = [header]
    for report in reports:
        blocks = _blocks_cell(report)
        if report is reports[0]:
            match = "reference"
        else:
            match = "DIFFER" if mismatched_requests(report, reports[0], exact=exact) else "match"
        rows.append(
            [
                report.name,
                str(report.num_prompt_tokens),
                str(report.num_external_tokens),
                blocks,
                format_bytes(report.load_bytes),
                format_bytes(report.store_bytes),
                f"{report.ttft_s * 1000:.0f}",
                match,
            ]
        )
    return rows


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first row is the header."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])


def verdict(reports: Sequence[RunReport], *, exact: bool = True) -> list[str]:
    """Why the demo failed, if it did: outputs that differ, warm runs that loaded nothing."""
    problems = []
    if not reports:
        return ["no runs finished"]
    for report in reports[1:]:
        wrong = mismatched_requests(report, reports[0], exact=exact)
        if wrong:
            problems.append(
                f"{report.name} run: outputs of prompts {wrong} differ from the cold run"
            )
        if report.num_external_tokens == 0:
            problems.append(f"{report.name} run: loaded no tokens from the tiers")
    return problems
