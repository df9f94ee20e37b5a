"""Scheduler + worker on real CPU and disk tiers, driven like vLLM drives them.

Every scenario checks KV bytes, not just counts: a loaded attention block
must equal what a cold run writes, a loaded Mamba state must equal the cold
state, and computing on after a load must give the cold final state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.connector.metadata import BlockTransfer, LoadOutcome
from hybridkv.connector.steps import StepInput
from hybridkv.groups import GroupKind
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.check import assert_kv_matches_cold
from hybridkv.tools.sim.drive import run_to_end, wait_loaded
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import (
    block_keys,
    block_refs,
    make_remote_lookup,
    remove_from_disk,
    store_prompt,
)

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
KIND_SETS = {
    "gemma-like": (SW, FULL),
    "qwen3-next-like": (MAMBA, FULL),
    "full-only": (FULL,),
    "three-kinds": (FULL, SW, MAMBA),
}


@pytest.mark.parametrize("lookup_mode", ["same-process", "other-process"])
@pytest.mark.parametrize("name", list(KIND_SETS))
def test_fresh_pair_loads_byte_identical(tmp_path: Path, name: str, lookup_mode: str) -> None:
    model_groups = make_groups(KIND_SETS[name])
    tokens = prompt(37)
    store_prompt(model_groups, tmp_path, tokens, chunk=12)
    config = make_config(tmp_path)
    lookup, opened = (
        make_remote_lookup(config, model_groups) if lookup_mode == "other-process" else (None, [])
    )
    second = make_engine(model_groups, config, lookup=lookup)
    # 36 = the whole prompt but its last token, aligned; Mamba has states at 12, 24, 36.
    assert second.add("warm", tokens) == 36
    req = wait_loaded(second, "warm")
    assert req.outcomes[-1].ok and req.num_computed == 36
    assert assert_kv_matches_cold(second, req, 36) > 0
    run_to_end(second, "warm", chunk=5)
    assert_kv_matches_cold(second, req, 37)
    stats = second.worker.stats
    assert stats.loads[LoadOutcome.OK] == 1
    assert sum(g.load_failed_blocks for g in stats.groups) == 0
    planned = [
        sum(
            len(t.block_ids)
            for m in second.metas
            for ld in m.loads
            for t in ld.transfers
            if t.group_id == g
        )
        for g in range(model_groups.num_groups)
    ]
    assert [g.loaded_blocks for g in stats.groups] == planned and sum(planned) > 0
    close_engine(second)
    for tier in opened:
        tier.close()


@pytest.mark.parametrize(
    ("name", "expected_hit"),
    [("gemma-like", 20), ("full-only", 20), ("qwen3-next-like", 12), ("three-kinds", 12)],
)
def test_partial_hit_stops_where_the_prompts_diverge(
    tmp_path: Path, name: str, expected_hit: int
) -> None:
    model_groups = make_groups(KIND_SETS[name])
    stored = prompt(40)
    store_prompt(model_groups, tmp_path, stored, chunk=12)  # Mamba states at 12, 24, 36
    other = stored[:22] + prompt(30, seed=1)  # shares 22 tokens = 5 full blocks of 4
    engine = make_engine(model_groups, make_config(tmp_path))
    assert engine.add("b", other) == expected_hit
    req = wait_loaded(engine, "b")
    assert req.outcomes[-1].ok
    assert_kv_matches_cold(engine, req, expected_hit)
    run_to_end(engine, "b", chunk=7)
    assert_kv_matches_cold(engine, req, len(other))
    close_engine(engine)


def _load_a_stored_prompt(
    tmp_path: Path, kinds: tuple[GroupKind, ...], req_id: str
) -> tuple[SimEngine, dict[int, BlockTransfer]]:
    """Stores a 37-token prompt (window 8), asks a fresh engine for it: the one load it
    plans, by group, resuming at 36 tokens."""
    model_groups = make_groups(kinds, window=8)
    tokens = prompt(37)
    store_prompt(model_groups, tmp_path, tokens, chunk=12)
    engine = make_engine(model_groups, make_config(tmp_path))
    assert engine.add(req_id, tokens) == 36
    engine.step({})
    assert engine.last_meta is not None
    (load,) = engine.last_meta.loads
    return engine, {t.group_id: t for t in load.transfers}


def test_sliding_window_loads_only_the_window(tmp_path: Path) -> None:
    engine, by_group = _load_a_stored_prompt(tmp_path, (SW, FULL), "w")
    # Resuming at 36 with a window of 8 needs tokens 29..35: blocks 7 and 8 only.
    assert by_group[0].block_indices == (7, 8)
    assert by_group[1].block_indices == tuple(range(9))
    req = engine.requests["w"]
    assert req.block_ids[0][:7] == [0] * 7  # the engine keeps no block outside the window
    assert 0 not in by_group[0].block_ids
    wait_loaded(engine, "w")
    assert_kv_matches_cold(engine, req, 36)
    close_engine(engine)


def test_sliding_window_block_is_stored_before_the_engine_reuses_it(tmp_path: Path) -> None:
    # Chunks of three blocks and a window of one block (as the tiny Gemma 3 prefilling
    # 150 tokens with a 32-token window): the first blocks a step computes are out of the
    # window at the next step, freed and handed out again before its forward pass.
    model_groups = make_groups((SW, FULL), window=4)
    config = make_config(tmp_path)
    first = make_engine(model_groups, config, reuse_freed_first=True)
    a, b = prompt(40), prompt(40, seed=7)
    first.add("a", a)
    first.add("b", b)
    while first.requests["a"].num_computed < 40:
        first.step({"a": 12, "b": 12})
    owner: dict[int, tuple[str, int]] = {}
    num_reused = 0
    for rid, g, bid in first.handed_out:
        num_reused += owner.get(bid) == ("a", 0)
        owner[bid] = (rid, g)
    assert num_reused >= 4, "the scenario must overwrite a's window blocks while a runs"
    first.settle()
    close_engine(first)
    second = make_engine(model_groups, config)
    # A hit at h loads the window block h/4 - 1: every block of a, early-freed ones too.
    for hit in range(4, 40, 4):
        req_id = f"a{hit}"
        assert second.add(req_id, a[: hit + 1]) == hit
        req = wait_loaded(second, req_id)
        assert req.outcomes[-1].ok
        sw_index = hit // 4 - 1
        got = second.block_bytes(0, req.block_ids[0][sw_index])
        assert got == second.expected_block(a, 0, sw_index), f"window block {sw_index}"
        assert second.finish(req_id) is False
    close_engine(second)


def test_mamba_loads_only_the_last_state(tmp_path: Path) -> None:
    engine, by_group = _load_a_stored_prompt(tmp_path, (MAMBA, FULL), "m")
    assert by_group[0].block_indices == (8,)  # the state after 36 tokens
    assert by_group[1].block_indices == tuple(range(9))
    req = engine.requests["m"]
    assert [i for i, b in enumerate(req.block_ids[0]) if b] == [8]
    wait_loaded(engine, "m")
    run_to_end(engine, "m", chunk=1)
    assert_kv_matches_cold(engine, req, 37)  # the recurrence continued from the loaded state
    close_engine(engine)


@pytest.mark.parametrize(
    ("name", "retry_hit"), [("full-only", None), ("gemma-like", 20), ("qwen3-next-like", 12)]
)
def test_failed_load_reports_exact_block_ids_and_resumes_where_vllm_can(
    tmp_path: Path, name: str, retry_hit: int | None
) -> None:
    """One full-attention group keeps the prefix before its first failed block (vLLM's
    block-level errors); hybrid layouts start over and a second lookup finds the longest
    hit that no longer needs the lost blocks."""
    model_groups = make_groups(KIND_SETS[name])
    tokens = prompt(37)
    store_prompt(model_groups, tmp_path, tokens, chunk=12)
    config = make_config(tmp_path)
    engine = make_engine(model_groups, config)
    assert engine.add("f", tokens) == 36
    full = next(g for g, group in enumerate(model_groups.groups) if group.kind is FULL)
    assert remove_from_disk(config, block_keys(model_groups, tokens, full, [5, 7])) == 2
    req = engine.requests["f"]
    lost = {req.block_ids[full][5], req.block_ids[full][7]}
    wait_loaded(engine, "f")
    first = engine.finished_loads()[0]
    assert first.outcome is LoadOutcome.FAILED and req.outcomes[0] == first
    assert set(first.failed_block_ids[full]) == lost
    assert not any(ids for g, ids in enumerate(first.failed_block_ids) if g != full)
    assert set(engine.reported("missing")) == set(block_refs(model_groups, tokens, full, [5, 7]))
    if retry_hit is None:
        assert req.num_computed == 20  # the prefix before block 5
    else:
        wait_loaded(engine, "f")
        loads = [load for meta in engine.metas for load in meta.loads]
        assert [load.num_tokens for load in loads] == [36, retry_hit]
        assert req.outcomes[-1].ok and len(req.outcomes) == 2
    run_to_end(engine, "f", chunk=8)
    assert_kv_matches_cold(engine, req, 37)
    assert engine.worker.stats.loads[LoadOutcome.FAILED] == 1
    close_engine(engine)


def test_load_after_a_local_hit_moves_only_blocks_the_engine_lacks(tmp_path: Path) -> None:
    model_groups = make_groups((SW, FULL, MAMBA), window=8)
    tokens = prompt(37)
    store_prompt(model_groups, tmp_path, tokens, chunk=12)
    engine = make_engine(model_groups, make_config(tmp_path))
    scheduler = engine.scheduler
    scheduler.add_request("h")
    # The engine's own prefix cache already holds 12 tokens.
    result = scheduler.lookup("h", tokens, 12)
    assert (result.num_tokens, result.is_async) == (24, True)
    sw_ids = [0, 0, 0, 0, 0, 0, 0, 41, 42]  # the window before token 36
    full_ids = [1, 2, 3, 21, 22, 23, 24, 25, 26]  # 0..2 local, 3..8 to load
    mamba_ids = [0, 0, 0, 0, 0, 0, 0, 0, 51]  # the state after 36 tokens
    scheduler.allocated("h", [sw_ids, full_ids, mamba_ids], 24)
    meta = scheduler.build_metadata(StepInput())
    (load,) = meta.loads
    assert (load.num_tokens, load.base_tokens) == (36, 12)
    by_group = {t.group_id: t for t in load.transfers}
    assert by_group[0].block_indices == (7, 8) and by_group[0].block_ids == (41, 42)
    assert by_group[1].block_indices == tuple(range(3, 9))
    assert by_group[1].block_ids == (21, 22, 23, 24, 25, 26)
    assert by_group[2].block_indices == (8,) and by_group[2].block_ids == (51,)
    refs = block_refs(model_groups, tokens, 1, range(3, 9))
    assert by_group[1].block_hashes == tuple(ref.block_hash for ref in refs)
    # A full-attention block the engine did not allocate makes the load impossible.
    scheduler.add_request("x")
    assert scheduler.lookup("x", tokens, 12).num_tokens == 24
    scheduler.allocated("x", [sw_ids, [*full_ids[:5], 0, *full_ids[6:]], mamba_ids], 24)
    (bad,) = scheduler.build_metadata(StepInput()).loads
    assert not bad.planned and bad.transfers == ()
    engine.worker.start_loads([bad])  # the worker reports it failed at once: recompute
    report = engine.worker.poll()
    (result,) = report.ranks[0].finished_loads
    assert result.outcome is LoadOutcome.UNPLANNED and not result.ok
    scheduler.process_report(report)
    assert scheduler.lookup("x", tokens, 12).num_tokens == 0  # recomputed, not retried
    close_engine(engine)
