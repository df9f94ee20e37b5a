"""vLLM 0.32 adapter: ``HybridKVConnector``, a thin shell over ``hybridkv.connector``.

Load it with ``--kv-transfer-config '{"kv_connector": "HybridKVConnector",
"kv_connector_module_path": "hybridkv.vllm", "kv_role": "kv_both"}'``. vLLM
builds one instance with the SCHEDULER role (EngineCore process) and one
with the WORKER role per worker (the same process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a separate one with the default
multiprocess executor). The worker instance owns the tiers; the scheduler
instance looks up hits in that very store when it shares the process, else
in lookup-only instances of the tiers it can see (disk, shared pools) plus
the keys workers report stored in their private CPU tier.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.metadata import ConnectorMetadata, WorkerReport
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.wiring import (
    build_lookup,
    build_store,
    register_local_store,
    unregister_local_store,
)
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.integrations.vllm.engine import (
    VllmMetadata,
    VllmWorkerMeta,
    engine_facts,
    is_cacheable,
    preferred_kv_cache_layout,
    step_input,
)
from hybridkv.integrations.vllm.metrics import (
    CounterDeltas,
    HybridKVPromMetrics,
    HybridKVStats,
    flatten,
)
from hybridkv.planner import ChunkPlan
from hybridkv.spec import GroupKind
from hybridkv.tiers.base import Tier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.transfer import TransferConfig

if TYPE_CHECKING:
    import torch

__all__ = ["HybridKVConnector"]

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """Show hybridkv's messages in vLLM's log, with its handlers and level.

    vLLM configures the ``vllm`` logger only; a plugin's own loggers would
    otherwise be silent in ``vllm serve``. Skipped when the application gave
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
        self.facts = engine_facts(vllm_config, kv_cache_config, self.config.model_id)
        self.alignment_tokens = self._alignment(vllm_config)
        self._engine_key = str(transfer_config.engine_id)
        groups = self.facts.layout.groups
        self._block_level_errors = len(groups) == 1 and groups[0].kind is GroupKind.FULL
        self._deltas = CounterDeltas()
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._store: TieredStore | None = None
        self._lookup_tiers: list[Tier] = []
        self._requests: dict[str, Any] = {}
        self._invalid_block_ids: set[int] = set()
        self._report = WorkerReport()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker()

    def _alignment(self, vllm_config: Any) -> int:
        layout = self.facts.layout
        chunk = self.config.chunk_tokens
        if chunk is None:
            return layout.scheduler_block_size
        ChunkPlan.build(layout, chunk, vllm_config.model_config.max_model_len)
        problems = []
        if chunk % layout.scheduler_block_size:
            problems.append(
                f"chunk_tokens={chunk} is not a multiple of the scheduler block size "
                f"{layout.scheduler_block_size}; use a multiple of it"
            )
        if chunk != layout.scheduler_block_size and any(
            g.kind is GroupKind.CHUNKED_LOCAL for g in layout.groups
        ):
            problems.append(
                f"chunk_tokens={chunk}: with chunked local attention hits must be aligned to "
                f"the block size {layout.scheduler_block_size}; leave chunk_tokens unset"
            )
        if problems:
            raise ValueError("kv_connector_extra_config: " + "; ".join(problems))
        return chunk

    def _init_scheduler(self, vllm_config: Any) -> None:
        lookup, self._lookup_tiers = build_lookup(self.config, self._engine_key)
        self._scheduler = ConnectorScheduler(
            self.facts.layout,
            lookup,
            alignment_tokens=self.alignment_tokens,
            hash_algo=self.config.hash_algo,
            selection=self.config.selection,
            tp_size=self.facts.tp_size,
        )
        transfer_config = vllm_config.kv_transfer_config
        if transfer_config.kv_load_failure_policy != "recompute":
            # A cache that cannot load a block costs a recompute, never a failed request.
            logger.info("hybridkv sets kv_load_failure_policy='recompute' (it is a cache)")
            transfer_config.kv_load_failure_policy = "recompute"
        logger.info(
            "hybridkv scheduler: %d KV groups %s, hits aligned to %d tokens, tiers %s",
            self.facts.layout.num_groups,
            [f"{g.kind.value}/{g.block_size}" for g in self.facts.layout.groups],
            self.alignment_tokens,
            [type(c).__name__ for c in self.config.tiers],
        )

    def _init_worker(self) -> None:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # distributed state not initialized (single process)
            tp_rank = 0
        self._store = build_store(self.config)
        self._worker = ConnectorWorker(
            self.facts.layout,
            self._store,
            tp_rank=tp_rank,
            tp_size=self.facts.tp_size,
            transfer_config=TransferConfig(load_timeout_s=self.config.load_timeout_s),
        )
        if tp_rank == 0:
            register_local_store(self._engine_key, self._store)

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
        caches = self._worker.register_kv_caches(kv_caches)
        logger.info(
            "hybridkv worker: engine KV cache layout %s; %s (%s copy per block and group)",
            self.facts.kv_cache_layout,
            caches.describe(),
            "one" if all(caches.block_major) else "one per layer",
        )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, VllmMetadata):
            self._worker.cancel(kv_connector_metadata.meta.cancelled_req_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_loads(self._meta().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # Mamba layers never come here: stores are gathered in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.save(self._meta().stores)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self._worker is None:
            return results
        report = self._worker.poll()
        self._report = self._report.merge(report)
        for load in report.finished_loads:
            results.finished_recving.add(load.req_id)
            if load.ok:
                continue
            failed = {b for ids in load.failed_block_ids for b in ids}
            if self._block_level_errors and failed and not load.cancelled:
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
        data = self._deltas.delta(self.counters())
        return HybridKVStats(data=data) if data else None

    def counters(self) -> dict[str, float]:
        """This side's counters since it started, named as in the ``hybridkv_*`` metrics.

        The engine ships them with its steps: what a write-back finishes after
        the last step reaches the metrics only with the next one.
        """
        counters: dict[str, float] = {}
        if self._scheduler is not None:
            counters.update(flatten("lookup", self._scheduler.stats.as_dict()))
        if self._worker is not None:
            counters.update(self._worker_counters())
        return counters

    def flush_writes(self, timeout_s: float | None = None) -> bool:
        """Worker side: wait until every queued write-back to the slower tiers is done
        (False on timeout). True at once on the scheduler side."""
        return self._store is None or self._store.flush(timeout_s)

    def _worker_counters(self) -> dict[str, float]:
        assert self._worker is not None and self._store is not None
        counters = flatten("load", self._worker.stats.as_dict())
        store_names = {"store_blocks", "store_blocks_dropped"}
        for name in store_names:
            counters[f"store.{name}"] = counters.pop(f"load.{name}")
        if self._worker.engine is not None:
            transfer = self._worker.engine.stats()
            counters["load.bytes"] = float(transfer.bytes["load"])
            counters["store.bytes"] = float(transfer.bytes["store"])
        for name, stats in self._store.stats_by_tier().items():
            counters.update(flatten(f"tier.{name}", stats.as_dict()))
        return counters

    def check_integrity(self) -> None:
        """Raise AssertionError if the worker side's bookkeeping is inconsistent.

        Worker side only (no-op on the scheduler side): staging fully accounted
        for, no bytes in flight beyond live jobs, tiers consistent.
        """
        if self._worker is not None:
            self._worker.check_integrity()

    def shutdown(self) -> None:
        if self._worker is not None and self._store is not None:
            unregister_local_store(self._engine_key, self._store)
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
        self._scheduler.allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> VllmMetadata:
        assert self._scheduler is not None
        step = step_input(scheduler_output, self._requests)
        return VllmMetadata(self._scheduler.build_metadata(step))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, VllmWorkerMeta):
            self._scheduler.process_report(meta.report)

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
