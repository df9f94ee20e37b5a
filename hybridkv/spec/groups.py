"""The KV cache model: groups of layers that share a kind and a block size.

Pure data, no I/O; used by the scheduler side and the worker side alike.
A hybrid model's KV cache is split into groups (full attention, sliding
window, chunked local attention, Mamba/linear attention); every group has its
own block size in tokens and its own page size (one layer's block, in bytes).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any


class GroupKind(enum.Enum):
    """Which tokens a group needs to resume a request at a given length."""

    FULL = "full"
    """Every past token: a hit is a prefix."""
    SLIDING_WINDOW = "sliding_window"
    """Only the last ``sliding_window - 1`` tokens before the resume point."""
    CHUNKED_LOCAL = "chunked_local"
    """Only the tokens since the start of the current attention chunk."""
    MAMBA = "mamba"
    """Only the recurrent state after the last block."""


@dataclass(frozen=True, kw_only=True)
class KVGroup:
    """One KV cache group: layers with the same kind, block size and page size.

    ``page_size_bytes`` is one layer's block; a block of the whole group is
    ``page_size_bytes * num_layers`` bytes.
    """

    kind: GroupKind
    block_size: int
    page_size_bytes: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
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
    def block_bytes(self) -> int:
        """Bytes of one block across all layers of the group."""
        return self.page_size_bytes * self.num_layers

    @property
    def spec_key(self) -> tuple[Any, ...]:
        """Identity of the group's spec, layer names excluded.

        Groups with equal spec keys are searched together for hits: a block
        hits only if every such group holds it (as vLLM's coordinator does).
        """
        return (
            self.kind,
            self.block_size,
            self.page_size_bytes,
            self.sliding_window,
            self.attention_chunk_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes,
            "layer_names": list(self.layer_names),
            "sliding_window": self.sliding_window,
            "attention_chunk_size": self.attention_chunk_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "group") -> KVGroup:
        allowed = {
            "kind",
            "block_size",
            "page_size_bytes",
            "layer_names",
            "sliding_window",
            "attention_chunk_size",
        }
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {type(data).__name__}")
        problems: list[str] = []
        unknown = sorted(set(data) - allowed)
        if unknown:
            problems.append(f"unknown keys {unknown}; allowed: {sorted(allowed)}")
        missing = sorted({"kind", "block_size", "page_size_bytes", "layer_names"} - set(data))
        if missing:
            problems.append(f"missing required keys {missing}")
        kinds = [k.value for k in GroupKind]
        if "kind" in data and data["kind"] not in kinds:
            problems.append(f"kind={data['kind']!r} is not one of {kinds}")
        names = data.get("layer_names")
        if "layer_names" in data and (
            not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names)
        ):
            problems.append(f"layer_names={names!r} must be a list of strings")
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        try:
            return cls(
                kind=GroupKind(data["kind"]),
                block_size=data["block_size"],
                page_size_bytes=data["page_size_bytes"],
                layer_names=tuple(data["layer_names"]),
                sliding_window=data.get("sliding_window"),
                attention_chunk_size=data.get("attention_chunk_size"),
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None


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
    window, chunk = group.sliding_window, group.attention_chunk_size
    if group.kind is GroupKind.SLIDING_WINDOW:
        problem = _positive_int("sliding_window", window)
        if problem:
            problems.append(problem + " (required for kind SLIDING_WINDOW)")
    elif window is not None:
        problems.append(f"sliding_window={window} is only allowed for kind SLIDING_WINDOW")
    if group.kind is GroupKind.CHUNKED_LOCAL:
        problem = _positive_int("attention_chunk_size", chunk)
        if problem:
            problems.append(problem + " (required for kind CHUNKED_LOCAL)")
        elif (
            isinstance(group.block_size, int) and group.block_size > 0 and chunk % group.block_size  # type: ignore[operator]
        ):
            problems.append(
                f"attention_chunk_size={chunk} must be a multiple of block_size={group.block_size}"
            )
    elif chunk is not None:
        problems.append(f"attention_chunk_size={chunk} is only allowed for kind CHUNKED_LOCAL")
    return problems


@dataclass(frozen=True, kw_only=True)
class KVLayoutSpec:
    """All groups of a model's KV cache plus the two block sizes derived from them.

    * ``scheduler_block_size``: the alignment of hits, a multiple of every
      group's block size (LCM by default).
    * ``hash_block_size``: the granularity of block hashes; every group's
      block size is a multiple of it (GCD by default).
    """

    groups: tuple[KVGroup, ...]
    scheduler_block_size: int = 0
    hash_block_size: int = 0
    model_id: str = "model"
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
        """Stable 16-hex-digit digest of everything that shapes stored bytes."""
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
    def from_dict(cls, data: dict[str, Any]) -> KVLayoutSpec:
        if not isinstance(data, dict):
            raise ValueError(f"layout must be a JSON object, got {type(data).__name__}")
        allowed = {"model_id", "scheduler_block_size", "hash_block_size", "groups"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"layout: unknown keys {unknown}; allowed: {sorted(allowed)}")
        raw_groups = data.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise ValueError("layout: 'groups' must be a non-empty list of group objects")
        problems: list[str] = []
        groups: list[KVGroup] = []
        for i, raw in enumerate(raw_groups):
            try:
                groups.append(KVGroup.from_dict(raw, where=f"groups[{i}]"))
            except (ValueError, TypeError) as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("invalid layout: " + "; ".join(problems))
        return cls(
            groups=tuple(groups),
            scheduler_block_size=data.get("scheduler_block_size", 0),
            hash_block_size=data.get("hash_block_size", 0),
            model_id=_model_id(data.get("model_id", "model")),
        )


def _model_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"layout: model_id={value!r} must be a non-empty string")
    return value


def _fingerprint(spec: KVLayoutSpec) -> str:
    body = {
        "scheduler_block_size": spec.scheduler_block_size,
        "hash_block_size": spec.hash_block_size,
        "groups": [g.to_dict() for g in spec.groups],
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_layer_names(prefix: str, indices: Sequence[int]) -> tuple[str, ...]:
    """Layer names in vLLM's style, ``{prefix}.{i}``."""
    return tuple(f"{prefix}.{i}" for i in indices)
