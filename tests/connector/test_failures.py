"""Timeouts, cancellations, preemption and stale lookups: always recompute, never wrong KV."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from hybridkv.connector.metadata import BlockRef, LoadOutcome
from hybridkv.connector.setup import build_store
from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.check import assert_kv_matches_cold
from hybridkv.tools.sim.drive import run_to_end, wait_loaded
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import (
    GatedTier,
    block_keys,
    block_refs,
    disk_config,
    make_remote_lookup,
    store_prompt,
)

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


def gated_engine(
    tmp_path: Path, kinds: tuple[GroupKind, ...], *, load_timeout_s: float = 30.0
) -> tuple[SimEngine, GatedTier]:
    """An engine whose only tier is the real disk tier behind a gate on reads."""
    config = make_config(tmp_path)
    gated = GatedTier(DiskTier(disk_config(config)))
    store = TieredStore([gated])
    engine = make_engine(make_groups(kinds), config, store=store, load_timeout_s=load_timeout_s)
    return engine, gated


def load_rows(engine: SimEngine, req_id: str) -> dict[tuple[int, int], bytes]:
    """The bytes of every block a load of ``req_id`` targets, by (group, block id)."""
    assert engine.last_meta is not None
    (load,) = [x for x in engine.last_meta.loads if x.req_id == req_id]
    return {
        (t.group_id, b): engine.block_bytes(t.group_id, b)
        for t in load.transfers
        for b in t.block_ids
    }


def test_load_timeout_reports_every_block_and_never_writes_late_bytes(tmp_path: Path) -> None:
    kinds = (SW, FULL)
    tokens = prompt(37)
    store_prompt(make_groups(kinds), tmp_path, tokens, chunk=12)
    engine, gated = gated_engine(tmp_path, kinds, load_timeout_s=0.2)
    assert engine.add("t", tokens) == 36
    engine.step({})  # the load is submitted and blocks in the tier
    before = load_rows(engine, "t")
    planned = {t.group_id: set(t.block_ids) for t in engine.last_meta.loads[0].transfers}  # type: ignore[union-attr]
    time.sleep(0.3)
    engine.step({})
    req = engine.requests["t"]
    (result,) = engine.finished_loads()
    assert result.outcome is LoadOutcome.TIMED_OUT and not result.ok
    assert {g: set(ids) for g, ids in enumerate(result.failed_block_ids) if ids} == planned
    assert req.num_computed == 0  # starts over; a timed-out tier is not asked again
    gated.release()  # the tier answers now, too late
    engine.worker.wait_idle(5)
    assert load_rows_now(engine, before) == before, "late bytes were scattered"
    assert engine.worker.stats.loads[LoadOutcome.TIMED_OUT] == 1
    run_to_end(engine, "t", chunk=12)  # recomputed, no second load
    assert_kv_matches_cold(engine, req, 37)
    assert engine.scheduler.stats.loads_planned == 1
    close_engine(engine)


def load_rows_now(
    engine: SimEngine, before: dict[tuple[int, int], bytes]
) -> dict[tuple[int, int], bytes]:
    return {(g, b): engine.block_bytes(g, b) for g, b in before}


def test_finished_request_holds_its_blocks_until_its_load_is_cancelled(tmp_path: Path) -> None:
    kinds = (MAMBA, FULL)
    tokens = prompt(37)
    store_prompt(make_groups(kinds), tmp_path, tokens, chunk=12)
    engine, gated = gated_engine(tmp_path, kinds)
    assert engine.add("c", tokens) == 36
    engine.step({})
    before = load_rows(engine, "c")
    assert engine.finish("c") is True  # aborted while loading: blocks stay allocated
    assert "c" in engine.requests
    engine.step({})  # the cancel reaches the worker
    (result,) = engine.finished_loads()
    assert result.outcome is LoadOutcome.CANCELLED and not result.ok
    assert "c" not in engine.requests  # freed once the worker reported
    assert engine.scheduler.num_requests == 0
    gated.release()
    engine.worker.wait_idle(5)
    assert load_rows_now(engine, before) == before
    assert engine.worker.stats.loads[LoadOutcome.CANCELLED] == 1
    close_engine(engine)


def test_preempted_request_resumes_from_its_own_stored_blocks(tmp_path: Path) -> None:
    model_groups = make_groups((SW, FULL, MAMBA))
    engine = make_engine(model_groups, make_config(tmp_path))
    tokens = prompt(40)
    assert engine.add("p", tokens) == 0
    engine.step({"p": 12})
    engine.step({"p": 12})  # 24 tokens computed and stored
    engine.settle()
    engine.preempt("p")
    engine.step({})  # the scheduler forgets the old block ids
    assert engine.readmit("p") == 24
    req = wait_loaded(engine, "p")
    assert req.outcomes[-1].ok
    assert_kv_matches_cold(engine, req, 24)
    run_to_end(engine, "p", chunk=12)
    assert_kv_matches_cold(engine, req, 40)
    stored = engine.reported("stored")
    assert len(stored) == len(set(stored)), "a block was stored twice"
    close_engine(engine)


def test_other_process_lookup_sees_reported_cpu_keys_and_drops_bad_ones(tmp_path: Path) -> None:
    model_groups = make_groups((MAMBA, FULL))
    config = make_config(tmp_path, tiers=[{"kind": "cpu", "capacity_bytes": "4MiB"}])
    lookup, opened = make_remote_lookup(config, model_groups)
    assert opened == [] and not lookup.complete
    store = build_store(config.tier_configs, config)
    engine = make_engine(model_groups, config, store=store, lookup=lookup)
    tokens = prompt(37)
    engine.add("a", tokens)
    run_to_end(engine, "a", chunk=12)
    engine.settle()
    engine.finish("a")
    assert len(lookup.record) > 0  # learnt from the worker's reports only
    # The worker's private tier loses blocks (an eviction the scheduler cannot see).
    lost = block_keys(model_groups, tokens, 1, [3])
    assert store.delete_many(lost) == 1
    assert engine.add("b", tokens) == 36  # the stale record still offers them
    req = wait_loaded(engine, "b")
    assert req.outcomes[0].outcome is LoadOutcome.FAILED
    assert lookup.contains_many(lost) == [False]  # never offered again
    req = wait_loaded(engine, "b")  # the retry loads what is still there: 12 tokens
    assert req.outcomes[-1].ok and req.num_computed == 12
    run_to_end(engine, "b", chunk=12)
    assert_kv_matches_cold(engine, req, 37)
    # b recomputed block 3 and stored it again: the whole prompt hits once more.
    assert engine.add("c", tokens) == 36
    req = wait_loaded(engine, "c")
    assert req.outcomes[-1].ok
    assert_kv_matches_cold(engine, req, 36)
    close_engine(engine)


def assert_dropped_then_sent_again(
    engine: SimEngine, tokens: list[int], free_the_room: Callable[[], None]
) -> None:
    """The first step's 4 blocks find no room and are reported dropped; once the room is
    back, a request computing the same blocks stores them."""
    model_groups = engine.model_groups
    engine.add("a", tokens)
    engine.step({"a": 16})
    dropped = engine.reported("dropped")
    assert dropped == block_refs(model_groups, tokens, 0, range(4))
    assert engine.worker.stats.groups[0].store_dropped_blocks == 4
    free_the_room()
    assert engine.finish("a") is False
    engine.add("b", tokens)  # computes the same blocks: they are sent again
    run_to_end(engine, "b", chunk=16)
    engine.settle()
    assert set(dropped) <= set(engine.reported("stored"))
    close_engine(engine)


def test_store_backpressure_drops_blocks_and_sends_them_again(tmp_path: Path) -> None:
    """Staging full (a first tier without memory of its own: stores go through staging)."""
    model_groups = make_groups((FULL,))
    config = make_config(tmp_path)
    engine = make_engine(model_groups, config, store=TieredStore([DiskTier(disk_config(config))]))
    arena = engine.worker.engine.arena  # type: ignore[union-attr]
    held = arena.allocate(arena.total_bytes)  # something else fills the staging arena
    assert held is not None
    assert_dropped_then_sent_again(engine, prompt(33), lambda: arena.free(held))


def test_a_full_cpu_tier_drops_blocks_and_they_are_sent_again(tmp_path: Path) -> None:
    """Stores go straight into the CPU tier's memory; while every byte of it is reserved
    by someone else, a store has no room there and its blocks are reported dropped."""
    model_groups = make_groups((FULL,))
    block_bytes = model_groups.groups[0].block_bytes
    cpu = CpuTier(CpuConfig(capacity_bytes=4 * block_bytes, pin_memory=False))
    engine = make_engine(model_groups, make_config(tmp_path), store=TieredStore([cpu]))
    memory = cpu.memory()
    assert memory is not None
    others = [StoreKey(f"other/{i}") for i in range(4)]
    assert all(isinstance(r, int) for r in memory.reserve_many(others, [block_bytes] * 4))
    assert_dropped_then_sent_again(
        engine, prompt(33), lambda: memory.commit_many(others, [False] * 4)
    )


def _disk_engine(
    tmp_path: Path, kinds: tuple[GroupKind, ...]
) -> tuple[ModelGroups, DiskTier, SimEngine]:
    """An engine whose only tier is the real disk tier, and that tier."""
    model_groups = make_groups(kinds)
    config = make_config(tmp_path)
    tier = DiskTier(disk_config(config))
    return model_groups, tier, make_engine(model_groups, config, store=TieredStore([tier]))


def _computed(engine: SimEngine, req_id: str) -> list[BlockRef]:
    """Run an added request to its end and settle; the blocks it reported stored."""
    num_before = len(engine.reported("stored"))
    run_to_end(engine, req_id, chunk=16)
    engine.settle()
    assert engine.finish(req_id) is False
    return engine.reported("stored")[num_before:]


def test_blocks_gone_from_every_tier_are_sent_again(tmp_path: Path) -> None:
    model_groups, tier, engine = _disk_engine(tmp_path, (FULL,))
    tokens = prompt(33)
    engine.add("a", tokens)
    stored = _computed(engine, "a")
    num_blocks = len(stored)
    assert num_blocks and set(stored) == set(block_refs(model_groups, tokens, 0, range(num_blocks)))
    # Gone from outside (a pool restarted empty, files removed): nothing reports it.
    keys = block_keys(model_groups, tokens, 0, range(num_blocks))
    assert tier.delete_many(keys) == num_blocks
    assert engine.add("b", tokens) == 0  # the lookup finds none of them
    again = _computed(engine, "b")
    assert sorted(again) == sorted(stored), "recomputed blocks are stored again"
    assert engine.add("c", tokens) == 32
    close_engine(engine)


def test_every_group_is_sent_again_when_the_first_misses(tmp_path: Path) -> None:
    # The lookup stops at the full group's first miss and never asks about the sliding
    # window's blocks; they were lost too and must be stored again with the full ones.
    model_groups, tier, engine = _disk_engine(tmp_path, (FULL, SW))
    tokens = prompt(33)
    engine.add("a", tokens)
    stored = _computed(engine, "a")
    assert {ref.group_id for ref in stored} == {0, 1}, stored
    for group_id in (0, 1):
        tier.delete_many(block_keys(model_groups, tokens, group_id, range(8)))
    assert engine.add("b", tokens) == 0
    again = _computed(engine, "b")
    assert sorted(again) == sorted(stored), "both groups' recomputed blocks are stored again"
    assert engine.add("c", tokens) == 32
    close_engine(engine)


def test_load_seconds_end_when_the_last_block_lands_not_at_the_next_poll(
    tmp_path: Path,
) -> None:
    """vLLM polls the worker once a step; a load that lands early in a long step is timed
    to its landing, not to the poll that sees it."""
    kinds = (SW, FULL)
    tokens = prompt(37)
    store_prompt(make_groups(kinds), tmp_path, tokens, chunk=12)
    engine, gated = gated_engine(tmp_path, kinds)
    assert engine.add("s", tokens) == 36
    engine.step({})  # the load is submitted and waits at the gate
    time.sleep(0.2)
    gated.release()
    assert engine.worker.wait_idle(5)
    time.sleep(0.6)  # a long step: the load landed before it ended
    engine.step({})
    (result,) = engine.finished_loads()
    assert result.ok
    seconds = engine.worker.stats.load_seconds_sum
    assert 0.2 <= seconds < 0.6, seconds
    close_engine(engine)
