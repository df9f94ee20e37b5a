"""Building the connector's two sides from the user's config and the engine's facts.

Any process. An engine adapter reads ``EngineFacts`` once and calls
``build_scheduler`` (scheduler process) or ``build_worker`` (each worker
process, one per tensor-parallel rank). A worker registers its store in its
process; a scheduler in the same process (one rank) then looks up hits in
that very store. Otherwise the scheduler opens lookup-only instances of the
tiers other processes can see (each rank's), and answers for worker-private
tiers (CPU memory) from the keys the workers report stored.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.lookup import KeyLookup, LookupView, TierSlice
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.schema import ConfigError
from hybridkv.spec import KVLayoutSpec
from hybridkv.spec.kinds import GroupKind, rules_for
from hybridkv.tiers.base import Tier, TierReach
from hybridkv.tiers.registry import TierConfig, build_tier, build_tiers
from hybridkv.tiers.tiered.store import TieredStore

logger = logging.getLogger(__name__)

_LOCAL_STORES: weakref.WeakValueDictionary[str, TieredStore] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """What the connector needs to know about the engine, read once by its adapter."""

    layout: KVLayoutSpec
    alignment_tokens: int
    """The engine's own granularity of prefix-cache hits."""
    tp_size: int = 1
    use_eagle: bool = False
    """The engine drafts with EAGLE/MTP: hits drop their last block as its own do."""
    eagle_group_ids: frozenset[int] = frozenset()
    """The groups that drop it (empty with ``use_eagle``: every group)."""
    engine_key: str = "engine"
    """Tells this engine's scheduler and workers apart from other engines' in a process."""


def hit_alignment(config: ConnectorConfig, facts: EngineFacts) -> int:
    """The granularity of hits: the configured one, checked against the engine, or the
    engine's own."""
    align = config.hit_alignment_tokens
    if align is None:
        return facts.alignment_tokens
    problems = []
    if align % facts.alignment_tokens:
        problems.append(
            f"hit_alignment_tokens={align} must be a multiple of the engine's alignment "
            f"{facts.alignment_tokens}"
        )
    for group_id, group in enumerate(facts.layout.groups):
        problem = rules_for(group.kind).alignment_problem(group, align)
        if problem:
            problems.append(f"group {group_id}: {problem}; leave hit_alignment_tokens unset")
        elif group.kind is GroupKind.MAMBA and align > facts.alignment_tokens:
            # A state exists only where an engine step ended, on the engine's alignment:
            # on a coarser one most prompts would have no state to hit.
            problems.append(
                f"group {group_id} (mamba): hit_alignment_tokens={align} is coarser than the "
                f"engine's alignment {facts.alignment_tokens}; Mamba states exist only where "
                "the engine's steps end, so most prompts would never hit; leave "
                "hit_alignment_tokens unset"
            )
    if problems:
        raise ConfigError("kv_connector_extra_config: " + "; ".join(problems))
    return align


def build_store(tier_configs: tuple[TierConfig, ...], config: ConnectorConfig) -> TieredStore:
    """One rank's tiers behind one store (closes what it built if one tier fails)."""
    return TieredStore(build_tiers(tier_configs), selection=config.selection)


def register_local_store(engine_key: str, store: TieredStore) -> None:
    with _LOCK:
        _LOCAL_STORES[engine_key] = store


def unregister_local_store(engine_key: str, store: TieredStore) -> None:
    with _LOCK:
        if _LOCAL_STORES.get(engine_key) is store:
            del _LOCAL_STORES[engine_key]


def lookup_for_store(store: TieredStore) -> KeyLookup:
    """Lookups straight against one worker's own store (same process, one rank)."""
    views: list[LookupView | None] = [TierSlice(store, i) for i in range(len(store.tiers))]
    weights = [tier.load_weight for tier in store.tiers]
    return KeyLookup([views], weights, union_views=[store])


def build_lookup(config: ConnectorConfig, facts: EngineFacts) -> tuple[KeyLookup, list[Tier]]:
    """The scheduler's lookup view and the lookup-only tiers it opened (close them)."""
    with _LOCK:
        local = _LOCAL_STORES.get(facts.engine_key)
    if local is not None and facts.tp_size == 1:
        logger.info("hybridkv lookups use the worker's store in this process (every tier)")
        return lookup_for_store(local), []
    opened: dict[TierConfig, Tier] = {}
    per_rank: list[list[LookupView | None]] = []
    try:
        for rank in range(facts.tp_size):
            views: list[LookupView | None] = []
            for tier_config in config.for_rank(rank, facts.tp_size):
                if tier_config.reach is TierReach.PROCESS:
                    views.append(None)  # answered from the workers' reports
                    continue
                lookup_config = tier_config.lookup_only()
                if lookup_config not in opened:
                    opened[lookup_config] = build_tier(lookup_config)
                views.append(opened[lookup_config])
            per_rank.append(views)
    except Exception:
        for tier in opened.values():
            tier.close()
        raise
    weights = [c.load_weight for c in config.tier_configs]
    kinds = ["reported" if v is None else "lookup-only" for v in per_rank[0]]
    logger.info("hybridkv lookups from the scheduler process: tiers %s", kinds)
    return KeyLookup(per_rank, weights), list(opened.values())


def build_scheduler(
    config: ConnectorConfig, facts: EngineFacts
) -> tuple[ConnectorScheduler, list[Tier]]:
    """The scheduler side and the lookup-only tiers it opened (close them at shutdown)."""
    lookup, opened = build_lookup(config, facts)
    scheduler = ConnectorScheduler(
        facts.layout,
        lookup,
        alignment_tokens=hit_alignment(config, facts),
        hash_algo=config.hash_algo,
        selection=config.selection,
        tp_size=facts.tp_size,
        use_eagle=facts.use_eagle,
        eagle_group_ids=facts.eagle_group_ids or None,
    )
    return scheduler, opened
