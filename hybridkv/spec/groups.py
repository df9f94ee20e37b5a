"""The KV cache model: groups of layers that share a kind and a block size.

Pure data, no I/O; used by the scheduler side and the worker side alike.
A hybrid model's KV cache is split into groups (full attention, sliding
window, chunked local attention, Mamba/linear attention); every group has its
own block size in tokens and its own page size (one layer's block, in bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from pydantic import StrictInt, StrictStr

from hybridkv.schema import CONFIG, parse
from hybridkv.spec.kinds import GroupKind, rules_for


@dataclass(frozen=True, kw_only=True)
class KVGroup:
    """One KV cache group: layers with the same kind and block size.

    ``page_size_bytes`` is one layer's block. Most groups have one page size for
    every layer; a group whose layers differ (vLLM's ``UniformTypeKVCacheSpecs``,
    e.g. DeepSeek-V4's compressed MLA + indexer group) lists each layer's page in
    ``layer_page_sizes_bytes`` and its ``page_size_bytes`` is the largest. A block
    of the whole group is the sum of its layers' pages (``block_bytes``).
    """

    __pydantic_config__ = CONFIG

    kind: GroupKind
    block_size: StrictInt
    page_size_bytes: StrictInt
    layer_names: tuple[StrictStr, ...]
    sliding_window: StrictInt | None = None
    attention_chunk_size: StrictInt | None = None
    layer_page_sizes_bytes: tuple[StrictInt, ...] = ()
    """Per layer, in ``layer_names`` order, when pages differ; empty: all ``page_size_bytes``."""

    def __post_init__(self) -> None:
        if not isinstance(self.layer_page_sizes_bytes, tuple):
            object.__setattr__(self, "layer_page_sizes_bytes", tuple(self.layer_page_sizes_bytes))
        if isinstance(self.layer_names, str | bytes):
            raise TypeError(
                f"invalid KVGroup: layer_names={self.layer_names!r} must be a sequence of "
                "layer names, not one string"
            )
        if not isinstance(self.layer_names, tuple):
            object.__setattr__(self, "layer_names", tuple(self.layer_names))
        problems = _group_problems(self)
        if problems:
            raise ValueError("invalid KVGroup: " + "; ".join(problems))

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def page_sizes_bytes(self) -> tuple[int, ...]:
        """Each layer's page, in ``layer_names`` order."""
        return self.layer_page_sizes_bytes or (self.page_size_bytes,) * self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers of the group."""
        if self.layer_page_sizes_bytes:
            return sum(self.layer_page_sizes_bytes)
        return self.page_size_bytes * self.num_layers

    @property
    def spec_key(self) -> tuple[Any, ...]:
        """Identity of the group's spec, layer names excluded.

        Groups with equal spec keys are searched together for hits: a block
        hits only if every such group holds it (as vLLM's coordinator does).
        A group with per-layer pages is its own spec: vLLM's per-layer spec
        collections name their layers, so two such groups never compare equal.
        """
        return (
            self.kind,
            self.block_size,
            self.page_size_bytes,
            self.sliding_window,
            self.attention_chunk_size,
            self.layer_names if self.layer_page_sizes_bytes else (),
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind.value,
            "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes,
            "layer_names": list(self.layer_names),
            "sliding_window": self.sliding_window,
            "attention_chunk_size": self.attention_chunk_size,
        }
        if self.layer_page_sizes_bytes:  # absent for uniform pages: layout files unchanged
            data["layer_page_sizes_bytes"] = list(self.layer_page_sizes_bytes)
        return data

    @classmethod
    def from_dict(cls, data: object, *, where: str = "group") -> KVGroup:
        group: KVGroup = parse(cls, data, where=where)
        return group


def _positive_int(name: str, value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name}={value!r} must be an int"
    if value <= 0:
        return f"{name}={value} must be > 0"
    return None


def _group_problems(group: KVGroup) -> list[str]:
    problems: list[str] = []
    if not isinstance(group.kind, GroupKind):
        problems.append(f"kind={group.kind!r} must be a GroupKind")
    for name in ("block_size", "page_size_bytes"):
        problem = _positive_int(name, getattr(group, name))
        if problem:
            problems.append(problem)
    if not group.layer_names:
        problems.append("layer_names is empty; a group needs at least one layer")
    elif len(set(group.layer_names)) != len(group.layer_names):
        problems.append(f"layer_names {list(group.layer_names)} has duplicates")
    problems += _layer_page_problems(group)
    if isinstance(group.kind, GroupKind):
        problems += rules_for(group.kind).param_problems(group)
    return problems


def _layer_page_problems(group: KVGroup) -> list[str]:
    pages = group.layer_page_sizes_bytes
    if not pages:
        return []
    bad = [p for p in pages if isinstance(p, bool) or not isinstance(p, int) or p <= 0]
    if bad:
        return [f"layer_page_sizes_bytes has {bad[:3]}; every page must be an int > 0"]
    problems = []
    if len(pages) != len(group.layer_names):
        problems.append(
            f"layer_page_sizes_bytes has {len(pages)} pages for {len(group.layer_names)} "
            "layers; give one page per layer, in layer_names order"
        )
    if isinstance(group.page_size_bytes, int) and group.page_size_bytes != max(pages):
        problems.append(
            f"page_size_bytes={group.page_size_bytes} must be the largest of "
            f"layer_page_sizes_bytes ({max(pages)})"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class KVLayoutSpec:
    """All groups of a model's KV cache plus the two block sizes derived from them.

    * ``scheduler_block_size``: the alignment of hits, a multiple of every
      group's block size (LCM by default).
    * ``hash_block_size``: the granularity of block hashes; every group's
      block size is a multiple of it (GCD by default).
    """

    __pydantic_config__ = CONFIG

    groups: tuple[KVGroup, ...]
    scheduler_block_size: StrictInt = 0
    hash_block_size: StrictInt = 0
    model_id: StrictStr = "model"
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.groups, tuple):
            object.__setattr__(self, "groups", tuple(self.groups))
        problems: list[str] = []
        if not self.groups:
            raise ValueError("invalid KVLayoutSpec: groups is empty; at least one group needed")
        sizes = [g.block_size for g in self.groups]
        if not self.scheduler_block_size:
            object.__setattr__(self, "scheduler_block_size", math.lcm(*sizes))
        if not self.hash_block_size:
            object.__setattr__(self, "hash_block_size", reduce(math.gcd, sizes))
        for name in ("scheduler_block_size", "hash_block_size"):
            problem = _positive_int(name, getattr(self, name))
            if problem:
                problems.append(problem)
        if problems:
            raise ValueError("invalid KVLayoutSpec: " + "; ".join(problems))
        layer_owner: dict[str, int] = {}
        for group_id, group in enumerate(self.groups):
            if group.block_size % self.hash_block_size:
                problems.append(
                    f"group {group_id} block_size={group.block_size} is not divisible by "
                    f"hash_block_size={self.hash_block_size} (use a hash_block_size dividing "
                    f"every group's block size, e.g. their GCD {reduce(math.gcd, sizes)})"
                )
            if self.scheduler_block_size % group.block_size:
                problems.append(
                    f"scheduler_block_size={self.scheduler_block_size} is not a multiple of "
                    f"group {group_id} block_size={group.block_size} (use a multiple of "
                    f"their LCM {math.lcm(*sizes)})"
                )
            for layer in group.layer_names:
                if layer in layer_owner:
                    problems.append(
                        f"layer {layer!r} is in group {layer_owner[layer]} and group {group_id}"
                    )
                layer_owner[layer] = group_id
        if not isinstance(self.model_id, str) or not self.model_id:
            problems.append(f"model_id={self.model_id!r} must be a non-empty string")
        if problems:
            raise ValueError("invalid KVLayoutSpec: " + "; ".join(problems))
        object.__setattr__(self, "_fingerprint", _fingerprint(self))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size for g in self.groups)

    @property
    def fingerprint(self) -> str:
        """Stable 16-hex-digit digest of what names stored blocks: groups, kinds, block
        sizes, windows, layers, in order (not pages: see ``_fingerprint``)."""
        return self._fingerprint

    def group_of_layer(self, layer_name: str) -> int:
        for group_id, group in enumerate(self.groups):
            if layer_name in group.layer_names:
                return group_id
        raise KeyError(f"layer {layer_name!r} is in no group")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "scheduler_block_size": self.scheduler_block_size,
            "hash_block_size": self.hash_block_size,
            "groups": [g.to_dict() for g in self.groups],
        }

    @classmethod
    def from_dict(cls, data: object, *, where: str = "layout") -> KVLayoutSpec:
        """A layout from its JSON form (``to_dict``); ConfigError lists every problem."""
        layout: KVLayoutSpec = parse(cls, data, where=where)
        return layout


def _fingerprint(spec: KVLayoutSpec) -> str:
    # Pages are left out: vLLM's scheduler process sees a group with per-layer pages
    # (DeepSeek-V4) as its first layer's spec, its workers see every page, and both
    # must name blocks alike. Page sizes follow from the model, dtype and in-page
    # layout (the key namespace) and each object's length is checked on load.
    groups = []
    for g in spec.groups:
        data = g.to_dict()
        del data["page_size_bytes"]
        data.pop("layer_page_sizes_bytes", None)
        groups.append(data)
    body = {
        "scheduler_block_size": spec.scheduler_block_size,
        "hash_block_size": spec.hash_block_size,
        "groups": groups,
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_layer_names(prefix: str, indices: Sequence[int]) -> tuple[str, ...]:
    """Layer names in vLLM's style, ``{prefix}.{i}``."""
    return tuple(f"{prefix}.{i}" for i in indices)
