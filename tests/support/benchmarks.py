"""Running a script of ``benchmarks/`` as a user would, for the tests that keep each
one working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, out: Path, *args: str, timeout_s: float = 600
) -> tuple[dict[str, Any], str]:
    """``python benchmarks/<script> <args> --json <out>`` from the repository root: its
    report and its standard output (asserts it exited 0)."""
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report, result.stdout
