"""Mamba2 / KDA prefill checkpoints and speculative decoding, driven by vLLM's own scheduler.

vLLM's CPU build cannot run these configurations (a Mamba2 model with prefix
caching fails in ``mamba_mixer2``, a Mamba model with drafting in a Triton
kernel), so vLLM's ``Scheduler`` and ``KVCacheManager`` drive hybridkv's
connector over a simulated worker (``tests.support.vllm_scheduler``). For each
configuration three engines run the same requests: the engine alone (its own
prefix cache), one with hybridkv whose own cache is reset between rounds (every
hit is hybridkv's), and a restarted one (new scheduler and worker, an empty CPU
tier: hits come from the disk). Hits must equal the engine's own, outputs the
engine alone's; each request resumed from loaded blocks finds exactly a cold
run's KV and states; the states stored are exactly the ones vLLM handed over,
with a cold run's bytes: never one a rejected draft token touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.support.vllm_configs import Drafting, Setup, SimModel
from tests.support.vllm_scheduler import (
    SimVllmEngine,
    cold_object,
    connector_extra,
    random_prompt,
    stored_objects,
)

MAX_TOKENS = 40
"""Long enough for decoding to cross two block boundaries."""


def first_round() -> dict[str, list[int]]:
    shared = random_prompt(7, 41)
    return {
        "a": random_prompt(1, 100),  # a checkpoint at 96 (Mamba2), or a split at 96 (GDN)
        "b": random_prompt(2, 64),  # block-aligned: the state at 64 is never hit by b
        "c": shared + random_prompt(3, 50),
        "d": shared + random_prompt(4, 30),  # shares c's first 41 tokens
    }


def second_round(setup: Setup, alone: SimVllmEngine) -> dict[str, list[int]]:
    """Requests that hit the first round's prompts (and, where states are kept at every
    block boundary, a state that decoding handed over). None hits another of its round:
    which one runs first depends on when loads land."""
    rounds = first_round()
    second = {
        "a2": rounds["a"] + random_prompt(5, 20),
        "b2": rounds["b"] + random_prompt(6, 3),
        "c2": rounds["c"],
    }
    if setup.dense:
        second["d2"] = [*rounds["a"], *alone.outputs["a"], *random_prompt(8, 5)]
    return second


def renamed(prompts: dict[str, list[int]], suffix: str) -> dict[str, list[int]]:
    return {req_id + suffix: prompt for req_id, prompt in prompts.items()}


@dataclass
class Run:
    setup: Setup
    alone: SimVllmEngine
    first: SimVllmEngine
    restarted: SimVllmEngine
    second: dict[str, list[int]]
    stored: dict[str, dict[tuple[int, int], bytes]]
    """What the first engine's tiers held for each of its requests' tokens at its end."""


def run(setup: Setup, root: Path) -> Run:
    configs, cache = root / "configs", root / "cache"
    alone = SimVllmEngine(setup, configs, None)
    alone.generate(first_round(), MAX_TOKENS)
    second = second_round(setup, alone)
    alone.generate(second, MAX_TOKENS)
    alone.generate(renamed(second, "-again"), MAX_TOKENS)
    first = SimVllmEngine(setup, configs, connector_extra(cache))
    first.generate(first_round(), MAX_TOKENS)
    first.reset_prefix_cache()
    first.generate(second, MAX_TOKENS)
    first.flush()
    stored = {r: stored_objects(first, sequence(first, r)) for r in first.requests}
    first.close()
    restarted = SimVllmEngine(setup, configs, connector_extra(cache))
    restarted.generate(renamed(second, "-again"), MAX_TOKENS)
    restarted.close()
    return Run(setup, alone, first, restarted, second, stored)


def sequence(engine: SimVllmEngine, req_id: str) -> list[int]:
    return [*engine.requests[req_id].prompt_token_ids, *engine.outputs[req_id]]


SETUPS = {
    "qwen3-next": Setup(model=SimModel.QWEN3_NEXT),
    "qwen3-next-dense": Setup(model=SimModel.QWEN3_NEXT, dense=True),
    "granite-mamba2": Setup(model=SimModel.GRANITE),
    "kimi-kda": Setup(model=SimModel.KIMI_KDA),
    "qwen3-next-mtp": Setup(model=SimModel.QWEN3_NEXT, drafting=Drafting.MTP),
    "granite-eagle": Setup(model=SimModel.GRANITE, drafting=Drafting.EAGLE),
    "granite-ngram": Setup(model=SimModel.GRANITE, drafting=Drafting.NGRAM),
    "granite-dense": Setup(model=SimModel.GRANITE, dense=True),
    "qwen3-next-mtp-dense": Setup(model=SimModel.QWEN3_NEXT, drafting=Drafting.MTP, dense=True),
    "granite-eagle-dense": Setup(model=SimModel.GRANITE, drafting=Drafting.EAGLE, dense=True),
}


@pytest.fixture(scope="module", params=list(SETUPS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run(SETUPS[request.param], tmp_path_factory.mktemp(request.param))


def test_hits_are_the_engines_own_after_a_reset_and_a_restart(runs: Run) -> None:
    """Where states are stored as vLLM hands them over, hits are the engine's own; a
    plain gated delta net's states are stored at every aligned step end, which vLLM
    keeps fewer of: hits at least the engine's own (b2: the state at the end of b's
    64-token prompt, which vLLM's sparse retention drops)."""
    alone, first, restarted = runs.alone, runs.first, runs.restarted
    again = renamed(runs.second, "-again")
    own = {r: alone.num_cached_tokens(r) for r in [*runs.second, *again]}
    assert all(own.values()), own  # every request of the round hits the engine's cache
    external = {r: first.num_external_tokens(r) for r in runs.second}
    external |= {r: restarted.num_external_tokens(r) for r in again}
    assert {r: first.num_cached_tokens(r) for r in runs.second} == {
        r: external[r] for r in runs.second
    }  # nothing came from the engine's own cache: it was reset
    if first.connector.facts.handoff_group_ids:
        assert external == own
    else:
        assert all(external[r] >= own[r] for r in own), (external, own)


def test_outputs_are_the_engine_alones_and_loads_are_a_cold_runs(runs: Run) -> None:
    for engine in (runs.first, runs.restarted):
        assert engine.worker.bad_resumes == []
        for req_id, tokens in engine.outputs.items():
            assert tokens == runs.alone.outputs[req_id], req_id
    assert runs.alone.worker.bad_resumes == []  # the simulation itself resumes right


def test_stored_states_are_the_handed_over_ones_with_a_cold_runs_bytes(runs: Run) -> None:
    """Groups whose states move store exactly the states vLLM handed over; a plain
    gated delta net's states stay at their blocks, stored at every aligned step end
    (all vLLM hands over, and more)."""
    first = runs.first
    handoff_groups = first.connector.facts.handoff_group_ids
    alignment = first.kv_cache_config.cache_hit_alignment_tokens
    sequences = {r: sequence(first, r) for r in first.requests}
    handed = {(g, tuple(sequences[r][:n])) for r, g, _, n in first.handoffs if n % alignment == 0}
    assert handed, "vLLM handed over no state"
    stored = set()
    for req_id, tokens in sequences.items():
        for (g, n), data in runs.stored[req_id].items():
            assert data == cold_object(first, tokens, g, n), (req_id, g, n)
            spec = first.kv_cache_config.kv_cache_groups[g].kv_cache_spec
            if "Mamba" in type(spec).__name__:
                stored.add((g, tuple(tokens[:n])))
            else:  # a full attention block of the computed tokens (the last is not)
                assert n <= len(tokens) - 1
    if handoff_groups:
        assert stored == handed
    else:
        assert stored >= handed


def test_decoded_states_are_stored_where_vllm_keeps_them(runs: Run) -> None:
    """vLLM's default keeps a prompt's replay boundary only; kept densely, decoding
    (with drafts: accepted tokens crossing a boundary) commits each boundary it
    passes, and d2 resumes from one of a's."""
    first = runs.first
    a_len = len(first.requests["a"].prompt_token_ids)
    decoded = {n for r, _, _, n in first.handoffs if r == "a" and n > a_len}
    if not runs.setup.dense:
        assert decoded == set()
        return
    assert decoded == {112, 128}, decoded
    # With EAGLE-style drafting the hit drops its last block, as the engine's own.
    drop = runs.setup.drafting in (Drafting.EAGLE, Drafting.MTP)
    assert first.num_external_tokens("d2") == (112 if drop else 128)


def test_drafts_are_verified_accepted_and_rejected(runs: Run) -> None:
    worker, speculative = runs.first.worker, runs.first.vllm_config.speculative_config
    if speculative is None:
        assert worker.num_drafts == 0
        return
    assert worker.num_drafts > worker.num_accepted_drafts
    if speculative.method != "ngram":  # n-grams of random tokens are seldom right
        assert worker.num_accepted_drafts > 0
