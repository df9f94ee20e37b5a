"""Targets as ratios of the same run's summaries."""

from __future__ import annotations

from typing import Any

from hybridkv.cli.bench.report import Summary
from hybridkv.cli.bench.targets import eviction_targets, output_targets, targets
from hybridkv.cli.bench.workloads import WorkloadKind


def summary(setup: str, phase: str, ttft_p50: float, **kw: Any) -> Summary:
    fields: dict[str, Any] = dict(
        setup=setup, phase=phase, requests=1, ttft_ms={"p50": ttft_p50, "p90": 0, "p99": 0},
        latency_p50_ms=0.0, prompt_tokens_per_s=0.0, output_tokens_per_s=1.0,
        prompt_tokens=0, cached_tokens=0, hit_rate_by_source={}, loaded_blocks_by_group={},
        loaded_bytes=0, bytes_per_hit_token=0.0, recomputed_tokens=0, reusable_tokens=0,
        cached_tokens_of_repeats=0,
    )  # fmt: skip
    fields.update(kw)
    return Summary(**fields)


def by_name(found: list[Any]) -> dict[str, Any]:
    return {t.name: t for t in found}


def test_restart_targets_compare_phases_of_one_setup() -> None:
    summaries = [
        summary("alone", "cold", 5000), summary("alone", "engine-cache", 200),
        summary("cpu+disk", "cold", 5000), summary("cpu+disk", "engine-cache", 200),
        summary("cpu+disk", "tiers", 220), summary("cpu+disk", "restarted", 900),
        summary("cpu", "cold", 5000), summary("cpu", "engine-cache", 200),
        summary("cpu", "tiers", 240), summary("cpu", "restarted", 5000),
    ]  # fmt: skip
    found = by_name(targets(WorkloadKind.RESTART, summaries))
    own = found["cpu+disk: TTFT p50 from the tiers / from the engine's own cache"]
    assert own.value == 1.1 and own.met
    cold = found["cpu+disk: TTFT p50 from the tiers / cold"]
    assert cold.value == 220 / 5000 and cold.met
    restarted = found["cpu+disk: TTFT p50 after a restart / cold"]
    assert restarted.value == 0.18 and not restarted.met and restarted.row()[-1] == "MISSED"
    assert not found["cpu: TTFT p50 from the tiers / from the engine's own cache"].met
    # A CPU tier does not outlive its engine: no restart target for it, none for alone.
    assert "cpu: TTFT p50 after a restart / cold" not in found
    assert not any(name.startswith("alone") for name in found)


def test_multi_turn_targets_compare_with_the_engine_alone() -> None:
    summaries = [summary("alone", "run", 3000, output_tokens_per_s=10.0),
                 summary("cpu+disk", "run", 900, output_tokens_per_s=16.0)]  # fmt: skip
    found = by_name(targets(WorkloadKind.MULTI_TURN, summaries))
    assert found["cpu+disk: TTFT p50 / the engine alone's"].met
    speed = found["cpu+disk: generated tokens/s / the engine alone's"]
    assert speed.value == 1.6 and speed.met and speed.row()[2] == ">= 1.500"


def test_shared_target_is_engine_1s_hit_rate_over_engine_0s() -> None:
    summaries = [
        summary("mooncake", "engine0", 0, reusable_tokens=1000, cached_tokens_of_repeats=1000),
        summary("mooncake", "engine1", 0, reusable_tokens=2000, cached_tokens_of_repeats=1700),
    ]
    (target,) = targets(WorkloadKind.SHARED, summaries)
    assert target.value == 0.85 and not target.met


def test_outputs_target_counts_differences_per_setup() -> None:
    ok = {"match": 3, "near_tie": 1, "differ": 0, "not_compared": 0}
    bad = {"match": 2, "near_tie": 0, "differ": 2, "not_compared": 0}
    found = by_name(output_targets([
        summary("alone", "run", 1), summary("cpu", "a", 1, outputs=ok),
        summary("disk", "a", 1, outputs=ok), summary("disk", "b", 1, outputs=bad),
    ]))  # fmt: skip
    assert found["cpu: outputs differing from the engine alone's"].met
    assert found["disk: outputs differing from the engine alone's"].value == 2.0
    assert len(found) == 2


def test_eviction_targets_pair_each_policy_with_its_lru_per_phase() -> None:
    found = by_name(eviction_targets([
        summary("cpu", "run", 1, cached_tokens=260),
        summary("cpu-lru", "run", 1, cached_tokens=200),
        summary("cpu+disk-reuse", "run", 1, cached_tokens=500),
        summary("cpu+disk-lru", "run", 1, cached_tokens=400),
        summary("cpu+disk-reuse", "other", 1, cached_tokens=9),
    ]))  # fmt: skip
    chain = found["cpu (run): cached tokens, chain eviction / cpu-lru's"]
    reuse = found["cpu+disk-reuse (run): cached tokens, reuse / cpu+disk-lru's"]
    assert (chain.value, chain.met) == (1.3, True)
    assert (reuse.value, reuse.met) == (1.25, False)
    assert len(found) == 2, "a phase without its lru run has no target"


def test_a_baseline_without_hits_is_beaten_by_any_and_says_so_when_neither_hit() -> None:
    """Hits where LRU had none meet any ratio; neither hitting shows nothing, and is not
    met (the run did not show what the target asks)."""
    reuse = "cpu+disk-reuse (run): cached tokens, reuse / cpu+disk-lru's"
    beaten = by_name(eviction_targets([
        summary("cpu+disk-reuse", "run", 1, cached_tokens=300),
        summary("cpu+disk-lru", "run", 1, cached_tokens=0),
    ]))[reuse]  # fmt: skip
    assert beaten.value == float("inf") and beaten.met and beaten.row()[-1] == "met"
    neither = by_name(eviction_targets([
        summary("cpu+disk-reuse", "run", 1, cached_tokens=0),
        summary("cpu+disk-lru", "run", 1, cached_tokens=0),
    ]))[reuse]  # fmt: skip
    assert not neither.met
    assert neither.row()[1:] == ["-", ">= 1.300", "MISSED (0 / 0)"]
