"""The real models' shapes on real vLLM (CPU), without the connector.

* vLLM makes the KV cache groups ``ShapeModel.groups`` documents (kinds,
  layers, windows, order), with block and page sizes of its own choosing that
  follow its rules (they differ between CPUs: never a constant here);
* a ~600-token prompt prefills, and runs again from the engine's prefix cache.

One engine per shape, each in its own driver process. gemma3-1b is left out
(1.5 GB to build); ``tests/tools/test_shapes.py`` checks its documented groups
against vLLM's grouping rule.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from hybridkv.tools.models import ShapeKind, ShapeModel, build_shape_model
from tests.e2e.compare import output_problems
from tests.e2e.expect import engine_facts, full_hit_tokens
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.shape_plans import MAX_TOKENS, PROMPT_TOKENS, shape_engine

pytestmark = pytest.mark.slow

E2E_SHAPES = (ShapeKind.GEMMA3_270M, ShapeKind.QWEN3_NEXT_SMALL, ShapeKind.GPT_OSS_SMALL)


def _run(harness: Harness, kind: ShapeKind) -> tuple[ShapeModel, PlanRun]:
    """Build the shape here (cached; the driver then finds it) and run its plan once."""
    model = build_shape_model(kind, harness.model_dir)
    run = harness.run(f"shape-{kind.value}", [shape_engine(model)])
    assert run.returncode == 0, run.describe_failure()
    return model, run


def _attention_bytes_per_token(model: ShapeModel) -> int:
    config = json.loads((model.path / "config.json").read_text())
    return 2 * int(config["num_key_value_heads"]) * int(config["head_dim"]) * 2  # K+V, bf16


def _documented(model: ShapeModel) -> list[dict[str, Any]]:
    return [
        {
            "kind": g.kind.value,
            "sliding_window": g.sliding_window,
            "layer_names": list(g.layer_names),
        }
        for g in model.groups
    ]


@pytest.mark.parametrize("kind", E2E_SHAPES, ids=lambda k: k.value)
def test_vllm_makes_the_documented_groups(kind: ShapeKind, harness: Harness) -> None:
    """Kinds, layers, windows and order as documented; sizes follow the engine's rules: a
    block a multiple of the one asked for, attention pages sized by their block, one page
    size for every group (one block pool), a Mamba state that fits its page."""
    model, run = _run(harness, kind)
    facts = engine_facts(run, kind.value)
    measured = facts["groups"]
    assert [{k: g[k] for k in ("kind", "sliding_window", "layer_names")} for g in measured] == (
        _documented(model)
    )
    for g in measured:
        assert g["block_size"] % model.block_size == 0, g
        if g["kind"] == "mamba":
            assert g["real_page_size_bytes"] <= g["page_size_bytes"], g
        else:
            assert g["page_size_bytes"] == g["block_size"] * _attention_bytes_per_token(model), g
    assert len({g["page_size_bytes"] for g in measured}) == 1, measured
    block_sizes = [g["block_size"] for g in measured]
    assert facts["alignment_tokens"] == math.lcm(*block_sizes), facts
    assert facts["hash_block_size"] == math.gcd(*block_sizes), facts


@pytest.mark.parametrize("kind", E2E_SHAPES, ids=lambda k: k.value)
def test_prompt_prefills_and_hits_the_prefix_cache(kind: ShapeKind, harness: Harness) -> None:
    _, run = _run(harness, kind)
    facts = engine_facts(run, kind.value)
    cold, hit = run.step(kind.value, "cold"), run.step(kind.value, "hit")
    assert cold["num_prompt_tokens"] == [PROMPT_TOKENS]
    assert cold["num_cached_tokens"] == [0]
    assert [len(ids) for ids in cold["output_token_ids"]] == [MAX_TOKENS]
    assert hit["num_cached_tokens"] == [full_hit_tokens(PROMPT_TOKENS, facts)]
    assert output_problems(hit, cold, exact=False) == []
