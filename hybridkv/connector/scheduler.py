"""Scheduler side of the connector: hit lookups, load plans and store plans.

Scheduler process; never touches tensors. Per request it keeps the chained
block hashes (extended as tokens arrive) and the engine's block ids per
group. ``lookup`` finds the longest hit every group can resume from, over
every rank's tiers and the blocks still being stored; ``allocated`` turns it
into per-group load transfers once the engine has allocated blocks;
``build_metadata`` adds, each step, the blocks of every group completed by
that step's tokens, or the states the engine handed over for groups whose
states move (to store), and the blocks it writes (to fence); the
workers' results come back through ``process_report``. With
``Admission.REUSED`` it also names the stored blocks the slower tiers receive
(``connector.admission``).

Read-your-writes: a block sent for storing counts as stored for lookups
until a worker reports it dropped, so a request that follows the one that
computed it hits at once; the worker loads it only after its store is done.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hybridkv.connector.admission import DEFAULT_SEEN_HASHES, AdmissionTracker
from hybridkv.connector.loads import plan_load
from hybridkv.connector.lookup import KeyLookup
from hybridkv.connector.metadata import (
    BlockRef,
    ConnectorMetadata,
    LoadOutcome,
    LoadPlan,
    LoadResult,
    RankReport,
    StorePlan,
    WorkerReport,
)
from hybridkv.connector.ranks import EngineRanks
from hybridkv.connector.requests import GroupBlockTable, RequestState
from hybridkv.connector.search import HitSearch
from hybridkv.connector.sightings import DEFAULT_SIGHTING_TTL_S, PoolSightings
from hybridkv.connector.sources import hit_sources
from hybridkv.connector.stats import SchedulerStats
from hybridkv.connector.steps import LookupResult, ScheduledRequest, StateHandoff, StepInput
from hybridkv.connector.stores import StorePlanner
from hybridkv.groups import ModelGroups
from hybridkv.hits import Hit, drafting_groups
from hybridkv.keys import BlockHash, HashAlgo, RequestBlockHasher
from hybridkv.tiers.admission import Admission
from hybridkv.tiers.base import Tier
from hybridkv.tiers.retention import StackMode
from hybridkv.tiers.selection import Selection, pick_whole_request_tier

logger = logging.getLogger(__name__)

MAX_LOAD_ATTEMPTS = 2
"""A request whose loads failed this often is recomputed without asking again."""
_RETRY = frozenset({LoadOutcome.FAILED, LoadOutcome.CANCELLED})
"""Outcomes after which a new lookup may still find a (shorter) usable hit: the blocks
that failed are no longer offered."""


class ConnectorScheduler:
    """Engine-neutral scheduler side (one per engine, single-threaded use)."""

    def __init__(
        self,
        model_groups: ModelGroups,
        lookup: KeyLookup,
        *,
        alignment_tokens: int | None = None,
        hash_algo: HashAlgo = HashAlgo.XXH3_128,
        selection: Selection = Selection.PER_BLOCK,
        ranks: EngineRanks | None = None,
        use_eagle: bool = False,
        eagle_group_ids: frozenset[int] | None = None,
        admission: Admission = Admission.ALL,
        admission_seen_hashes: int = DEFAULT_SEEN_HASHES,
        admission_keep_slower: bool = False,
        sighting_tier: Tier | None = None,
        sighting_ttl_s: int = DEFAULT_SIGHTING_TTL_S,
        handoff_group_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.ranks = ranks or EngineRanks.uniform(model_groups)  # None: one rank
        if lookup.num_ranks != self.ranks.world_size:
            raise ValueError(f"the lookup answers for {lookup.num_ranks} ranks, not {ranks}")
        self.model_groups = model_groups
        self.lookup_view = lookup
        self.selection = selection
        self.alignment_tokens = alignment_tokens or model_groups.scheduler_block_size
        self.hash_algo = hash_algo
        self.use_eagle = use_eagle
        self.eagle_group_ids = eagle_group_ids
        self.hit_search = HitSearch(
            model_groups=model_groups,
            ranks=self.ranks,
            alignment_tokens=self.alignment_tokens,
            use_eagle=use_eagle,
            eagle_group_ids=eagle_group_ids,
        )
        self.builders = self.hit_search.builders
        self.stats = SchedulerStats()
        self._requests: dict[str, RequestState] = {}
        self._loads: list[LoadPlan] = []
        self._cancelled: set[str] = set()
        drafting = drafting_groups(model_groups.groups, use_eagle, eagle_group_ids)
        self.stores = StorePlanner(
            model_groups, self.builders[0], self.ranks, drafting, handoff_group_ids
        )
        sightings = PoolSightings.over(sighting_tier, self.builders[0], sighting_ttl_s, self.stats)
        self.admission = AdmissionTracker.if_needed(
            admission,
            model_groups,
            self.builders[0],
            lookup.num_tiers,
            admission_seen_hashes,
            sightings,
            keeps=admission_keep_slower,
        )
        """None: every stored block reaches every tier (or there is one tier)."""

    # --- lookups and loads ---------------------------------------------------

    def add_request(
        self,
        req_id: str,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        cacheable: bool = True,
    ) -> None:
        """Start tracking a request (its salt and LoRA enter every block hash).

        ``cacheable=False``: its token ids do not name its KV (embeddings,
        multimodal inputs), so it is never looked up nor stored.
        """
        self._state(req_id, cache_salt, lora_name).cacheable = cacheable

    def lookup(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> LookupResult:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (the engine keeps >= 1)."""
        st = self._state(req_id, cache_salt, lora_name)
        st.engine_cached_tokens = num_computed_tokens
        st.hash_up_to(token_ids, len(token_ids))
        if self.admission is not None and st.cacheable:
            self.admission.note(st)
        st.hit = None
        max_hit_tokens = len(token_ids) - 1
        blocked = st.load is not None or not st.cacheable
        if blocked or st.num_failed_loads >= MAX_LOAD_ATTEMPTS:
            return LookupResult(0, False)
        if max_hit_tokens <= num_computed_tokens:
            return LookupResult(0, False)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(token_ids) - num_computed_tokens
        hit, tier_index = self._find_hit(st, max_hit_tokens)
        if self.admission is not None:
            self.admission.looked_up(st, num_computed_tokens, hit.num_tokens)
        if hit.num_tokens <= num_computed_tokens:
            return LookupResult(0, False)
        st.hit, st.hit_base_tokens, st.hit_tier = hit, num_computed_tokens, tier_index
        self.stats.lookup_hits += 1
        self.stats.hit_tokens += hit.num_tokens - num_computed_tokens
        return LookupResult(hit.num_tokens - num_computed_tokens, True)

    def _find_hit(self, st: RequestState, max_hit_tokens: int) -> tuple[Hit, int | None]:
        """The longest hit over all tiers, or (whole request) from the best single tier."""
        if self.selection is Selection.PER_BLOCK or self.lookup_view.num_tiers == 1:
            hit = self._search(st, max_hit_tokens, None)
            if hit.first_miss_token is not None:  # in no tier at all: lost, or evicted
                self._forget_sent_from(st.hasher.block_hashes, hit.first_miss_token)
            return hit, None
        hits = [
            self._search(st, max_hit_tokens, tier_index)
            for tier_index in range(self.lookup_view.num_tiers)
        ]
        best = pick_whole_request_tier(
            [hit.num_tokens for hit in hits], self.lookup_view.load_weights
        )
        return (hits[0], None) if best is None else (hits[best], best)

    def _search(self, st: RequestState, max_hit_tokens: int, tier_index: int | None) -> Hit:
        """The hit over every tier (``tier_index`` None) or one; asks, changes nothing."""
        # Blocks being stored land in the first tier first.
        count_storing = tier_index in (None, 0)
        return self.hit_search.search(
            self.lookup_view,
            st.hasher.block_hashes,
            max_hit_tokens,
            tier_index=tier_index,
            is_storing=self._is_storing if count_storing else None,
        )

    def _is_storing(self, group_id: int, block_hash: BlockHash) -> bool:
        return self.stores.is_storing(BlockRef(group_id, block_hash))

    def _forget_sent_from(self, chain: Sequence[BlockHash], num_tokens: int) -> None:
        """Every group's blocks from token ``num_tokens`` on: the search stops at a group's
        first miss, so the other groups' blocks past a lost one are never asked about; they
        were most likely lost with it (a pool restarted empty) and are sent again."""
        builder = self.builders[0]
        for group_id, group in enumerate(self.model_groups.groups):
            num_full = builder.num_full_blocks(group_id, len(chain))
            indices = range(num_tokens // group.block_size, num_full)
            hashes = builder.block_hashes(group_id, chain, indices)
            self.stores.forget_sent([BlockRef(group_id, h) for h in hashes])

    def allocated(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """The engine allocated blocks; plan the load of ``num_external_tokens`` tokens."""
        st = self._requests.get(req_id)
        if st is None or num_external_tokens <= 0:
            if st is not None:
                st.hit = None
            return
        target = st.hit_base_tokens + num_external_tokens
        plan = plan_load(self.model_groups, self.builders[0], req_id, st, block_ids, target)
        st.hit, st.load, st.load_results = None, plan, {}
        self._loads.append(plan)
        if plan.planned:
            self.stats.loads_planned += 1
            if self.admission is not None:
                self.admission.loaded(st, plan.num_tokens)
        else:
            self.stats.loads_unplanned += 1

    # --- every step ------------------------------------------------------------

    def build_metadata(self, step: StepInput) -> ConnectorMetadata:
        """This step's loads (planned since the last call), stores and cancellations."""
        for req_id in step.preempted_req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                st.table.clear()
                st.hit = None
                if st.load is not None:
                    self._cancelled.add(req_id)
        stores: list[StorePlan] = []
        admitted: list[BlockRef] = []
        handoffs = self._live_handoffs(step)
        for req in step.scheduled:
            plan = self._plan_stores(req)
            plan = self._with_handoffs(req.req_id, plan, handoffs.pop(req.req_id, ()))
            refs, plan = self._admits(req, plan)
            if plan is not None:
                stores.append(plan)
            admitted += refs
        for req_id, states in handoffs.items():  # states of requests not scheduled
            plan = self._with_handoffs(req_id, None, states)
            if plan is not None:
                stores.append(plan)
        meta = ConnectorMetadata(
            loads=tuple(self._loads),
            stores=tuple(stores),
            cancelled_req_ids=frozenset(self._cancelled),
            written_block_ids=step.written_block_ids(self.model_groups),
            admitted=tuple(admitted),
            mode=StackMode.OWN_RULES if self.admission is None else self.admission.mode,
        )
        self._loads, self._cancelled = [], set()
        return meta

    def _plan_stores(self, req: ScheduledRequest) -> StorePlan | None:
        st = self._requests.get(req.req_id)
        if st is None:
            st = self._state(req.req_id, None, None)
        if req.replaces_block_ids:
            st.table.clear()
        st.table.append(req.new_block_ids)
        return self.stores.plan(st, req, self.alignment_tokens)

    def _live_handoffs(self, step: StepInput) -> dict[str, Sequence[StateHandoff]]:
        """The step's state hand-offs of requests still running. A request finished or
        preempted gives its blocks back: another request may already write them."""
        gone = step.finished_req_ids | step.preempted_req_ids
        live: dict[str, Sequence[StateHandoff]] = {}
        for req_id, states in step.state_handoffs.items():
            self.stats.state_handoffs += len(states)
            st = self._requests.get(req_id)
            if req_id in gone or st is None or st.finished:
                self.stats.state_handoffs_not_stored += len(states)
            else:
                live[req_id] = states
        return live

    def _with_handoffs(
        self, req_id: str, plan: StorePlan | None, states: Sequence[StateHandoff]
    ) -> StorePlan | None:
        """``plan`` with the handed-over states of the request that a hit can read."""
        if not states:
            return plan
        transfers, num_unused = self.stores.handoffs(
            self._requests[req_id], states, self.alignment_tokens
        )
        self.stats.state_handoffs_not_stored += num_unused
        if not transfers:
            return plan
        if plan is None:
            return StorePlan(req_id=req_id, transfers=tuple(transfers))
        return StorePlan(
            req_id=req_id, transfers=(*plan.transfers, *transfers), refresh=plan.refresh
        )

    def _admits(
        self, req: ScheduledRequest, plan: StorePlan | None
    ) -> tuple[list[BlockRef], StorePlan | None]:
        """The blocks this step of ``req`` admits to the slower tiers (none without
        ``Admission.REUSED``), and its stores, with those of them the engine's own cache
        served it to store again (``StorePlanner.refresh``; not while plain LRU)."""
        st = self._requests[req.req_id]
        if self.admission is None or not st.cacheable:
            return [], plan
        refs = self.admission.admits(st, req, plan)
        if self.admission.mode is StackMode.PLAIN_LRU:
            return refs, plan
        refresh = self.stores.refresh(st, req, set(refs), self.alignment_tokens)
        if refresh:
            transfers = () if plan is None else plan.transfers
            plan = StorePlan(req_id=req.req_id, transfers=transfers, refresh=refresh)
        return refs, plan

    # --- results and the end of a request --------------------------------------

    def process_report(self, report: WorkerReport) -> None:
        """Take the workers' results (any number of ranks, in any order)."""
        for rank_report in report.ranks:
            self._process_rank(rank_report)

    def _process_rank(self, report: RankReport) -> None:
        if not 0 <= report.rank < self.ranks.world_size:
            raise ValueError(f"report of rank {report.rank}; ranks are 0..{len(self.builders) - 1}")
        builder = self.builders[report.rank]
        self.lookup_view.on_stored([builder.key(*ref) for ref in report.stored])
        self.lookup_view.on_missing([builder.key(*ref) for ref in report.missing])
        self.stores.take_report(report)
        for result in report.finished_loads:
            self._finish_load(report.rank, result)

    def _finish_load(self, rank: int, result: LoadResult) -> None:
        st = self._requests.get(result.req_id)
        if st is None or st.load is None:
            return
        st.load_results[rank] = result
        if len(st.load_results) < self.ranks.world_size:
            return  # the other ranks are still loading
        plan, results = st.load, st.load_results
        st.load, st.load_results = None, {}
        outcomes = sorted({r.outcome.value for r in results.values()})
        if outcomes != [LoadOutcome.OK.value]:
            st.num_failed_loads += 1
            retry = all(r.ok or r.outcome in _RETRY for r in results.values())
            if not retry:
                st.num_failed_loads = MAX_LOAD_ATTEMPTS
            logger.warning(
                "request %s: load of %d tokens ended %s; the engine recomputes%s",
                result.req_id,
                plan.num_tokens - plan.base_tokens,
                "/".join(outcomes),
                " (a later lookup may find a shorter hit)" if retry else "",
            )
        if st.finished:
            del self._requests[result.req_id]

    def request_finished(self, req_id: str) -> bool:
        """The request is done. True: keep its blocks until its load is reported."""
        st = self._requests.get(req_id)
        if st is None:
            return False
        if st.load is not None:
            st.finished = True
            self._cancelled.add(req_id)
            return True
        del self._requests[req_id]
        return False

    def hit_sources(self, req_id: str) -> dict[int, int]:
        """Tokens of the load just planned for ``req_id``, by the tier (index) serving them
        (``connector.sources``; one lookup per tier, for metrics)."""
        st = self._requests.get(req_id)
        if st is None or st.load is None:
            return {}
        return hit_sources(st.load, self.lookup_view, self.hit_search, self.stores.is_storing)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def state_sizes(self) -> dict[str, int]:
        """Entries of the per-request bookkeeping; all zero once every request finished
        and the workers reported every store (a load test watches them for leaks)."""
        return {
            "requests": len(self._requests),
            "planned_loads": len(self._loads),
            "cancelled": len(self._cancelled),
            "blocks_storing": self.stores.num_blocks_storing,
        }

    # --- helpers ---------------------------------------------------------------

    def _state(self, req_id: str, cache_salt: str | None, lora_name: str | None) -> RequestState:
        st = self._requests.get(req_id)
        if st is None:
            hasher = RequestBlockHasher(
                self.model_groups.hash_block_size,
                algo=self.hash_algo,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
            st = RequestState(hasher=hasher, table=GroupBlockTable(self.model_groups.num_groups))
            self._requests[req_id] = st
        return st
