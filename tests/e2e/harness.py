"""Running engine plans in driver subprocesses, and the records they leave.

Engines run in subprocesses (``python -m tests.e2e.driver``), one process per
plan, so every test gets a fresh interpreter and the pytest process never
imports vLLM. Tiny models are built once per session in a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hybridkv.tools.models import TinyModel, TinyModelKind, build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
PLAN_TIMEOUT_S = 420


@dataclass
class PlanRun:
    """The records one driver process wrote, plus how it ended."""

    name: str
    returncode: int
    records: list[dict[str, Any]]
    log_path: Path
    seconds: float

    def log_tail(self, num_chars: int = 4000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-num_chars:]

    def describe_failure(self) -> str:
        errors = [r["traceback"] for r in self.records if r.get("op") == "error"]
        detail = errors[-1] if errors else self.log_tail()
        return f"plan {self.name!r} exited with {self.returncode}:\n{detail}"

    def step(self, engine: str, label: str) -> dict[str, Any]:
        """The record of step ``label`` of engine ``engine``; fails the test if absent."""
        for record in self.records:
            if record.get("engine") == engine and record.get("label") == label:
                return record
        pytest.fail(f"no step {label!r} of engine {engine!r}; {self.describe_failure()}")

    def op(self, op: str, *, engine: str | None = None) -> dict[str, Any]:
        """The first record of ``op`` (of ``engine`` when given)."""
        for record in self.records:
            if record.get("op") == op and engine in (None, record.get("engine")):
                return record
        pytest.fail(f"no {op!r} record of engine {engine!r}; {self.describe_failure()}")


class Harness:
    """Runs engine plans in driver subprocesses; memoizes by plan name."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.model_dir = work_dir / "models"
        self._runs: dict[str, PlanRun] = {}

    def model(self, kind: TinyModelKind) -> TinyModel:
        return build_tiny_model(kind, self.model_dir)

    def cache_dir(self, name: str) -> Path:
        return self.work_dir / "cache" / name

    def run(
        self, name: str, engines: list[dict[str, Any]], env: dict[str, str] | None = None
    ) -> PlanRun:
        """Run ``engines`` in one driver process (once per name); ``env`` adds variables."""
        if name in self._runs:
            return self._runs[name]
        plan_path = self.work_dir / f"{name}.plan.json"
        results_path = self.work_dir / f"{name}.results.jsonl"
        log_path = self.work_dir / f"{name}.log"
        plan_path.write_text(json.dumps({"engines": engines}))
        results_path.unlink(missing_ok=True)
        extra = env or {}
        env = dict(os.environ)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["HYBRIDKV_CACHE_DIR"] = str(self.cache_dir(f"{name}-default"))
        env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.update(extra)
        start = time.perf_counter()
        with log_path.open("w") as log:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "tests.e2e.driver", str(plan_path), str(results_path)],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=PLAN_TIMEOUT_S,
                    check=False,
                )
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                returncode = -9
        records = []
        if results_path.exists():
            records = [json.loads(line) for line in results_path.read_text().splitlines()]
        run = PlanRun(
            name=name,
            returncode=returncode,
            records=records,
            log_path=log_path,
            seconds=time.perf_counter() - start,
        )
        self._runs[name] = run
        return run


BASELINE_KINDS = tuple(TinyModelKind)
