"""Eviction and admission against plain LRU, on a mixed workload, in one run.

The simulated engine of the tests (``tests/support/sim.py``: a real
``ConnectorScheduler`` and ``ConnectorWorker`` over a real CPU tier and a
real disk tier, vLLM's block rules for the hybrid allocator, and KV written
from the token prefix, so every hit's KV is compared with a cold
computation) replays one seeded mixed workload under each policy:

* ``lru``: LRU everything, the setting to compare with (``eviction_order:
  lru``, ``admission: all``, the CPU tier's ``second_chance`` off);
* ``chain``: chain-aware recency (``eviction_order: chain``, the default);
* ``chain+2nd``: and the CPU tier's ``second_chance``;
* ``chain+2nd+reused``: and ``admission: reused``;
* ``worth+2nd+reused``: the same with ``eviction_order: worth`` (a request's
  blocks passed over by the prefill they save per byte, ``connector/worth.py``).

The workload interleaves, round by round in a seeded order, requests of four
classes: ``shared`` (two system prompts, each with a new user tail every
round), ``docs`` (long documents, each asked a question in several rounds),
``chat`` (conversations whose every turn resends the history) and
``one-off`` (prompts never seen again). Its distinct tokens are several
times what the tiers hold. Two model shapes: sliding window + full attention
(Gemma 3-like) and Mamba + full attention (Qwen3-Next-like); a 4 MiB disk
tier behind a CPU tier of two sizes (a fraction of one round's new blocks,
and about one round's).

A second workload, ``long-doc-qa``, asks each of 16 documents (about twice
the disk tier) three questions in a seeded random order, as the served
workload of that name does: every document is read again the same number of
times, so what a reuse policy protects is worth no more than what it holds
back, and plain recency is hard to beat.

Per workload, policy and class: reusable tokens (the longest block-aligned
prefix an earlier request of the run computed), hit tokens, and the ratio of
hit tokens to ``lru``'s. Each policy replays each case ``--repeats`` times
(default 3) and the run of median hit tokens is reported, with every run's
total: the disk tier writes on background threads, and runs of the same
case still differ now and then though every step waits for its transfers.
Targets: >= 1.3x ``lru``'s hit tokens over the mixed workload, and no
workload, nor class of the mixed one, under 0.98x.
``--quick`` runs fewer rounds of the mixed workload, once; ``--workload``
picks one.

    python benchmarks/bench_eviction.py [--quick] [--repeats N] [--workload NAME] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
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

from hybridkv.groups import GroupKind, ModelGroups  # noqa: E402
from tests.support.connector import (  # noqa: E402
    assert_kv_matches_cold,
    close_engine,
    make_config,
    make_engine,
    prompt,
    run_to_end,
    wait_loaded,
)
from tests.support.sim import SimEngine, attention_page_bytes, make_groups  # noqa: E402

BLOCK_SIZE = 4
CHUNK = 32
"""Tokens per step (a Mamba state is stored where a step ends)."""
POLICIES: dict[str, dict[str, Any]] = {
    "lru": {"eviction_order": "lru", "admission": "all", "second_chance": False},
    "chain": {"eviction_order": "chain", "admission": "all", "second_chance": False},
    "chain+2nd": {"eviction_order": "chain", "admission": "all", "second_chance": True},
    "chain+2nd+reused": {"eviction_order": "chain", "admission": "reused", "second_chance": True},
    "worth+2nd+reused": {"eviction_order": "worth", "admission": "reused", "second_chance": True},
}
SHAPES = {
    "sliding+full (Gemma 3-like)": (GroupKind.SLIDING_WINDOW, GroupKind.FULL),
    "mamba+full (Qwen3-Next-like)": (GroupKind.MAMBA, GroupKind.FULL),
}
CPU_BLOCKS = (128, 512)
"""The CPU tier's sizes, in blocks per group: a fraction of one round's new blocks, and
about one round's."""
CLASSES = ("shared", "docs", "chat", "one-off")
DOCS, QUESTIONS = 16, 3
"""long-doc-qa: documents of 320 tokens, each asked this many times."""
WORKLOADS = ("mixed", "long-doc-qa")
OVER_LRU, WORST_CLASS = 1.3, 0.98


@dataclass(frozen=True)
class Ask:
    kind: str
    tokens: tuple[int, ...]


def workload(rounds: int, seed: int) -> list[Ask]:
    """The requests in order: each round, every class's requests, shuffled."""
    rng = random.Random(seed)
    fresh = iter(range(10_000, 1_000_000))
    systems = [prompt(96, seed=next(fresh)) for _ in range(2)]
    docs = [prompt(192, seed=next(fresh)) for _ in range(4)]
    chats: list[list[int]] = [[] for _ in range(2)]
    asks: list[Ask] = []
    for r in range(rounds):
        batch = [Ask("shared", tuple(s + prompt(32, seed=next(fresh)))) for s in systems]
        for d in (r % len(docs), (r + 1) % len(docs)):
            batch.append(Ask("docs", tuple(docs[d] + prompt(16, seed=next(fresh)))))
        for chat in chats:
            chat += prompt(48, seed=next(fresh))
            batch.append(Ask("chat", tuple(chat)))
        batch += [Ask("one-off", tuple(prompt(192, seed=next(fresh)))) for _ in range(6)]
        rng.shuffle(batch)
        asks += batch
    return asks


def docs_workload(seed: int) -> list[Ask]:
    """Long documents, each asked several questions, all in a seeded random order (the
    served ``long-doc-qa``): a document's first question stores it, and what admission
    holds back then is lost to its later ones. The documents are about twice the disk
    tier."""
    rng = random.Random(seed)
    fresh = iter(range(2_000_000, 3_000_000))
    docs = [prompt(320, seed=next(fresh)) for _ in range(DOCS)]
    asks = [d for d in range(DOCS) for _ in range(QUESTIONS)]
    rng.shuffle(asks)
    return [Ask("docs", tuple(docs[d] + prompt(16, seed=next(fresh)))) for d in asks]


def reusable(asks: Sequence[Ask]) -> list[int]:
    """Per request: the longest block-aligned prefix an earlier request computed."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ask in asks:
        blocks = len(ask.tokens) // BLOCK_SIZE
        k = 0
        while k < blocks and ask.tokens[: (k + 1) * BLOCK_SIZE] in seen:
            k += 1
        out.append(k * BLOCK_SIZE)
        seen.update(ask.tokens[: (j + 1) * BLOCK_SIZE] for j in range(blocks))
    return out


def tiers(
    cache_dir: Path, model_groups: ModelGroups, cpu_blocks: int, second_chance: bool
) -> list[dict[str, Any]]:
    """A CPU tier of ``cpu_blocks`` blocks per group and a 4 MiB disk (a block of 256 B
    takes a 4 KiB page there: 512 blocks per group): the workload's distinct tokens (8
    rounds: about 2900 blocks per group) are several times both."""
    block_bytes = 2 * attention_page_bytes(BLOCK_SIZE)  # two layers per group
    cpu_bytes = cpu_blocks * model_groups.num_groups * block_bytes
    return [
        {
            "kind": "cpu",
            "capacity_bytes": cpu_bytes,
            "pin_memory": False,
            "second_chance": second_chance,
        },
        {
            "kind": "disk",
            "path": str(cache_dir / "disk"),
            "capacity_bytes": "4MiB",
            "segment_bytes": "256KiB",
            "num_io_threads": 1,
        },
    ]


def quiet(engine: SimEngine) -> None:
    """Every transfer job and write-back to a slower tier done, its results taken."""
    engine.settle()
    assert engine.worker.store.flush(30), "write-backs still queued after 30 s"
    engine.settle()


def serve(
    engine: SimEngine, req_id: str, tokens: Sequence[int], chunk: int = CHUNK
) -> tuple[int, int]:
    """One request from lookup to its last token, ``chunk`` tokens a step: its hit, and
    the KV blocks of the hit checked against a cold computation. Every step waits for
    the jobs and write-backs it started (``quiet``), so a run does not turn on how the
    stores' threads interleave with later steps (what is left to chance is the disk
    tier's own writing: ``median_run``)."""
    checked = 0
    hit = engine.add(req_id, list(tokens))
    if hit:
        req = wait_loaded(engine, req_id, after_step=quiet)
        # A failed load (its blocks evicted since the lookup) is looked up again: a
        # shorter hit, or none and the prompt recomputed.
        hit = req.num_computed if req.outcomes[-1].ok else 0
        if hit:
            checked = assert_kv_matches_cold(engine, req, hit)
    run_to_end(engine, req_id, chunk, after_step=quiet)
    engine.finish(req_id)
    quiet(engine)
    return hit, checked


def replay(engine: SimEngine, asks: Sequence[Ask]) -> tuple[list[int], int]:
    """Each request in turn (``serve``): the hits, and the KV blocks checked."""
    served = [serve(engine, f"r{i}", ask.tokens) for i, ask in enumerate(asks)]
    return [hit for hit, _ in served], sum(checked for _, checked in served)


def run_policy(
    shape: tuple[GroupKind, ...],
    cpu_blocks: int,
    policy: dict[str, Any],
    asks: Sequence[Ask],
) -> dict[str, Any]:
    """One replay of ``asks`` on fresh tiers in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-eviction-") as tmp:
        work = Path(tmp)
        model_groups = make_groups(shape, block_size=BLOCK_SIZE)
        tier_list = tiers(work, model_groups, cpu_blocks, policy["second_chance"])
        config = make_config(
            work,
            tiers=tier_list,
            eviction_order=policy["eviction_order"],
            admission=policy["admission"],
        )
        engine = make_engine(model_groups, config)
        start = time.perf_counter()
        try:
            hits, checked = replay(engine, asks)
        finally:
            close_engine(engine)
    return {"hits": hits, "kv_blocks_checked": checked, "seconds": time.perf_counter() - start}


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of median hit tokens, with every run's total (``totals``, in run order)."""
    totals = [sum(run["hits"]) for run in runs]
    median = sorted(range(len(runs)), key=totals.__getitem__)[(len(runs) - 1) // 2]
    return {**runs[median], "totals": totals}


def tally(
    asks: Sequence[Ask], can: Sequence[int], run: dict[str, Any], classes: Sequence[str]
) -> dict[str, Any]:
    """A run's row: reusable and hit tokens per class of request and in total, and the run."""
    by_class = {
        kind: {
            "reusable": sum(c for c, a in zip(can, asks, strict=True) if a.kind == kind),
            "hit": sum(h for h, a in zip(run["hits"], asks, strict=True) if a.kind == kind),
        }
        for kind in classes
    }
    total = {"reusable": sum(can), "hit": sum(run["hits"])}
    return {"classes": by_class, "total": total, **run}


def summarize(asks: Sequence[Ask], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    can = reusable(asks)
    rows = {name: tally(asks, can, run, CLASSES) for name, run in runs.items()}
    lru = rows["lru"]
    for row in rows.values():
        row["over_lru"] = row["total"]["hit"] / max(1, lru["total"]["hit"])
        row["class_over_lru"] = {
            kind: row["classes"][kind]["hit"] / lru["classes"][kind]["hit"]
            if lru["classes"][kind]["hit"]
            else (1.0 if not row["classes"][kind]["hit"] else float("inf"))
            for kind in CLASSES
        }
    return rows


def table(report: dict[str, Any]) -> str:
    lines = []
    for workload_name, part in report["workloads"].items():
        classes = CLASSES if workload_name == "mixed" else ("docs",)
        for shape, rows in part["shapes"].items():
            title = f"{workload_name}, {shape}: {part['requests']} requests"
            lines += ["", title + ", hit tokens (of reusable)"]
            header = f"{'policy':18}" + "".join(f"{k:>16}" for k in (*classes, "total"))
            lines += [header + f"{'x lru':>8}  worst class x lru  runs' totals"]
            for name, row in rows.items():
                cells = [row["classes"][k] for k in classes] + [row["total"]]
                worst = min(row["class_over_lru"].values())
                lines.append(
                    f"{name:18}"
                    + "".join(f"{c['hit']:>8} ({c['reusable']:>5})" for c in cells)
                    + f"{row['over_lru']:>8.2f}  {worst:<17.2f}  "
                    + ", ".join(map(str, row["totals"]))
                )
    lines += [
        "",
        f"targets: mixed >= {OVER_LRU}x lru's hit tokens; no workload and no class of mixed "
        f"under {WORST_CLASS}x",
    ]
    return "\n".join(lines)


def replay_arguments(description: str) -> argparse.ArgumentParser:
    """The options of a benchmark that replays these workloads under several policies."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds of mixed, once")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs per policy and case (default 3; 1 quick)"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    return parser


def rounds_and_repeats(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[int, int]:
    """Rounds of ``mixed`` and runs per case, from ``replay_arguments``' options."""
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats {repeats}: need at least one run")
    return args.rounds or (3 if args.quick else 8), repeats


def publish(text: str, report: dict[str, Any], json_path: Path | None) -> int:
    """Print a benchmark's table, write its report as JSON where asked; exit status 0."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    parser = replay_arguments(__doc__)
    parser.add_argument("--workload", choices=WORKLOADS, action="append", help="default: both")
    args = parser.parse_args()
    rounds, repeats = rounds_and_repeats(parser, args)
    report: dict[str, Any] = {"rounds": rounds, "repeats": repeats, "workloads": {}}
    for workload_name in args.workload or WORKLOADS:
        asks = workload(rounds, args.seed) if workload_name == "mixed" else docs_workload(args.seed)
        part: dict[str, Any] = {"requests": len(asks), "shapes": {}}
        for shape_name, shape in SHAPES.items():
            for cpu_blocks in CPU_BLOCKS:
                case = f"{shape_name}, cpu tier of {cpu_blocks} blocks per group"
                runs = {}
                for name, policy in POLICIES.items():
                    runs[name] = median_run(
                        [run_policy(shape, cpu_blocks, policy, asks) for _ in range(repeats)]
                    )
                    totals = ", ".join(map(str, runs[name]["totals"]))
                    print(f"{workload_name}, {case}, {name}: {totals} hit tokens", flush=True)
                part["shapes"][case] = summarize(asks, runs)
        report["workloads"][workload_name] = part
    return publish(table(report), report, args.json)


if __name__ == "__main__":
    sys.exit(main())
