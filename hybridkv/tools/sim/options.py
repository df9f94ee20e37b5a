"""The command line of a benchmark that replays workloads under several policies, and
where its report goes.

Runs in the benchmark's process, once, before and after the replays.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def replay_arguments(description: str) -> argparse.ArgumentParser:
    """``--quick``, ``--rounds``, ``--seed``, ``--repeats`` and ``--json``; the
    description's first paragraph is the parser's."""
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
    repeats: int = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats {repeats}: need at least one run")
    rounds: int = args.rounds or (3 if args.quick else 8)
    return rounds, repeats


def write_report(report: dict[str, Any], json_path: Path | None) -> None:
    """Every figure of the run as JSON, where ``--json`` asked for it."""
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
