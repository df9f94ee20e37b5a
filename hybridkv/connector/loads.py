"""Turning a hit into the load of the blocks the engine allocated for it.

Scheduler process; no I/O. Once the engine allocated blocks for a hit,
``plan_load`` names, per group, the blocks to load past what the engine holds
and the engine block each lands in (for a Mamba group the column of the hit's
last block: where the engine reads a resumed request's state).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hybridkv.connector.metadata import BlockTransfer, LoadPlan
from hybridkv.connector.requests import RequestState
from hybridkv.connector.stores import make_transfer
from hybridkv.groups import ModelGroups
from hybridkv.groups.kinds import rules_for
from hybridkv.hits import Hit
from hybridkv.keys import KeyBuilder

logger = logging.getLogger(__name__)


def plan_load(
    model_groups: ModelGroups,
    builder: KeyBuilder,
    req_id: str,
    st: RequestState,
    block_ids: Sequence[Sequence[int]],
    target: int,
) -> LoadPlan:
    """The load that brings ``req_id`` from ``st.hit_base_tokens`` to ``target`` tokens
    into ``block_ids`` (per group); unplanned when the hit or the allocation does not
    allow it (the engine then recomputes)."""
    base, hit = st.hit_base_tokens, st.hit
    unplanned = LoadPlan(
        req_id=req_id, num_tokens=target, base_tokens=base, transfers=(), planned=False
    )
    if hit is None or hit.num_tokens != target or len(block_ids) != model_groups.num_groups:
        logger.warning(
            "request %s: the engine asked to load up to token %d but the lookup found %s; "
            "recomputing instead",
            req_id,
            target,
            None if hit is None else hit.num_tokens,
        )
        return unplanned
    transfers = _transfers(model_groups, builder, req_id, st, block_ids, base, hit)
    if transfers is None:
        return unplanned
    return LoadPlan(
        req_id=req_id,
        num_tokens=target,
        base_tokens=base,
        transfers=tuple(transfers),
        tier_index=st.hit_tier,
    )


def _transfers(
    model_groups: ModelGroups,
    builder: KeyBuilder,
    req_id: str,
    st: RequestState,
    block_ids: Sequence[Sequence[int]],
    base: int,
    hit: Hit,
) -> list[BlockTransfer] | None:
    transfers: list[BlockTransfer] = []
    for group_id, group in enumerate(model_groups.groups):
        ids = block_ids[group_id]
        first = base // group.block_size  # the engine holds the blocks before
        indices = [i for i in hit.blocks_to_load[group_id] if i >= first]
        missing = [i for i in indices if i >= len(ids) or ids[i] == 0]
        if missing and rules_for(group.kind).needs_every_block:
            logger.warning(
                "request %s: group %d needs blocks %s the engine did not allocate; "
                "recomputing instead",
                req_id,
                group_id,
                missing,
            )
            return None
        kept = [i for i in indices if i not in missing]
        if kept:
            hashes = builder.block_hashes(group_id, st.hasher.block_hashes, kept)
            transfers.append(make_transfer(group_id, hashes, [ids[i] for i in kept], kept))
    return transfers
