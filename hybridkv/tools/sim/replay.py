"""Replaying a workload on simulated engines, and comparing policies by their hits.

Runs in the benchmark's process. Each request goes from lookup to its last
token, every step waiting for the jobs and write-backs it started, and the KV
of every hit is checked against a cold computation (a wrong byte stops the
run). A run is a JSON-ready dict: ``hits`` per request, ``kv_blocks_checked``,
``seconds``; policies are compared on the run of median hit tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from itertools import cycle
from typing import Any, NamedTuple, TypeVar

from hybridkv.tools.sim.check import assert_kv_matches_cold
from hybridkv.tools.sim.drive import run_to_end, settle_and_flush, wait_loaded
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.workloads import Ask

CHUNK = 32
"""Tokens per step (a Mamba state is stored where a step ends)."""

Run = dict[str, Any]
"""One replay's figures, as its benchmark reports them."""
Policy = TypeVar("Policy")


class Served(NamedTuple):
    hit: int
    """Tokens the request loaded (0 after a failed load)."""
    kv_blocks_checked: int
    """Blocks of the hit compared with a cold computation."""


def serve(engine: SimEngine, req_id: str, tokens: Sequence[int], chunk: int = CHUNK) -> Served:
    """One request from lookup to its last token, ``chunk`` tokens a step. Every step
    waits for the jobs and write-backs it started (``settle_and_flush``), so a run does
    not turn on how the stores' threads interleave with later steps (what is left to
    chance is a slower tier's own writing: ``median_run``)."""
    checked = 0
    hit = engine.add(req_id, list(tokens))
    if hit:
        req = wait_loaded(engine, req_id, after_step=settle_and_flush)
        # A failed load (its blocks evicted since the lookup) is looked up again: a
        # shorter hit, or none and the prompt recomputed.
        hit = req.num_computed if req.outcomes[-1].ok else 0
        if hit:
            checked = assert_kv_matches_cold(engine, req, hit)
    run_to_end(engine, req_id, chunk, after_step=settle_and_flush)
    engine.finish(req_id)
    settle_and_flush(engine)
    return Served(hit, checked)


def replay(engines: Sequence[SimEngine], asks: Sequence[Ask], *, chunk: int | None = CHUNK) -> Run:
    """Each request in turn (``serve``), to the engines round-robin; ``chunk=None``
    prefills each prompt in one step, as vLLM does a prompt within its token budget."""
    start = time.perf_counter()
    served = [
        serve(engine, f"r{i}", ask.tokens, len(ask.tokens) if chunk is None else chunk)
        for i, (ask, engine) in enumerate(zip(asks, cycle(engines)))
    ]
    return {
        "hits": [s.hit for s in served],
        "kv_blocks_checked": sum(s.kv_blocks_checked for s in served),
        "seconds": time.perf_counter() - start,
    }


def median_run(runs: Sequence[Run]) -> Run:
    """The run of median hit tokens, with every run's total (``totals``, in run order)."""
    totals = [sum(run["hits"]) for run in runs]
    median = sorted(range(len(runs)), key=totals.__getitem__)[(len(runs) - 1) // 2]
    return {**runs[median], "totals": totals}


def compare_policies(
    case: str,
    policies: Mapping[str, Policy],
    replay_once: Callable[[Policy], Run],
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Run]:
    """Each policy's ``median_run`` of ``repeats`` replays of ``case``; ``progress``
    hears a line of each policy's totals as it is done."""
    runs = {}
    for name, policy in policies.items():
        runs[name] = median_run([replay_once(policy) for _ in range(repeats)])
        totals = ", ".join(map(str, runs[name]["totals"]))
        progress(f"{case}, {name}: {totals} hit tokens")
    return runs


def tally(
    asks: Sequence[Ask], can: Sequence[int], run: Run, classes: Sequence[str]
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
