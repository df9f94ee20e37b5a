"""Which tier serves a load: per block (the cheapest holding each block) or one per request.

Pure functions, any process. A tier's ``load_weight`` is its relative cost of
loading a block (lower is cheaper). ``WHOLE_REQUEST`` picks the tier with the
most ``hit_tokens / load_weight``: vLLM MultiConnector's ``hit_tokens x
weight`` rule with its preference weight = 1 / load_weight, so with equal
hits both modes prefer the same (cheapest) tier.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class Selection(enum.Enum):
    PER_BLOCK = "per_block"
    WHOLE_REQUEST = "whole_request"


def pick_whole_request_tier(
    hit_tokens_per_tier: Sequence[int], load_weights: Sequence[float]
) -> int | None:
    """Index of the tier with the most ``hit_tokens / load_weight``; None if no tier hits."""
    if len(hit_tokens_per_tier) != len(load_weights):
        raise ValueError(
            f"{len(hit_tokens_per_tier)} hit counts but {len(load_weights)} weights; "
            "give one of each per tier"
        )
    best: int | None = None
    best_score = 0.0
    for index, (hit_tokens, weight) in enumerate(
        zip(hit_tokens_per_tier, load_weights, strict=True)
    ):
        if weight <= 0:
            raise ValueError(f"load_weights[{index}]={weight}: must be > 0")
        if hit_tokens > 0 and (best is None or hit_tokens / weight > best_score):
            best, best_score = index, hit_tokens / weight
    return best
