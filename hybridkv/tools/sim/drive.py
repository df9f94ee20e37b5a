"""Driving a request through the simulated engine step by step: to its last token, until
its load ends, and until every transfer and write-back is done.

Runs in the process of the test or benchmark, on its ``SimEngine``. A request
that does not get there in time raises ``TimeoutError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hybridkv.tools.sim.engine import SimEngine, SimRequest

AfterStep = Callable[[SimEngine], None]
"""Run after each step of ``run_to_end`` and ``wait_loaded`` (say, to wait for the step's
transfers); without one, a step that leaves a load waiting is followed by a short sleep."""

FLUSH_TIMEOUT_S = 30.0


def run_to_end(
    engine: SimEngine,
    req_id: str,
    chunk: int,
    timeout_s: float = 10.0,
    *,
    after_step: AfterStep | None = None,
) -> None:
    """Steps of ``chunk`` tokens (and, while its load runs, empty ones) until the request
    computed its last token."""
    req = engine.requests[req_id]
    deadline = time.monotonic() + timeout_s
    while req.num_computed < len(req.tokens) or req.waiting_load:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{req_id} did not finish in {timeout_s} s")
        engine.step({} if req.waiting_load else {req_id: chunk})
        _after_step(engine, req, after_step)


def wait_loaded(
    engine: SimEngine,
    req_id: str,
    timeout_s: float = 10.0,
    *,
    after_step: AfterStep | None = None,
) -> SimRequest:
    """Empty steps until the request's load ended (its outcome in ``req.outcomes``)."""
    req = engine.requests[req_id]
    deadline = time.monotonic() + timeout_s
    while req.waiting_load:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"load of {req_id} never finished in {timeout_s} s")
        engine.step({})
        _after_step(engine, req, after_step)
    return req


def _after_step(engine: SimEngine, req: SimRequest, after_step: AfterStep | None) -> None:
    if after_step is not None:
        after_step(engine)
    elif req.waiting_load:
        time.sleep(0.002)


def settle_and_flush(engine: SimEngine) -> None:
    """Every transfer job and write-back to a slower tier done, its results taken (an
    ``AfterStep`` that keeps a run from turning on how the stores' threads interleave
    with later steps)."""
    engine.settle()
    if not engine.worker.store.flush(FLUSH_TIMEOUT_S):
        raise TimeoutError(f"write-backs still queued after {FLUSH_TIMEOUT_S} s")
    engine.settle()
