"""Building the connector's two sides from the user's config and the engine's facts.

Any process. An engine adapter reads ``EngineFacts`` once and calls
``build_worker`` (each worker process, one per rank) and
``build_scheduler`` (scheduler process). Whoever builds both in one process
(one rank) hands the worker's store to ``build_scheduler``, which then looks
up hits in that very store. Otherwise the scheduler opens lookup-only
instances of the tiers other processes can see (each rank's), and answers for
worker-private tiers (CPU memory) from the keys the workers report stored.
``build_scheduler`` also writes the engine's card for routers (``card``) when the
config names a file for it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.connector.card import publish_card
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.exit_flush import flush_at_exit
from hybridkv.connector.lookup import KeyLookup, LookupView, TierSlice
from hybridkv.connector.ranks import EngineRanks
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import ModelGroups
from hybridkv.groups.kinds import rules_for
from hybridkv.schema import ConfigError
from hybridkv.tiers.base import Tier, TierReach
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.registry import TierConfig, build_tier, build_tiers
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.transfer import TransferConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """What the connector needs to know about the engine, read once by its adapter."""

    model_groups: ModelGroups
    """The model's groups (in a worker process, with its pipeline stage's layers)."""
    alignment_tokens: int
    """The engine's own granularity of prefix-cache hits."""
    tp_size: int = 1
    pp_size: int = 1
    stage_groups: tuple[ModelGroups, ...] = ()
    """With pipeline parallel, each stage's groups with its own layers (the scheduler
    learns them from the workers); empty: every stage holds ``model_groups``."""
    use_eagle: bool = False
    """The engine drafts with EAGLE/MTP: hits drop their last block as its own do."""
    eagle_group_ids: frozenset[int] = frozenset()
    """The groups that drop it (empty with ``use_eagle``: every group)."""
    handoff_group_ids: frozenset[int] = frozenset()
    """Groups whose states the engine hands over each step (``StateHandoff``): the only
    states stored for them, since their blocks do not keep a state at their position."""
    engine_group_ids: tuple[int, ...] = ()
    """The engine's own id of each group (its KV events name groups so), when the
    connector serves fewer groups than the engine has; empty: a group's place."""
    engine_key: str = "engine"
    """Tells this engine's scheduler and workers apart from other engines' in a process
    (for an adapter that must find one side's objects from the other)."""


def engine_ranks(facts: EngineFacts) -> EngineRanks:
    """Every rank of the engine and the layers each holds."""
    stages = facts.stage_groups or (facts.model_groups,) * facts.pp_size
    if len(stages) != facts.pp_size:
        raise ValueError(
            f"{len(stages)} stages' groups for pipeline_parallel_size={facts.pp_size}; give "
            "one per stage"
        )
    return EngineRanks(tp_size=facts.tp_size, stage_groups=stages)


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
    for group_id, group in enumerate(facts.model_groups.groups):
        rules = rules_for(group.kind)
        problem = rules.alignment_problem(group, align)
        if problem:
            problems.append(f"group {group_id}: {problem}; leave hit_alignment_tokens unset")
        elif rules.coarser_alignment_problem and align > facts.alignment_tokens:
            problems.append(
                f"group {group_id} ({group.kind.value}): hit_alignment_tokens={align} is "
                f"coarser than the engine's alignment {facts.alignment_tokens}; "
                f"{rules.coarser_alignment_problem}; leave hit_alignment_tokens unset"
            )
    if problems:
        raise ConfigError("kv_connector_extra_config: " + "; ".join(problems))
    return align


def build_store(tier_configs: tuple[TierConfig, ...], config: ConnectorConfig) -> TieredStore:
    """One rank's tiers behind one store (closes what it built if one tier fails)."""
    tiers = build_tiers(tier_configs)
    return TieredStore(tiers, selection=config.selection, admission=config.admission)


def lookup_for_store(store: TieredStore) -> KeyLookup:
    """Lookups straight against one worker's own store (same process, one rank)."""
    views: list[LookupView | None] = [TierSlice(store, i) for i in range(len(store.tiers))]
    weights = [tier.load_weight for tier in store.tiers]
    return KeyLookup([views], weights, union_views=[store])


def build_lookup(
    config: ConnectorConfig,
    facts: EngineFacts,
    *,
    worker_store: TieredStore | None = None,
    opened: dict[TierConfig, Tier] | None = None,
) -> tuple[KeyLookup, list[Tier]]:
    """The scheduler's lookup view and the lookup-only tiers it opened (close them).

    ``worker_store``: the one worker's store, built in this process (one rank only).
    ``opened``: lookup-only tiers already open in this process, by config, used and
    added to (a router serving several engines of one pool opens it once); the
    tiers returned are then only those this call opened.
    """
    ranks = engine_ranks(facts)
    if worker_store is not None:
        if ranks.world_size != 1:
            raise ValueError(
                f"worker_store with {ranks.world_size} ranks (tensor x pipeline parallel): one "
                "store holds one rank's blocks; pass it only with one rank"
            )
        logger.info("hybridkv lookups use the worker's store in this process (every tier)")
        return lookup_for_store(worker_store), []
    known = {} if opened is None else opened
    new: dict[TierConfig, Tier] = {}
    per_rank: list[list[LookupView | None]] = []
    try:
        for rank in ranks.ranks:
            views: list[LookupView | None] = []
            for tier_config in config.for_rank(rank):
                if tier_config.reach is TierReach.PROCESS:
                    views.append(None)  # answered from the workers' reports
                    continue
                lookup_config = tier_config.lookup_only()
                tier = known.get(lookup_config, new.get(lookup_config))
                if tier is None:
                    tier = new[lookup_config] = build_tier(lookup_config)
                views.append(tier)
            per_rank.append(views)
    except Exception:
        for tier in new.values():
            tier.close()
        raise
    known.update(new)
    weights = [c.load_weight for c in config.tier_configs]
    kinds = ["reported" if v is None else "lookup-only" for v in per_rank[0]]
    logger.info("hybridkv lookups from the scheduler process: tiers %s", kinds)
    return KeyLookup(per_rank, weights), list(new.values())


def build_scheduler(
    config: ConnectorConfig, facts: EngineFacts, *, worker_store: TieredStore | None = None
) -> tuple[ConnectorScheduler, list[Tier]]:
    """The scheduler side and the lookup-only tiers it opened (close them at shutdown).

    ``worker_store``: the worker's store when the same process built it (one rank);
    None: lookups from the tiers this process can open and the workers' reports.
    """
    lookup, opened = build_lookup(config, facts, worker_store=worker_store)
    rank_tiers = lookup.tier_views[0] if worker_store is None else worker_store.tiers
    scheduler = ConnectorScheduler(
        facts.model_groups,
        lookup,
        alignment_tokens=hit_alignment(config, facts),
        hash_algo=config.hash_algo,
        selection=config.selection,
        ranks=engine_ranks(facts),
        use_eagle=facts.use_eagle,
        eagle_group_ids=facts.eagle_group_ids or None,
        admission=config.admission,
        admission_seen_hashes=config.admission_seen_hashes,
        admission_keep_slower=config.admission_keep_slower,
        sighting_tier=sighting_tier(config, rank_tiers),
        sighting_ttl_s=config.admission_sighting_ttl_s,
        handoff_group_ids=facts.handoff_group_ids,
    )
    publish_card(config, facts, scheduler.alignment_tokens)
    return scheduler, opened


def sighting_tier(config: ConnectorConfig, tiers: Sequence[object]) -> Tier | None:
    """The first of one rank's tiers that can mark hashes seen for other engines
    (``Tier.marks_sightings``, ``connector.sightings``); None with
    ``admission_sighting_ttl_s`` 0."""
    if config.admission_sighting_ttl_s == 0:
        return None
    return next((t for t in tiers if isinstance(t, Tier) and t.marks_sightings), None)


def build_worker(
    config: ConnectorConfig, facts: EngineFacts, *, rank: WorkerRank
) -> ConnectorWorker:
    """``rank``'s worker side over its own tiers (``facts.model_groups``: the groups
    with its own layers)."""
    if (rank.tp_size, rank.pp_size) != (facts.tp_size, facts.pp_size):
        raise ValueError(
            f"{rank} is not a rank of tensor_parallel_size={facts.tp_size}, "
            f"pipeline_parallel_size={facts.pp_size}"
        )
    store = build_store(config.for_rank(rank), config)
    lower_switch_interval(config.thread_switch_interval_s)
    worker = ConnectorWorker(
        facts.model_groups,
        store,
        rank=rank,
        transfer_config=TransferConfig(
            load_timeout_s=config.load_timeout_s, device_chunk_bytes=config.device_chunk_bytes
        ),
        eviction_order=config.eviction_order,
        close_timeout_s=config.exit_flush_timeout_s,
    )
    flush_at_exit(worker)
    return worker


def lower_switch_interval(interval_s: float | None) -> None:
    """Lower the interpreter's thread switch interval to ``interval_s`` (None: leave it).

    The engine's loop holds the interpreter lock while it runs; each time a transfer
    or I/O thread comes back from a copy or a read it waits for the lock, up to one
    switch interval. A load is hundreds of such returns, so Python's 5 ms default
    adds up to hundreds of milliseconds per hit.
    """
    current = sys.getswitchinterval()
    if interval_s is None or interval_s >= current:
        return
    sys.setswitchinterval(interval_s)
    logger.info(
        "hybridkv lowered Python's thread switch interval from %.2f ms to %.2f ms "
        "(thread_switch_interval_s) so transfer threads are not starved",
        current * 1e3,
        interval_s * 1e3,
    )
