"""Worker side of the connector: executes the scheduler's loads and stores.

Worker process (the one that owns the KV tensors); never decides what to
move. Loads run asynchronously on the transfer engine and are reported once
every block of the request has arrived, failed or timed out. Stores are
gathered from the KV tensors during ``save`` (the step that computed them,
before the engine can free or reuse the blocks) and written to the tiers in
the background; a store that cannot be queued is dropped and reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.connector.metadata import (
    BlockTransfer,
    ConnectorMetadata,
    LoadResult,
    LoadSpec,
    StoreSpec,
    WorkerReport,
)
from hybridkv.connector.routing import RoutedStore
from hybridkv.keys import KeyNamespace
from hybridkv.layout import CanonicalKVCaches, canonicalize
from hybridkv.spec import KVLayoutSpec
from hybridkv.tiers.base import StoreKey, Tier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.transfer import JobId, JobResult, TransferConfig, TransferEngine, TransferPart

logger = logging.getLogger(__name__)

JOB_SHARE = 4
"""A job takes at most 1/JOB_SHARE of the staging arena, so several fit at once."""


@dataclass(kw_only=True)
class WorkerStats:
    """Monotonic counters of the worker side (the tiers and transfers count their own)."""

    loads: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    loads_timed_out: int = 0
    loads_cancelled: int = 0
    load_blocks: int = 0
    load_failed_blocks: int = 0
    load_latency_s_sum: float = 0.0
    load_latency_s_max: float = 0.0
    store_blocks: int = 0
    store_blocks_dropped: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@dataclass(kw_only=True)
class _Load:
    spec: LoadSpec
    started: float
    parts: list[tuple[TransferPart, ...]]
    """Jobs not submitted yet (staging was full)."""
    jobs: set[JobId] = field(default_factory=set)
    failed: dict[int, list[int]] = field(default_factory=dict)
    timed_out: bool = False
    cancelled: bool = False


class ConnectorWorker:
    """Engine-neutral worker side; call its methods from one thread."""

    def __init__(
        self,
        layout: KVLayoutSpec,
        store: Tier,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        transfer_config: TransferConfig | None = None,
    ) -> None:
        self.layout = layout
        self.store = store
        self.routed = RoutedStore(store)
        self.transfer_config = transfer_config or TransferConfig()
        self.stats = WorkerStats()
        self.caches: CanonicalKVCaches | None = None
        self.engine: TransferEngine | None = None
        base = KeyNamespace.for_layout(layout, tp_rank=0, tp_size=tp_size).prefix
        own = KeyNamespace.for_layout(layout, tp_rank=tp_rank, tp_size=tp_size).prefix
        self._rank_prefixes = (base, own)
        self._loads: dict[str, _Load] = {}
        self._job_loads: dict[JobId, str] = {}
        self._job_stores: dict[JobId, tuple[TransferPart, ...]] = {}
        self._stored: list[StoreKey] = []
        self._missing: list[StoreKey] = []
        self._dropped: list[StoreKey] = []
        self._finished: list[LoadResult] = []

    # --- set-up ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> CanonicalKVCaches:
        """Describe the engine's KV tensors and start the transfer engine over them."""
        return self.register_canonical(canonicalize(kv_caches, self.layout))

    def register_canonical(self, caches: CanonicalKVCaches) -> CanonicalKVCaches:
        if self.engine is not None:
            raise RuntimeError("KV caches are already registered")
        self.caches = caches
        self.engine = TransferEngine(caches, self.routed, self.transfer_config)
        logger.info("worker KV caches: %s", caches.describe())
        return caches

    # --- every step ----------------------------------------------------------------

    def cancel(self, req_ids: frozenset[str] | set[str]) -> None:
        """Stop loads of requests preempted or finished (reported as cancelled)."""
        engine = self._engine()
        for req_id in req_ids:
            load = self._loads.get(req_id)
            if load is None:
                continue
            load.cancelled = True
            self._drop_parts(load)
            for job_id in list(load.jobs):
                engine.cancel(job_id)  # False: it is scattering; its result comes anyway

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        """Submit new loads, and retry parts that found staging full last time."""
        now = time.monotonic()
        for spec in loads:
            self.stats.loads += 1
            load = _Load(spec=spec, started=now, parts=self._load_jobs(spec))
            self._loads[spec.req_id] = load
        for load in list(self._loads.values()):
            self._submit_load_parts(load, now)

    def save(self, stores: Sequence[StoreSpec]) -> None:
        """Gather this step's blocks now; the tiers are written in the background."""
        engine = self._engine()
        for spec in stores:
            for parts in self._split(spec.transfers):
                n = sum(len(p.block_ids) for p in parts)
                job_id = engine.submit_store(parts)
                if job_id is None:
                    self.stats.store_blocks_dropped += n
                    self._dropped += [self._base_key(k) for p in parts for k in p.keys]
                    continue
                self.stats.store_blocks += n
                self._job_stores[job_id] = parts

    def handle_metadata(self, meta: ConnectorMetadata) -> None:
        """Everything of one step at once (for engines without separate hooks)."""
        self.cancel(meta.cancelled_req_ids)
        self.start_loads(meta.loads)
        self.save(meta.stores)

    def poll(self) -> WorkerReport:
        """Collect finished jobs; report loads that are complete and keys stored."""
        if self.engine is not None:
            for result in self.engine.poll_finished():
                self._on_result(result)
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            if self._expired(load, now):
                load.timed_out = True
                self._drop_parts(load)
            if not load.jobs and not load.parts:
                self._finish(req_id, load, now)
        report = WorkerReport(
            finished_loads=tuple(self._finished),
            stored_keys=tuple(self._stored),
            missing_keys=tuple(self._missing),
            dropped_keys=tuple(self._dropped),
        )
        self._finished, self._stored, self._missing, self._dropped = [], [], [], []
        return report

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no transfer job is running (tests, shutdown)."""
        return self.engine is None or self.engine.wait_idle(timeout_s)

    def check_integrity(self) -> None:
        if self.engine is not None:
            self.engine.check_integrity()
        self.store.check_integrity()
        assert set(self._job_loads.values()) <= set(self._loads), "job of an unknown load"
        if not self._loads:
            assert self.routed.num_routes == 0, "tier routes of finished loads were kept"

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.store.close()

    # --- internals ---------------------------------------------------------------

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("register the KV caches before moving blocks")
        return self.engine

    def _own_key(self, key: StoreKey) -> StoreKey:
        base, own = self._rank_prefixes
        return key if base == own else StoreKey(own + key[len(base) :])

    def _base_key(self, key: StoreKey) -> StoreKey:
        base, own = self._rank_prefixes
        return key if base == own else StoreKey(base + key[len(own) :])

    def _split(self, transfers: Sequence[BlockTransfer]) -> list[tuple[TransferPart, ...]]:
        """Jobs of at most one part per group and 1/JOB_SHARE of the staging arena."""
        limit = max(self._engine().max_job_bytes // JOB_SHARE, 1)
        jobs: list[tuple[TransferPart, ...]] = []
        for t in transfers:
            per_job = max(1, limit // self.layout.groups[t.group_id].block_bytes)
            for start in range(0, len(t.block_ids), per_job):
                keys = [self._own_key(k) for k in t.keys[start : start + per_job]]
                jobs.append((TransferPart(t.group_id, t.block_ids[start : start + per_job], keys),))
        return jobs

    def _load_jobs(self, spec: LoadSpec) -> list[tuple[TransferPart, ...]]:
        jobs = self._split(spec.transfers)
        if spec.tier_index is not None:
            for parts in jobs:
                self.routed.route([k for p in parts for k in p.keys], spec.tier_index)
        return jobs

    def _submit_load_parts(self, load: _Load, now: float) -> None:
        engine = self._engine()
        while load.parts and not load.cancelled:
            deadline = load.started + (self.transfer_config.load_timeout_s or float("inf"))
            job_id = engine.submit_load(load.parts[0], timeout_s=max(deadline - now, 1e-3))
            if job_id is None:
                return  # staging full: retry next step
            load.parts.pop(0)
            load.jobs.add(job_id)
            self._job_loads[job_id] = load.spec.req_id

    def _drop_parts(self, load: _Load) -> None:
        """Forget jobs never submitted (and their tier routes)."""
        self.routed.unroute([k for parts in load.parts for p in parts for k in p.keys])
        load.parts.clear()

    def _expired(self, load: _Load, now: float) -> bool:
        timeout = self.transfer_config.load_timeout_s
        return bool(load.parts) and timeout is not None and now - load.started > timeout

    def _on_result(self, result: JobResult) -> None:
        req_id = self._job_loads.pop(result.job_id, None)
        if req_id is not None:
            load = self._loads[req_id]
            load.jobs.discard(result.job_id)
            for group_id, ids in result.failed_block_ids.items():
                if ids:
                    load.failed.setdefault(group_id, []).extend(ids)
            if result.error is not None and result.error.startswith("timed out"):
                load.timed_out = True
            elif not load.cancelled:
                self._missing += self._keys_of(load.spec.transfers, result.failed_block_ids)
            self.routed.unroute(self._keys_of(load.spec.transfers, result.failed_block_ids))
            self.routed.unroute(self._keys_of(load.spec.transfers, result.ok_block_ids))
            return
        parts = self._job_stores.pop(result.job_id, ())
        self._stored += self._keys_of_parts(parts, result.ok_block_ids)
        failed = self._keys_of_parts(parts, result.failed_block_ids)
        self.stats.store_blocks_dropped += len(failed)
        self._dropped += [self._base_key(k) for k in failed]

    def _keys_of(
        self, transfers: Sequence[BlockTransfer], block_ids: Mapping[int, Sequence[int]]
    ) -> list[StoreKey]:
        keys: list[StoreKey] = []
        for t in transfers:
            wanted = set(block_ids.get(t.group_id, ()))
            keys += [
                self._own_key(k) for k, b in zip(t.keys, t.block_ids, strict=True) if b in wanted
            ]
        return keys

    @staticmethod
    def _keys_of_parts(
        parts: Sequence[TransferPart], block_ids: Mapping[int, Sequence[int]]
    ) -> list[StoreKey]:
        keys: list[StoreKey] = []
        for p in parts:
            wanted = set(block_ids.get(p.group_id, ()))
            keys += [k for k, b in zip(p.keys, p.block_ids, strict=True) if b in wanted]
        return keys

    def _finish(self, req_id: str, load: _Load, now: float) -> None:
        del self._loads[req_id]
        spec = load.spec
        failed = [tuple(load.failed.get(g, ())) for g in range(self.layout.num_groups)]
        if load.timed_out or load.cancelled:
            # The whole load is abandoned: blocks that did arrive are not used either.
            failed = [tuple(t.block_ids) for t in self._by_group(spec)]
        result = LoadResult(
            req_id=req_id,
            failed_block_ids=tuple(failed),
            timed_out=load.timed_out,
            cancelled=load.cancelled,
            unplanned=not spec.planned,
        )
        self._finished.append(result)
        num_blocks = sum(len(t.block_ids) for t in spec.transfers)
        self.stats.load_blocks += num_blocks
        self.stats.load_failed_blocks += sum(len(ids) for ids in failed)
        latency = now - load.started
        self.stats.load_latency_s_sum += latency
        self.stats.load_latency_s_max = max(self.stats.load_latency_s_max, latency)
        if load.cancelled:
            self.stats.loads_cancelled += 1
        elif result.ok:
            self.stats.loads_ok += 1
            if spec.tier_index is not None and isinstance(self.store, TieredStore):
                self.store.record_hit_tokens(
                    spec.tier_index, spec.num_tokens - spec.fallback_tokens
                )
        else:
            self.stats.loads_failed += 1
            self.stats.loads_timed_out += int(load.timed_out)

    def _by_group(self, spec: LoadSpec) -> list[BlockTransfer]:
        empty = [
            BlockTransfer(group_id=g, keys=(), block_ids=(), block_indices=())
            for g in range(self.layout.num_groups)
        ]
        for t in spec.transfers:
            empty[t.group_id] = t
        return empty
