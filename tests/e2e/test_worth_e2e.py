"""``eviction_order: worth`` on real vLLM (CPU), every tiny model: the worker reckons a
request's worth from the engine's own groups (its block sizes, Mamba states, sliding
windows) at each touch, and a warm run after vLLM's cache is wiped still loads every
group from the tiers, with the greedy tokens of the engine alone."""

from __future__ import annotations

import pytest

from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import assert_loaded_from_tiers, assert_same_outputs, engine_facts
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import first_engine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", tuple(TinyModelKind), ids=lambda k: k.value)
def test_worth_keeps_loads_whole_and_outputs_equal(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    model = harness.model(kind)
    plan = first_engine(model, harness.cache_dir(f"worth-{kind.value}"))
    plan["connector"] = {**plan["connector"], "eviction_order": "worth"}
    run = harness.run(f"worth-{kind.value}", [plan])
    warm = run.step("first", "warm")
    assert_same_outputs(warm, baselines.step(f"baseline-{kind.value}", "cold"), model, "warm")
    assert_loaded_from_tiers(warm, engine_facts(run, "first"))
    concurrent = run.step("first", "concurrent")
    reference = baselines.step(f"baseline-{kind.value}", "concurrent")
    assert_same_outputs(concurrent, reference, model, "16 concurrent requests")
