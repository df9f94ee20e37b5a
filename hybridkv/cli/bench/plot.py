"""``hybridkv bench --plot DIR``: PNGs of a run (matplotlib, no display needed).

CLI process; matplotlib is imported here only (the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridkv.cli.bench.replay import Record
from hybridkv.cli.bench.report import SOURCES, Summary

TTFT_PNG = "ttft.png"
HITS_PNG = "hit_rate.png"
_COLORS = {"device": "#4c72b0", "host": "#55a868", "disk": "#c44e52", "p2p": "#8172b2"}


def _label(setup: str, phase: str) -> str:
    return setup if phase in ("run", "") else f"{setup}\n{phase}"


def write_plots(
    out_dir: Path, title: str, summaries: Sequence[Summary], records: Sequence[Record]
) -> list[Path]:
    """TTFT per request by setup and phase; prompt tokens served from each source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [_label(s.setup, s.phase) for s in summaries]
    ttfts = [
        [r.ttft_s * 1000 for r in records if (r.setup, r.phase) == (s.setup, s.phase)]
        for s in summaries
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels)), 4.5))
    ax.boxplot(ttfts, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    for i, values in enumerate(ttfts, start=1):
        ax.scatter([i] * len(values), values, s=8, alpha=0.5, color="black", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(f"{title}: TTFT per request")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    ttft_path = out_dir / TTFT_PNG
    fig.savefig(ttft_path, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels)), 4.0))
    bottom = [0.0] * len(summaries)
    for source in SOURCES:
        heights = [100 * s.hit_rate_by_source[source] for s in summaries]
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottom, label=source, color=_COLORS[source])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("prompt tokens served from a cache (%)")
    ax.set_title(f"{title}: hit rate by source")
    ax.legend(loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    hits_path = out_dir / HITS_PNG
    fig.savefig(hits_path, dpi=110)
    plt.close(fig)
    return [ttft_path, hits_path]
