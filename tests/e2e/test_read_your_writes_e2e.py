"""Read-your-writes: a request sent right after the one that stored its prefix hits it,
even while that store is still in flight, and never reads a half-written block.

The only tier is a real valkey-server whose writes are held back with
``CLIENT PAUSE <ms> WRITE`` (reads still answer): every store of the first
run stays in flight for seconds, far longer than an engine step. The second
run (vLLM's prefix cache reset and its KV blocks zeroed) is sent as soon as
the first returns: its lookup counts the blocks being stored as hits, its
loads wait for those stores, and its greedy tokens are those of the engine
alone. Both families: sliding window + full, Mamba + full.
"""

from __future__ import annotations

import pytest

from hybridkv.tools.models import TinyModelKind
from hybridkv.tools.pool import LocalPool
from tests.e2e.expect import (
    assert_loaded_from_tiers,
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
)
from tests.e2e.harness import Harness
from tests.e2e.scenarios import RESET, base_prompts, engine, generate

pytestmark = pytest.mark.slow

KINDS = (TinyModelKind.GEMMA3, TinyModelKind.QWEN3_NEXT)
PAUSE_MS = 10_000
"""How long valkey holds writes back: several times what the first run takes here."""


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_a_request_right_after_a_store_hits_it_and_matches(
    kind: TinyModelKind, harness: Harness, valkey: LocalPool
) -> None:
    model = harness.model(kind)
    prompts = base_prompts(model.vocab_size)
    (tier,) = valkey.tier_configs()
    hold_writes = {
        "op": "valkey_command",
        "label": "pause",
        "port": valkey.valkey_port,
        "args": ["CLIENT", "PAUSE", str(PAUSE_MS), "WRITE"],
    }
    steps = [hold_writes, generate("first", prompts), RESET, generate("second", prompts)]
    plan = [
        engine("alone", model, [generate("first", prompts)]),
        # The store must outlast the pause (a timed-out store is dropped, not retried).
        engine("W", model, steps, {"tiers": [{**tier, "op_timeout_s": 30.0}]}),
    ]
    run = harness.run(f"read-your-writes-{kind.value}", plan)
    assert run.returncode == 0, run.describe_failure()
    assert run.step("W", "pause")["reply"] == "+OK"
    first, second = run.step("W", "first"), run.step("W", "second")
    reference = run.step("alone", "first")
    assert_same_outputs(first, reference, model, "first run")
    assert_same_outputs(second, reference, model, "second run, right after the first")
    where = describe(second)
    # The first run returned with its stores held back: none had reached valkey.
    assert counter(first["connector"], "tier_writes", tier="valkey") == 0, describe(first)
    assert_loaded_from_tiers(second, engine_facts(run, "W"), where, tier="valkey")
    assert counter(second["connector"], "load_store_waits") > 0, where
    (check,) = (r for r in run.records if r.get("op") == "integrity" and r["engine"] == "W")
    assert check["integrity"] == "ok", check
