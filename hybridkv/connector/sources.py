"""Which tiers serve a planned load: its tokens, split by the bytes each tier serves.

Scheduler process; for metrics only (an engine asks after planning a load). Each
block goes to the cheapest tier holding it, and blocks still being stored to the
first tier count for it; a load's tokens are split in proportion to the bytes
each tier serves. Costs one lookup per tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.connector.lookup import KeyLookup
from hybridkv.connector.metadata import BlockRef, LoadPlan
from hybridkv.connector.search import HitSearch


def hit_sources(
    plan: LoadPlan,
    view: KeyLookup,
    search: HitSearch,
    is_storing: Callable[[BlockRef], bool],
) -> dict[int, int]:
    """Tokens ``plan`` loads, by the tier (index) serving them ({} for none).

    ``search``: the engine's ranks and their keys (each group is asked of the first
    rank holding it); ``is_storing``: whether a block is still being stored.
    """
    ranks, builders = search.ranks, search.builders
    if not plan.planned or plan.num_tokens <= plan.base_tokens:
        return {}
    num_tokens = plan.num_tokens - plan.base_tokens
    if plan.tier_index is not None:
        return {plan.tier_index: num_tokens}
    order = sorted(range(view.num_tiers), key=lambda i: (view.load_weights[i], i))
    served = [0] * view.num_tiers
    for t in plan.transfers:
        block_bytes = ranks.block_bytes((t.group_id,))
        rank = ranks.holders[t.group_id][0]
        todo = [h for h in t.block_hashes if not is_storing(BlockRef(t.group_id, h))]
        served[0] += (len(t.block_hashes) - len(todo)) * block_bytes
        for tier in order:
            if not todo:
                break
            keys = builders[rank].keys_of(t.group_id, todo)
            found = view.contains_many(keys, rank=rank, tier_index=tier)
            served[tier] += sum(found) * block_bytes
            todo = [h for h, hit in zip(todo, found, strict=True) if not hit]
        served[order[0]] += len(todo) * block_bytes  # gone since the lookup: unknown
    return _split(num_tokens, served)


def _split(total: int, weights: Sequence[int]) -> dict[int, int]:
    """``total`` split in proportion to ``weights`` (largest remainders), summing exactly."""
    weight = sum(weights)
    if weight == 0:
        return {0: total}
    shares = [total * w // weight for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: -(total * weights[i] % weight))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return {i: share for i, share in enumerate(shares) if share}
