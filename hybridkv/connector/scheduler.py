"""Scheduler side of the connector: hit lookups, load plans and store plans.

Scheduler process; never touches tensors. Per request it keeps the chained
block hashes (extended as tokens arrive) and the engine's block ids per
group. ``lookup`` finds the longest hit every group can resume from;
``allocated`` turns it into per-group load transfers once the engine has
allocated blocks; ``build_metadata`` adds, each step, the blocks of every
group completed by that step's tokens so the worker stores them before the
engine can free or reuse them. ``process_report`` takes the worker's results.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.connector.metadata import (
    BlockTransfer,
    ConnectorMetadata,
    LoadResult,
    LoadSpec,
    StoreSpec,
    WorkerReport,
)
from hybridkv.connector.rules import load_indices, needs_every_block, resume_tokens, store_indices
from hybridkv.connector.steps import (
    LoadOutcome,
    LookupResult,
    ScheduledRequest,
    SchedulerStats,
    StepInput,
)
from hybridkv.connector.views import BoundedKeySet, KeyLookup
from hybridkv.hits import Hit, find_longest_hit
from hybridkv.keys import HashAlgo, KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.planner import GroupBlockTable
from hybridkv.spec import KVLayoutSpec
from hybridkv.tiers.selection import Selection, pick_whole_request_tier

logger = logging.getLogger(__name__)

RECENT_STORE_KEYS = 1 << 16
"""Keys sent for storing recently: not sent again while remembered."""


@dataclass(kw_only=True)
class _Request:
    hasher: RequestBlockHasher
    table: GroupBlockTable
    hit: Hit | None = None
    hit_base_tokens: int = 0
    hit_tier: int | None = None
    load: LoadSpec | None = None
    """The load sent to the worker and not yet reported."""
    loads_disabled: bool = False
    finished: bool = False
    cacheable: bool = True


@dataclass(kw_only=True)
class _Pending:
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)


class ConnectorScheduler:
    """Engine-neutral scheduler side (one per engine, single-threaded use)."""

    def __init__(
        self,
        layout: KVLayoutSpec,
        lookup: KeyLookup,
        *,
        alignment_tokens: int | None = None,
        hash_algo: HashAlgo = HashAlgo.XXH3_128,
        selection: Selection = Selection.PER_BLOCK,
        tp_size: int = 1,
        use_eagle: bool = False,
    ) -> None:
        self.layout = layout
        self.lookup_view = lookup
        self.selection = selection
        self.alignment_tokens = alignment_tokens or layout.scheduler_block_size
        self.hash_algo = hash_algo
        self.use_eagle = use_eagle
        self.builders = [
            KeyBuilder(layout, KeyNamespace.for_layout(layout, tp_rank=r, tp_size=tp_size))
            for r in range(tp_size)
        ]
        self.stats = SchedulerStats()
        self._requests: dict[str, _Request] = {}
        self._pending = _Pending()
        self._recent_store_keys = BoundedKeySet(RECENT_STORE_KEYS)

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
        self._extend(st, token_ids, len(token_ids))
        st.hit = None
        max_hit_tokens = len(token_ids) - 1
        blocked = st.loads_disabled or st.load is not None or not st.cacheable
        if blocked or max_hit_tokens <= num_computed_tokens:
            return LookupResult(0, False)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(token_ids) - num_computed_tokens
        hit, tier_index = self._find_hit(st, max_hit_tokens)
        if hit.num_tokens <= num_computed_tokens:
            self.stats.misses += 1
            return LookupResult(0, False)
        st.hit, st.hit_base_tokens, st.hit_tier = hit, num_computed_tokens, tier_index
        self.stats.hits += 1
        self.stats.hit_tokens += hit.num_tokens - num_computed_tokens
        return LookupResult(hit.num_tokens - num_computed_tokens, True)

    def _find_hit(self, st: _Request, max_hit_tokens: int) -> tuple[Hit, int | None]:
        """The longest hit over all tiers, or (whole request) from the best single tier."""
        if self.selection is Selection.PER_BLOCK or self.lookup_view.num_tiers == 1:
            return self._search(st, max_hit_tokens, None), None
        hits = [
            self._search(st, max_hit_tokens, tier_index)
            for tier_index in range(self.lookup_view.num_tiers)
        ]
        best = pick_whole_request_tier(
            [hit.num_tokens for hit in hits], self.lookup_view.load_weights
        )
        return (hits[0], None) if best is None else (hits[best], best)

    def _search(self, st: _Request, max_hit_tokens: int, tier_index: int | None) -> Hit:
        hashes = st.hasher.block_hashes

        def contains(group_id: int, indices: Sequence[int]) -> list[bool]:
            keys = [k for b in self.builders for k in b.keys(group_id, hashes, indices)]
            found = self.lookup_view.contains_many(keys, tier_index=tier_index)
            n = len(indices)
            return [all(found[r * n + i] for r in range(len(self.builders))) for i in range(n)]

        return find_longest_hit(
            self.layout.groups,
            max_hit_tokens,
            contains,
            alignment_tokens=self.alignment_tokens,
            use_eagle=self.use_eagle,
        )

    def allocated(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """The engine allocated blocks; plan the load of ``num_external_tokens`` tokens."""
        st = self._requests.get(req_id)
        if st is None or num_external_tokens <= 0:
            if st is not None:
                st.hit = None
            return
        base, hit = st.hit_base_tokens, st.hit
        target = base + num_external_tokens
        spec = self._plan_load(req_id, st, block_ids, base, target, hit)
        st.hit, st.load = None, spec
        self._pending.loads.append(spec)
        if spec.planned:
            self.stats.loads_planned += 1
        else:
            self.stats.loads_unplanned += 1

    def _plan_load(
        self,
        req_id: str,
        st: _Request,
        block_ids: Sequence[Sequence[int]],
        base: int,
        target: int,
        hit: Hit | None,
    ) -> LoadSpec:
        unplanned = LoadSpec(
            req_id=req_id, num_tokens=target, fallback_tokens=base, transfers=(), planned=False
        )
        if hit is None or hit.num_tokens != target or len(block_ids) != self.layout.num_groups:
            logger.warning(
                "request %s: the engine asked to load up to token %d but the lookup found %s; "
                "recomputing instead",
                req_id,
                target,
                None if hit is None else hit.num_tokens,
            )
            return unplanned
        transfers: list[BlockTransfer] = []
        hashes = st.hasher.block_hashes
        for group_id, group in enumerate(self.layout.groups):
            ids = block_ids[group_id]
            indices = load_indices(group, hit.blocks_to_load[group_id], base)
            missing = [i for i in indices if i >= len(ids) or ids[i] == 0]
            if missing and needs_every_block(group.kind):
                logger.warning(
                    "request %s: group %d needs blocks %s the engine did not allocate; "
                    "recomputing instead",
                    req_id,
                    group_id,
                    missing,
                )
                return unplanned
            kept = [i for i in indices if i not in missing]
            if kept:
                keys = self.builders[0].keys(group_id, hashes, kept)
                transfers.append(
                    BlockTransfer(
                        group_id=group_id,
                        keys=tuple(keys),
                        block_ids=tuple(ids[i] for i in kept),
                        block_indices=tuple(kept),
                    )
                )
        return LoadSpec(
            req_id=req_id,
            num_tokens=target,
            fallback_tokens=base,
            transfers=tuple(transfers),
            tier_index=st.hit_tier,
        )

    # --- every step ------------------------------------------------------------

    def build_metadata(self, step: StepInput) -> ConnectorMetadata:
        """This step's loads (planned since the last call), stores and cancellations."""
        for req_id in step.preempted_req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                st.table.clear()
                st.hit = None
                if st.load is not None:
                    self._pending.cancelled.add(req_id)
        stores = [s for r in step.scheduled if (s := self._plan_stores(r)) is not None]
        meta = ConnectorMetadata(
            loads=tuple(self._pending.loads),
            stores=tuple(stores),
            cancelled_req_ids=frozenset(self._pending.cancelled),
        )
        self._pending = _Pending()
        return meta

    def _plan_stores(self, req: ScheduledRequest) -> StoreSpec | None:
        st = self._requests.get(req.req_id)
        if st is None:
            st = self._state(req.req_id, None, None)
        if req.replaces_block_ids:
            st.table.clear()
        st.table.append(req.new_block_ids)
        start = req.num_computed_tokens
        end = min(start + req.num_scheduled_tokens, len(req.token_ids))
        if end <= start or not st.cacheable:
            return None
        self._extend(st, req.token_ids, end)
        hashes = st.hasher.block_hashes
        transfers: list[BlockTransfer] = []
        for group_id, group in enumerate(self.layout.groups):
            ids = st.table.group_block_ids(group_id)
            indices = [
                i
                for i in store_indices(group, start, end, self.alignment_tokens)
                if i < len(ids) and ids[i] != 0
            ]
            if not indices:
                continue
            keys = self.builders[0].keys(group_id, hashes, indices)
            fresh = [n for n, key in enumerate(keys) if key not in self._recent_store_keys]
            if not fresh:
                continue
            self._recent_store_keys.add_many(keys[n] for n in fresh)
            transfers.append(
                BlockTransfer(
                    group_id=group_id,
                    keys=tuple(keys[n] for n in fresh),
                    block_ids=tuple(ids[indices[n]] for n in fresh),
                    block_indices=tuple(indices[n] for n in fresh),
                )
            )
            self.stats.store_blocks_planned += len(fresh)
        if not transfers:
            return None
        return StoreSpec(req_id=req.req_id, transfers=tuple(transfers))

    # --- results and the end of a request --------------------------------------

    def process_report(self, report: WorkerReport) -> list[LoadOutcome]:
        """Take the worker's results; returns how each finished load ended."""
        self.lookup_view.on_stored(report.stored_keys)
        self.lookup_view.on_missing(report.missing_keys)
        # Dropped or lost blocks may be stored again when a request computes them.
        self._recent_store_keys.discard_many(report.dropped_keys)
        self._recent_store_keys.discard_many(report.missing_keys)
        return [self._finish_load(result) for result in report.finished_loads]

    def _finish_load(self, result: LoadResult) -> LoadOutcome:
        st = self._requests.get(result.req_id)
        spec = None if st is None else st.load
        if st is None or spec is None:
            return LoadOutcome(result.req_id, 0, result.ok)
        st.load = None
        num_tokens = resume_tokens(self.layout, spec, result, self.alignment_tokens)
        if result.ok:
            self.stats.loads_ok += 1
        else:
            self.stats.loads_failed += 1
            st.loads_disabled = True  # a retry could only fail the same way
            logger.warning(
                "request %s: load of %d tokens failed%s; resuming at %d",
                result.req_id,
                spec.num_tokens,
                " (timed out)" if result.timed_out else "",
                num_tokens,
            )
        if st.finished:
            del self._requests[result.req_id]
        return LoadOutcome(result.req_id, num_tokens, result.ok)

    def request_finished(self, req_id: str) -> bool:
        """The request is done. True: keep its blocks until its load is reported."""
        st = self._requests.get(req_id)
        if st is None:
            return False
        if st.load is not None:
            st.finished = True
            self._pending.cancelled.add(req_id)
            return True
        del self._requests[req_id]
        return False

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # --- helpers ---------------------------------------------------------------

    def _state(self, req_id: str, cache_salt: str | None, lora_name: str | None) -> _Request:
        st = self._requests.get(req_id)
        if st is None:
            hasher = RequestBlockHasher(
                self.layout.hash_block_size,
                algo=self.hash_algo,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
            st = _Request(hasher=hasher, table=GroupBlockTable(self.layout.num_groups))
            self._requests[req_id] = st
        return st

    @staticmethod
    def _extend(st: _Request, token_ids: Sequence[int], end: int) -> None:
        have = st.hasher.num_tokens
        if end > have:
            st.hasher.extend(token_ids[have:end])
