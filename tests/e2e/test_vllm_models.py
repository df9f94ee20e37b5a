"""The tiny models on real vLLM without the connector: the ground the other
end-to-end tests stand on.

* vLLM makes the KV cache groups ``TinyModel.groups`` documents, with block and
  page sizes of its own choosing that differ between CPUs;
* a prefix-cache hit gives the same greedy tokens as a cold run;
* zeroing any single group's cached blocks changes the tokens of most
  requests, so a test that compares outputs (``compare.py``: exactly for
  float32, within bfloat16 noise otherwise) catches a wrong load in any
  group. For Qwen3-Next this holds only because ``hybridkv.tools.models`` scales
  the linear-attention and attention weights.
"""

from __future__ import annotations

import json
import math

import pytest

from hybridkv.tools.models import TinyModelKind
from tests.e2e.compare import output_problems
from tests.e2e.expect import engine_facts
from tests.e2e.harness import BASELINE_KINDS, Harness, PlanRun

pytestmark = pytest.mark.slow


def _engine(kind: TinyModelKind) -> str:
    return f"baseline-{kind.value}"


@pytest.mark.parametrize("kind", BASELINE_KINDS, ids=lambda k: k.value)
def test_vllm_makes_the_documented_groups(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    """Kinds, layers and windows as documented; sizes are the engine's, but follow
    its rules: a block a multiple of the one asked for, attention pages sized by
    their block, every group's page the same (one block pool)."""
    model = harness.model(kind)
    facts = engine_facts(baselines, _engine(kind))
    measured = facts["groups"]
    expected = [
        {
            "kind": g.kind.value,
            "sliding_window": g.sliding_window,
            "layer_names": list(g.layer_names),
        }
        for g in model.groups
    ]
    assert [{k: g[k] for k in expected[0]} for g in measured] == expected
    config = json.loads((model.path / "config.json").read_text())
    kv_bytes = (
        2
        * config["num_key_value_heads"]
        * config["head_dim"]
        * (4 if model.dtype == "float32" else 2)
    )
    for g in measured:
        assert g["block_size"] % model.block_size == 0, g
        if g["kind"] != "mamba":
            assert g["page_size_bytes"] == g["block_size"] * kv_bytes, g
    assert len({g["page_size_bytes"] for g in measured}) == 1, measured
    block_sizes = [g["block_size"] for g in measured]
    assert facts["alignment_tokens"] == math.lcm(*block_sizes), facts
    assert facts["hash_block_size"] == math.gcd(*block_sizes), facts


@pytest.mark.parametrize("kind", BASELINE_KINDS, ids=lambda k: k.value)
def test_prefix_cache_hit_matches_cold_run(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    cold = baselines.step(_engine(kind), "cold")
    hit = baselines.step(_engine(kind), "local_hit")
    exact = harness.model(kind).dtype == "float32"
    assert output_problems(hit, cold, exact=exact) == []
    assert all(n > 0 for n in hit["num_cached_tokens"]), hit["num_cached_tokens"]
    assert cold["num_cached_tokens"] == [0] * len(cold["num_cached_tokens"])


@pytest.mark.parametrize("kind", BASELINE_KINDS, ids=lambda k: k.value)
def test_every_group_changes_outputs_when_zeroed(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    engine = _engine(kind)
    cold = baselines.step(engine, "cold")
    exact = harness.model(kind).dtype == "float32"
    for group_id in range(len(harness.model(kind).groups)):
        refill = baselines.step(engine, f"refill_{group_id}")
        assert output_problems(refill, cold, exact=exact) == [], f"group {group_id}: refill"
        zeroed = baselines.step(engine, f"zero_{group_id}")
        assert zeroed["num_blocks_zeroed"] > 0, f"group {group_id}: nothing cached"
        after = baselines.step(engine, f"zeroed_{group_id}")
        assert all(n > 0 for n in after["num_cached_tokens"]), f"group {group_id}: no hit"
        # The comparison the connector tests use must see the damage in most requests.
        caught = output_problems(after, cold, exact=exact)
        num_prompts = len(cold["output_token_ids"])
        assert len(caught) > num_prompts // 2, (
            f"group {group_id}: zeroed blocks changed only {len(caught)} of {num_prompts} "
            f"requests: {caught}"
        )
