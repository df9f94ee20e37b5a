"""The targets ``hybridkv bench`` checks, as ratios measured in the same run.

CLI process; pure functions over ``Summary``s. A target whose setups or
phases were not run is left out. No target is a test: the bench prints each
with its limit and whether it was met.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.cli.bench.report import Summary
from hybridkv.cli.bench.workloads import WorkloadKind


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    value: float
    limit: float
    at_most: bool
    """True: the value must be <= the limit; False: >= it."""

    @property
    def met(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def row(self) -> list[str]:
        sign = "<=" if self.at_most else ">="
        if math.isnan(self.value):  # 0 / 0: neither side had any, so nothing was shown
            return [self.name, "-", f"{sign} {self.limit:.3f}", "MISSED (0 / 0)"]
        return [self.name, f"{self.value:.3f}", f"{sign} {self.limit:.3f}", _verdict(self.met)]


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _find(summaries: Sequence[Summary], setup: str, phase: str) -> Summary | None:
    return next((s for s in summaries if s.setup == setup and s.phase == phase), None)


def _ratio(a: float, b: float) -> float:
    """``a / b``; infinite where only ``b`` is 0 (e.g. hits where the baseline had none),
    nan where both are."""
    if b:
        return a / b
    return math.inf if a > 0 else math.nan


def targets(kind: WorkloadKind, summaries: Sequence[Summary]) -> list[Target]:
    found: list[Target] = []
    if kind is WorkloadKind.RESTART:
        found += _restart_targets(summaries)
    elif kind is WorkloadKind.MULTI_TURN:
        found += _versus_alone(summaries, "cpu+disk", "run", ttft_limit=1 / 3, speedup=1.5)
    elif kind is WorkloadKind.SHARED:
        for s1 in summaries:
            s0 = _find(summaries, s1.setup, "engine0")
            if s1.phase != "engine1" or s0 is None or s1.setup == "alone":
                continue
            found.append(
                Target(
                    name=f"{s1.setup}: engine 1's hit rate / engine 0's (repeated prefixes)",
                    value=_ratio(_repeat_hit_rate(s1), _repeat_hit_rate(s0)),
                    limit=0.9,
                    at_most=False,
                )
            )
    return found


def _restart_targets(summaries: Sequence[Summary]) -> list[Target]:
    found = []
    for setup in ("cpu", "cpu+disk", "mooncake", "valkey"):
        tiers, own, cold = (_find(summaries, setup, p) for p in ("tiers", "engine-cache", "cold"))
        if tiers is None or own is None or cold is None:
            continue
        found += [
            _ttft_target(
                f"{setup}: TTFT p50 from the tiers / from the engine's own cache", tiers, own, 1.10
            ),
            _ttft_target(f"{setup}: TTFT p50 from the tiers / cold", tiers, cold, 0.05),
        ]
        restarted = _find(summaries, setup, "restarted")
        if restarted is not None and setup != "cpu":  # a CPU tier does not outlive its engine
            found.append(
                _ttft_target(f"{setup}: TTFT p50 after a restart / cold", restarted, cold, 0.15)
            )
    return found


def _ttft_target(name: str, ours: Summary, baseline: Summary, limit: float) -> Target:
    """``ours``' TTFT p50 over ``baseline``'s, at most ``limit``."""
    return Target(
        name=name,
        value=_ratio(ours.ttft_ms["p50"], baseline.ttft_ms["p50"]),
        limit=limit,
        at_most=True,
    )


def _versus_alone(
    summaries: Sequence[Summary], setup: str, phase: str, *, ttft_limit: float, speedup: float
) -> list[Target]:
    alone, tiered = _find(summaries, "alone", phase), _find(summaries, setup, phase)
    if alone is None or tiered is None:
        return []
    return [
        _ttft_target(f"{setup}: TTFT p50 / the engine alone's", tiered, alone, ttft_limit),
        Target(
            name=f"{setup}: generated tokens/s / the engine alone's",
            value=_ratio(tiered.output_tokens_per_s, alone.output_tokens_per_s),
            limit=speedup,
            at_most=False,
        ),
    ]


def _repeat_hit_rate(summary: Summary) -> float:
    """Cached tokens per reusable token (what an earlier request computed)."""
    return _ratio(summary.cached_tokens_of_repeats, summary.reusable_tokens)


CHAIN_OVER_LRU = 1.3
"""Cached tokens of an eviction policy over plain recency's, where it matters."""


def eviction_targets(summaries: Sequence[Summary]) -> list[Target]:
    """Per phase: chain-aware eviction (``cpu``) against plain recency (``cpu-lru``), and
    the reuse policies (``cpu+disk-reuse``) against LRU everything (``cpu+disk-lru``)."""
    found = []
    pairs = (("cpu", "cpu-lru", "chain eviction"), ("cpu+disk-reuse", "cpu+disk-lru", "reuse"))
    for setup, baseline, what in pairs:
        for ours in summaries:
            theirs = _find(summaries, baseline, ours.phase)
            if ours.setup != setup or theirs is None:
                continue
            found.append(
                Target(
                    name=f"{setup} ({ours.phase}): cached tokens, {what} / {baseline}'s",
                    value=_ratio(ours.cached_tokens, theirs.cached_tokens),
                    limit=CHAIN_OVER_LRU,
                    at_most=False,
                )
            )
    return found


def output_targets(summaries: Sequence[Summary]) -> list[Target]:
    """Zero outputs that differ from the engine alone's, per setup."""
    setups = dict.fromkeys(s.setup for s in summaries if s.outputs)
    return [
        Target(
            name=f"{setup}: outputs differing from the engine alone's",
            value=float(sum(s.outputs["differ"] for s in summaries if s.setup == setup)),
            limit=0.0,
            at_most=True,
        )
        for setup in setups
    ]
