"""A model's KV cache groups: layers that share a kind and a block size.

Pure data, no I/O; used by the scheduler side and the worker side alike.
A hybrid model's KV cache is split into groups (full attention, sliding
window, chunked local attention, Mamba/linear attention); every group has its
own block size in tokens and its own page size (one layer's block, in bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Annotated, Any

from pydantic import Field, StrictStr

from hybridkv.groups.kinds import GroupKind, rules_for
from hybridkv.schema import (
    CONFIG,
    Distinct,
    NonEmptyStr,
    NonNegativeInt,
    PositiveInt,
    check_fields,
    parse,
)

LayerNames = Annotated[tuple[StrictStr, ...], Distinct]
"""A group's layers, each named once; none on a pipeline stage that holds no layer of
the group (the model's groups as that stage sees them)."""


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
    block_size: PositiveInt
    page_size_bytes: PositiveInt
    layer_names: LayerNames
    sliding_window: PositiveInt | None = None
    attention_chunk_size: PositiveInt | None = None
    layer_page_sizes_bytes: tuple[PositiveInt, ...] = ()
    """Per layer, in ``layer_names`` order, when pages differ; empty: all ``page_size_bytes``."""

    def __post_init__(self) -> None:
        _lists_as_tuples(self, "layer_names", "layer_page_sizes_bytes")
        problems = check_fields(self)
        if problems.valid("kind", "block_size", "sliding_window", "attention_chunk_size"):
            problems.add(rules_for(self.kind).param_problems(self))
        if problems.valid("page_size_bytes", "layer_names", "layer_page_sizes_bytes"):
            problems.add(_layer_page_problems(self))
        problems.raise_if_any()

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
    def search_key(self) -> tuple[Any, ...]:
        """What the group shares with others searched with it, layer names excluded.

        Groups with equal search keys are searched together for hits: a block
        hits only if every such group holds it (as vLLM's coordinator does).
        A group with per-layer pages is searched alone: vLLM's per-layer spec
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
        if self.layer_page_sizes_bytes:  # absent for uniform pages: groups files unchanged
            data["layer_page_sizes_bytes"] = list(self.layer_page_sizes_bytes)
        return data

    @classmethod
    def from_dict(cls, data: object, *, where: str = "group") -> KVGroup:
        group: KVGroup = parse(cls, data, where=where)
        return group


def _lists_as_tuples(obj: object, *names: str) -> None:
    """Lists given for tuple fields, as tuples (the field types hold them to tuples)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, list):
            object.__setattr__(obj, name, tuple(value))


def _layer_page_problems(group: KVGroup) -> list[str]:
    pages = group.layer_page_sizes_bytes
    if not pages:
        return []
    problems = []
    if len(pages) != len(group.layer_names):
        problems.append(
            f"layer_page_sizes_bytes has {len(pages)} pages for {len(group.layer_names)} "
            "layers; give one page per layer, in layer_names order"
        )
    if group.page_size_bytes != max(pages):
        problems.append(
            f"page_size_bytes={group.page_size_bytes} must be the largest of "
            f"layer_page_sizes_bytes ({max(pages)})"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class ModelGroups:
    """All groups of a model's KV cache plus the two block sizes derived from them.

    * ``scheduler_block_size``: the alignment of hits, a multiple of every
      group's block size (LCM by default).
    * ``hash_block_size``: the granularity of block hashes; every group's
      block size is a multiple of it (GCD by default).
    """

    __pydantic_config__ = CONFIG

    groups: Annotated[tuple[KVGroup, ...], Field(min_length=1)]
    scheduler_block_size: NonNegativeInt = 0
    """0: the LCM of the groups' block sizes."""
    hash_block_size: NonNegativeInt = 0
    """0: the GCD of the groups' block sizes."""
    model_id: NonEmptyStr = "model"
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _lists_as_tuples(self, "groups")
        problems = check_fields(self)
        if problems.valid("groups", "scheduler_block_size", "hash_block_size"):
            sizes = [g.block_size for g in self.groups]
            if not self.scheduler_block_size:
                object.__setattr__(self, "scheduler_block_size", math.lcm(*sizes))
            if not self.hash_block_size:
                object.__setattr__(self, "hash_block_size", reduce(math.gcd, sizes))
            problems.add(_block_size_problems(self))
        if problems.valid("groups"):
            problems.add(_shared_layer_problems(self.groups))
            if not any(g.layer_names for g in self.groups):
                problems.add(["every group has no layers; at least one group needs a layer"])
        problems.raise_if_any()
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
    def from_dict(cls, data: object, *, where: str = "model groups") -> ModelGroups:
        """Model groups from their JSON form (``to_dict``); ConfigError lists every problem."""
        model_groups: ModelGroups = parse(cls, data, where=where)
        return model_groups


def merge_stages(stages: Sequence[ModelGroups]) -> ModelGroups:
    """The whole model's groups from each pipeline stage's (the stages' layers of each
    group, in stage order: the groups one stage holding every layer would have)."""
    groups = []
    for per_stage in zip(*(s.groups for s in stages), strict=True):
        held = [g for g in per_stage if g.layer_names]
        pages = [p for g in held for p in g.page_sizes_bytes]
        uniform = all(not g.layer_page_sizes_bytes for g in held)
        groups.append(
            dataclasses.replace(
                per_stage[0],
                layer_names=tuple(name for g in held for name in g.layer_names),
                page_size_bytes=max(pages, default=per_stage[0].page_size_bytes),
                layer_page_sizes_bytes=() if uniform else tuple(pages),
            )
        )
    first = stages[0]
    return dataclasses.replace(first, groups=tuple(groups))


def _block_size_problems(model_groups: ModelGroups) -> list[str]:
    sizes = model_groups.block_sizes
    problems = []
    for group_id, size in enumerate(sizes):
        if size % model_groups.hash_block_size:
            problems.append(
                f"group {group_id} block_size={size} is not divisible by "
                f"hash_block_size={model_groups.hash_block_size} (use a hash_block_size dividing "
                f"every group's block size, e.g. their GCD {reduce(math.gcd, sizes)})"
            )
        if model_groups.scheduler_block_size % size:
            problems.append(
                f"scheduler_block_size={model_groups.scheduler_block_size} is not a multiple of "
                f"group {group_id} block_size={size} (use a multiple of their LCM "
                f"{math.lcm(*sizes)})"
            )
    return problems


def _shared_layer_problems(groups: Sequence[KVGroup]) -> list[str]:
    problems = []
    layer_owner: dict[str, int] = {}
    for group_id, group in enumerate(groups):
        for layer in group.layer_names:
            if layer in layer_owner:
                problems.append(
                    f"layer {layer!r} is in group {layer_owner[layer]} and group {group_id}"
                )
            layer_owner[layer] = group_id
    return problems


def _fingerprint(model_groups: ModelGroups) -> str:
    # Pages are left out: vLLM's scheduler process sees a group with per-layer pages
    # (DeepSeek-V4) as its first layer's spec, its workers see every page, and both
    # must name blocks alike. Page sizes follow from the model, dtype and in-page
    # layout (the key namespace) and each object's length is checked on load.
    groups = []
    for g in model_groups.groups:
        data = g.to_dict()
        del data["page_size_bytes"]
        data.pop("layer_page_sizes_bytes", None)
        groups.append(data)
    body = {
        "scheduler_block_size": model_groups.scheduler_block_size,
        "hash_block_size": model_groups.hash_block_size,
        "groups": groups,
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_layer_names(prefix: str, indices: Sequence[int]) -> tuple[str, ...]:
    """Layer names in vLLM's style, ``{prefix}.{i}``."""
    return tuple(f"{prefix}.{i}" for i in indices)
