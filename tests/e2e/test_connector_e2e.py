"""HybridKVConnector on real vLLM (CPU) with the hybrid allocator on.

Per tiny model: a cold run stores; after vLLM's prefix cache is reset and
every KV block zeroed, a warm run must load from our tiers and give the
greedy tokens of a run without the connector; 16 concurrent requests with
shared prefixes of different lengths match too; a fresh process hits the
disk tier; damaged disk files are detected, counted and recomputed.
``test_vllm_models.py`` shows that zeroing any one group changes the tokens,
so equal tokens here mean every group was loaded right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import (
    EXTERNAL_HITS,
    EXTERNAL_PREFILLED,
    assert_full_hits,
    assert_loaded_from_tiers,
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
    full_hit_tokens,
    group_counter,
    moved_bytes_per_block,
    needed_blocks,
    summed,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import first_engine, restart_plan

pytestmark = pytest.mark.slow

KINDS = tuple(TinyModelKind)
"""Two groups and several groups of one spec, sliding window and Mamba."""


def _first(harness: Harness, kind: TinyModelKind) -> PlanRun:
    model = harness.model(kind)
    return harness.run(f"first-{kind.value}", [first_engine(model, _cache_dir(harness, kind))])


def _restart(harness: Harness, kind: TinyModelKind) -> PlanRun:
    _first(harness, kind)  # fills the disk tier
    model = harness.model(kind)
    return harness.run(f"restart-{kind.value}", restart_plan(model, _cache_dir(harness, kind)))


def _cache_dir(harness: Harness, kind: TinyModelKind) -> Path:
    return harness.cache_dir(kind.value)


def _assert_matches_alone(
    step: dict[str, Any],
    harness: Harness,
    baselines: PlanRun,
    kind: TinyModelKind,
    what: str,
    label: str = "cold",
) -> None:
    """``step`` gave the outputs of the engine without the connector on the same prompts
    (the baseline's step ``label``)."""
    reference = baselines.step(f"baseline-{kind.value}", label)
    assert_same_outputs(step, reference, harness.model(kind), what)


def _facts(run: PlanRun, engine: str = "first") -> dict[str, Any]:
    """The engine's own KV cache groups and hit alignment (they differ between CPUs)."""
    return engine_facts(run, engine)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_connector_keeps_the_hybrid_layout(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    facts = _facts(run)
    assert facts == engine_facts(baselines, f"baseline-{kind.value}")
    assert len(facts["groups"]) == len(harness.model(kind).groups) >= 2


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_cold_run_stores_and_matches(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    cold = run.step("first", "cold")
    _assert_matches_alone(cold, harness, baselines, kind, "cold run")
    assert cold["metrics"].get(EXTERNAL_HITS, 0.0) == 0, describe(cold)
    stored = group_counter(cold["connector"], "stored_blocks", _facts(run))
    assert all(n > 0 for n in stored), describe(cold)  # every group stored blocks
    assert summed(cold["connector"], "stored_bytes") > 0, describe(cold)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_warm_run_loads_every_group_from_the_tiers(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    warm = run.step("first", "warm")
    _assert_matches_alone(warm, harness, baselines, kind, "warm run")
    facts = _facts(run)
    # vLLM's prefix cache was reset and zeroed: every cached token came from us.
    expected = assert_loaded_from_tiers(warm, facts)
    assert warm["metrics"].get(EXTERNAL_PREFILLED, 0.0) == sum(expected), describe(warm)
    stats = warm["connector"]
    assert counter(stats, "hit_tokens") == sum(expected), describe(warm)
    assert counter(stats, "load_seconds_count") == len(expected), describe(warm)
    per_group = [needed_blocks(facts, h) for h in expected]
    want_blocks = [sum(blocks[g] for blocks in per_group) for g in range(len(facts["groups"]))]
    assert group_counter(stats, "loaded_blocks", facts) == want_blocks, describe(warm)
    sizes = moved_bytes_per_block(facts)
    want_bytes = [n * size for n, size in zip(want_blocks, sizes, strict=True)]
    assert group_counter(stats, "loaded_bytes", facts) == want_bytes, describe(warm)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_sixteen_concurrent_requests_with_shared_prefixes_match(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    step = run.step("first", "concurrent")
    assert len(step["output_token_ids"]) == 16
    _assert_matches_alone(step, harness, baselines, kind, "16 concurrent requests", "concurrent")
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) > 0, describe(step)
    assert counter(step["connector"], "loads", outcome="failed") == 0, describe(step)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_fresh_process_hits_the_disk_tier(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _restart(harness, kind)
    step = run.step("restart", "restart")
    _assert_matches_alone(step, harness, baselines, kind, "restart")
    expected = assert_full_hits(step, _facts(_first(harness, kind)))
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) == sum(expected), describe(step)
    assert step["metrics"].get(EXTERNAL_PREFILLED, 0.0) == sum(expected), describe(step)
    stats = step["connector"]
    assert counter(stats, "tier_reads", tier="disk") > 0, describe(step)
    assert counter(stats, "tier_hits", tier="cpu") == 0, describe(step)
    assert counter(stats, "loads", outcome="failed") == 0, describe(step)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_damaged_disk_files_are_detected_counted_and_recomputed(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _restart(harness, kind)
    damage = run.op("corrupt_files")
    assert damage["corrupted"], f"no stored object files found: {damage}"
    step = run.step("corrupted", "corrupted")
    _assert_matches_alone(step, harness, baselines, kind, "after damage")
    stats = step["connector"]
    assert counter(stats, "tier_corrupt_objects", tier="disk") > 0, describe(step)
    num_failed = counter(stats, "loads", outcome="failed")
    assert num_failed > 0, describe(step)
    # A failed load restarts its request, which may then load the shorter hit that
    # needs no damaged block; the others load their full hit.
    facts = _facts(_first(harness, kind))
    full = [full_hit_tokens(n, facts) for n in step["num_prompt_tokens"]]
    loaded = step["metrics"].get(EXTERNAL_PREFILLED, 0.0)
    assert 0 <= loaded < sum(full), describe(step)
    assert counter(stats, "loads", outcome="ok") >= len(full) - num_failed, describe(step)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_tiers_and_transfers_pass_integrity_checks(kind: TinyModelKind, harness: Harness) -> None:
    checked = {}
    for run in (_first(harness, kind), _restart(harness, kind)):
        for record in run.records:
            if record.get("op") == "integrity":
                checked[f"{run.name}/{record['engine']}"] = record["integrity"]
    assert len(checked) == 4, checked  # first, restart, again, corrupted
    assert set(checked.values()) == {"ok"}, checked


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_second_engine_in_the_same_process_starts_and_hits(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    """Engines one after another in one process (a notebook, a test session)."""
    run = _restart(harness, kind)
    step = run.step("again", "again")
    _assert_matches_alone(step, harness, baselines, kind, "second engine")
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) > 0, describe(step)
