"""What the connector needs to know about a vLLM 0.32 engine, read once from its config.

vLLM's scheduler and worker processes. Turns vLLM's ``KVCacheConfig`` into a
``ModelGroups`` (refusing, in one error, every group we cannot serve
correctly) and the engine's choices (hit alignment, tensor parallelism,
EAGLE-style drafting) into ``EngineFacts``. Values the engine picks (block
sizes vary by CPU) are always read from the engine, never assumed.
"""

from __future__ import annotations

import logging
from typing import Any

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


def _group_problems(group_id: int, group: Any, mamba_mode: str | None) -> list[str]:
    outer = type(group.kv_cache_spec).__name__
    where = f"KV cache group {group_id} ({outer}, layers {list(group.layer_names)[:3]}...)"
    problems = []
    specs = _layer_specs(group)
    if not specs:
        problems.append(f"{where}: the group has no layers")
    for cls in sorted({type(spec) for spec in specs.values()}, key=lambda c: c.__name__):
        name = cls.__name__
        if name == "CrossAttentionSpec":
            problems.append(f"{where}: cross-attention (encoder-decoder) groups are not supported")
        elif cls not in _KINDS:
            allowed = sorted(c.__name__ for c in _KINDS)
            problems.append(f"{where}: spec {name} is not supported; supported specs: {allowed}")
    mixed = _mixed_layer_problem(where, group)
    if mixed:
        problems.append(mixed)
    if any(isinstance(s, SlidingWindowMLASpec) and s.bounded_replay for s in specs.values()):
        problems.append(f"{where}: bounded-replay sliding windows are not supported")
    modes = {s.mamba_cache_mode for s in specs.values() if isinstance(s, MambaSpec)}
    if modes - {"align"}:
        problems.append(
            f"{where}: Mamba cache mode is {sorted(modes - {'align'})[0]!r}; of vLLM's two "
            "modes ('align', 'none') hybridkv needs 'align', where states are kept at block "
            "boundaries and handed to connectors: enable prefix caching and leave "
            "--mamba-cache-mode unset or 'align' (with prefix caching off vLLM uses 'none' "
            f"whatever it says; engine setting: {mamba_mode!r})"
        )
    if getattr(group, "host_resident", False) or not getattr(group, "enable_kv_transfer", True):
        problems.append(f"{where}: host-resident or non-transferable groups are not supported")
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
        # Several groups cannot work with it; one group would need hits aligned to
        # block_size * dcp, which this connector does not do yet.
        problems.append(
            f"prefill/decode context parallel (pcp={pcp}, dcp={dcp}) is not supported "
            f"({len(groups)} KV cache groups); use pcp = dcp = 1"
        )
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported; use 1"
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
        for spec in list(_layer_specs(group).values())[:1]
        if isinstance(spec, MambaSpec) and spec.block_size > alignment
    ]


def handoff_groups(kv_cache_config: Any) -> frozenset[int]:
    """The Mamba groups whose blocks do not keep a state at their position: with
    speculative blocks (the running state moves between the last ``1 +
    num_speculative_blocks`` columns) or prefill checkpoints (a state exported into
    a reserved column mid-step). Their states are stored as vLLM 0.32 hands them
    over by block id ("align" mode, ``SchedulerOutput.kv_connector_block_state``);
    other Mamba groups keep each step's state at its block, stored from there."""
    return frozenset(
        group_id
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        if any(
            isinstance(spec, MambaSpec)
            and (spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks)
            for spec in _layer_specs(group).values()
        )
    )


def page_size_bytes(spec: Any) -> int:
    """One layer's page: the bytes a kernel uses, without the allocator's padding."""
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real if isinstance(real, int) and real > 0 else spec.page_size_bytes)


def groups_from_config(kv_cache_config: Any, model_id: str) -> ModelGroups:
    """vLLM's groups as a ``ModelGroups`` (call ``check_engine`` first).

    A ``UniformTypeKVCacheSpecs`` group (DeepSeek-V4: compressed MLA + indexer
    caches, compressor states) keeps each layer's real page, in ``layer_names``
    order; when they are all equal the group is an ordinary uniform-page group.
    """
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        specs = _layer_specs(group)
        spec = next(iter(specs.values()))
        kind = _KINDS[type(spec)]
        pages = tuple(page_size_bytes(s) for s in specs.values())
        groups.append(
            KVGroup(
                kind=kind,
                block_size=int(spec.block_size),
                page_size_bytes=max(pages),
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
    model_groups = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    in_page = model_groups[-3:] if len(model_groups) == 5 else model_groups
    return f"{model_id}|{dtype}|{in_page}"


def engine_facts(
    vllm_config: Any, kv_cache_config: Any, model_id: str | None, engine_key: str
) -> EngineFacts:
    check_engine(vllm_config, kv_cache_config)
    name = model_namespace(model_id or default_model_id(vllm_config), vllm_config, kv_cache_config)
    model_groups = groups_from_config(kv_cache_config, name)
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    use_eagle, eagle_groups = eagle_drafting(vllm_config, kv_cache_config)
    return EngineFacts(
        model_groups=model_groups,
        alignment_tokens=int(alignment or model_groups.scheduler_block_size),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        use_eagle=use_eagle,
        eagle_group_ids=eagle_groups,
        handoff_group_ids=handoff_groups(kv_cache_config),
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
    groups = kv_cache_config.kv_cache_groups
    flagged = frozenset(i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False))
    # vLLM flags every group when none is flagged (a separate draft model's layers).
    return True, flagged or frozenset(range(len(groups)))
