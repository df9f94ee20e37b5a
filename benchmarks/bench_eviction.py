"""Eviction and admission against plain LRU, on a mixed workload, in one run.

The simulated engine (``hybridkv.tools.sim``: a real ``ConnectorScheduler``
and ``ConnectorWorker`` over a real CPU tier and a real disk tier, vLLM's
block rules for the hybrid allocator, and KV written from the token prefix,
so every hit's KV is compared with a cold computation) replays one seeded
mixed workload under each policy:

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

import sys
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.options import replay_arguments, rounds_and_repeats, write_report
from hybridkv.tools.sim.replay import Run, compare_policies, replay, tally
from hybridkv.tools.sim.shapes import attention_page_bytes, make_groups
from hybridkv.tools.sim.workloads import (
    BLOCK_SIZE,
    MIXED_CLASSES,
    SHAPES,
    Ask,
    docs_workload,
    mixed_workload,
    reusable_prefixes,
)

POLICIES: dict[str, dict[str, Any]] = {
    "lru": {"eviction_order": "lru", "admission": "all", "second_chance": False},
    "chain": {"eviction_order": "chain", "admission": "all", "second_chance": False},
    "chain+2nd": {"eviction_order": "chain", "admission": "all", "second_chance": True},
    "chain+2nd+reused": {"eviction_order": "chain", "admission": "reused", "second_chance": True},
    "worth+2nd+reused": {"eviction_order": "worth", "admission": "reused", "second_chance": True},
}
CPU_BLOCKS = (128, 512)
"""The CPU tier's sizes, in blocks per group: a fraction of one round's new blocks, and
about one round's."""
WORKLOADS = ("mixed", "long-doc-qa")
OVER_LRU, WORST_CLASS = 1.3, 0.98


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


def run_policy(
    shape: tuple[GroupKind, ...],
    cpu_blocks: int,
    policy: dict[str, Any],
    asks: Sequence[Ask],
) -> Run:
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
        try:
            return replay([engine], asks)
        finally:
            close_engine(engine)


def summarize(asks: Sequence[Ask], runs: dict[str, Run]) -> dict[str, Any]:
    can = reusable_prefixes(asks)
    rows = {name: tally(asks, can, run, MIXED_CLASSES) for name, run in runs.items()}
    lru = rows["lru"]
    for row in rows.values():
        row["over_lru"] = row["total"]["hit"] / max(1, lru["total"]["hit"])
        row["class_over_lru"] = {
            kind: row["classes"][kind]["hit"] / lru["classes"][kind]["hit"]
            if lru["classes"][kind]["hit"]
            else (1.0 if not row["classes"][kind]["hit"] else float("inf"))
            for kind in MIXED_CLASSES
        }
    return rows


def table(report: dict[str, Any]) -> str:
    lines = []
    for workload_name, part in report["workloads"].items():
        classes = MIXED_CLASSES if workload_name == "mixed" else ("docs",)
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


def main() -> int:
    parser = replay_arguments(__doc__)
    parser.add_argument("--workload", choices=WORKLOADS, action="append", help="default: both")
    args = parser.parse_args()
    rounds, repeats = rounds_and_repeats(parser, args)
    report: dict[str, Any] = {"rounds": rounds, "repeats": repeats, "workloads": {}}
    for workload_name in args.workload or WORKLOADS:
        mixed = workload_name == "mixed"
        asks = mixed_workload(rounds, args.seed) if mixed else docs_workload(args.seed)
        part: dict[str, Any] = {"requests": len(asks), "shapes": {}}
        for shape_name, shape in SHAPES.items():
            for cpu_blocks in CPU_BLOCKS:
                case = f"{shape_name}, cpu tier of {cpu_blocks} blocks per group"
                runs = compare_policies(
                    f"{workload_name}, {case}",
                    POLICIES,
                    partial(run_policy, shape, cpu_blocks, asks=asks),
                    repeats,
                    partial(print, flush=True),
                )
                part["shapes"][case] = summarize(asks, runs)
        report["workloads"][workload_name] = part
    print(table(report))
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
