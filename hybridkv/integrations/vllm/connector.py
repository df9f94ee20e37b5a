"""vLLM 0.32 adapter: ``HybridKVConnector``, a thin shell over ``hybridkv.connector``.

Load it with ``--kv-transfer-config '{"kv_connector": "HybridKVConnector",
"kv_connector_module_path": "hybridkv.vllm", "kv_role": "kv_both"}'``. vLLM
builds one instance with the SCHEDULER role (EngineCore process) and one
with the WORKER role per worker (per rank; the same process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one rank, separate ones otherwise).
With pipeline parallel the scheduler side is built once the workers sent their
stages' groups (vLLM's handshake, before the first request). This class only
translates: facts come from ``facts``, vLLM's types from ``plumbing``, metrics
from ``metrics``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.events import TierEvents, event_source
from hybridkv.connector.metadata import ConnectorMetadata, LoadOutcome, WorkerReport
from hybridkv.connector.metrics import Sample, scheduler_samples, worker_samples
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.setup import build_scheduler, build_worker, engine_ranks
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import GroupKind
from hybridkv.integrations.vllm.events import BlockEvents, group_events
from hybridkv.integrations.vllm.facts import engine_facts
from hybridkv.integrations.vllm.metrics import (
    CounterDeltas,
    HybridKVPromMetrics,
    HybridKVStats,
    stats_data,
)
from hybridkv.integrations.vllm.plumbing import (
    StageGroups,
    VllmMetadata,
    VllmWorkerMeta,
    is_cacheable,
    preferred_kv_cache_layout,
    step_input,
    with_stages,
    worker_connector_in_process,
    worker_rank,
)
from hybridkv.integrations.vllm.served import ServedGroups
from hybridkv.tiers.base import Tier, TierMedium
from hybridkv.tiers.tiered.changes import ChangeLog
from hybridkv.tiers.tiered.store import TieredStore

if TYPE_CHECKING:
    import torch

__all__ = ["HybridKVConnector"]

logger = logging.getLogger(__name__)

_SOURCES = {
    TierMedium.MEMORY: CacheHitSource.HOST,
    TierMedium.DISK: CacheHitSource.DISK,
    TierMedium.REMOTE: CacheHitSource.P2P,
}
"""What vLLM's ``prompt_tokens_cached_by_source`` calls hits from each medium."""


def _log_through_vllm() -> None:
    """Show hybridkv's messages in vLLM's log, with its handlers and level.

    vLLM configures the ``vllm`` logger only; a plugin's own loggers would
    otherwise be silent in the server. Skipped when the application gave
    ``hybridkv`` handlers of its own.
    """
    ours = logging.getLogger("hybridkv")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level or logging.INFO)
    ours.propagate = False


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Offloads and shares the KV cache of hybrid models with the hybrid allocator on."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        transfer_config = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_dict(transfer_config.kv_connector_extra_config)
        self.facts = engine_facts(
            vllm_config, kv_cache_config, self.config.model_id, str(transfer_config.engine_id)
        )
        self._served = ServedGroups.of(kv_cache_config)
        """The groups hybridkv serves, by vLLM's ids (the others the engine recomputes)."""
        groups = self.facts.model_groups.groups
        one_group = self._served.num_engine_groups == 1
        self._block_level_errors = one_group and groups[0].kind is GroupKind.FULL
        self._deltas = CounterDeltas()
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._lookup_tiers: list[Tier] = []
        self._requests: dict[str, Any] = {}
        self._invalid_block_ids: set[int] = set()
        self._report = WorkerReport()
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._publish_events = bool(events_config and events_config.enable_kv_cache_events)
        self._events: BlockEvents | None = None
        if role != KVConnectorRole.SCHEDULER:
            self._init_worker()
            return
        if transfer_config.kv_load_failure_policy != "recompute":
            # A cache that cannot load a block costs a recompute, never a failed request.
            logger.info("hybridkv sets kv_load_failure_policy='recompute' (it is a cache)")
            transfer_config.kv_load_failure_policy = "recompute"
        if self.facts.pp_size == 1:
            self._init_scheduler()

    def _init_scheduler(self) -> None:
        self._scheduler, self._lookup_tiers = build_scheduler(
            self.config, self.facts, worker_store=self._worker_store_in_process()
        )
        if self._publish_events:
            ranks = engine_ranks(self.facts)
            hash_block_size = getattr(self._kv_cache_config, "hash_block_size", None)
            self._events = BlockEvents(
                group_events(self._kv_cache_config, self._served),
                hash_block_size or self.facts.model_groups.hash_block_size,
                [event_source(c) for c in self.config.tier_configs],
                tiers=TierEvents(ranks.world_size, holders=ranks.holders),
            )
        model_groups = self.facts.model_groups
        logger.info(
            "hybridkv scheduler: %d KV groups %s, hits aligned to %d tokens%s, tiers %s",
            model_groups.num_groups,
            [f"{g.kind.value}/{g.block_size}" for g in model_groups.groups],
            self._scheduler.alignment_tokens,
            ", EAGLE drafting" if self.facts.use_eagle else "",
            [c.kind for c in self.config.tier_configs],
        )

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Scheduler side, with pipeline parallel: every stage's groups, from the workers;
        the scheduler side is built with them."""
        if self._scheduler is None and self.facts.pp_size > 1:
            self.facts = with_stages(self.facts, metadata)
            self._init_scheduler()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker side: this stage's groups for the scheduler (pipeline parallel only)."""
        if self._worker is None or self.facts.pp_size == 1:
            return None
        return StageGroups(self.facts.model_groups)

    def _init_worker(self) -> None:
        rank = worker_rank(self.facts.tp_size, self.facts.pp_size)
        self._worker = build_worker(self.config, self.facts, rank=rank)
        if self._publish_events:  # the scheduler publishes what the tiers store and remove
            self._worker.store.record_changes(ChangeLog())

    def _worker_store_in_process(self) -> TieredStore | None:
        """This engine's one worker's store, when vLLM built that worker in this process."""
        other = worker_connector_in_process()
        one_rank = self.facts.tp_size * self.facts.pp_size == 1
        if not one_rank or not isinstance(other, HybridKVConnector):
            return None
        if other._worker is None or other.facts.engine_key != self.facts.engine_key:
            return None
        return other._worker.store

    # --- class-level hooks -----------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        _log_through_vllm()
        return preferred_kv_cache_layout(vllm_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridKVStats:
        return HybridKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HybridKVPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker side -------------------------------------------------------------------

    def _meta(self) -> ConnectorMetadata:
        meta = self._connector_metadata
        return meta.meta if isinstance(meta, VllmMetadata) else ConnectorMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        caches = self._worker.register_kv_caches(
            self._served.served_layers(self._kv_cache_config, kv_caches)
        )
        logger.info(
            "hybridkv worker %s: %s; %s per block and group",
            self._worker.rank.label,
            caches.describe(),
            "one copy" if all(caches.block_major) else "one copy per layer",
        )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, VllmMetadata):
            meta = kv_connector_metadata.meta
            self._worker.cancel(meta.cancelled_req_ids)
            # vLLM calls this before it zeroes the step's new blocks (every model with a
            # Mamba layer zeroes them): a store still copying one out must end first.
            self._worker.fence(meta.written_block_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            meta = self._meta()
            self._worker.fence(meta.written_block_ids)  # before the forward pass writes them
            self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # Mamba layers never come here: stores are gathered in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None:
            meta = self._meta()
            self._worker.save(meta.stores, meta.mode)
            self._worker.admit(meta.admitted)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self._worker is None:
            return results
        self._worker.finish_requests(finished_req_ids)
        report = self._worker.poll()
        self._report = self._report.merge(report)
        for rank_report in report.ranks:
            for load in rank_report.finished_loads:
                # Failed loads are reported finished too (vLLM requires it without an
                # aggregator), and failed below.
                results.finished_recving.add(load.req_id)
                if load.ok:
                    continue
                failed = {b for ids in load.failed_block_ids for b in ids}
                if self._block_level_errors and failed and load.outcome is LoadOutcome.FAILED:
                    self._invalid_block_ids |= failed  # the engine keeps the prefix before them
                else:
                    results.failed_recving.add(load.req_id)  # block ids overlap across groups
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def build_connector_worker_meta(self) -> VllmWorkerMeta | None:
        report, self._report = self._report, WorkerReport()
        return None if report.is_empty else VllmWorkerMeta(report)

    def get_kv_connector_stats(self) -> HybridKVStats | None:
        counters = self._deltas.delta(self._samples())
        seconds = self._worker.stats.take_load_seconds() if self._worker is not None else []
        data = stats_data(counters, seconds)
        return HybridKVStats(data=data) if data else None

    def _samples(self) -> list[Sample]:
        samples: list[Sample] = []
        if self._scheduler is not None:
            scheduler = self._scheduler
            samples += scheduler_samples(scheduler.stats, scheduler.state_sizes())
        if self._worker is not None:
            worker = self._worker
            tiers = worker.store.stats_by_tier()
            samples += worker_samples(worker.stats, self.facts.model_groups, tiers)
        return samples

    def counters(self) -> dict[str, float]:
        """This side's totals since it started, by ``name{label=value,...}``.

        The engine ships deltas of them with its steps: what a write-back
        finishes after the last step reaches the metrics only with the next one.
        """
        return {sample.key: float(sample.value) for sample in self._samples()}

    def flush_writes(self, timeout_s: float | None = None) -> bool:
        """Worker side: wait until every store job has written its blocks to the first
        tier, then until every queued write-back to the slower tiers is done (False on
        timeout). True at once on the scheduler side."""
        if self._worker is None:
            return True
        end = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._worker.wait_jobs(timeout_s):
            return False
        return self._worker.store.flush(None if end is None else max(0.0, end - time.monotonic()))

    def check_integrity(self) -> None:
        """Raise AssertionError if the worker side's bookkeeping is inconsistent.

        Worker side only (no-op on the scheduler side): staging fully accounted
        for, no bytes in flight beyond live jobs, tiers consistent.
        """
        if self._worker is not None:
            self._worker.check_integrity()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        for tier in self._lookup_tiers:
            tier.close()
        self._lookup_tiers = []

    # --- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._requests[request.request_id] = request
        lora = getattr(request, "lora_request", None)
        self._scheduler.add_request(
            request.request_id,
            cache_salt=getattr(request, "cache_salt", None),
            lora_name=None if lora is None else lora.lora_name,
            cacheable=is_cacheable(request),
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if request.request_id not in self._requests:
            self.on_new_request(request)
        result = self._scheduler.lookup(
            request.request_id, request.all_token_ids, num_computed_tokens
        )
        return result.num_tokens, result.is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = self._served.select(blocks.get_block_ids())
        self._scheduler.allocated(request.request_id, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Where the hit just planned comes from: host memory, disk or a remote pool."""
        assert self._scheduler is not None
        by_tier = self._scheduler.hit_sources(request.request_id)
        tiers = self.config.tier_configs
        sources: dict[CacheHitSource, int] = {}
        for tier_index, num_tokens in by_tier.items():
            source = _SOURCES[tiers[tier_index].medium]
            sources[source] = sources.get(source, 0) + num_tokens
        if sum(sources.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return sources

    def build_connector_meta(self, scheduler_output: Any) -> VllmMetadata:
        assert self._scheduler is not None
        step = step_input(scheduler_output, self._requests, self._served)
        meta = self._scheduler.build_metadata(step)
        if self._events is not None:
            self._events.note_plans(meta, self._requests)
        return VllmMetadata(meta)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, VllmWorkerMeta):
            self._scheduler.process_report(meta.report)
            if self._events is not None:
                self._events.take_report(meta.report)

    def take_events(self) -> Iterable[Any]:
        """What the tiers stored and removed, as vLLM's KV events (published with the
        engine's own, in the same batch); nothing unless the engine publishes events."""
        return () if self._events is None else self._events.take_events()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._requests.pop(request.request_id, None)
        return self._scheduler.request_finished(request.request_id), None

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_external=True)``: hybridkv keeps its tiers
        (they are the point of it); only the engine's own cache is reset."""
        logger.info("hybridkv: reset of the external cache asked; its tiers are kept")
        return None
