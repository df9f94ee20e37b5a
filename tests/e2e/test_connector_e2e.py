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

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hybridkv.spec import GroupKind
from hybridkv.tools.models import TinyModel, TinyModelKind
from tests.e2e.compare import LOGPROB_TOLERANCE, output_problems
from tests.e2e.conftest import Harness, PlanRun
from tests.e2e.scenarios import first_engine, full_hit_tokens, restart_plan

pytestmark = pytest.mark.slow

KINDS = tuple(TinyModelKind)
"""Two groups and several groups of one spec, sliding window and Mamba."""
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
"""Counted when the scheduler accepts a hit; a load that fails later stays counted."""
EXTERNAL_PREFILLED = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
"""Counted per finished prefill: tokens that really came from the connector."""


def _first(harness: Harness, kind: TinyModelKind) -> PlanRun:
    model = harness.model(kind)
    return harness.run(f"first-{kind.value}", [first_engine(model, _cache_dir(harness, kind))])


def _restart(harness: Harness, kind: TinyModelKind) -> PlanRun:
    _first(harness, kind)  # fills the disk tier
    model = harness.model(kind)
    return harness.run(f"restart-{kind.value}", restart_plan(model, _cache_dir(harness, kind)))


def _cache_dir(harness: Harness, kind: TinyModelKind) -> Path:
    return harness.cache_dir(kind.value)


def counter(stats: dict[str, float], name: str, **labels: str) -> float:
    """A connector counter from the metric snapshot, e.g. ``load.load_blocks``."""
    base = "hybridkv_" + name.replace(".", "_")
    suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return stats.get(f"{base}{{{suffix}}}" if suffix else base, 0.0)


def tier_counter(stats: dict[str, float], tier: str, name: str) -> float:
    return counter(stats, f"tier.{name}", tier=tier)


def needed_blocks(model: TinyModel, hit_tokens: int) -> list[int]:
    """Blocks per group a hybrid-aware load moves to resume at ``hit_tokens``.

    Full attention: every block before the hit; sliding window: the blocks
    holding the last ``window - 1`` tokens; Mamba: the one block with the
    state at the hit. The same rule vLLM's own prefix cache uses.
    """
    needed = []
    for group in model.kv_groups:
        num_hit_blocks = hit_tokens // group.block_size
        if group.kind is GroupKind.FULL:
            needed.append(num_hit_blocks)
        elif group.kind is GroupKind.SLIDING_WINDOW:
            assert group.sliding_window is not None
            window_blocks = math.ceil((group.sliding_window - 1) / group.block_size)
            needed.append(min(num_hit_blocks, window_blocks))
        else:
            needed.append(1 if num_hit_blocks else 0)
    return needed


def moved_bytes_per_block(model: TinyModel) -> list[int]:
    """Bytes one block of each group carries: its pages, but a Mamba layer's
    state unpadded (vLLM pads it to the attention page; the padding is not data)."""
    config = json.loads((model.path / "config.json").read_text())
    sizes = []
    for group in model.kv_groups:
        if group.kind is GroupKind.MAMBA:
            key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
            value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
            conv = (2 * key_dim + value_dim) * (config["linear_conv_kernel_dim"] - 1)
            recurrent = config["linear_num_value_heads"] * (
                config["linear_key_head_dim"] * config["linear_value_head_dim"]
            )
            sizes.append(2 * (conv + recurrent) * group.num_layers)  # bfloat16
        else:
            sizes.append(group.block_bytes)
    return sizes


def _describe(step: dict[str, Any]) -> str:
    return (
        f"num_cached_tokens={step['num_cached_tokens']} metrics={step['metrics']} "
        f"connector={step['connector']}"
    )


def assert_same_outputs(
    step: dict[str, Any], reference: dict[str, Any], model: TinyModel, what: str
) -> None:
    """Greedy tokens equal (float32) or equal within bfloat16 noise (see ``compare``)."""
    exact = model.dtype == "float32"
    problems = output_problems(step, reference, exact=exact)
    rule = "identical" if exact else f"within {LOGPROB_TOLERANCE} nats"
    assert not problems, (
        f"{what}: outputs not {rule} to the run without the connector:\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_connector_keeps_the_hybrid_layout(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    groups = run.op("groups", engine="first")["groups"]
    assert groups == baselines.op("groups", engine=f"baseline-{kind.value}")["groups"]
    assert len(groups) == len(harness.model(kind).kv_groups) >= 2


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_cold_run_stores_and_matches(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    cold = run.step("first", "cold")
    reference = baselines.step(f"baseline-{kind.value}", "cold")
    assert_same_outputs(cold, reference, harness.model(kind), "cold run")
    assert cold["metrics"].get(EXTERNAL_HITS, 0.0) == 0, _describe(cold)
    assert counter(cold["connector"], "store.store_blocks") > 0, _describe(cold)
    assert counter(cold["connector"], "store.bytes") > 0, _describe(cold)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_warm_run_loads_every_group_from_the_tiers(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    model = harness.model(kind)
    run = _first(harness, kind)
    warm = run.step("first", "warm")
    reference = baselines.step(f"baseline-{kind.value}", "cold")
    assert_same_outputs(warm, reference, model, "warm run")
    expected = [full_hit_tokens(n, model.block_size) for n in warm["num_prompt_tokens"]]
    # vLLM's prefix cache was reset and zeroed: every cached token came from us.
    assert warm["num_cached_tokens"] == expected, _describe(warm)
    external = warm["metrics"].get(EXTERNAL_HITS, 0.0)
    assert external == sum(expected) > 0, _describe(warm)
    assert warm["metrics"].get(EXTERNAL_PREFILLED, 0.0) == external, _describe(warm)
    stats = warm["connector"]
    assert counter(stats, "lookup.hit_tokens") == external, _describe(warm)
    assert counter(stats, "load.loads_failed") == 0, _describe(warm)
    assert counter(stats, "load.loads_ok") == len(expected), _describe(warm)
    per_group = [needed_blocks(model, h) for h in expected]
    assert counter(stats, "load.load_blocks") == sum(map(sum, per_group)), _describe(warm)
    sizes = moved_bytes_per_block(model)
    want_bytes = sum(
        n * size for blocks in per_group for n, size in zip(blocks, sizes, strict=True)
    )
    assert counter(stats, "load.bytes") == want_bytes, _describe(warm)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_sixteen_concurrent_requests_with_shared_prefixes_match(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _first(harness, kind)
    step = run.step("first", "concurrent")
    reference = baselines.step(f"baseline-{kind.value}", "concurrent")
    assert len(step["output_token_ids"]) == 16
    assert_same_outputs(step, reference, harness.model(kind), "16 concurrent requests")
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) > 0, _describe(step)
    assert counter(step["connector"], "load.loads_failed") == 0, _describe(step)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_fresh_process_hits_the_disk_tier(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    model = harness.model(kind)
    run = _restart(harness, kind)
    step = run.step("restart", "restart")
    reference = baselines.step(f"baseline-{kind.value}", "cold")
    assert_same_outputs(step, reference, model, "restart")
    expected = [full_hit_tokens(n, model.block_size) for n in step["num_prompt_tokens"]]
    assert step["num_cached_tokens"] == expected, _describe(step)
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) == sum(expected), _describe(step)
    assert step["metrics"].get(EXTERNAL_PREFILLED, 0.0) == sum(expected), _describe(step)
    stats = step["connector"]
    assert tier_counter(stats, "disk", "gets") > 0, _describe(step)
    assert tier_counter(stats, "cpu", "hits") == 0, _describe(step)
    assert counter(stats, "load.loads_failed") == 0, _describe(step)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_damaged_disk_files_are_detected_counted_and_recomputed(
    kind: TinyModelKind, harness: Harness, baselines: PlanRun
) -> None:
    run = _restart(harness, kind)
    damage = run.op("corrupt_files")
    assert damage["corrupted"], f"no stored object files found: {damage}"
    step = run.step("corrupted", "corrupted")
    reference = baselines.step(f"baseline-{kind.value}", "cold")
    assert_same_outputs(step, reference, harness.model(kind), "after damage")
    stats = step["connector"]
    assert tier_counter(stats, "disk", "corrupt") > 0, _describe(step)
    num_failed = counter(stats, "load.loads_failed")
    assert num_failed > 0, _describe(step)
    # A failed load is recomputed whole; the others resume at their full hit.
    full = [full_hit_tokens(n, harness.model(kind).block_size) for n in step["num_prompt_tokens"]]
    cached = step["num_cached_tokens"]
    assert all(c in (0, f) for c, f in zip(cached, full, strict=True)), _describe(step)
    assert cached.count(0) == num_failed, _describe(step)
    assert step["metrics"].get(EXTERNAL_PREFILLED, 0.0) == sum(cached), _describe(step)


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
    reference = baselines.step(f"baseline-{kind.value}", "cold")
    assert_same_outputs(step, reference, harness.model(kind), "second engine")
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) > 0, _describe(step)
