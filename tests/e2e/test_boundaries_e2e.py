"""Where offload connectors have shipped wrong outputs: boundaries, chunked prefill,
multi-turn, preemption. Both families (sliding window + full; Mamba + full), greedy
outputs compared with the engine alone.

* Prompts exactly on a multiple of the hit alignment, one token before, one after.
* Chunked prefill in steps that are not block multiples (``max_num_batched_tokens``
  48), so blocks and Mamba states are stored mid-prompt, across steps.
* A second turn (first prompt + the engine's answer + a new question) after the
  engine's prefix cache is reset and in a restarted engine: it hits past the end
  of the first prompt (blocks completed while decoding are stored too).
* Preemption: a KV cache so small that vLLM preempts and resumes requests while
  they decode.

Prompt lengths are multiples of 128 plus or minus one: every alignment vLLM's
CPU kernels choose for these models (32 or 64 tokens) divides 128.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.tools.models import TinyModel, TinyModelKind, default_prompt_token_ids
from tests.e2e.expect import (
    EXTERNAL_PREFILLED,
    assert_full_hits,
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, connector_config, engine, generate

pytestmark = pytest.mark.slow

KINDS = (TinyModelKind.GEMMA3, TinyModelKind.QWEN3_NEXT)
BOUNDARY_LENGTHS = (255, 256, 257, 383, 384, 385)
TURN_ANSWER_TOKENS = 60
"""First prompts of 150 and 220 tokens plus 59 computed answer tokens cross a
multiple of 64 (and so of every alignment these models get) past the prompt."""
CHUNKED = {"max_num_batched_tokens": 48, "max_num_seqs": 4}
"""Prefill in 48-token steps: never on a block boundary."""
TIGHT = {
    TinyModelKind.GEMMA3: {"kv_cache_memory_bytes": 1 << 20, "max_num_seqs": 8},
    TinyModelKind.QWEN3_NEXT: {"kv_cache_memory_bytes": 3 << 20, "max_num_seqs": 8},
}
"""KV caches of about 1000 tokens (sized in bytes, so the token capacity does not
depend on the block size a CPU gets): one request of ``max_model_len`` fits."""
PREEMPT_PROMPTS = (120, 110, 100, 90, 80, 70, 60, 50)
PREEMPT_ANSWER_TOKENS = 300
"""Eight short prompts all fit; their answers grow past the cache, so vLLM preempts
running requests and resumes them (their prefix then comes from a cache)."""
PREEMPTION = "vllm:num_preemptions"


def _prompts(model: TinyModel, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    return [
        default_prompt_token_ids(n, vocab_size=model.vocab_size, seed=seed + i)
        for i, n in enumerate(lengths)
    ]


def _turn2(model: TinyModel, label: str = "turn2", seed: int = 700) -> dict[str, Any]:
    questions = _prompts(model, (17, 30), seed=seed)
    return {"op": "next_turn", "label": label, "after": "turn1", "max_tokens": 12,
            "questions": questions}  # fmt: skip


def _steps(model: TinyModel) -> dict[str, list[dict[str, Any]]]:
    boundary = _prompts(model, BOUNDARY_LENGTHS, seed=300)
    turn1 = _prompts(model, (150, 220), seed=500)
    preempt = _prompts(model, PREEMPT_PROMPTS, seed=900)
    return {
        "boundary": [generate("boundary", boundary)],
        "turn1": [{**generate("turn1", turn1), "max_tokens": TURN_ANSWER_TOKENS}],
        "preempt": [{**generate("preempt", preempt), "max_tokens": PREEMPT_ANSWER_TOKENS}],
    }


def _plan(harness: Harness, kind: TinyModelKind) -> PlanRun:
    model = harness.model(kind)
    steps = _steps(model)
    cache = connector_config(harness.cache_dir(f"boundaries-{kind.value}"))
    chunked_cache = connector_config(harness.cache_dir(f"boundaries-chunked-{kind.value}"))
    baseline = engine(
        "alone",
        model,
        [
            *steps["boundary"],
            *steps["turn1"],
            _turn2(model),
            _turn2(model, "turn2_other", seed=800),
            *steps["preempt"],
        ],
    )
    first = engine(
        "first",
        model,
        [
            *steps["boundary"],
            RESET,
            {**steps["boundary"][0], "label": "boundary_warm"},
            *steps["turn1"],
            RESET,
            _turn2(model),
        ],
        cache,
    )
    # Another question: the restarted engine can only hit what turn 1 stored.
    restarted = engine("restarted", model, [_turn2(model, "turn2_other", seed=800)], cache)
    chunked = engine(
        "chunked",
        model,
        [
            {**steps["boundary"][0], "label": "chunked_cold"},
            RESET,
            {**steps["boundary"][0], "label": "chunked_warm"},
        ],
        chunked_cache,
    )
    chunked["engine_kwargs"] = CHUNKED
    tight = engine("tight", model, steps["preempt"], connector_config(
        harness.cache_dir(f"boundaries-tight-{kind.value}")))  # fmt: skip
    tight["engine_kwargs"] = TIGHT[kind]
    return harness.run(f"boundaries-{kind.value}", [baseline, first, restarted, chunked, tight])


def _ok(run: PlanRun) -> PlanRun:
    assert run.returncode == 0, run.describe_failure()
    return run


def _cold_and_warm_match_alone(
    run: PlanRun, model: TinyModel, engine_name: str, cold_label: str, warm_label: str
) -> tuple[dict[str, Any], list[int]]:
    """The engine's cold and warm steps of the boundary prompts give the outputs of the
    engine alone, and the warm one hits in full. Returns the warm step and its hits."""
    reference = run.step("alone", "boundary")
    for label in (cold_label, warm_label):
        assert_same_outputs(run.step(engine_name, label), reference, model, label)
    warm = run.step(engine_name, warm_label)
    return warm, assert_full_hits(warm, engine_facts(run, engine_name))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_prompts_on_and_around_the_alignment_hit_and_match(
    kind: TinyModelKind, harness: Harness
) -> None:
    run = _ok(_plan(harness, kind))
    facts = engine_facts(run, "first")
    warm, expected = _cold_and_warm_match_alone(
        run, harness.model(kind), "first", "boundary", "boundary_warm"
    )
    # On the alignment the last block is left to compute; one past it, it is a hit.
    align = facts["alignment_tokens"]
    assert [n % align for n in warm["num_prompt_tokens"]] == [align - 1, 0, 1] * 2
    assert (
        expected[1] == warm["num_prompt_tokens"][1] - align and expected[2] == expected[1] + align
    )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_chunked_prefill_stores_mid_prompt_and_matches(
    kind: TinyModelKind, harness: Harness
) -> None:
    run = _ok(_plan(harness, kind))
    warm, expected = _cold_and_warm_match_alone(
        run, harness.model(kind), "chunked", "chunked_cold", "chunked_warm"
    )
    assert counter(warm["connector"], "loads", outcome="ok") == len(expected), describe(warm)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_second_turn_hits_past_the_first_prompt_after_reset_and_restart(
    kind: TinyModelKind, harness: Harness
) -> None:
    run = _ok(_plan(harness, kind))
    model = harness.model(kind)
    facts = engine_facts(run, "first")
    align = facts["alignment_tokens"]
    turn1 = run.step("first", "turn1")
    for engine_label, label in (("first", "turn2"), ("restarted", "turn2_other")):
        step = run.step(engine_label, label)
        reference = run.step("alone", label)
        assert_same_outputs(step, reference, model, f"{label} ({engine_label})")
        for i, cached in enumerate(step["num_cached_tokens"]):
            first_prompt = turn1["num_prompt_tokens"][i]
            # The answer's last token was sampled, never computed: its KV is not stored.
            computed = first_prompt + TURN_ANSWER_TOKENS - 1
            assert cached == computed // align * align, describe(step)
            assert cached > first_prompt // align * align, describe(step)
        assert step["metrics"].get(EXTERNAL_PREFILLED, 0.0) == sum(step["num_cached_tokens"])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_preempted_requests_resume_and_match(kind: TinyModelKind, harness: Harness) -> None:
    run = _ok(_plan(harness, kind))
    model = harness.model(kind)
    step = run.step("tight", "preempt")
    assert_same_outputs(step, run.step("alone", "preempt"), model, "under preemption")
    assert step["metrics"].get(PREEMPTION, 0.0) > 0, describe(step)
    assert counter(step["connector"], "loads", outcome="failed") == 0, describe(step)
    (check,) = (r for r in run.records if r.get("op") == "integrity" and r["engine"] == "tight")
    assert check["integrity"] == "ok", check
