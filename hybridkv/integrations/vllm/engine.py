"""Translation between vLLM 0.32's connector types and the engine-neutral connector.

Imported by ``hybridkv.vllm`` only, in vLLM's scheduler and worker
processes. Turns vLLM's ``KVCacheConfig`` into a ``KVLayoutSpec`` (refusing,
in one error, every group we cannot serve correctly), a ``SchedulerOutput``
into a ``StepInput``, and carries our metadata, worker reports and stats
through vLLM's connector plumbing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from hybridkv.connector.metadata import ConnectorMetadata, WorkerReport
from hybridkv.connector.steps import ScheduledRequest, StepInput
from hybridkv.spec import GroupKind, KVGroup, KVLayoutSpec

logger = logging.getLogger(__name__)

_KINDS: dict[type, GroupKind] = {
    FullAttentionSpec: GroupKind.FULL,
    MLAAttentionSpec: GroupKind.FULL,
    SlidingWindowSpec: GroupKind.SLIDING_WINDOW,
    SlidingWindowMLASpec: GroupKind.SLIDING_WINDOW,
    ChunkedLocalAttentionSpec: GroupKind.CHUNKED_LOCAL,
    MambaSpec: GroupKind.MAMBA,
}
"""Exact spec classes we serve; subclasses with other semantics are refused."""


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


@dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """What the adapter needs from vLLM's config, read once."""

    layout: KVLayoutSpec
    tp_size: int
    alignment_tokens: int
    kv_cache_layout: str | None


def _group_problems(group_id: int, group: Any, mamba_mode: str | None) -> list[str]:
    spec = group.kv_cache_spec
    name = type(spec).__name__
    where = f"KV cache group {group_id} ({name}, layers {list(group.layer_names)[:3]}...)"
    problems = []
    kind = _KINDS.get(type(spec))
    if name == "CrossAttentionSpec":
        problems.append(f"{where}: cross-attention (encoder-decoder) groups are not supported")
    elif kind is None:
        allowed = sorted(cls.__name__ for cls in _KINDS)
        problems.append(f"{where}: spec {name} is not supported; supported specs: {allowed}")
    if isinstance(spec, SlidingWindowMLASpec) and spec.bounded_replay:
        problems.append(f"{where}: bounded-replay sliding windows are not supported")
    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode != "align":
            problems.append(
                f"{where}: Mamba cache mode is {spec.mamba_cache_mode!r}; hybridkv needs "
                "'align' (enable prefix caching, or pass --mamba-cache-mode align)"
            )
        if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
            problems.append(
                f"{where}: Mamba groups with speculative or checkpoint blocks (speculative "
                "decoding) are not supported; disable speculative decoding"
            )
    if getattr(group, "host_resident", False) or not getattr(group, "enable_kv_transfer", True):
        problems.append(f"{where}: host-resident or non-transferable groups are not supported")
    if getattr(group, "is_eagle_group", False):
        problems.append(f"{where}: draft-model (EAGLE/MTP) groups are not supported")
    return problems


def check_engine(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, in one ValueError, every part of this engine we cannot serve correctly."""
    groups = kv_cache_config.kv_cache_groups
    parallel = vllm_config.parallel_config
    mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
    problems: list[str] = []
    if not groups:
        problems.append("the model has no KV cache groups; nothing to offload")
    for group_id, group in enumerate(groups):
        problems += _group_problems(group_id, group, mamba_mode)
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if pcp * dcp > 1:
        # Multi-group layouts cannot work with it; one group would need hits aligned to
        # block_size * dcp, which this connector does not do yet.
        problems.append(
            f"prefill/decode context parallel (pcp={pcp}, dcp={dcp}) is not supported "
            f"({len(groups)} KV cache groups); use pcp = dcp = 1"
        )
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported; use 1"
        )
    if getattr(vllm_config, "speculative_config", None) is not None and any(
        isinstance(g.kv_cache_spec, MambaSpec) for g in groups
    ):
        problems.append("speculative decoding with Mamba groups is not supported")
    if problems:
        raise ValueError(
            "hybridkv cannot serve this engine:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def page_size_bytes(spec: Any) -> int:
    """One layer's page: the bytes a kernel uses, without the allocator's padding."""
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real if isinstance(real, int) and real > 0 else spec.page_size_bytes)


def layout_from_config(kv_cache_config: Any, model_id: str) -> KVLayoutSpec:
    """vLLM's groups as a ``KVLayoutSpec`` (call ``check_engine`` first)."""
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = _KINDS[type(spec)]
        groups.append(
            KVGroup(
                kind=kind,
                block_size=int(spec.block_size),
                page_size_bytes=page_size_bytes(spec),
                layer_names=tuple(group.layer_names),
                sliding_window=spec.sliding_window if kind is GroupKind.SLIDING_WINDOW else None,
                attention_chunk_size=(
                    spec.attention_chunk_size if kind is GroupKind.CHUNKED_LOCAL else None
                ),
            )
        )
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or 0
    return KVLayoutSpec(groups=tuple(groups), hash_block_size=hash_block_size, model_id=model_id)


def default_model_id(vllm_config: Any) -> str:
    """The model and revision: what makes the weights (and so the KV) differ."""
    model_config = vllm_config.model_config
    revision = getattr(model_config, "revision", None)
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)


def model_namespace(model_id: str, vllm_config: Any, kv_cache_config: Any) -> str:
    """``model_id`` plus what changes the bytes of a page (KV dtype, in-page order)."""
    dtype = vllm_config.cache_config.cache_dtype
    if dtype == "auto":
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    in_page = layout[-3:] if len(layout) == 5 else layout
    return f"{model_id}|{dtype}|{in_page}"


def engine_facts(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> EngineFacts:
    check_engine(vllm_config, kv_cache_config)
    name = model_namespace(model_id or default_model_id(vllm_config), vllm_config, kv_cache_config)
    layout = layout_from_config(kv_cache_config, name)
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    return EngineFacts(
        layout=layout,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        alignment_tokens=int(alignment or layout.scheduler_block_size),
        kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None),
    )


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
    return StepInput(scheduled=tuple(scheduled), preempted_req_ids=preempted)


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
