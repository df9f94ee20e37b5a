"""What the connector needs to know about a vLLM 0.32 engine, read once from its config.

vLLM's scheduler and worker processes. Turns vLLM's ``KVCacheConfig`` into a
``ModelGroups`` of the groups it serves (``served``: those vLLM lets a
connector store under a prefix hash; refusing, in one error, every served
group we cannot serve correctly) and the engine's choices (hit alignment,
tensor and pipeline parallelism, EAGLE-style drafting) into ``EngineFacts``.
Values the engine picks (block sizes vary by CPU) are always read from the
engine, never assumed.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from hybridkv.connector.setup import EngineFacts
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.integrations.vllm.served import ServedGroups

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


def _layer_specs(group: Any) -> dict[str, Any]:
    """Each layer's spec: a ``UniformTypeKVCacheSpecs`` group lists them, any other
    group has one spec for all its layers."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return {name: spec.kv_cache_specs[name] for name in group.layer_names}
    return dict.fromkeys(group.layer_names, spec)


def _spec_params(spec: Any) -> tuple[Any, ...]:
    """What must agree between a group's layers: kind, block size, window, chunk."""
    return (
        _KINDS.get(type(spec)),
        spec.block_size,
        getattr(spec, "sliding_window", None),
        getattr(spec, "attention_chunk_size", None),
    )


def _mixed_layer_problem(where: str, group: Any) -> str | None:
    """A per-layer spec group whose layers are not one hybridkv kind with one block
    size, window and chunk size (vLLM's grouping never makes one; refuse if it does)."""
    by_params: dict[tuple[Any, ...], list[str]] = {}
    for name, spec in _layer_specs(group).items():
        by_params.setdefault(_spec_params(spec), []).append(name)
    if len(by_params) <= 1:
        return None
    found = "; ".join(
        f"{layers[:2]}: {type(_layer_specs(group)[layers[0]]).__name__} "
        f"block_size={params[1]} sliding_window={params[2]} attention_chunk_size={params[3]}"
        for params, layers in by_params.items()
    )
    return (
        f"{where}: its layers' specs differ ({found}); hybridkv needs every layer of a "
        "group to have the same kind, block size, window and chunk size"
    )


def _group_problems(group_id: int, group: Any, mamba_mode: str | None, pp_size: int) -> list[str]:
    outer = type(group.kv_cache_spec).__name__
    where = f"KV cache group {group_id} ({outer}, layers {list(group.layer_names)[:3]}...)"
    problems = []
    specs = _layer_specs(group)
    if not specs and pp_size == 1:  # a pipeline stage may hold no layer of a group
        problems.append(f"{where}: the group has no layers")
    classes = {type(spec) for spec in specs.values()} or {
        type(_any_layer_spec(group.kv_cache_spec))
    }
    for cls in sorted(classes, key=lambda c: c.__name__):
        name = cls.__name__
        if name == "CrossAttentionSpec":
            problems.append(f"{where}: cross-attention (encoder-decoder) groups are not supported")
        elif cls not in _KINDS:
            allowed = sorted(c.__name__ for c in _KINDS)
            problems.append(f"{where}: spec {name} is not supported; supported specs: {allowed}")
    mixed = _mixed_layer_problem(where, group)
    if mixed:
        problems.append(mixed)
    modes = {s.mamba_cache_mode for s in specs.values() if isinstance(s, MambaSpec)}
    if modes - {"align"}:
        problems.append(
            f"{where}: Mamba cache mode is {sorted(modes - {'align'})[0]!r}; of vLLM's two "
            "modes ('align', 'none') hybridkv needs 'align', where states are kept at block "
            "boundaries and handed to connectors: enable prefix caching and leave "
            "--mamba-cache-mode unset or 'align' (with prefix caching off vLLM uses 'none' "
            f"whatever it says; engine setting: {mamba_mode!r})"
        )
    return problems


def check_engine(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, in one ValueError, every part of this engine we cannot serve correctly."""
    groups = kv_cache_config.kv_cache_groups
    parallel = vllm_config.parallel_config
    mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
    problems: list[str] = []
    served = ServedGroups.of(kv_cache_config)
    if not served.engine_group_ids:
        problems.append(
            f"none of the model's {len(groups)} KV cache groups can be stored under a prefix "
            "hash (vLLM's prefix_cacheable_group_ids, in the device pool); nothing to offload: "
            "serve this model without hybridkv"
        )
    for group_id in served.engine_group_ids:  # the others are skipped: the engine recomputes
        pp_size = parallel.pipeline_parallel_size
        problems += _group_problems(group_id, groups[group_id], mamba_mode, pp_size)
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        # Prefill context parallel shards a block's tokens across ranks that vLLM's
        # block ids do not name per rank; decode context parallel is served.
        problems.append(
            f"prefill context parallel (prefill_context_parallel_size={pcp}) is not "
            "supported; use 1 (decode context parallel, decode_context_parallel_size > 1, "
            "is)"
        )
    problems += _partial_hit_problems(kv_cache_config)
    if problems:
        raise ValueError(
            "hybridkv cannot serve this engine:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _partial_hit_problems(kv_cache_config: Any) -> list[str]:
    """Hits inside a Mamba block: with ``prefix_match_unit`` below the Mamba block
    size, vLLM resumes a request at a hash block inside a Mamba block from a state
    copied out of it (a partial tail); hybridkv keys and loads whole blocks."""
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    if not alignment:
        return []
    return [
        f"KV cache group {group_id} (Mamba, block_size={spec.block_size}): vLLM's prefix-cache "
        f"hits land every {alignment} tokens (its hash block size), inside the group's "
        "blocks, resuming from a state copied out of a block (a partial tail); hybridkv "
        "stores and loads whole Mamba blocks only: unset --prefix-match-unit or set it to "
        f"{spec.block_size}, so hits land on block boundaries"
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        for spec in [_any_layer_spec(group.kv_cache_spec)]
        if isinstance(spec, MambaSpec) and spec.block_size > alignment
    ]


def handoff_groups(kv_cache_config: Any) -> frozenset[int]:
    """The Mamba groups whose blocks do not keep a state at their position: with
    speculative blocks (the running state moves between the last ``1 +
    num_speculative_blocks`` columns) or prefill checkpoints (a state exported into
    a reserved column mid-step). Their states are stored as vLLM 0.32 hands them
    over by block id ("align" mode, ``SchedulerOutput.kv_connector_block_state``);
    other Mamba groups keep each step's state at its block, stored from there. A
    group's spec stands for all its layers, so a pipeline stage without any of them
    answers as the others do."""
    return frozenset(
        group_id
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        for spec in [_any_layer_spec(group.kv_cache_spec)]
        if isinstance(spec, MambaSpec)
        and (spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks)
    )


def page_size_bytes(spec: Any) -> int:
    """One layer's page: the bytes a kernel uses, without the allocator's padding."""
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real if isinstance(real, int) and real > 0 else spec.page_size_bytes)


def groups_from_config(kv_cache_config: Any, model_id: str, dcp_world_size: int = 1) -> ModelGroups:
    """vLLM's served groups as a ``ModelGroups``, in vLLM's order (call ``check_engine``
    first; ``ServedGroups`` maps the ids).

    A group's block spans the tokens of one block-table entry: with decode context
    parallel (``dcp_world_size``) a sharded group's (full attention) spans
    ``block_size * dcp_world_size`` tokens, each rank holding its share of them in a
    block of ``block_size``; a replicated one's (Mamba) ``block_size``, as vLLM's
    ``resolve_dcp_kv_block_size`` says.

    A ``UniformTypeKVCacheSpecs`` group (DeepSeek-V4: compressed MLA + indexer
    caches, compressor states) keeps each layer's real page, in ``layer_names``
    order; when they are all equal the group is an ordinary uniform-page group.
    """
    groups = []
    for group in ServedGroups.of(kv_cache_config).select(kv_cache_config.kv_cache_groups):
        specs = _layer_specs(group)
        spec = next(iter(specs.values()), None) or _any_layer_spec(group.kv_cache_spec)
        kind = _KINDS[type(spec)]
        pages = tuple(page_size_bytes(s) for s in specs.values())
        groups.append(
            KVGroup(
                kind=kind,
                block_size=resolve_dcp_kv_block_size(spec, dcp_world_size),
                page_size_bytes=max(pages, default=page_size_bytes(spec)),
                layer_names=tuple(specs),
                sliding_window=spec.sliding_window if kind is GroupKind.SLIDING_WINDOW else None,
                attention_chunk_size=(
                    spec.attention_chunk_size if kind is GroupKind.CHUNKED_LOCAL else None
                ),
                layer_page_sizes_bytes=pages if len(set(pages)) > 1 else (),
            )
        )
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or 0
    return ModelGroups(groups=tuple(groups), hash_block_size=hash_block_size, model_id=model_id)


def _any_layer_spec(spec: Any) -> Any:
    """A layer's spec of a group this pipeline stage holds no layer of (vLLM keeps the
    group's spec there, a per-layer collection naming the other stages' layers)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


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
    kv_cache_layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    in_page = kv_cache_layout[-3:] if len(kv_cache_layout) == 5 else kv_cache_layout
    return f"{model_id}|{dtype}|{in_page}"


def engine_facts(
    vllm_config: Any, kv_cache_config: Any, model_id: str | None, engine_key: str
) -> EngineFacts:
    check_engine(vllm_config, kv_cache_config)
    name = model_namespace(model_id or default_model_id(vllm_config), vllm_config, kv_cache_config)
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1))
    model_groups = groups_from_config(kv_cache_config, name, dcp)
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    use_eagle, eagle_groups = eagle_drafting(vllm_config, kv_cache_config)
    served = ServedGroups.of(kv_cache_config)
    every_group = served.engine_group_ids == tuple(range(served.num_engine_groups))
    return EngineFacts(
        model_groups=model_groups,
        alignment_tokens=int(alignment or model_groups.scheduler_block_size),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        pp_size=int(vllm_config.parallel_config.pipeline_parallel_size),
        use_eagle=use_eagle,
        eagle_group_ids=eagle_groups,
        handoff_group_ids=served.ours(sorted(handoff_groups(kv_cache_config))),
        engine_group_ids=() if every_group else served.engine_group_ids,
        engine_key=engine_key,
    )


def eagle_drafting(vllm_config: Any, kv_cache_config: Any) -> tuple[bool, frozenset[int]]:
    """Whether the engine drops the last block of its hits for EAGLE-style drafting, and
    which groups drop it (as vLLM's KV cache manager decides)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False, frozenset()
    drop = getattr(spec, "use_eagle_block_drop", None)
    use_eagle = bool(drop() if callable(drop) else spec.use_eagle())
    if not use_eagle:
        return False, frozenset()
    served = ServedGroups.of(kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    flagged = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)]
    # vLLM flags every group when none is flagged (a separate draft model's layers).
    return True, served.ours(flagged or range(len(groups)))
