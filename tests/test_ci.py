"""CI's entry point: ``.ci/run`` runs the whole suite through ``make test``, which ends
with the slowest tests' times, so the suite's time stays visible in CI's log."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _make_dry_run(target: str) -> list[str]:
    """The pytest command lines ``make TARGET`` would run (``make -n`` runs nothing)."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    out = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if "scripts/run_tests.sh" in line]


def test_ci_runs_the_whole_suite_through_make_test() -> None:
    steps = re.findall(r"^make (\S+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert steps[-1] == "test" and "setup" in steps


@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_the_suite_prints_its_slowest_tests(target: str) -> None:
    (command,) = _make_dry_run(target)
    durations = re.search(r"--durations=(\d+)", command)
    assert durations and int(durations.group(1)) >= 10, command


def test_make_test_deselects_nothing() -> None:
    (command,) = _make_dry_run("test")
    assert " -m " not in command and " -k " not in command, command
