"""Carrying the connector's data through vLLM 0.32's connector plumbing.

vLLM's scheduler and worker processes. Wraps our step metadata and worker
reports in vLLM's types, turns a ``SchedulerOutput`` into a ``StepInput``,
asks for a block-major KV layout when the attention backends offer one,
finds a worker's rank (pipeline stage and tensor-parallel rank), carries each
stage's groups to the scheduler in vLLM's handshake, and finds the worker-role
connector vLLM built in this process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hybridkv.connector.metadata import ConnectorMetadata, WorkerReport
from hybridkv.connector.setup import EngineFacts
from hybridkv.connector.steps import ScheduledRequest, StateHandoff, StepInput
from hybridkv.groups import ModelGroups, merge_stages
from hybridkv.integrations.vllm.served import ServedGroups
from hybridkv.tiers.ranks import WorkerRank

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


def step_input(
    scheduler_output: Any, requests: Mapping[str, Any], served: ServedGroups
) -> StepInput:
    """The requests scheduled this step, with their tokens taken from vLLM's requests and
    the block ids of the groups hybridkv serves (``served``)."""
    scheduled: list[ScheduledRequest] = []
    others: list[int] = []
    num_tokens = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        others += served.unserved_device_blocks(new.block_ids)
        request = requests.get(new.req_id)
        if request is None:
            continue
        scheduled.append(
            ScheduledRequest(
                req_id=new.req_id,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=num_tokens.get(new.req_id, 0),
                token_ids=request.all_token_ids,
                new_block_ids=_block_ids(served.select(new.block_ids)),
                replaces_block_ids=True,
            )
        )
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        others += () if new_ids is None else served.unserved_device_blocks(new_ids)
        request = requests.get(req_id)
        if request is None:
            continue
        scheduled.append(
            ScheduledRequest(
                req_id=req_id,
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=num_tokens.get(req_id, 0),
                token_ids=request.all_token_ids,
                new_block_ids=None if new_ids is None else _block_ids(served.select(new_ids)),
                replaces_block_ids=req_id in cached.resumed_req_ids,
            )
        )
    preempted = frozenset(scheduler_output.preempted_req_ids or ())
    return StepInput(
        scheduled=tuple(scheduled),
        preempted_req_ids=preempted,
        finished_req_ids=frozenset(scheduler_output.finished_req_ids or ()),
        state_handoffs=state_handoffs(scheduler_output, served),
        other_block_ids=tuple(others),
    )


def state_handoffs(
    scheduler_output: Any, served: ServedGroups
) -> dict[str, tuple[StateHandoff, ...]]:
    """The Mamba states vLLM hands connectors this step ("align" mode), by request.

    vLLM moves a request's running state between the last ``1 +
    num_speculative_blocks`` columns and exports prefill checkpoints into
    reserved ones, so a state block is named by id, never by position:
    ``boundary_state_offloads`` lists each committed boundary state as (group,
    block id, tokens). Steps without it (no Mamba group) hand over nothing. vLLM
    names the group by its own id; hand-offs of groups hybridkv does not serve
    (``served``) are left out.
    """
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(block_state, "boundary_state_offloads", None) or {}
    ours = {engine: ours for ours, engine in enumerate(served.engine_group_ids)}
    handoffs = {
        req_id: tuple(
            StateHandoff(ours[int(g)], int(b), int(n)) for g, b, n in entries if int(g) in ours
        )
        for req_id, entries in offloads.items()
    }
    return {req_id: entries for req_id, entries in handoffs.items() if entries}


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
    layer per block): there the default is kept and per-layer copies are used,
    which the worker logs.
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


def worker_rank(tp_size: int, pp_size: int) -> WorkerRank:
    """This worker's rank; with several an unknown rank is an error (two ranks writing
    one rank's keys would serve each other's shards or layers)."""
    if tp_size * pp_size == 1:
        return WorkerRank()
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception as exc:
        raise RuntimeError(
            f"hybridkv: tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size} but "
            f"this worker cannot read its rank ({exc!r}); the connector must be created after "
            "vLLM's distributed state is initialized"
        ) from exc
    try:
        return WorkerRank(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
    except ValueError as exc:
        raise RuntimeError(f"hybridkv: this worker's rank is out of range: {exc}") from None


class StageGroups(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """A worker's groups with its pipeline stage's layers, sent to the scheduler once
    when the engine starts (vLLM's handshake): the scheduler needs every stage's to
    name each rank's keys and know which ranks hold which groups."""

    def __init__(self, model_groups: ModelGroups) -> None:
        self.groups = model_groups.to_dict()


def with_stages(facts: EngineFacts, metadata: Mapping[tuple[int, int], object]) -> EngineFacts:
    """The scheduler's facts with every stage's groups, from the workers' handshake, and
    the whole model's groups merged from them."""
    stages = stage_groups(metadata, facts.tp_size, facts.pp_size)
    return dataclasses.replace(facts, model_groups=merge_stages(stages), stage_groups=stages)


def stage_groups(
    metadata: Mapping[tuple[int, int], object], tp_size: int, pp_size: int
) -> tuple[ModelGroups, ...]:
    """Each stage's groups, from every worker's ``StageGroups`` keyed by (stage, tp rank);
    RuntimeError when a worker's is missing or two ranks of a stage disagree."""
    stages: list[ModelGroups] = []
    for pp_rank in range(pp_size):
        found = []
        for tp_rank in range(tp_size):
            meta = metadata.get((pp_rank, tp_rank))
            if not isinstance(meta, StageGroups):
                raise RuntimeError(
                    f"hybridkv: no groups from the worker of stage {pp_rank}, tensor-parallel "
                    f"rank {tp_rank} (got {type(meta).__name__}); every worker sends its own"
                )
            found.append(ModelGroups.from_dict(meta.groups))
        if len({g.fingerprint for g in found}) != 1:
            raise RuntimeError(f"hybridkv: the ranks of pipeline stage {pp_rank} hold other layers")
        stages.append(found[0])
    return tuple(stages)


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
