"""Fault cases on a running vLLM engine (test helper, pytest process).

The engine runs a plan in a ``tests.e2e.driver`` process (started from a thread
here); at each ``await`` step it hands over, the test runs the fault action of
that name (on the tier's files, its servers, or the engine process itself) and
lets the engine go on. Every case is the same five steps (``case_steps``):
fault, serve, recover, serve again (stores what the fault cost), serve a third
time (must hit). ``judge`` turns a case's records into the figures a row of
docs/RELIABILITY.md reports; the tests assert on them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.tools.models import TinyModel
from tests.e2e.compare import output_problems
from tests.e2e.expect import counter, engine_facts, full_hit_tokens, summed
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, SETTLE, generate
from tests.faults.report import record

Action = Callable[[int], dict[str, Any]]
"""A fault or recovery, given the engine process's pid; returns what it did."""

STALL_HOW = "stall: the fault run's wall time minus the same prompts' run after recovery"
STALL_SLACK_S = 5.0
"""Scheduling noise a step may add on a busy 2-core machine."""

FAULT_COUNTERS = (
    "loads{outcome=failed}",
    "tier_corrupt_objects",
    "tier_errors",
    "tier_full_skips",
    "store_dropped_blocks",
)
"""Connector counters that count a fault (summed over their labels)."""


def await_step(sync_dir: Path, name: str) -> dict[str, Any]:
    return {"op": "await", "label": f"await-{name}", "dir": str(sync_dir), "name": name}


def case_steps(case: str, prompts: list[list[int]], sync_dir: Path) -> list[dict[str, Any]]:
    """Fault ``case``, serve ``prompts``; recover, serve them twice more: the first
    stores, and once its writes are in the tiers, the second must hit."""
    return [
        await_step(sync_dir, case),
        RESET,
        generate(f"{case}:fault", prompts),
        await_step(sync_dir, f"{case}:recover"),
        RESET,
        generate(f"{case}:restore", prompts),
        SETTLE,
        RESET,
        generate(f"{case}:hit", prompts),
    ]


def run_with_faults(
    harness: Harness,
    name: str,
    engines: list[dict[str, Any]],
    actions: Mapping[str, Action],
    sync_dir: Path,
) -> PlanRun:
    """Run the plan; answer each ``await`` step with its action (none: go on at once).

    An action that raises still lets the engine go on (told so in the go
    file), so the plan ends; the error is raised here after it.
    """
    sync_dir.mkdir(parents=True, exist_ok=True)
    outcome: dict[str, PlanRun] = {}
    worker = threading.Thread(target=lambda: outcome.update(run=harness.run(name, engines)))
    worker.start()
    handled: set[str] = set()
    errors: list[str] = []
    while worker.is_alive():
        for ready in sorted(sync_dir.glob("*.ready")):
            step_name = ready.name.removesuffix(".ready")
            if step_name in handled:
                continue
            handled.add(step_name)
            done = _act(actions.get(step_name), int(ready.read_text()), errors)
            go = sync_dir / f"{step_name}.go"
            go.with_suffix(".tmp").write_text(json.dumps(done))
            go.with_suffix(".tmp").replace(go)
        time.sleep(0.01)
    worker.join()
    assert not errors, f"fault actions failed: {errors}"
    return outcome["run"]


def _act(action: Action | None, pid: int, errors: list[str]) -> dict[str, Any]:
    if action is None:
        return {}
    start = time.monotonic()
    try:
        done = action(pid)
    except Exception as exc:  # the engine must still be let go
        errors.append(repr(exc))
        return {"error": repr(exc)}
    return {**done, "action_s": time.monotonic() - start}


@dataclass(frozen=True, kw_only=True)
class CaseFigures:
    """What one case's records show."""

    output_problems: list[str]
    """Requests of the three steps whose outputs differ from the engine alone's."""
    fault_step_s: float
    restore_step_s: float
    stall_s: float
    """The fault step's wall time minus the restore step's (same prompts, fault gone)."""
    counted: dict[str, float]
    """Fault counters (and lookup misses) over the case's steps, nonzero ones."""
    hit_tokens: list[int]
    expected_hit_tokens: list[int]
    hits_resumed_s: float
    """Engine time from the recovery to the end of the first step that hit."""
    fault_cached_tokens: list[int]

    @property
    def outputs_identical(self) -> bool:
        return not self.output_problems

    @property
    def hits_resumed(self) -> bool:
        return self.hit_tokens == self.expected_hit_tokens

    def within_load_timeout(self, load_timeout_s: float) -> bool:
        return self.fault_step_s <= load_timeout_s + self.restore_step_s + STALL_SLACK_S

    def record(self, case: str, *, done: str, seen: str) -> None:
        """The case's row in the fault report, with these figures and counters."""
        record(
            case,
            done=done,
            seen=f"{seen}; {STALL_HOW}",
            counters={k: int(v) for k, v in self.counted.items()},
            outputs_identical=self.outputs_identical,
            max_stall_s=self.stall_s,
            hits_resumed_s=self.hits_resumed_s,
        )


def judge(
    run: PlanRun, engine: str, case: str, reference: dict[str, Any], model: TinyModel
) -> CaseFigures:
    """The figures of ``case`` (see ``case_steps``) on ``engine``, against the engine
    alone's ``reference`` step for the same prompts."""
    steps = [run.step(engine, f"{case}:{part}") for part in ("fault", "restore", "hit")]
    exact = model.dtype == "float32"
    problems = [
        f"{case}:{part} {line}"
        for part, step in zip(("fault", "restore", "hit"), steps, strict=True)
        for line in output_problems(step, reference, exact=exact)
    ]
    fault, restore, hit = steps
    facts = engine_facts(run, engine)
    expected = [full_hit_tokens(n, facts) for n in hit["num_prompt_tokens"]]
    first_hit = next((i for i, s in enumerate(steps[1:]) if sum(s["num_cached_tokens"])), None)
    resumed = float("nan")
    if first_hit is not None:
        resumed = sum(s["seconds"] for s in steps[1 : 2 + first_hit])
    return CaseFigures(
        output_problems=problems,
        fault_step_s=fault["seconds"],
        restore_step_s=restore["seconds"],
        stall_s=max(0.0, fault["seconds"] - restore["seconds"]),
        counted=fault_counters(steps),
        hit_tokens=hit["num_cached_tokens"],
        expected_hit_tokens=expected,
        hits_resumed_s=resumed,
        fault_cached_tokens=fault["num_cached_tokens"],
    )


def fault_counters(steps: list[dict[str, Any]]) -> dict[str, float]:
    """The fault counters summed over ``steps`` (and keys a lookup did not find)."""
    totals: dict[str, float] = {}
    for step in steps:
        stats = step["connector"]
        for name in FAULT_COUNTERS:
            base, _, label = name.partition("{")
            value = counter(stats, base, **_labels(label)) if label else summed(stats, base)
            key = name if label else base
            totals[key] = totals.get(key, 0.0) + value
        misses = summed(stats, "tier_lookup_keys") - summed(stats, "tier_hits")
        totals["lookup_misses"] = totals.get("lookup_misses", 0.0) + misses
    return {k: v for k, v in totals.items() if v}


def _labels(text: str) -> dict[str, str]:
    pairs = (part.split("=", 1) for part in text.rstrip("}").split(","))
    return {k: v for k, v in pairs}
