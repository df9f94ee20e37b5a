"""Shared-pool faults under running vLLM engines, one fault after another.

One driver process (Gemma 3 tiny model, float32): the engine alone on the
base prompts (the reference), then engine V whose only tier is a Valkey
server, then engine M whose only tier is a Mooncake pool (master + one
storage daemon). Each stores the prompts, hits them, then takes its faults;
for each (see ``engine_faults.case_steps``): the fault, a run on it, the
recovery, a run that stores again, a run that must hit, ``check_integrity``.
Valkey: killed (then restarted), restarted empty. Mooncake: the daemon hung
(SIGSTOP) for longer than ``op_timeout_s`` (then SIGCONT), the daemon killed
(then restarted), the master killed (then restarted).

A pool too small for its prompts is ``tests/e2e/test_pool_full_e2e.py``'s case.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

from hybridkv.tools import pool_probe
from hybridkv.tools.models import TinyModelKind
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.servers import ServerRole
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, engine, generate
from tests.faults.engine_faults import Action, CaseFigures, case_steps, judge, run_with_faults
from tests.support.servers import MIB, MooncakePool, ValkeyServer, timed, wait_for

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3
LOAD_TIMEOUT_S = 10.0
OP_TIMEOUT_S = 1.0
HANG_S = 3 * OP_TIMEOUT_S
"""The least time the daemon stays stopped."""

VALKEY_CASES = ("valkey killed", "valkey restarted empty")
MOONCAKE_CASES = ("daemon hung", "daemon killed", "master killed")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return Harness(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="module")
def mooncake() -> Iterator[LocalPool]:
    with MooncakePool(segment_bytes=32 * MIB, client_ttl_s=2) as running:
        yield running


@pytest.fixture(scope="module")
def valkey() -> Iterator[LocalPool]:
    with ValkeyServer(maxmemory_bytes=64 * MIB) as running:
        yield running


def _pool_capacity(pool: LocalPool) -> int:
    return int(pool.status()["pool"]["total_capacity_bytes"] or 0)


def _takes_stores(pool: LocalPool) -> bool:
    """Whether a client of its own stores and reads back a few objects in the pool.

    Measured here: a restarted daemon's memory listed by the master, puts were still
    refused for a while (no room, -200), and the engine's stores of that time dropped;
    after a restarted master listed the daemon, a whole step's stores still failed.
    """
    try:
        pool_probe.time_reads(pool.master_address, num_reads=1, timeout_s=30)
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
    return True


def kill(pool: LocalPool, role: ServerRole) -> Action:
    return lambda pid: {"killed": role.value, "kill_s": timed(lambda: pool.kill(role))[1]}


def restart(pool: LocalPool, role: ServerRole) -> Action:
    def act(pid: int) -> dict[str, Any]:
        if role is ServerRole.DAEMON:  # a new daemon must not find the old one listed
            wait_for(lambda: not _pool_capacity(pool), timeout_s=30)
        done = {"restarted": role.value, "restart_s": timed(lambda: pool.restart(role))[1]}
        if role is not ServerRole.VALKEY:
            # Recovered once the daemon's memory is listed and the pool takes stores
            # (listed, it may still refuse them).
            done["listed_again_s"] = wait_for(lambda: _pool_capacity(pool) > 0, timeout_s=30)
            done["stores_again_s"] = wait_for(lambda: _takes_stores(pool), timeout_s=60)
        return done

    return act


def restart_empty(pool: LocalPool) -> Action:
    """Kill Valkey and start it again at once (no persistence: an empty dataset)."""

    def act(pid: int) -> dict[str, Any]:
        pool.kill(ServerRole.VALKEY)
        pool.restart(ServerRole.VALKEY)
        used = pool.status()["valkey_pool"]["used_memory_bytes"]
        return {"restarted": "valkey", "used_memory_bytes": used}

    return act


class Hang:
    """SIGSTOP the daemon; SIGCONT it no sooner than ``HANG_S`` later."""

    def __init__(self, pool: LocalPool) -> None:
        self.pool = pool
        self.stopped_at = 0.0

    def stop(self, pid: int) -> dict[str, Any]:
        self.pool.pause(ServerRole.DAEMON)
        self.stopped_at = time.monotonic()
        return {"sigstop": "daemon"}

    def resume(self, pid: int) -> dict[str, Any]:
        time.sleep(max(0.0, self.stopped_at + HANG_S - time.monotonic()))
        hung_s = time.monotonic() - self.stopped_at
        self.pool.resume(ServerRole.DAEMON)
        # The master dropped the silent daemon (its TTL is 2 s); wait for it to return.
        back_s = wait_for(lambda: _pool_capacity(self.pool) > 0, timeout_s=30)
        return {"sigcont": "daemon", "hung_s": hung_s, "listed_again_s": back_s}


def integrity_step(case: str) -> dict[str, Any]:
    return {"op": "integrity", "label": f"{case}:integrity"}


def engine_steps(cases: tuple[str, ...], prompts: list[list[int]], sync: Any) -> list[Any]:
    steps = [generate("store", prompts), RESET, generate("warm", prompts)]
    for case in cases:
        steps += [*case_steps(case, prompts, sync), integrity_step(case)]
    return steps


class PoolMatrix:
    def __init__(self, harness: Harness, mooncake: LocalPool, valkey: LocalPool) -> None:
        self.model = harness.model(KIND)
        prompts = base_prompts(self.model.vocab_size)
        sync = harness.work_dir / "pool-faults-sync"
        timeouts = {"op_timeout_s": OP_TIMEOUT_S}
        valkey_tiers = [tier | timeouts for tier in valkey.tier_configs()]
        mooncake_tiers = [tier | timeouts for tier in mooncake.tier_configs()]
        hang = Hang(mooncake)
        actions: dict[str, Action] = {
            "valkey killed": kill(valkey, ServerRole.VALKEY),
            "valkey killed:recover": restart(valkey, ServerRole.VALKEY),
            "valkey restarted empty": restart_empty(valkey),
            "daemon hung": hang.stop,
            "daemon hung:recover": hang.resume,
            "daemon killed": kill(mooncake, ServerRole.DAEMON),
            "daemon killed:recover": restart(mooncake, ServerRole.DAEMON),
            "master killed": kill(mooncake, ServerRole.MASTER),
            "master killed:recover": restart(mooncake, ServerRole.MASTER),
        }
        engines = [
            engine("ref", self.model, [generate("base", prompts)]),
            engine(
                "V",
                self.model,
                engine_steps(VALKEY_CASES, prompts, sync),
                {"tiers": valkey_tiers, "load_timeout_s": LOAD_TIMEOUT_S},
            ),
            engine(
                "M",
                self.model,
                engine_steps(MOONCAKE_CASES, prompts, sync),
                {"tiers": mooncake_tiers, "load_timeout_s": LOAD_TIMEOUT_S},
            ),
        ]
        self.run = run_with_faults(harness, "pool-faults", engines, actions, sync)

    def figures(self, engine_label: str, case: str) -> CaseFigures:
        return judge(self.run, engine_label, case, self.run.step("ref", "base"), self.model)


_matrix: dict[str, PoolMatrix] = {}


@pytest.fixture(scope="module")
def matrix(harness: Harness, mooncake: LocalPool, valkey: LocalPool) -> PoolMatrix:
    if "run" not in _matrix:
        _matrix["run"] = PoolMatrix(harness, mooncake, valkey)
    return _matrix["run"]


CASES = [
    pytest.param(label, case, id=case)
    for label, cases in (("V", VALKEY_CASES), ("M", MOONCAKE_CASES))
    for case in cases
]


@pytest.mark.parametrize(("engine_label", "case"), CASES)
def test_pool_fault_under_a_running_engine(
    engine_label: str, case: str, matrix: PoolMatrix
) -> None:
    run = matrix.run
    assert run.returncode == 0, run.describe_failure()
    figures = matrix.figures(engine_label, case)
    assert figures.outputs_identical, "\n".join(figures.output_problems)
    assert figures.within_load_timeout(LOAD_TIMEOUT_S), figures
    assert figures.counted, f"{case}: the fault was not counted: {figures}"
    assert figures.hits_resumed, (
        f"hit {figures.hit_tokens} of {figures.expected_hit_tokens}: {figures}"
    )
    assert run.step(engine_label, f"{case}:integrity")["integrity"] == "ok"
    done = _action_done(run, engine_label, case)
    done |= _action_done(run, engine_label, f"{case}:recover")
    figures.record(
        f"pool (engine): {case}",
        done=f"{DONE[case]}; {done}",
        seen=f"{SEEN[case]}; fault run cached {figures.fault_cached_tokens}",
    )


def _action_done(run: PlanRun, engine_label: str, name: str) -> dict[str, Any]:
    return dict(run.step(engine_label, f"await-{name}")["test"])


DONE = {
    "valkey killed": "valkey-server SIGKILLed, then started again on its port (empty)",
    "valkey restarted empty": "valkey-server SIGKILLed and started again at once, empty",
    "daemon hung": f"storage daemon SIGSTOPped for at least {HANG_S} s "
    f"(op_timeout_s={OP_TIMEOUT_S}), then SIGCONTed",
    "daemon killed": "storage daemon SIGKILLed; restarted once the master dropped it",
    "master killed": "Mooncake master SIGKILLed, then started again on its port",
}
SEEN = {
    "valkey killed": "calls refused, counted, recomputed; stored again after the restart",
    "valkey restarted empty": "every lookup missed (counted); blocks sent again and stored",
    "daemon hung": "round trips timed out and were counted; the gate skipped the pool meanwhile",
    "daemon killed": "loads and stores failed or missed, counted; stored again after restart",
    "master killed": "calls failed, counted, recomputed; stored again after the restart",
}
