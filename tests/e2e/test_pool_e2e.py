"""Engines in separate processes sharing a real Mooncake pool on 127.0.0.1.

Sharing (Gemma 3 and Qwen3-Next tiny models): process A (a CPU tier in front
of the pool, so the pool is filled by the write-back) stores its prompts;
process B, whose only local tier is a fresh CPU tier, loads every hit from
the pool and gives the greedy tokens of a run without the connector.

Faults (Gemma 3, a pool of its own): process C stores and hits through the
pool, then its storage daemon is SIGKILLed while C keeps serving: loads fail
or miss, are counted, and the tokens are recomputed, still the same. After
the daemon restarts the pool is empty (the data lived in the daemon): one run
stores again and the next one hits.

Every engine runs in its own ``tests.e2e.driver`` process; the pools are
children of this one. ``MC_TCP_BIND_ADDRESS=127.0.0.1`` everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind
from hybridkv.tools.pool import LocalPool
from tests.e2e.expect import (
    EXTERNAL_HITS,
    assert_loaded_from_tiers,
    assert_same_outputs,
    counter,
    describe,
    engine_facts,
    summed,
)
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, concurrent_prompts, engine, generate
from tests.support.servers import MIB, MooncakePool, wait_for

pytestmark = pytest.mark.slow

SHARE_KINDS = (TinyModelKind.GEMMA3, TinyModelKind.QWEN3_NEXT)
"""Sliding window + full attention; Mamba-style state + full attention."""
FAULT_KIND = TinyModelKind.GEMMA3
CPU_TIER = {"kind": "cpu", "capacity_bytes": 64 * MIB}
FORGET_TIMEOUT_S = 30.0
"""How long the master may take to drop a dead daemon's memory (its TTL is 2 s)."""
POST_KILL_LABELS = ("killed", "during", "after")

_fault_runs: dict[int, PlanRun] = {}
"""The fault run per pool (keyed by master port): it kills the daemon, so it runs once."""
_restarted: set[int] = set()


@pytest.fixture(scope="module")
def shared_pool() -> Iterator[LocalPool]:
    with MooncakePool(segment_bytes=128 * MIB, client_ttl_s=2) as running:
        yield running


@pytest.fixture(scope="module")
def fault_pool() -> Iterator[LocalPool]:
    with MooncakePool(segment_bytes=128 * MIB, client_ttl_s=2) as running:
        yield running


def _ok(run: PlanRun) -> PlanRun:
    assert run.returncode == 0, run.describe_failure()
    return run


def _integrity(run: PlanRun) -> dict[str, str]:
    return {r["engine"]: r["integrity"] for r in run.records if r.get("op") == "integrity"}


def _store(harness: Harness, pool: LocalPool, kind: TinyModelKind) -> PlanRun:
    """Process A: first the reference engine without the connector (base prompts,
    and for Gemma the concurrent ones too), then engine A (CPU tier + pool) whose
    cold run stores."""
    model = harness.model(kind)
    prompts = base_prompts(model.vocab_size)
    ref_steps = [generate("cold", prompts)]
    if kind is FAULT_KIND:
        ref_steps += [RESET, generate("concurrent", concurrent_prompts(model.vocab_size))]
    tiers = [CPU_TIER, *pool.tier_configs()]
    plan = [
        engine("ref", model, ref_steps),
        engine("A", model, [generate("cold", prompts)], {"tiers": tiers}),
    ]
    return _ok(harness.run(f"pool-store-{kind.value}-{pool.ports['master']}", plan))


def _share(harness: Harness, pool: LocalPool, kind: TinyModelKind) -> PlanRun:
    """Process B: a fresh, empty CPU tier + the pool A filled; no disk tier."""
    _store(harness, pool, kind)
    model = harness.model(kind)
    tiers = [CPU_TIER, *pool.tier_configs()]
    steps = [generate("shared", base_prompts(model.vocab_size))]
    plan = [engine("B", model, steps, {"tiers": tiers})]
    return _ok(harness.run(f"pool-share-{kind.value}-{pool.ports['master']}", plan))


def _reference(harness: Harness, pool: LocalPool, kind: TinyModelKind, label: str) -> Any:
    return _store(harness, pool, kind).step("ref", label)


def _fault(harness: Harness, pool: LocalPool) -> PlanRun:
    """Process C (the pool its only tier): stores, hits, then the daemon is killed as
    soon as the "before" step is recorded, while C serves the "killed" step (new
    and shared prefixes), "during" and "after" (the stored prompts again)."""
    port = pool.ports["master"]
    if port in _fault_runs:
        return _fault_runs[port]
    model = harness.model(FAULT_KIND)
    prompts = base_prompts(model.vocab_size)
    steps = [
        generate("store", prompts),
        RESET,
        generate("before", prompts),
        RESET,
        generate("killed", concurrent_prompts(model.vocab_size)),
        RESET,
        generate("during", prompts),
        RESET,
        generate("after", prompts),
    ]
    name = f"pool-fault-{port}"
    plan = [engine("C", model, steps, {"tiers": pool.tier_configs()})]
    results = harness.work_dir / f"{name}.results.jsonl"
    outcome: dict[str, PlanRun] = {}
    worker = threading.Thread(target=lambda: outcome.update(run=harness.run(name, plan)))
    worker.start()
    try:
        wait_for(
            lambda: (
                not worker.is_alive()
                or (results.exists() and '"label": "before"' in results.read_text())
            ),
            timeout_s=420,
            interval_s=0.02,
        )
    finally:
        pool.kill_daemon()  # also when the wait failed: the worker must not hang
        worker.join()
    _fault_runs[port] = outcome["run"]
    return _ok(outcome["run"])


def _recover(harness: Harness, pool: LocalPool) -> PlanRun:
    """Process D (the pool its only tier), after the daemon restarted empty: one run
    stores, the next (vLLM's cache reset and zeroed) hits."""
    _fault(harness, pool)
    port = pool.ports["master"]
    if port not in _restarted:
        _restarted.add(port)
        # The restarted daemon must not find its old objects listed.
        wait_for(lambda: not pool.status()["pool"]["total_capacity_bytes"], timeout_s=30)
        pool.restart_daemon()
    model = harness.model(FAULT_KIND)
    prompts = base_prompts(model.vocab_size)
    steps = [generate("restore", prompts), RESET, generate("again", prompts)]
    plan = [engine("D", model, steps, {"tiers": pool.tier_configs()})]
    return _ok(harness.run(f"pool-recover-{port}", plan))


def _assert_full_pool_hit(run: PlanRun, engine_label: str, step_label: str) -> None:
    """Every prompt resumed from the pool at its last aligned block."""
    step = run.step(engine_label, step_label)
    facts = engine_facts(run, engine_label)
    where = f"{engine_label}/{step_label}: {describe(step)}"
    expected = assert_loaded_from_tiers(step, facts, where, tier="mooncake")
    stats = step["connector"]
    assert counter(stats, "hit_tokens") == sum(expected), where
    assert counter(stats, "tier_read_bytes", tier="mooncake") == summed(stats, "loaded_bytes")


# -- sharing ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SHARE_KINDS, ids=lambda k: k.value)
def test_cold_run_stores_into_the_pool(
    kind: TinyModelKind, harness: Harness, shared_pool: LocalPool
) -> None:
    run = _store(harness, shared_pool, kind)
    cold = run.step("A", "cold")
    where = describe(cold)
    model = harness.model(kind)
    assert_same_outputs(cold, _reference(harness, shared_pool, kind, "cold"), model, "cold run")
    assert cold["metrics"].get(EXTERNAL_HITS, 0.0) == 0, where
    stored = summed(cold["connector"], "stored_blocks")
    assert stored > 0 and summed(cold["connector"], "store_dropped_blocks") == 0, where
    # The write-back copied every stored block on to the pool (it may finish after the
    # last engine step, so the counters are read after waiting for it).
    (settled,) = (r for r in run.records if r.get("op") == "integrity")
    assert settled["flushed"], settled
    totals = settled["counters"]
    assert sum(v for k, v in totals.items() if k.startswith("stored_blocks{")) == stored
    assert totals["tier_writes{tier=mooncake}"] == stored, settled
    assert shared_pool.status()["pool"]["key_count"], shared_pool.status()
    assert _integrity(run) == {"A": "ok"}


@pytest.mark.parametrize("kind", SHARE_KINDS, ids=lambda k: k.value)
def test_second_process_loads_from_the_pool(
    kind: TinyModelKind, harness: Harness, shared_pool: LocalPool
) -> None:
    model = harness.model(kind)
    run = _share(harness, shared_pool, kind)
    step = run.step("B", "shared")
    reference = _reference(harness, shared_pool, kind, "cold")
    assert_same_outputs(step, reference, model, "engine B from the pool")
    _assert_full_pool_hit(run, "B", "shared")
    # B's CPU tier started empty: nothing came from it.
    assert counter(step["connector"], "tier_reads", tier="cpu") == 0, describe(step)
    assert _integrity(run) == {"B": "ok"}


# -- faults -----------------------------------------------------------------------------


def test_killed_daemon_costs_hits_not_correctness(
    harness: Harness, shared_pool: LocalPool, fault_pool: LocalPool
) -> None:
    model = harness.model(FAULT_KIND)
    run = _fault(harness, fault_pool)
    cold = _reference(harness, shared_pool, FAULT_KIND, "cold")
    concurrent = _reference(harness, shared_pool, FAULT_KIND, "concurrent")
    assert_same_outputs(run.step("C", "store"), cold, model, "storing run")
    before = run.step("C", "before")
    assert_same_outputs(before, cold, model, "before the kill")
    _assert_full_pool_hit(run, "C", "before")
    totals = {"failed": 0.0, "misses": 0.0, "dropped": 0.0}
    for label in POST_KILL_LABELS:
        step = run.step("C", label)
        where = f"{label}: {describe(step)}"
        want = concurrent if label == "killed" else cold
        assert_same_outputs(step, want, model, f"{label} (daemon dead)")
        stats = step["connector"]
        # Nothing can come from a dead daemon: every hit the lookup still saw failed or
        # timed out (counted, recomputed), or the master had dropped the objects (counted
        # miss). A load waits for stores of the same blocks (read-your-writes), and
        # those stores may each wait op_timeout_s on the dead daemon: on a busy machine
        # that outlasts the load timeout.
        assert counter(stats, "loads", outcome="ok") == 0, where
        assert counter(stats, "tier_read_bytes", tier="mooncake") == 0, where
        failed = counter(stats, "loads", outcome="failed")
        failed += counter(stats, "loads", outcome="timed_out")
        assert failed == summed(stats, "loads"), where
        if failed == 0:
            assert counter(stats, "hit_tokens") == 0, where
            assert step["metrics"].get(EXTERNAL_HITS, 0.0) == 0, where
            assert step["num_cached_tokens"] == [0] * len(step["num_cached_tokens"]), where
        totals["failed"] += failed
        lookups = counter(stats, "tier_lookup_keys", tier="mooncake")
        totals["misses"] += lookups - counter(stats, "tier_hits", tier="mooncake")
        totals["misses"] += counter(stats, "tier_errors", tier="mooncake")
        totals["dropped"] += summed(stats, "store_dropped_blocks")
    # The faults were seen and counted: failed loads or misses, and stores refused.
    assert totals["failed"] + totals["misses"] > 0, totals
    assert totals["dropped"] > 0, totals
    assert _integrity(run) == {"C": "ok"}


def test_restarted_daemon_stores_and_hits_again(
    harness: Harness, shared_pool: LocalPool, fault_pool: LocalPool
) -> None:
    model = harness.model(FAULT_KIND)
    run = _recover(harness, fault_pool)
    cold = _reference(harness, shared_pool, FAULT_KIND, "cold")
    restore = run.step("D", "restore")
    where = describe(restore)
    assert_same_outputs(restore, cold, model, "after the restart")
    # The restarted daemon came back empty: nothing to hit, everything stored again.
    assert restore["metrics"].get(EXTERNAL_HITS, 0.0) == 0, where
    stored = summed(restore["connector"], "stored_blocks")
    assert stored > 0 and summed(restore["connector"], "store_dropped_blocks") == 0, where
    assert counter(restore["connector"], "tier_writes", tier="mooncake") == stored, where
    again = run.step("D", "again")
    assert_same_outputs(again, cold, model, "hit after the restart")
    _assert_full_pool_hit(run, "D", "again")
    assert _integrity(run) == {"D": "ok"}
