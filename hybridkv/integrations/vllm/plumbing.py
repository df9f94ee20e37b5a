"""Carrying the connector's data through vLLM 0.32's connector plumbing.

vLLM's scheduler and worker processes. Wraps our step metadata and worker
reports in vLLM's types, turns a ``SchedulerOutput`` into a ``StepInput``,
asks for a block-major KV layout when the attention backends offer one,
finds a worker's tensor-parallel rank, and the worker-role connector vLLM
built in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hybridkv.connector.metadata import ConnectorMetadata, WorkerReport
from hybridkv.connector.steps import ScheduledRequest, StateHandoff, StepInput

logger = logging.getLogger(__name__)


class VllmMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Our ``ConnectorMetadata`` inside vLLM's scheduler output."""

    def __init__(self, meta: ConnectorMetadata) -> None:
        self.meta = meta


class VllmWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Our ``WorkerReport`` on its way from the workers to the scheduler."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, VllmWorkerMeta)
        return VllmWorkerMeta(self.report.merge(other.report))


def step_input(scheduler_output: Any, requests: Mapping[str, Any]) -> StepInput:
    """The requests scheduled this step, with their tokens taken from vLLM's requests."""
    scheduled: list[ScheduledRequest] = []
    num_tokens = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        request = requests.get(new.req_id)
        if request is None:
            continue
        scheduled.append(
            ScheduledRequest(
                req_id=new.req_id,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=num_tokens.get(new.req_id, 0),
                token_ids=request.all_token_ids,
                new_block_ids=_block_ids(new.block_ids),
                replaces_block_ids=True,
            )
        )
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        request = requests.get(req_id)
        if request is None:
            continue
        new_ids = cached.new_block_ids[i]
        scheduled.append(
            ScheduledRequest(
                req_id=req_id,
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=num_tokens.get(req_id, 0),
                token_ids=request.all_token_ids,
                new_block_ids=None if new_ids is None else _block_ids(new_ids),
                replaces_block_ids=req_id in cached.resumed_req_ids,
            )
        )
    preempted = frozenset(scheduler_output.preempted_req_ids or ())
    return StepInput(
        scheduled=tuple(scheduled),
        preempted_req_ids=preempted,
        finished_req_ids=frozenset(scheduler_output.finished_req_ids or ()),
        state_handoffs=state_handoffs(scheduler_output),
    )


def state_handoffs(scheduler_output: Any) -> dict[str, tuple[StateHandoff, ...]]:
    """The Mamba states vLLM hands connectors this step ("align" mode), by request.

    vLLM moves a request's running state between the last ``1 +
    num_speculative_blocks`` columns and exports prefill checkpoints into
    reserved ones, so a state block is named by id, never by position:
    ``boundary_state_offloads`` lists each committed boundary state as (group,
    block id, tokens). Steps without it (no Mamba group) hand over nothing.
    """
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(block_state, "boundary_state_offloads", None) or {}
    return {
        req_id: tuple(StateHandoff(int(g), int(b), int(n)) for g, b, n in entries)
        for req_id, entries in offloads.items()
    }


def _block_ids(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(ids) for ids in groups)


def is_cacheable(request: Any) -> bool:
    """Token ids alone name the request's KV (no embeddings, no multimodal inputs)."""
    return getattr(request, "prompt_embeds", None) is None and not getattr(
        request, "mm_features", None
    )


BLOCK_MAJOR_LAYOUT = "BLHNC"
"""Every layer's page of one block side by side: one copy moves a block of a group."""


def preferred_kv_cache_layout(vllm_config: Any) -> str | None:
    """Ask for the block-major layout when the attention backends offer it, else None.

    vLLM 0.32's CPU attention backend supports only ``LBHNC`` (one page per
    layer per block; measured): there the default is kept and per-layer copies
    are used, which the worker logs.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        supported = [
            layout.name
            for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))
        ]
    except Exception as exc:  # an internal API moved: keep the engine's default
        logger.info("hybridkv: cannot read the supported KV cache layouts (%r); default kept", exc)
        return None
    if BLOCK_MAJOR_LAYOUT in supported:
        logger.info("hybridkv asks for the block-major KV cache layout %s", BLOCK_MAJOR_LAYOUT)
        return BLOCK_MAJOR_LAYOUT
    logger.info(
        "hybridkv: the attention backends support only %s, not the block-major %s; "
        "keeping the default (blocks move with one copy per layer)",
        supported,
        BLOCK_MAJOR_LAYOUT,
    )
    return None


def tensor_parallel_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank; with ``tp_size > 1`` an unknown rank is an
    error (two ranks writing one rank's keys would serve each other's shards)."""
    if tp_size == 1:
        return 0
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception as exc:
        raise RuntimeError(
            f"hybridkv: tensor_parallel_size={tp_size} but this worker cannot read its "
            f"tensor-parallel rank ({exc!r}); the connector must be created after vLLM's "
            "distributed state is initialized"
        ) from exc
    if not 0 <= rank < tp_size:
        raise RuntimeError(f"hybridkv: tensor-parallel rank {rank} is outside 0..{tp_size - 1}")
    return rank


def worker_connector_in_process() -> object | None:
    """The worker-role connector vLLM built in this process, if any.

    vLLM builds each role's connector itself; with one rank its engine core
    runs the worker in its own process and builds the worker's connector
    before the scheduler's, so the scheduler's can read the worker's store.
    """
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        return get_kv_transfer_group() if has_kv_transfer_group() else None
    except Exception as exc:  # an internal API moved: look up hits as another process would
        logger.info("hybridkv: cannot read this process's worker connector (%r)", exc)
        return None
