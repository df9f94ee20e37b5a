"""Eviction by prefill saved per byte (``eviction_order: worth``) against chain order and
plain LRU, in one run.

The simulated engine of the tests (``tests/support/sim.py``: a real
``ConnectorScheduler`` and ``ConnectorWorker`` over a real CPU tier, vLLM's
block rules, and KV written from the token prefix, so every hit's KV is
compared with a cold computation), shaped as vLLM lays out a Qwen3-Next-like
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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_eviction import (  # noqa: E402
    Ask,
    median_run,
    publish,
    replay_arguments,
    rounds_and_repeats,
    serve,
    tally,
)

from hybridkv.groups import GroupKind  # noqa: E402
from tests.support.connector import (  # noqa: E402
    close_engine,
    make_config,
    make_engine,
    prompt,
)
from tests.support.sim import (  # noqa: E402
    MAMBA_STATE_BYTES,
    attention_page_bytes,
    make_groups,
)

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


def run_policy(cpu_objects: int, order: str, asks: Sequence[Ask]) -> dict[str, Any]:
    """One replay of ``asks`` on a fresh CPU tier."""
    assert attention_page_bytes(BLOCK_SIZE) == MAMBA_STATE_BYTES
    block_bytes = 2 * MAMBA_STATE_BYTES  # two layers per group
    tier = {"kind": "cpu", "capacity_bytes": cpu_objects * block_bytes, "pin_memory": False}
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-worth-") as tmp:
        config = make_config(Path(tmp), tiers=[tier], eviction_order=order)
        engine = make_engine(make_groups(SHAPE, block_size=BLOCK_SIZE), config)
        start = time.perf_counter()
        try:
            served = [  # each prompt prefilled in one step
                serve(engine, f"r{i}", ask.tokens, chunk=len(ask.tokens))
                for i, ask in enumerate(asks)
            ]
        finally:
            close_engine(engine)
    return {
        "hits": [hit for hit, _ in served],
        "kv_blocks_checked": sum(checked for _, checked in served),
        "seconds": time.perf_counter() - start,
    }


def summarize(asks: Sequence[Ask], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
            runs = {}
            for name, order in POLICIES.items():
                replays = [run_policy(cpu_objects, order, asks) for _ in range(repeats)]
                runs[name] = median_run(replays)
                totals = ", ".join(map(str, runs[name]["totals"]))
                print(f"{case}, {name}: {totals} hit tokens", flush=True)
            report["cases"][case] = summarize(asks, runs)
    return publish(table(report), report, args.json)


if __name__ == "__main__":
    sys.exit(main())
