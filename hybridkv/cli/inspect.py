"""``hybridkv inspect``: a model's KV groups and what a hybrid-aware load moves.

Runs in the CLI process only. ``compute_report`` is the pure calculation
(tested); ``render_text`` and ``run`` only format and print it.

For a hit of N tokens, a hybrid-aware loader moves per group only what the
group needs to resume at N, as the hit search answers it for a store holding
every block: all N tokens (full attention), the blocks holding the last
``window - 1`` tokens (sliding window), the blocks since the current chunk
began (chunked local attention), one state (Mamba). A layer-blind loader
moves every group's blocks for all N tokens (for Mamba: one state per block).

Stores: for a prompt of N tokens, each kind's ``stored_blocks`` rule keeps
only what a later aligned hit can read (sliding windows: the tail of each
aligned segment; Mamba: aligned states); a layer-blind store keeps every
block of every group (for Mamba: one state per block).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hybridkv.cli.tables import format_bytes
from hybridkv.groups import ModelGroups
from hybridkv.groups.kinds import rules_for
from hybridkv.hits import find_longest_hit
from hybridkv.tools.presets import PRESETS, load_groups

DEFAULT_HIT_TOKENS = 32768


@dataclass(frozen=True, kw_only=True)
class GroupLoad:
    group_id: int
    kind: str
    block_size: int
    sliding_window: int | None
    attention_chunk_size: int | None
    num_layers: int
    page_size_bytes: int
    block_bytes: int
    bytes_per_token: float
    hybrid_blocks: int
    hybrid_bytes: int
    blind_blocks: int
    blind_bytes: int
    stored_blocks: int
    """Blocks stored for a prompt of ``hit_tokens`` tokens."""
    stored_bytes: int
    stored_bytes_per_token: float
    blind_stored_bytes: int


@dataclass(frozen=True, kw_only=True)
class InspectReport:
    model_id: str
    fingerprint: str
    scheduler_block_size: int
    hash_block_size: int
    requested_hit_tokens: int
    hit_tokens: int
    """The requested hit rounded down to the alignment (hits are aligned)."""
    alignment_tokens: int
    groups: tuple[GroupLoad, ...]
    hybrid_bytes: int
    blind_bytes: int
    ratio: float
    """hybrid_bytes / blind_bytes."""
    stored_bytes: int
    blind_stored_bytes: int
    stored_ratio: float
    """stored_bytes / blind_stored_bytes."""
    stored_bytes_per_segment: float
    """Bytes stored per ``alignment_tokens`` of prompt."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_report(
    model_groups: ModelGroups,
    *,
    hit_tokens: int = DEFAULT_HIT_TOKENS,
    alignment_tokens: int | None = None,
) -> InspectReport:
    """The numbers ``inspect`` prints; ValueError for an impossible hit or alignment."""
    align = model_groups.scheduler_block_size if alignment_tokens is None else alignment_tokens
    is_int = isinstance(hit_tokens, int) and not isinstance(hit_tokens, bool)
    if not is_int or hit_tokens < align:
        raise ValueError(
            f"hit_tokens={hit_tokens!r} must be an int >= the alignment {align} "
            "(hits are aligned to it)"
        )
    # A request one token longer than the hit: the hit search may use all of it.
    hit = find_longest_hit(model_groups.groups, hit_tokens, _everything, alignment_tokens=align)
    loads = []
    for group_id, group in enumerate(model_groups.groups):
        hybrid_blocks = len(hit.blocks_to_load[group_id])
        blind_blocks = hit.num_tokens // group.block_size
        rule = rules_for(group.kind)
        stored_blocks = len(rule.stored_blocks(group, 0, hit.num_tokens, align, False))
        loads.append(
            GroupLoad(
                group_id=group_id,
                kind=group.kind.value,
                block_size=group.block_size,
                sliding_window=group.sliding_window,
                attention_chunk_size=group.attention_chunk_size,
                num_layers=group.num_layers,
                page_size_bytes=group.page_size_bytes,
                block_bytes=group.block_bytes,
                bytes_per_token=group.block_bytes / group.block_size,
                hybrid_blocks=hybrid_blocks,
                hybrid_bytes=hybrid_blocks * group.block_bytes,
                blind_blocks=blind_blocks,
                blind_bytes=blind_blocks * group.block_bytes,
                stored_blocks=stored_blocks,
                stored_bytes=stored_blocks * group.block_bytes,
                stored_bytes_per_token=stored_blocks * group.block_bytes / hit.num_tokens,
                blind_stored_bytes=blind_blocks * group.block_bytes,
            )
        )
    hybrid = sum(load.hybrid_bytes for load in loads)
    blind = sum(load.blind_bytes for load in loads)
    stored = sum(load.stored_bytes for load in loads)
    blind_stored = sum(load.blind_stored_bytes for load in loads)
    return InspectReport(
        model_id=model_groups.model_id,
        fingerprint=model_groups.fingerprint,
        scheduler_block_size=model_groups.scheduler_block_size,
        hash_block_size=model_groups.hash_block_size,
        requested_hit_tokens=hit_tokens,
        hit_tokens=hit.num_tokens,
        alignment_tokens=align,
        groups=tuple(loads),
        hybrid_bytes=hybrid,
        blind_bytes=blind,
        ratio=hybrid / blind,
        stored_bytes=stored,
        blind_stored_bytes=blind_stored,
        stored_ratio=stored / blind_stored,
        stored_bytes_per_segment=stored * align / hit.num_tokens,
    )


def _everything(group_id: int, block_ids: Sequence[int]) -> list[bool]:
    return [True] * len(block_ids)


def render_text(report: InspectReport) -> str:
    lines = [
        f"model {report.model_id}  groups fingerprint {report.fingerprint}",
        f"scheduler block size {report.scheduler_block_size} tokens, "
        f"hash block size {report.hash_block_size} tokens",
        "",
        f"{'group':>5} {'kind':<14} {'block':>6} {'window':>7} {'layers':>6} "
        f"{'page bytes':>11} {'bytes/token':>12} {'load':>10} {'blind':>10} "
        f"{'stored/token':>13} {'blind':>10}",
    ]
    for g in report.groups:
        window = g.sliding_window or g.attention_chunk_size
        lines.append(
            f"{g.group_id:>5} {g.kind:<14} {g.block_size:>6} {window or '-':>7} "
            f"{g.num_layers:>6} {g.page_size_bytes:>11} {g.bytes_per_token:>12.0f} "
            f"{format_bytes(g.hybrid_bytes):>10} {format_bytes(g.blind_bytes):>10} "
            f"{g.stored_bytes_per_token:>13.0f} {g.bytes_per_token:>10.0f}"
        )
    lines += [
        "",
        f"hit of {report.hit_tokens} tokens (requested {report.requested_hit_tokens}): "
        f"hybrid-aware load {format_bytes(report.hybrid_bytes)} ({report.hybrid_bytes} B), "
        f"layer-blind load {format_bytes(report.blind_bytes)} ({report.blind_bytes} B), "
        f"ratio {report.ratio:.2%} (hits aligned to {report.alignment_tokens} tokens)",
        f"prompt of {report.hit_tokens} tokens: stored {format_bytes(report.stored_bytes)} "
        f"({report.stored_bytes_per_segment:.0f} B per {report.alignment_tokens}-token "
        f"segment), layer-blind store {format_bytes(report.blind_stored_bytes)}, "
        f"ratio {report.stored_ratio:.2%}",
    ]
    return "\n".join(lines)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "groups",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a JSON file of a model's groups "
        "(ModelGroups.to_dict())",
    )
    parser.add_argument(
        "--hit-tokens",
        type=int,
        default=DEFAULT_HIT_TOKENS,
        help="length of the cache hit to cost (default %(default)s)",
    )
    parser.add_argument(
        "--alignment-tokens",
        type=int,
        default=None,
        help="granularity of hits (default: the scheduler block size, as the engine's)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    model_groups = load_groups(args.groups)
    report = compute_report(
        model_groups, hit_tokens=args.hit_tokens, alignment_tokens=args.alignment_tokens
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_text(report))
    return 0
