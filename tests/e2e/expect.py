"""What the end-to-end tests expect, computed from what the engine itself reported.

Block sizes, page sizes and the hit alignment are the engine's choice and
differ between CPUs (vLLM's CPU kernels pick them), so every expectation that
depends on them takes the ``groups`` record of the engine under test (its
``kv_cache_config``), never a constant. Also: readers of the connector's
metrics and the output comparison every test uses.
"""

from __future__ import annotations

import math
from typing import Any

from hybridkv.tools.models import TinyModel
from tests.e2e.compare import LOGPROB_TOLERANCE, output_problems
from tests.e2e.harness import PlanRun

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
"""Counted when the scheduler accepts a hit; a load that fails later stays counted."""
EXTERNAL_PREFILLED = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
"""Counted per finished prefill: tokens that really came from the connector."""


def full_hit_tokens(num_prompt_tokens: int, facts: dict[str, Any]) -> int:
    """The longest hit a prompt can have: aligned, one token left to compute."""
    align = int(facts["alignment_tokens"])
    return (num_prompt_tokens - 1) // align * align


def assert_full_hits(
    step: dict[str, Any], facts: dict[str, Any], where: str | None = None
) -> list[int]:
    """Every prompt of ``step`` hit as far as the engine's alignment allows
    (``full_hit_tokens``); those hits, one per prompt."""
    expected = [full_hit_tokens(n, facts) for n in step["num_prompt_tokens"]]
    assert step["num_cached_tokens"] == expected, where or describe(step)
    return expected


def assert_loaded_from_tiers(
    step: dict[str, Any],
    facts: dict[str, Any],
    where: str | None = None,
    *,
    tier: str | None = None,
) -> list[int]:
    """``assert_full_hits``, every hit counted by vLLM as external and loaded by one
    finished load per prompt, none failed (with ``tier``: every loaded block read from
    that tier); the hits."""
    where = where or describe(step)
    expected = assert_full_hits(step, facts, where)
    assert step["metrics"].get(EXTERNAL_HITS, 0.0) == sum(expected) > 0, where
    stats = step["connector"]
    assert counter(stats, "loads", outcome="ok") == len(expected), where
    assert counter(stats, "loads", outcome="failed") == 0, where
    if tier is not None:
        assert counter(stats, "tier_reads", tier=tier) == summed(stats, "loaded_blocks") > 0
    return expected


def needed_blocks(facts: dict[str, Any], hit_tokens: int) -> list[int]:
    """Blocks per group a hybrid-aware load moves to resume at ``hit_tokens``.

    Full attention: every block before the hit; sliding window: the blocks
    holding the last ``window - 1`` tokens (at least one); Mamba: the one
    block with the state at the hit. The rules vLLM's own prefix cache uses.
    """
    needed = []
    for group in facts["groups"]:
        block_size = group["block_size"]
        num_hit_blocks = hit_tokens // block_size
        if group["kind"] == "full":
            needed.append(num_hit_blocks)
        elif group["kind"] == "sliding_window":
            window_blocks = max(1, math.ceil((group["sliding_window"] - 1) / block_size))
            needed.append(min(num_hit_blocks, window_blocks))
        else:
            needed.append(1 if num_hit_blocks else 0)
    return needed


def moved_bytes_per_block(facts: dict[str, Any]) -> list[int]:
    """Bytes one block of each group carries: its layers' pages, a Mamba layer's state
    unpadded (vLLM pads it to the attention page; the padding is not data). The state's
    size is the engine's: its dtypes differ between CPUs."""
    return [g["real_page_size_bytes"] * len(g["layer_names"]) for g in facts["groups"]]


def engine_facts(run: PlanRun, engine: str) -> dict[str, Any]:
    """The KV cache facts an engine recorded first thing (see ``scenarios.engine``)."""
    record = run.op("groups", engine=engine)
    return {key: record[key] for key in ("groups", "alignment_tokens", "hash_block_size")}


def counter(stats: dict[str, float], name: str, **labels: str) -> float:
    """A connector metric from a snapshot, e.g. ``counter(s, "loads", outcome="ok")``."""
    base = f"hybridkv_{name}"
    suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return stats.get(f"{base}{{{suffix}}}" if suffix else base, 0.0)


def summed(stats: dict[str, float], name: str) -> float:
    """A connector metric summed over all its labels (groups, tiers, outcomes)."""
    base = f"hybridkv_{name}"
    return sum(v for k, v in stats.items() if k == base or k.startswith(base + "{"))


def group_counter(stats: dict[str, float], name: str, facts: dict[str, Any]) -> list[float]:
    """A per-group metric, one value per group of the engine."""
    return [
        counter(stats, name, group=str(g), kind=group["kind"])
        for g, group in enumerate(facts["groups"])
    ]


def describe(step: dict[str, Any]) -> str:
    return (
        f"num_cached_tokens={step['num_cached_tokens']} metrics={step['metrics']} "
        f"connector={step['connector']}"
    )


def assert_same_outputs(
    step: dict[str, Any], reference: dict[str, Any], model: TinyModel, what: str
) -> None:
    """Greedy tokens equal (float32) or equal within bfloat16 noise (see ``compare``)."""
    exact = model.dtype == "float32"
    problems = output_problems(step, reference, exact=exact)
    rule = "identical" if exact else f"within {LOGPROB_TOLERANCE} nats"
    assert not problems, (
        f"{what}: outputs not {rule} to the run without the connector:\n" + "\n".join(problems)
    )
