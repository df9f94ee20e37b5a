"""Eviction by prefill saved per byte (``eviction_order: worth``) against chain order and
plain LRU, in one run.

The simulated engine (``hybridkv.tools.sim``: a real ``ConnectorScheduler``
and ``ConnectorWorker`` over a real CPU tier, vLLM's block rules, and KV
written from the token prefix, so every hit's KV is compared with a cold
computation), shaped as vLLM lays out a Qwen3-Next-like
model: three Mamba groups and one full-attention group, every group's page the
same size (3-token blocks, so that a full-attention page is as large as a
state), and every prompt prefilled in one step, as vLLM does a prompt within
its token budget. So a request's chain holds a block per block of tokens and a
state per Mamba group where its steps ended: a long prompt's hit costs fewer
bytes per token than a short one's.

The workload: conversations with long turns (a pasted document) and
conversations with short ones, taking turns in a seeded random order; every
turn resends the history and can hit the previous turn's prompt. Each
conversation is as likely to come back, so the CPU tier (no disk: ``worth``
applies in the CPU tier) keeps most hit tokens by keeping the chains that hold
most tokens per byte. Four mixes (``MIXES``: blocks a turn adds, conversations
of each class, turns) behind two CPU tier sizes. Policies, each with
``admission: all`` and no ``second_chance``: ``lru`` (``eviction_order:
lru``), ``chain`` and ``worth``.

Per case, policy and class of conversation: reusable tokens (the previous
turn's prompt, block-aligned), hit tokens, and the totals' ratio to
``chain``'s; each policy replays each case ``--repeats`` times (default 3) and
the run of median hit tokens is reported. Target: ``worth`` >= 1.1x
``chain``'s hit tokens in every case. ``--quick``: the first mix, half the
turns, once.

    python benchmarks/bench_worth.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hybridkv.groups import GroupKind
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.options import replay_arguments, rounds_and_repeats, write_report
from hybridkv.tools.sim.replay import Run, compare_policies, replay, tally
from hybridkv.tools.sim.shapes import MAMBA_STATE_BYTES, attention_page_bytes, make_groups
from hybridkv.tools.sim.workloads import Ask

BLOCK_SIZE = 3
"""Tokens per block: a full-attention page (32 bytes per token) as large as a state."""
SHAPE = (GroupKind.MAMBA, GroupKind.MAMBA, GroupKind.MAMBA, GroupKind.FULL)
POLICIES = {"lru": "lru", "chain": "chain", "worth": "worth"}
CLASSES = ("long", "short")


@dataclass(frozen=True)
class Mix:
    blocks: tuple[int, int]
    """Blocks each turn of a long and of a short conversation adds."""
    conversations: tuple[int, int]
    """Long and short conversations."""
    turns: int

    def label(self, turns: int) -> str:
        (lb, sb), (lc, sc) = self.blocks, self.conversations
        return f"{lc} x {lb}-block turns, {sc} x {sb}-block turns, {turns} turns"


MIXES = (Mix((24, 2), (8, 8), 6), Mix((12, 1), (6, 24), 6), Mix((8, 1), (8, 32), 4))
MIXES += (Mix((16, 2), (4, 32), 6),)
CPU_OBJECTS = (256, 512)
"""The CPU tier's sizes, in blocks of any group: a fraction of what the conversations'
last turns hold together."""
OVER_CHAIN = 1.1


def workload(mix: Mix, turns: int, seed: int) -> list[Ask]:
    """Every conversation's turns, in order within it, conversations in a seeded order."""
    rng = random.Random(seed)
    fresh = iter(range(10_000, 1_000_000))
    order = [(k, c) for k in range(2) for c in range(mix.conversations[k]) for _ in range(turns)]
    rng.shuffle(order)
    history: dict[tuple[int, int], list[int]] = {}
    asks = []
    for k, c in order:
        tokens = history.setdefault((k, c), [])
        tokens += prompt(mix.blocks[k] * BLOCK_SIZE, seed=next(fresh))
        asks.append(Ask(CLASSES[k], tuple(tokens)))
    return asks


def reusable(asks: Sequence[Ask]) -> list[int]:
    """Per request: the previous turn's prompt, whole blocks (where its state is)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ask in asks:
        ends = [n for n in range(len(ask.tokens), 0, -1) if ask.tokens[:n] in seen]
        out.append(ends[0] // BLOCK_SIZE * BLOCK_SIZE if ends else 0)
        seen.add(ask.tokens)
    return out


def run_policy(cpu_objects: int, order: str, asks: Sequence[Ask]) -> Run:
    """One replay of ``asks`` on a fresh CPU tier, each prompt prefilled in one step."""
    assert attention_page_bytes(BLOCK_SIZE) == MAMBA_STATE_BYTES
    block_bytes = 2 * MAMBA_STATE_BYTES  # two layers per group
    tier = {"kind": "cpu", "capacity_bytes": cpu_objects * block_bytes, "pin_memory": False}
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-worth-") as tmp:
        config = make_config(Path(tmp), tiers=[tier], eviction_order=order)
        engine = make_engine(make_groups(SHAPE, block_size=BLOCK_SIZE), config)
        try:
            return replay([engine], asks, chunk=None)
        finally:
            close_engine(engine)


def summarize(asks: Sequence[Ask], runs: dict[str, Run]) -> dict[str, Any]:
    can = reusable(asks)
    rows = {name: tally(asks, can, run, CLASSES) for name, run in runs.items()}
    for row in rows.values():
        row["over_chain"] = row["total"]["hit"] / max(1, rows["chain"]["total"]["hit"])
    return rows


def table(report: dict[str, Any]) -> str:
    lines = []
    for case, rows in report["cases"].items():
        lines += ["", f"{case}: {len(rows['lru']['hits'])} requests, hit tokens (of reusable)"]
        header = f"{'policy':8}" + "".join(f"{k:>16}" for k in (*CLASSES, "total"))
        lines.append(header + f"{'x chain':>9}  runs' totals")
        for name, row in rows.items():
            cells = [row["classes"][k] for k in CLASSES] + [row["total"]]
            lines.append(
                f"{name:8}"
                + "".join(f"{c['hit']:>8} ({c['reusable']:>5})" for c in cells)
                + f"{row['over_chain']:>9.2f}  "
                + ", ".join(map(str, row["totals"]))
            )
    lines += ["", f"target: worth >= {OVER_CHAIN}x chain's hit tokens in every case"]
    return "\n".join(lines)


def main() -> int:
    parser = replay_arguments(__doc__)
    args = parser.parse_args()
    _, repeats = rounds_and_repeats(parser, args)
    report: dict[str, Any] = {"repeats": repeats, "cases": {}}
    for mix in MIXES[:1] if args.quick else MIXES:
        turns = args.rounds or (mix.turns // 2 if args.quick else mix.turns)
        asks = workload(mix, turns, args.seed)
        for cpu_objects in CPU_OBJECTS:
            case = f"{mix.label(turns)}, cpu tier of {cpu_objects} blocks"
            replay_once = partial(run_policy, cpu_objects, asks=asks)
            runs = compare_policies(
                case, POLICIES, replay_once, repeats, partial(print, flush=True)
            )
            report["cases"][case] = summarize(asks, runs)
    print(table(report))
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
