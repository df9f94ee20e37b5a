"""Reach into an in-process vLLM 0.32 engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Test-only helpers used by ``tests.e2e.driver``: read the KV cache groups vLLM
made, wipe or zero KV blocks in every worker (so a warm run can only be right
if the loaded bytes are right; workers are reached through ``collective_rpc``,
so tensor-parallel ranks in their own processes are too), and read vLLM's
Prometheus counters. They touch vLLM internals on purpose; a vLLM upgrade that
moves them breaks these tests loudly, never silently.
"""

from __future__ import annotations

from typing import Any

import torch


def engine_core(llm: Any) -> Any:
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError(
            "engine core is in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    return core


def kv_cache_config(llm: Any) -> Any:
    return engine_core(llm).scheduler.kv_cache_config


def _group_kind(spec: Any) -> str:
    name = type(spec).__name__
    if name == "MambaSpec":
        return "mamba"
    if name == "SlidingWindowSpec":
        return "sliding_window"
    if name == "ChunkedLocalAttentionSpec":
        return "chunked_local"
    if name == "FullAttentionSpec":
        return "full"
    return name


def kv_cache_facts(llm: Any) -> dict[str, Any]:
    """The engine's KV cache groups (one JSON-able dict each, in its order) and the
    granularity of its prefix-cache hits: what block-size-dependent expectations use."""
    config = kv_cache_config(llm)
    return {
        "groups": kv_cache_groups(llm),
        "alignment_tokens": int(config.cache_hit_alignment_tokens),
        "hash_block_size": int(config.hash_block_size),
    }


def kv_cache_groups(llm: Any) -> list[dict[str, Any]]:
    """One JSON-able dict per KV cache group, in vLLM's group order."""
    groups = []
    for group in kv_cache_config(llm).kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append(
            {
                "kind": _group_kind(spec),
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "page_size_bytes": int(spec.page_size_bytes),
                "real_page_size_bytes": int(getattr(spec, "real_page_size_bytes", 0) or 0)
                or int(spec.page_size_bytes),
                "sliding_window": getattr(spec, "sliding_window", None),
                "layer_names": list(group.layer_names),
            }
        )
    return groups


def _layer_tensors(worker: Any, layer_name: str) -> list[torch.Tensor]:
    context = worker.model_runner.compilation_config.static_forward_context
    kv_cache = context[layer_name].kv_cache
    tensors = list(kv_cache) if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.numel() > 0]


def _zero_blocks_on_worker(
    worker: Any, layer_names: list[str] | None, block_ids: list[int] | None
) -> int:
    """In a worker: zero ``block_ids`` (or everything) of ``layer_names`` (None: every
    layer this worker holds, its pipeline stage's); bytes zeroed."""
    num_bytes = 0
    index = None if block_ids is None else torch.tensor(block_ids, dtype=torch.long)
    if layer_names is None:
        context = worker.model_runner.compilation_config.static_forward_context
        layer_names = [name for name, layer in context.items() if hasattr(layer, "kv_cache")]
    for layer_name in layer_names:
        for tensor in _layer_tensors(worker, layer_name):
            if index is None:
                tensor.zero_()
                num_bytes += tensor.numel() * tensor.element_size()
            else:
                tensor.index_fill_(0, index, 0)
    return num_bytes


def wipe_kv_cache(llm: Any) -> int:
    """Zero every KV block of every layer in every worker; returns the bytes zeroed
    (summed over ranks; views may overlap)."""
    return sum(llm.collective_rpc(_zero_blocks_on_worker, args=(None, None)))


def cached_block_ids(llm: Any, group_id: int) -> list[int]:
    """Block ids that vLLM's prefix cache holds for ``group_id``."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    block_ids: set[int] = set()
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        if get_group_id(key) != group_id:
            continue
        if isinstance(blocks, dict):
            block_ids.update(int(b) for b in blocks)
        else:
            block_ids.add(int(blocks.block_id))
    block_ids.discard(0)  # the null block
    return sorted(block_ids)


def zero_cached_blocks(llm: Any, group_id: int) -> int:
    """Zero the prefix-cached blocks of one group only; returns how many."""
    block_ids = cached_block_ids(llm, group_id)
    if not block_ids:
        return 0
    layer_names = list(kv_cache_config(llm).kv_cache_groups[group_id].layer_names)
    llm.collective_rpc(_zero_blocks_on_worker, args=(layer_names, block_ids))
    return len(block_ids)


def metric_totals(llm: Any) -> dict[str, float]:
    """Counters and gauges from ``llm.get_metrics()``, summed over engines.

    Keys are the metric name plus its labels other than ``engine`` and
    ``model_name``, e.g. ``vllm:prompt_tokens_by_source{source=external_kv_transfer}``.
    """
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if not isinstance(value, (int, float)):
            continue
        labels = {
            k: v for k, v in sorted(metric.labels.items()) if k not in ("engine", "model_name")
        }
        suffix = ",".join(f"{k}={v}" for k, v in labels.items())
        key = f"{metric.name}{{{suffix}}}" if suffix else metric.name
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def connector_stats(llm: Any) -> dict[str, float]:
    """The connector's own Prometheus counters, flattened to ``name{labels}: value``.

    ``llm.get_metrics()`` keeps only ``vllm:`` names, so the registry of this
    process (where the offline engine's stat logger records) is read directly.
    Keys drop the ``_total`` suffix and the ``engine``/``model_name`` labels.
    """
    from prometheus_client import REGISTRY

    del llm  # the registry is process-wide
    totals: dict[str, float] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("hybridkv"):
            continue
        for sample in family.samples:
            if not sample.name.endswith(("_total", "_count", "_sum")):
                continue  # skip _created samples and histogram buckets
            labels = {
                k: v for k, v in sorted(sample.labels.items()) if k not in ("engine", "model_name")
            }
            suffix = ",".join(f"{k}={v}" for k, v in labels.items())
            name = sample.name.removesuffix("_total")
            key = f"{name}{{{suffix}}}" if suffix else name
            totals[key] = totals.get(key, 0.0) + float(sample.value)
    return totals


def stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return metric_delta(before, after)


def _worker_connector() -> Any | None:
    """The KV connector of this process's worker, if there is one."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _settle_on_worker(worker: Any, timeout_s: float) -> dict[str, Any]:
    del worker
    connector = _worker_connector()
    if connector is None:
        return {}
    flushed = bool(connector.flush_writes(timeout_s))
    return {"flushed": flushed, "counters": connector.counters()}


def settle_connector(llm: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait for every worker connector's write-backs; then their counters since they
    started, summed over ranks.

    Metric snapshots taken right after ``generate`` may miss write-backs still
    running (they reach the metrics with a later engine step); these do not.
    """
    ranks = [r for r in llm.collective_rpc(_settle_on_worker, args=(timeout_s,)) if r]
    if not ranks:
        return {}
    counters: dict[str, float] = {}
    for rank in ranks:
        for key, value in rank["counters"].items():
            counters[key] = counters.get(key, 0.0) + value
    return {"flushed": all(r["flushed"] for r in ranks), "counters": counters}


def _integrity_on_worker(worker: Any) -> str:
    del worker
    connector = _worker_connector()
    if connector is None:
        return "no connector in this process"
    check = getattr(connector, "check_integrity", None)
    if check is None:
        return f"{type(connector).__name__} has no check_integrity()"
    try:
        check()
    except AssertionError as exc:
        return f"integrity check failed: {exc!r}"
    return "ok"


def check_connector_integrity(llm: Any) -> str:
    """Run every worker connector's ``check_integrity()``: "ok" or what failed, by rank."""
    results = list(llm.collective_rpc(_integrity_on_worker))
    if all(r == "ok" for r in results):
        return "ok"
    return "; ".join(f"rank {rank}: {r}" for rank, r in enumerate(results) if r != "ok")


def _json_hash(block_hash: Any) -> int | str:
    return block_hash if isinstance(block_hash, int) else bytes(block_hash).hex()


def _tier_blocks_on_worker(worker: Any, sequences: list[list[int]]) -> dict[str, Any]:
    """Every full block of each token sequence, per group: the engine's name of it (its
    prefix-caching hash, computed here with the engine's hash function) and whether each
    of this worker's tiers holds it (looked up by the connector's own store key)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    from hybridkv.keys import RequestBlockHasher

    connector = _worker_connector()
    if connector is None:
        return {}
    inner = connector._worker
    model_groups, store = inner.model_groups, inner.store
    hash_fn = get_hash_fn_by_name(worker.vllm_config.cache_config.prefix_caching_hash_algo)
    size = model_groups.hash_block_size
    rows = []
    for sequence, tokens in enumerate(sequences):
        hasher = RequestBlockHasher(size, algo=connector.config.hash_algo)
        hasher.extend(tokens)
        engine_hashes, parent = [], None
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash_block_tokens(hash_fn, parent, tokens[start : start + size], None)
            engine_hashes.append(maybe_convert_block_hash(parent))
        for group_id, group in enumerate(model_groups.groups):
            m = group.block_size // size
            num_blocks = len(hasher.block_hashes) // m
            keys = inner.keys.keys(group_id, hasher.block_hashes, range(num_blocks))
            held = [store.contains_many(keys, tier_index=t) for t in range(len(store.tiers))]
            rows += [
                {
                    "sequence": sequence,
                    "group_id": group_id,
                    "index": i,
                    "engine_hash": _json_hash(engine_hashes[(i + 1) * m - 1]),
                    "tiers": [found[i] for found in held],
                }
                for i in range(num_blocks)
            ]
    stats = store.stats_by_tier()
    return {"rows": rows, "evictions": {name: s.evictions for name, s in stats.items()}}


def tier_blocks(llm: Any, sequences: list[list[int]]) -> dict[str, Any]:
    """``_tier_blocks_on_worker`` of the first rank (in this process)."""
    return next(r for r in llm.collective_rpc(_tier_blocks_on_worker, args=(sequences,)) if r)


def native_signatures() -> dict[str, list[str]]:
    """Every numba-compiled function of hybridkv imported in this process, with the
    argument types it is compiled (or loaded from the cache) for."""
    import importlib
    import pkgutil
    import sys

    from numba.core.registry import CPUDispatcher

    import hybridkv

    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(hybridkv.__path__, "hybridkv."):
        module = sys.modules.get(info.name)
        if module is None:  # never imported here: nothing of it compiled
            continue
        for name, value in vars(importlib.import_module(info.name)).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == info.name:
                found[f"{info.name}.{name}"] = sorted(str(s) for s in value.signatures)
    return found
