"""Worker side of the connector: executes the scheduler's loads and stores.

Worker process (one per rank; it owns that rank's KV tensors and tiers); never
decides what to move. It names blocks in its own rank's key namespace. A
pipeline stage holding no layer of a group skips that group's blocks: it
stores none and loads none of them (its loads still report, so the scheduler
sees every rank finish). Loads run asynchronously on the transfer engine and are
reported once every block of the request has arrived, failed or timed out; a
load of a block this worker is still storing waits for that store. Stores are
copied out of the KV tensors from ``save`` on (the step that computed them;
asynchronously on CUDA, where ``fence`` keeps the engine from writing a block
before its copy is done) and written to the tiers in the background; a store
that cannot be queued is dropped and reported. Blocks the engine's own cache
served a request, admitted now, are stored again if the first tier has evicted
them (``StorePlan.refresh``). What it stores and loads, and the step's mode and
admitted blocks, it tells its retention policy (``connector.retention``, the
one ``eviction_order`` names), which tells the tiers.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from hybridkv.connector.exit_flush import close_worker
from hybridkv.connector.metadata import (
    BlockRef,
    BlockTransfer,
    LoadOutcome,
    LoadPlan,
    LoadResult,
    StorePlan,
    TierChange,
    WorkerReport,
)
from hybridkv.connector.report import ReportBuilder
from hybridkv.connector.retention import EvictionOrder, RetentionPolicy, policy_for
from hybridkv.connector.stats import WorkerStats
from hybridkv.connector.worker_parts import Load, Part, pack, refs_of
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder, KeyNamespace
from hybridkv.layout import CanonicalKVCaches, canonicalize
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.retention import StackMode
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.transfer import (
    JobId,
    JobOutcome,
    JobResult,
    TransferConfig,
    TransferEngine,
    TransferPart,
)

logger = logging.getLogger(__name__)

JOB_SHARE = 4
"""A job takes at most 1/JOB_SHARE of the staging arena, so several fit at once."""
DEFAULT_CLOSE_TIMEOUT_S = 30.0
"""How long ``close`` waits by default (the connector passes ``exit_flush_timeout_s``)."""


class ConnectorWorker:
    """Engine-neutral worker side of one rank; call its methods from one thread."""

    def __init__(
        self,
        model_groups: ModelGroups,
        store: TieredStore,
        *,
        rank: WorkerRank | None = None,
        transfer_config: TransferConfig | None = None,
        eviction_order: EvictionOrder = EvictionOrder.CHAIN,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
    ) -> None:
        self.model_groups = model_groups
        self.close_timeout_s = close_timeout_s
        """How long ``close`` waits for stores and write-back (``connector.exit_flush``)."""
        self._closed = False
        self.store = store
        self.rank = rank or WorkerRank()
        """None: the one rank of an engine without tensor or pipeline parallel."""
        self.keys = KeyBuilder(model_groups, KeyNamespace.for_rank(model_groups, self.rank))
        self.held = frozenset(g for g, group in enumerate(model_groups.groups) if group.num_layers)
        """The groups this rank has layers of (all but, on a pipeline stage, those whose
        layers all lie in other stages)."""
        self.transfer_config = transfer_config or TransferConfig()
        self.stats = WorkerStats.for_groups(model_groups.num_groups)
        self.caches: CanonicalKVCaches | None = None
        self.engine: TransferEngine | None = None
        self._loads: dict[str, Load] = {}
        self._job_loads: dict[JobId, tuple[str, tuple[Part, ...]]] = {}
        self._job_stores: dict[JobId, tuple[Part, ...]] = {}
        self._storing: Counter[StoreKey] = Counter()
        """Keys of store jobs in flight (a load of them waits)."""
        self._report = ReportBuilder(self.rank.index)
        self.retention: RetentionPolicy = policy_for(eviction_order, model_groups, self.keys, store)
        """What this rank tells the tiers of its blocks' fate (``connector.retention``)."""

    # --- set-up ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> CanonicalKVCaches:
        """Describe the engine's KV tensors and start the transfer engine over them."""
        return self.register_canonical(canonicalize(kv_caches, self.model_groups))

    def register_canonical(self, caches: CanonicalKVCaches) -> CanonicalKVCaches:
        if self.engine is not None:
            raise RuntimeError("KV caches are already registered")
        self.caches = caches
        self.engine = TransferEngine(caches, self.store, self.transfer_config)
        logger.info("worker KV caches (rank %s): %s", self.rank.label, caches.describe())
        return caches

    # --- every step ----------------------------------------------------------------

    def cancel(self, req_ids: frozenset[str] | set[str]) -> None:
        """Stop loads of requests preempted or finished (reported as cancelled)."""
        engine = self._engine()
        for req_id in req_ids:
            load = self._loads.get(req_id)
            if load is None:
                continue
            load.outcome = LoadOutcome.CANCELLED
            self._drop_parts(load)
            for job_id in list(load.jobs):
                engine.cancel(job_id)  # False: it is scattering; its result comes anyway

    def fence(self, written_block_ids: Sequence[int]) -> None:
        """Before the forward pass writes these blocks: no store may still be copying one
        of them out (see ``TransferEngine.fence``)."""
        if self.engine is not None and written_block_ids:
            self.engine.fence(written_block_ids)

    def start_loads(self, loads: Sequence[LoadPlan]) -> None:
        """Submit new loads, and retry parts that had to wait last time."""
        now = time.monotonic()
        for plan in loads:
            outcome = LoadOutcome.OK if plan.planned else LoadOutcome.UNPLANNED
            parts = self._split(plan.req_id, plan.transfers, tier_index=plan.tier_index)
            load = Load(plan=plan, started=now, parts=parts, outcome=outcome)
            self._loads[plan.req_id] = load
        self._submit_waiting(now)

    def save(self, stores: Sequence[StorePlan], mode: StackMode | None = None) -> None:
        """Gather this step's blocks now; the tiers are written in the background.

        ``mode``: the step's (``StackMode``; None: unchanged). Keeping takes effect
        before these stores, so that none of them evicts what the slower tiers keep
        (a store the first tier commits at once goes on at once); every other mode
        after them, so a switch to or from plain recency starts with the next step's
        stores (docs/DECISIONS.md, tiers under pressure, has what either order cost).
        """
        if mode is StackMode.KEEP_SLOWER:
            self.retention.use_mode(mode)
        self._save(stores)
        if mode is not None:
            self.retention.use_mode(mode)

    def _save(self, stores: Sequence[StorePlan]) -> None:
        engine = self._engine()
        for plan in stores:
            transfers = (*plan.transfers, *self._evicted(plan.refresh))
            for parts in self._pack(self._split(plan.req_id, transfers)):
                job_id = engine.submit_store(tuple(p.part for p in parts))
                for p in parts:
                    if job_id is None:
                        self.stats.groups[p.part.group_id].store_dropped_blocks += len(p.refs)
                        self._report.dropped += p.refs
                        continue
                    self._storing.update(p.part.keys)
                    self.retention.store_started(plan.req_id)
                if job_id is not None:
                    self._job_stores[job_id] = tuple(parts)

    def _evicted(self, refresh: Sequence[BlockTransfer]) -> list[BlockTransfer]:
        """Of blocks to store again (``StorePlan.refresh``), those the first tier no
        longer holds."""
        out: list[BlockTransfer] = []
        for t in refresh:
            if t.group_id not in self.held:
                continue
            held = self.store.first_holds(self.keys.keys_of(t.group_id, t.block_hashes))
            gone = [j for j, h in enumerate(held) if not h]
            if gone:
                self.stats.groups[t.group_id].refreshed_blocks += len(gone)
                out.append(t.picked(gone))
        return out

    def admit(self, refs: Sequence[BlockRef]) -> None:
        """Send these stored blocks on to the slower tiers (``Admission.REUSED``): now,
        or those still being stored once their store is done."""
        ours = [ref for ref in refs if ref.group_id in self.held]
        self.retention.admit(ours, self._storing)

    def finish_requests(self, req_ids: frozenset[str] | set[str]) -> None:
        """The engine finished these requests (their stores still run to the end)."""
        self.retention.finish(req_ids)

    def poll(self) -> WorkerReport:
        """Collect finished jobs; report loads that are complete and blocks stored."""
        self.collect_results()
        now = time.monotonic()
        self._submit_waiting(now)
        for req_id, load in list(self._loads.items()):
            if self._expired(load, now):
                load.outcome = LoadOutcome.TIMED_OUT
                self._drop_parts(load)
            if not load.jobs and not load.parts:
                self._finish(req_id, load, now)
        self.retention.touch_changed()
        self._take_tier_changes()
        return WorkerReport(ranks=(self._report.take(),))

    def collect_results(self) -> int:
        """Take the transfer engine's results; the blocks of stores still running."""
        if self.engine is not None:
            for result in self.engine.poll_finished():
                self._on_result(result)
        return self._storing.total()

    def _take_tier_changes(self) -> None:
        """What the tiers stored and removed, by block (recorded only when the engine
        publishes KV events; keys of other namespaces are left out)."""
        for change in self.store.take_changes():
            named = self.keys.parse(change.key)
            if named is not None:
                ref = BlockRef(*named)
                self._report.tier_changes.append(TierChange(change.tier_index, ref, change.stored))

    def wait_jobs(self, timeout_s: float | None = None) -> bool:
        """Block until every transfer job has its result (one given up on has it already)."""
        return self.engine is None or self.engine.wait(None, timeout_s)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no transfer job is running (tests, shutdown)."""
        return self.engine is None or self.engine.wait_idle(timeout_s)

    def check_integrity(self) -> None:
        if self.engine is not None:
            self.engine.check_integrity()
        self.store.check_integrity()
        assert {r for r, _ in self._job_loads.values()} <= set(self._loads), (
            "job of an unknown load"
        )
        storing = Counter(
            k for parts in self._job_stores.values() for p in parts for k in p.part.keys
        )
        assert storing == +self._storing, "in-flight store keys out of sync"
        self.retention.check_integrity(self._storing)

    def close(self) -> None:
        """Let stores and write-back finish for up to ``close_timeout_s``, count what they
        leave (``unflushed_blocks``), stop. Idempotent."""
        if not self._closed:
            self._closed = True
            close_worker(self, self.close_timeout_s)

    # --- internals ---------------------------------------------------------------

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("register the KV caches before moving blocks")
        return self.engine

    def _split(
        self, req_id: str, transfers: Sequence[BlockTransfer], *, tier_index: int | None = None
    ) -> list[Part]:
        """Parts of one group's blocks, each at most 1/JOB_SHARE of the staging arena
        (``_pack`` puts them into jobs); a load's parts name the tier it reads from
        (None: the cheapest holding each block). The request's chain learns every block.
        Groups this rank holds no layer of have none."""
        limit = self._job_limit()
        parts: list[Part] = []
        for t in transfers:
            if t.group_id not in self.held:
                continue
            per_job = max(1, limit // self.model_groups.groups[t.group_id].block_bytes)
            for start in range(0, len(t.block_ids), per_job):
                hashes = t.block_hashes[start : start + per_job]
                keys = self.keys.keys_of(t.group_id, hashes)
                block_ids = t.block_ids[start : start + per_job]
                indices = t.block_indices[start : start + per_job]
                part = TransferPart(t.group_id, block_ids, keys, tier_index)
                refs = tuple(BlockRef(t.group_id, h) for h in hashes)
                parts.append(Part(part, refs, req_id))
                self.retention.holds(req_id, t.group_id, indices, keys)
        return parts

    def _submit_waiting(self, now: float) -> None:
        for load in list(self._loads.values()):
            self._submit_load_parts(load, now)

    def _submit_load_parts(self, load: Load, now: float) -> None:
        engine = self._engine()
        while load.parts and load.outcome is LoadOutcome.OK:
            ready = self._unstoring(load.parts)
            if not ready:
                return
            parts = self._pack(ready)[0]
            deadline = load.started + (self.transfer_config.load_timeout_s or float("inf"))
            engine.fence([b for p in parts for b in p.part.block_ids])  # still copied out?
            job = tuple(p.part for p in parts)
            job_id = engine.submit_load(job, timeout_s=max(deadline - now, 1e-3))
            if job_id is None:
                return  # staging full: retry later
            del load.parts[: len(parts)]
            load.jobs.add(job_id)
            self._job_loads[job_id] = (load.plan.req_id, tuple(parts))

    def _unstoring(self, parts: list[Part]) -> list[Part]:
        """The parts before the first whose blocks a store of this worker still writes
        (read-your-writes: that one loads once the store is done)."""
        for i, p in enumerate(parts):
            if any(key in self._storing for key in p.part.keys):
                if not p.waited_for_store:
                    p.waited_for_store = True
                    self.stats.load_store_waits += 1
                return parts[:i]
        return parts

    def _pack(self, parts: list[Part]) -> list[list[Part]]:
        """Parts into jobs, a request's groups together (``worker_parts.pack``)."""
        return pack(parts, self._block_bytes, self._job_limit())

    def _block_bytes(self, group_id: int) -> int:
        return self.model_groups.groups[group_id].block_bytes

    def _job_limit(self) -> int:
        return max(self._engine().max_job_bytes // JOB_SHARE, 1)

    def _drop_parts(self, load: Load) -> None:
        """Forget jobs never submitted."""
        load.parts.clear()

    def _expired(self, load: Load, now: float) -> bool:
        timeout = self.transfer_config.load_timeout_s
        return bool(load.parts) and timeout is not None and now - load.started > timeout

    def _on_result(self, result: JobResult) -> None:
        loading = self._job_loads.pop(result.job_id, None)
        if loading is not None:
            req_id, load_parts = loading
            self._on_load_result(self._loads[req_id], load_parts, result)
            return
        parts = self._job_stores.pop(result.job_id, ())
        for p in parts:
            self._storing.subtract(p.part.keys)
            self.retention.store_ended(p.req_id)
            counts = self.stats.groups[p.part.group_id]
            block_bytes = self.model_groups.groups[p.part.group_id].block_bytes
            stored = refs_of((p,), result.ok_block_ids)
            failed = refs_of((p,), result.failed_block_ids)
            counts.stored_blocks += len(stored)
            counts.stored_bytes += len(stored) * block_bytes
            counts.store_dropped_blocks += len(failed)
            self._report.stored += stored
            self._report.dropped += failed
        self._storing = +self._storing  # drop zero counts
        self.retention.stored([key for p in parts for key in p.part.keys], self._storing)

    def _on_load_result(self, load: Load, parts: tuple[Part, ...], result: JobResult) -> None:
        load.jobs.discard(result.job_id)
        load.landed = max(load.landed or result.finished_at, result.finished_at)
        for group_id, ids in result.failed_block_ids.items():
            if ids:
                load.failed.setdefault(group_id, []).extend(ids)
        if result.outcome is JobOutcome.TIMED_OUT:
            load.outcome = LoadOutcome.TIMED_OUT
        elif not result.ok and load.outcome is LoadOutcome.OK:
            load.outcome = LoadOutcome.FAILED
        failed = refs_of(parts, result.failed_block_ids)
        if load.outcome is LoadOutcome.FAILED:
            self._report.missing += failed  # lookups stop offering them

    def _finish(self, req_id: str, load: Load, now: float) -> None:
        del self._loads[req_id]
        plan = load.plan
        failed = [tuple(load.failed.get(g, ())) for g in range(self.model_groups.num_groups)]
        if load.outcome not in (LoadOutcome.OK, LoadOutcome.FAILED):
            # The whole load is abandoned: blocks that did arrive are not used either.
            failed = [() for _ in range(self.model_groups.num_groups)]
            for t in plan.transfers:
                failed[t.group_id] = tuple(t.block_ids)
        self._report.finished_loads.append(
            LoadResult(req_id=req_id, outcome=load.outcome, failed_block_ids=tuple(failed))
        )
        self.stats.loads[load.outcome] += 1
        self.retention.touched(req_id)
        # Until the last block landed, not until this poll: vLLM polls once a step, and a
        # load that lands during a long prefill step would count the whole step.
        landed = load.landed
        end = now if landed is None or load.outcome is LoadOutcome.TIMED_OUT else landed
        self.stats.add_load_seconds(end - load.started)
        for t in plan.transfers:
            if t.group_id not in self.held:
                continue
            counts = self.stats.groups[t.group_id]
            num_failed = len(failed[t.group_id])
            num_loaded = len(t.block_ids) - num_failed
            counts.loaded_blocks += num_loaded
            counts.loaded_bytes += num_loaded * self.model_groups.groups[t.group_id].block_bytes
            counts.load_failed_blocks += num_failed
        if load.outcome is LoadOutcome.OK and plan.tier_index is not None:
            self.store.record_hit_tokens(plan.tier_index, plan.num_tokens - plan.base_tokens)
