"""A vLLM engine whose only tier is a Mooncake pool far smaller than its prompts.

One engine process (Gemma 3 tiny model) stores 48 unrelated prompts, six per
step, into a pool that holds about three quarters of their blocks: the master
evicts the least recently used objects (or refuses stores while eviction
catches up). The engine keeps serving the greedy tokens of a run without the
connector; evictions (the master's count) and refusals (the tier's counter,
equal to the master's but for puts that timed out) are counted; after vLLM's
own cache is reset the most recent prompts still hit from the pool and the
oldest are recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridkv.tools.models import TinyModelKind, default_prompt_token_ids
from hybridkv.tools.pool import LocalPool
from tests.e2e.expect import (
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
    full_hit_tokens,
)
from tests.e2e.harness import Harness
from tests.e2e.scenarios import RESET, engine, generate
from tests.faults.report import record
from tests.support.servers import MIB, MooncakePool

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3
SEGMENT_BYTES = 16 * MIB
"""Mooncake's smallest segment."""
PROMPT_TOKENS = 440
NUM_STEPS = 8
PROMPTS_PER_STEP = 6
"""48 unrelated prompts: their blocks (about 1 KiB per token) are 1.3x the pool."""


@pytest.fixture(scope="module")
def small_pool() -> Iterator[LocalPool]:
    with MooncakePool(segment_bytes=SEGMENT_BYTES) as running:
        yield running


def test_engine_serves_through_a_pool_that_fills_up(
    harness: Harness, small_pool: LocalPool
) -> None:
    model = harness.model(KIND)
    prompts = [
        default_prompt_token_ids(PROMPT_TOKENS, vocab_size=model.vocab_size, seed=300 + i)
        for i in range(NUM_STEPS * PROMPTS_PER_STEP)
    ]
    batches = [prompts[i : i + PROMPTS_PER_STEP] for i in range(0, len(prompts), PROMPTS_PER_STEP)]
    steps = [generate(f"fill_{i}", batch) for i, batch in enumerate(batches)]
    steps += [RESET, generate("latest", batches[-1]), RESET, generate("oldest", batches[0])]
    plan = [
        engine("ref", model, steps),
        engine("P", model, steps, {"tiers": small_pool.tier_configs()}),
    ]
    run = harness.run("pool-full", plan)
    assert run.returncode == 0, run.describe_failure()
    labels = [f"fill_{i}" for i in range(NUM_STEPS)] + ["latest", "oldest"]
    for label in labels:
        assert_same_outputs(run.step("P", label), run.step("ref", label), model, label)
    facts = engine_facts(run, "P")
    latest = run.step("P", "latest")
    where = f"latest: {describe(latest)}"
    expected = [full_hit_tokens(len(prompt), facts) for prompt in batches[-1]]
    assert latest["num_cached_tokens"] == expected, where
    assert counter(latest["connector"], "loads", outcome="ok") == len(expected), where
    assert counter(latest["connector"], "loads", outcome="failed") == 0, where
    oldest = run.step("P", "oldest")  # evicted: every token recomputed
    assert oldest["num_cached_tokens"] == [0] * PROMPTS_PER_STEP, describe(oldest)
    assert counter(oldest["connector"], "hit_tokens") == 0, describe(oldest)
    # One client and no deletes: every object it wrote is still there or was evicted;
    # every store the master refused is counted by the tier. A put that got no answer in
    # op_timeout_s counts as an error but may still land or be refused (a busy machine),
    # so the pool may count up to that many objects the tier did not.
    (settled,) = (r for r in run.records if r.get("op") == "integrity")
    totals, figures = settled["counters"], small_pool.status()["pool"]
    where = f"tier: {totals}; pool: {figures}"
    assert figures["evicted_keys"] > 0, where
    written = totals["tier_writes{tier=mooncake}"]
    unanswered = totals.get("tier_errors{tier=mooncake}", 0)
    landed = figures["key_count"] + figures["evicted_keys"]
    assert written <= landed <= written + unanswered, where
    assert totals["tier_written_bytes{tier=mooncake}"] > SEGMENT_BYTES, where
    refused = totals.get("tier_full_skips{tier=mooncake}", 0)
    assert refused <= figures["refused_puts"] <= refused + unanswered, where
    assert settled["integrity"] == "ok", settled
    stall_s = max(run.step("P", x)["seconds"] - run.step("ref", x)["seconds"] for x in labels)
    record(
        "pool (engine): pool full",
        done=f"{len(prompts)} unrelated {PROMPT_TOKENS}-token prompts, {PROMPTS_PER_STEP} a step, "
        f"stored into a {SEGMENT_BYTES >> 20} MiB Mooncake pool (about 1.3x too small)",
        seen=f"the master evicted {figures['evicted_keys']} objects and refused "
        f"{figures['refused_puts']} puts (the tier counted {refused}); the latest prompts "
        "hit, the oldest were recomputed; check_integrity ok; stall: the longest step's wall "
        "time minus the engine alone's on the same prompts",
        counters={"tier_full_skips": refused, "evicted_keys": figures["evicted_keys"]},
        outputs_identical=True,  # asserted for every step above
        max_stall_s=max(0.0, stall_s),
    )
