"""Storing only what a later hit can read, on real vLLM (CPU).

Gemma 3 with ``hit_alignment_tokens`` four times the engine's alignment: its
sliding-window group stores only the blocks of each segment's last window.
Qwen3-Next on the engine's alignment (a coarser one is refused with Mamba
groups: states exist only where engine steps end): its Mamba group stores
only aligned states. The warm run (vLLM's prefix cache reset and zeroed) must
hit as far as the alignment allows, load exactly the blocks the hit needs, and
give the greedy tokens of the engine alone, while the cold run stored fewer
bytes than a layer-blind store of every completed block.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from hybridkv.groups import GroupKind, KVGroup
from hybridkv.groups.kinds import rules_for
from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import (
    EXTERNAL_HITS,
    assert_same_outputs,
    describe,
    engine_facts,
    group_counter,
    moved_bytes_per_block,
    needed_blocks,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, engine, generate

pytestmark = pytest.mark.slow

SEGMENTS = {TinyModelKind.GEMMA3: 4, TinyModelKind.QWEN3_NEXT: 1}
"""Hits aligned to this many of the engine's alignments."""


def _run(harness: Harness, baselines: PlanRun, kind: TinyModelKind) -> tuple[PlanRun, int]:
    model = harness.model(kind)
    align = int(engine_facts(baselines, f"baseline-{kind.value}")["alignment_tokens"])
    align *= SEGMENTS[kind]
    prompts = base_prompts(model.vocab_size)
    steps = [generate("cold", prompts), RESET, generate("warm", prompts)]
    connector = {
        "cache_dir": str(harness.cache_dir(f"tails-{kind.value}")),
        "hit_alignment_tokens": align,
    }
    plan = engine("tails", model, steps, connector)
    return harness.run(f"tails-{kind.value}", [plan]), align


def _group(record: dict[str, Any]) -> KVGroup:
    kind = GroupKind(record["kind"])
    return KVGroup(
        kind=kind,
        block_size=record["block_size"],
        page_size_bytes=record["real_page_size_bytes"],
        layer_names=tuple(record["layer_names"]),
        sliding_window=record["sliding_window"] if kind is GroupKind.SLIDING_WINDOW else None,
    )


@pytest.mark.parametrize("kind", list(SEGMENTS), ids=lambda k: k.value)
def test_aligned_tails_are_enough_for_every_hit(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run, align = _run(harness, baselines, kind)
    facts = engine_facts(run, "tails")
    groups = [_group(g) for g in facts["groups"]]
    cold, warm = run.step("tails", "cold"), run.step("tails", "warm")
    reference = baselines.step(f"baseline-{kind.value}", "cold")
    model = harness.model(kind)
    assert_same_outputs(cold, reference, model, "cold run")
    assert_same_outputs(warm, reference, model, "warm run")

    # Hits: the longest prompt prefix on the coarse alignment, from our tiers only.
    expected = [(n - 1) // align * align for n in warm["num_prompt_tokens"]]
    assert warm["num_cached_tokens"] == expected, describe(warm)
    assert warm["metrics"].get(EXTERNAL_HITS, 0.0) == sum(expected) > 0, describe(warm)
    per_hit = [needed_blocks(facts, h) for h in expected]
    loaded = [sum(blocks[g] for blocks in per_hit) for g in range(len(groups))]
    assert group_counter(warm["connector"], "loaded_blocks", facts) == loaded, describe(warm)

    # Stores: at most the rule's blocks of each group over everything the run computed,
    # and a sliding or Mamba group far fewer than a layer-blind store.
    stored = group_counter(cold["connector"], "stored_blocks", facts)
    sizes = moved_bytes_per_block(facts)
    num_tokens = [
        n + len(out)
        for n, out in zip(cold["num_prompt_tokens"], cold["output_token_ids"], strict=True)
    ]
    blind_bytes = 0
    for group_id, group in enumerate(groups):
        rule = rules_for(group.kind)
        if group.kind is GroupKind.MAMBA:  # a state where a step ended on the alignment
            ceiling = sum(n // align for n in num_tokens)
        else:
            ceiling = sum(len(rule.stored_blocks(group, 0, n, align, False)) for n in num_tokens)
        blind = sum(n // group.block_size for n in num_tokens)
        blind_bytes += blind * sizes[group_id]
        assert 0 < stored[group_id] <= ceiling, (group_id, stored, describe(cold))
        if group.kind is not GroupKind.FULL:
            assert stored[group_id] < blind / 2, (group_id, stored, blind)
    stored_bytes = sum(n * size for n, size in zip(stored, sizes, strict=True))
    assert stored_bytes < blind_bytes, (stored_bytes, blind_bytes)
    assert math.isclose(
        sum(group_counter(cold["connector"], "stored_bytes", facts)), stored_bytes
    ), describe(cold)
