"""The scheduler's per-request state empties once requests finish (no growth under load)."""

from __future__ import annotations

from pathlib import Path

from hybridkv.groups import GroupKind
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.drive import run_to_end
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups

ROUNDS, REQUESTS_PER_ROUND = 3, 6


def test_state_sizes_return_to_zero_after_stores_loads_and_aborts(tmp_path: Path) -> None:
    engine = make_engine(make_groups((GroupKind.MAMBA, GroupKind.FULL)), make_config(tmp_path))
    sizes = []
    for round_id in range(ROUNDS):
        for i in range(REQUESTS_PER_ROUND):
            req_id = f"r{round_id}-{i}"
            engine.add(req_id, prompt(40 + 4 * i, seed=i))  # rounds > 0 hit round 0's stores
            if i % 3 == 2:
                assert engine.scheduler.state_sizes()["requests"] == 1
                if not engine.finish(req_id):  # aborted before it ran
                    continue
            run_to_end(engine, req_id, chunk=12)
            if not engine.requests[req_id].finished:
                engine.finish(req_id)
        engine.settle()
        engine.step({})  # the workers' last reports reach the scheduler
        sizes.append(engine.scheduler.state_sizes())
    assert engine.scheduler.stats.lookup_hits > 0
    assert sizes == [dict.fromkeys(sizes[0], 0)] * ROUNDS, sizes
    close_engine(engine)
