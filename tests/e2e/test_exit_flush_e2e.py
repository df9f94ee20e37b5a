"""A process that ends without shutting its engine down keeps what it stored.

An offline script (``LLM(...)``, generate, then return, or SIGTERM from its
supervisor) ends while its stores are still being written back to the slower
tier: a real valkey-server behind the CPU tier, whose writes are held back
with ``CLIENT PAUSE <ms> WRITE`` just before the prompts are sent, so the
write-back is in flight when the process ends. A restarted engine (a new
process: its CPU tier is empty) must then hit every prompt in full from the
pool, with the engine alone's greedy tokens. With a flush bound shorter than
the pause, the worker stops at the bound and says how many blocks it left.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from hybridkv.tools.models import TinyModel, TinyModelKind
from hybridkv.tools.pool import LocalPool
from tests.e2e.expect import (
    assert_loaded_from_tiers,
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
    summed,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import GROUPS, base_prompts, engine, generate

pytestmark = pytest.mark.slow

PAUSE_MS = 40_000
"""How long valkey holds writes back: longer than the prompts take (seconds; tens on a
loaded machine), so every write-back is still queued when the process ends."""
FLUSH_S = 90.0
"""The flush bound of the engines that must flush everything: past the pause."""
KIND = TinyModelKind.GEMMA3


def tiers(valkey: LocalPool) -> list[dict[str, Any]]:
    (pool,) = valkey.tier_configs()
    # The writes must outlast the pause (a timed-out write is dropped, not retried).
    return [{"kind": "cpu", "capacity_bytes": "64MiB"}, {**pool, "op_timeout_s": FLUSH_S}]


def command(valkey: LocalPool, label: str, *args: str) -> dict[str, Any]:
    return {"op": "valkey_command", "label": label, "port": valkey.valkey_port, "args": args}


def ended_run(
    harness: Harness, valkey: LocalPool, name: str, how: str, connector: dict[str, Any]
) -> PlanRun:
    """The engine alone, then one that stores the prompts and ends the process ``how``."""
    model = harness.model(KIND)
    prompts = base_prompts(model.vocab_size)
    steps = [
        GROUPS,
        command(valkey, "flush", "FLUSHALL"),
        command(valkey, "pause", "CLIENT", "PAUSE", str(PAUSE_MS), "WRITE"),
        generate("first", prompts),
        {"op": "exit", "how": how},
    ]
    first = {**engine("W", model, [], connector), "steps": steps}
    return harness.run(name, [engine("alone", model, [generate("first", prompts)]), first])


def restarted(harness: Harness, valkey: LocalPool, name: str, model: TinyModel) -> PlanRun:
    prompts = base_prompts(model.vocab_size)
    plan = [engine("R", model, [generate("again", prompts)], {"tiers": tiers(valkey)})]
    return harness.run(name, plan)


@pytest.mark.parametrize("how", ["return", "sigterm"])
def test_a_restarted_engine_hits_what_a_process_ended_without_shutdown_stored(
    harness: Harness, valkey: LocalPool, how: str
) -> None:
    model = harness.model(KIND)
    connector = {"tiers": tiers(valkey), "exit_flush_timeout_s": FLUSH_S}
    first_run = ended_run(harness, valkey, f"exit-{how}", how, connector)
    expected_code = 0 if how == "return" else -signal.SIGTERM
    assert first_run.returncode == expected_code, first_run.describe_failure()
    assert first_run.step("W", "pause")["reply"] == "+OK"
    first = first_run.step("W", "first")
    assert counter(first["connector"], "tier_writes", tier="valkey") == 0, describe(first)
    stored = summed(first["connector"], "stored_blocks")
    assert stored > 0, describe(first)

    run = restarted(harness, valkey, f"exit-{how}-restarted", model)
    assert run.returncode == 0, run.describe_failure()
    again = run.step("R", "again")
    assert_loaded_from_tiers(again, engine_facts(run, "R"))
    assert summed(again["connector"], "loaded_blocks") > 0, describe(again)
    assert_same_outputs(again, first_run.step("alone", "first"), model, "after the restart")


def test_a_flush_bound_shorter_than_the_write_back_stops_there_and_says_so(
    harness: Harness, valkey: LocalPool
) -> None:
    model = harness.model(KIND)
    connector = {"tiers": tiers(valkey), "exit_flush_timeout_s": 0.5}
    first_run = ended_run(harness, valkey, "exit-bounded", "return", connector)
    assert first_run.returncode == 0, first_run.describe_failure()
    log = first_run.log_tail(20_000)
    assert "not written to the slower tiers" in log, log[-3000:]
    assert "(exit_flush_timeout_s)" in log
    run = restarted(harness, valkey, "exit-bounded-restarted", model)
    again = run.step("R", "again")
    # Nothing reached the pool: the worker stopped before the pause ended.
    assert again["num_cached_tokens"] == [0] * len(again["num_cached_tokens"]), describe(again)
