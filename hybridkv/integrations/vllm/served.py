"""Which of vLLM's KV cache groups hybridkv serves, and their ids on both sides.

vLLM's scheduler and worker processes. vLLM numbers groups by their place in
``kv_cache_config.kv_cache_groups``; hybridkv's ``ModelGroups`` holds only the
groups it serves, numbered densely. A group is served when vLLM itself lets a
connector store it under a prefix hash: prefix-cacheable and transferable
(``KVCacheConfig.prefix_cacheable_group_ids``, as vLLM's offloading and Mooncake
store connectors choose), and in the device pool (not HiSparse's host-resident
pool). The others (bounded-replay sliding windows, per-request scratch, replicas
vLLM rebuilds from their source group) are skipped: a hit covers the served
groups and the engine recomputes the rest, as it does for vLLM's own
connectors. Every place where per-group block ids or layer names cross between
vLLM and hybridkv goes through ``ServedGroups``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ServedGroups:
    """vLLM's group ids of the groups hybridkv serves, in hybridkv's order."""

    engine_group_ids: tuple[int, ...]
    """``engine_group_ids[ours]``: vLLM's id of hybridkv's group ``ours``."""
    num_engine_groups: int
    device_group_ids: tuple[int, ...]
    """vLLM's groups whose blocks come from the device pool (all but host-resident)."""

    @classmethod
    def of(cls, kv_cache_config: Any) -> ServedGroups:
        groups = list(kv_cache_config.kv_cache_groups)
        device = tuple(i for i, g in enumerate(groups) if not getattr(g, "host_resident", False))
        cacheable = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
        if cacheable is None:  # a config without the property: read it from each group
            cacheable = tuple(i for i, g in enumerate(groups) if _prefix_cacheable(g))
        served = tuple(i for i in cacheable if i in device)
        return cls(engine_group_ids=served, num_engine_groups=len(groups), device_group_ids=device)

    @property
    def skipped_group_ids(self) -> tuple[int, ...]:
        """vLLM's ids of the groups hybridkv does not serve."""
        served = set(self.engine_group_ids)
        return tuple(i for i in range(self.num_engine_groups) if i not in served)

    def ours(self, engine_group_ids: Sequence[int]) -> frozenset[int]:
        """hybridkv's ids of the served groups among vLLM's ``engine_group_ids``."""
        index = {engine: ours for ours, engine in enumerate(self.engine_group_ids)}
        return frozenset(index[i] for i in engine_group_ids if i in index)

    def select(self, per_engine_group: Sequence[T]) -> tuple[T, ...]:
        """Of one entry per vLLM group (block ids, say), the served groups', in our order."""
        if len(per_engine_group) != self.num_engine_groups:
            raise ValueError(
                f"{len(per_engine_group)} entries for the engine's {self.num_engine_groups} KV "
                "cache groups; vLLM passes one per group"
            )
        return tuple(per_engine_group[i] for i in self.engine_group_ids)

    def unserved_device_blocks(self, per_engine_group: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Block ids of the skipped groups that live in the device pool: the pool the
        served groups share, so a block a store still copies out may be one of them."""
        served = set(self.engine_group_ids)
        return tuple(
            b
            for i in self.device_group_ids
            if i not in served and i < len(per_engine_group)
            for b in per_engine_group[i]
            if b
        )

    def served_layers(self, kv_cache_config: Any, kv_caches: Mapping[str, T]) -> dict[str, T]:
        """The KV tensors of the served groups' layers (vLLM registers every layer)."""
        groups = kv_cache_config.kv_cache_groups
        names = {n for i in self.engine_group_ids for n in groups[i].layer_names}
        return {name: tensor for name, tensor in kv_caches.items() if name in names}


def _prefix_cacheable(group: Any) -> bool:
    spec_cacheable = getattr(group.kv_cache_spec, "prefix_cacheable", True)
    return bool(getattr(group, "enable_kv_transfer", True) and spec_cacheable)
