"""Block bookkeeping across groups of different block sizes, and offload chunks.

Pure algorithms for the scheduler process: per-request, per-group block ids;
the divide-or-multiply slicing between the engine's unit block size and each
group's block size; the stored-prefix bound (min over all groups); and
``ChunkPlan``, which says which group blocks a newly complete chunk covers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

from hybridkv.spec import GroupKind, KVLayoutSpec

logger = logging.getLogger(__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class GroupBlockTable:
    """Block ids of one request, one list per KV cache group, appended step by step."""

    def __init__(self, num_groups: int) -> None:
        if not _is_int(num_groups) or num_groups <= 0:
            raise ValueError(f"num_groups={num_groups!r} must be an int > 0")
        self.block_ids: dict[int, list[int]] = {g: [] for g in range(num_groups)}

    @property
    def num_groups(self) -> int:
        return len(self.block_ids)

    def append(self, new_block_ids: Sequence[Sequence[int]] | None) -> None:
        """Add one step's new blocks (one sequence per group; None means no new blocks)."""
        if new_block_ids is None:
            return
        if len(new_block_ids) != self.num_groups:
            raise ValueError(
                f"new_block_ids has {len(new_block_ids)} groups; this table has "
                f"{self.num_groups} (pass one sequence per group, empty for none)"
            )
        for group_id, ids in enumerate(new_block_ids):
            self.block_ids[group_id].extend(ids)

    def num_blocks(self, group_id: int) -> int:
        return len(self.group_block_ids(group_id))

    def group_block_ids(self, group_id: int) -> list[int]:
        if group_id not in self.block_ids:
            raise ValueError(f"group_id={group_id} is out of range [0, {self.num_groups})")
        return self.block_ids[group_id]

    def clear(self) -> None:
        for ids in self.block_ids.values():
            ids.clear()


def slice_group_blocks(
    unit_block_size: int, group_block_size: int, start: int, end: int
) -> tuple[int, int]:
    """Map unit-block range ``[start, end)`` to the group's block range.

    A group block at least as large as the unit holds ``ratio`` units: divide
    (``[start // ratio, end // ratio)``). A smaller one takes ``ratio`` blocks
    per unit: multiply (``[start * ratio, end * ratio)``).
    """
    problems = []
    for name, value in (
        ("unit_block_size", unit_block_size),
        ("group_block_size", group_block_size),
    ):
        if not _is_int(value) or value <= 0:
            problems.append(f"{name}={value!r} must be an int > 0")
    for name, value in (("start", start), ("end", end)):
        if not _is_int(value) or value < 0:
            problems.append(f"{name}={value!r} must be an int >= 0")
    if not problems and start > end:
        problems.append(f"start={start} must be <= end={end}")
    if not problems and unit_block_size % group_block_size and group_block_size % unit_block_size:
        problems.append(
            f"group_block_size={group_block_size} and unit_block_size={unit_block_size} must "
            "divide one another (use a unit block size that is a multiple or a divisor of "
            "every group's block size, e.g. their GCD)"
        )
    if problems:
        raise ValueError("slice_group_blocks: " + "; ".join(problems))
    if group_block_size >= unit_block_size:
        ratio = group_block_size // unit_block_size
        return start // ratio, end // ratio
    ratio = unit_block_size // group_block_size
    return start * ratio, end * ratio


def stored_prefix_tokens(num_blocks_per_group: Sequence[int], block_sizes: Sequence[int]) -> int:
    """Tokens stored for every group: a hit can never go past the shortest group."""
    if len(num_blocks_per_group) != len(block_sizes) or not block_sizes:
        raise ValueError(
            f"need one block count per group: got {len(num_blocks_per_group)} counts for "
            f"{len(block_sizes)} block sizes"
        )
    if any(n < 0 for n in num_blocks_per_group) or any(bs <= 0 for bs in block_sizes):
        raise ValueError(
            f"block counts {list(num_blocks_per_group)} must be >= 0 and block sizes "
            f"{list(block_sizes)} > 0"
        )
    return min(n * bs for n, bs in zip(num_blocks_per_group, block_sizes, strict=True))


@dataclass(frozen=True, kw_only=True)
class GroupChunkUnit:
    """How one group's blocks make up a chunk."""

    group_id: int
    kind: GroupKind
    block_size: int
    blocks_per_chunk: int | None
    """Blocks of this group in one chunk; None when block_size does not divide the chunk."""


@dataclass(frozen=True, kw_only=True)
class ChunkPlan:
    """Offload chunks of ``chunk_tokens`` tokens, cut across every group.

    Chunk ``i`` covers tokens ``[i * chunk_tokens, (i + 1) * chunk_tokens)``.
    It owns the group blocks that become complete within it, so every group
    block belongs to exactly one chunk. A chunkable group contributes exactly
    ``blocks_per_chunk`` blocks to every chunk; an unchunkable one (its block
    size does not divide the chunk) contributes a varying number, maybe none.
    """

    chunk_tokens: int
    max_model_len: int
    units: tuple[GroupChunkUnit, ...]
    warnings: tuple[str, ...] = ()

    @classmethod
    def build(cls, layout: KVLayoutSpec, chunk_tokens: int, max_model_len: int) -> ChunkPlan:
        """Validate the chunk size against the layout; log a warning per unchunkable group."""
        _check_chunk_args(layout, chunk_tokens, max_model_len)
        fix = _suggest_chunk_tokens(
            reduce(math.lcm, layout.block_sizes), chunk_tokens, max_model_len
        )
        units: list[GroupChunkUnit] = []
        warnings: list[str] = []
        for group_id, group in enumerate(layout.groups):
            divides = chunk_tokens % group.block_size == 0
            units.append(
                GroupChunkUnit(
                    group_id=group_id,
                    kind=group.kind,
                    block_size=group.block_size,
                    blocks_per_chunk=chunk_tokens // group.block_size if divides else None,
                )
            )
            if not divides:
                warnings.append(
                    f"group {group_id} ({group.kind.value}, block_size={group.block_size}) does "
                    f"not divide chunk_tokens={chunk_tokens}: its blocks are stored as they "
                    f"complete, not in whole chunks; {fix}"
                )
        for message in warnings:
            logger.warning("%s", message)
        return cls(
            chunk_tokens=chunk_tokens,
            max_model_len=max_model_len,
            units=tuple(units),
            warnings=tuple(warnings),
        )

    @property
    def num_groups(self) -> int:
        return len(self.units)

    @property
    def max_chunks(self) -> int:
        """Chunks a request of ``max_model_len`` tokens can complete."""
        return self.max_model_len // self.chunk_tokens

    def chunks_ready(self, num_computed_tokens: int) -> int:
        """Number of complete chunks once ``num_computed_tokens`` tokens are computed."""
        if not _is_int(num_computed_tokens) or num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens={num_computed_tokens!r} must be an int >= 0")
        return num_computed_tokens // self.chunk_tokens

    def chunk_token_range(self, chunk_index: int) -> range:
        self._check_chunk(chunk_index)
        return range(chunk_index * self.chunk_tokens, (chunk_index + 1) * self.chunk_tokens)

    def group_blocks_for_chunk(self, group_id: int, chunk_index: int) -> range:
        """Indices of the group's blocks that become complete within chunk ``chunk_index``."""
        self._check_chunk(chunk_index)
        if not 0 <= group_id < self.num_groups:
            raise ValueError(f"group_id={group_id} is out of range [0, {self.num_groups})")
        block_size = self.units[group_id].block_size
        start = chunk_index * self.chunk_tokens // block_size
        return range(start, (chunk_index + 1) * self.chunk_tokens // block_size)

    def _check_chunk(self, chunk_index: int) -> None:
        if not _is_int(chunk_index) or chunk_index < 0:
            raise ValueError(f"chunk_index={chunk_index!r} must be an int >= 0")


def _check_chunk_args(layout: KVLayoutSpec, chunk_tokens: int, max_model_len: int) -> None:
    """One ValueError naming every problem and a chunk size that works."""
    problems = []
    for name, value in (("chunk_tokens", chunk_tokens), ("max_model_len", max_model_len)):
        if not _is_int(value) or value <= 0:
            problems.append(f"{name}={value!r} must be an int > 0")
    if problems:
        raise ValueError("invalid chunk plan: " + "; ".join(problems))
    hash_bs = layout.hash_block_size
    smallest = reduce(math.lcm, layout.block_sizes)
    fix = _suggest_chunk_tokens(smallest, chunk_tokens, max_model_len)
    if chunk_tokens % hash_bs:
        problems.append(
            f"chunk_tokens={chunk_tokens} is not a multiple of hash_block_size={hash_bs} ({fix})"
        )
    if chunk_tokens > max_model_len:
        problems.append(
            f"chunk_tokens={chunk_tokens} exceeds max_model_len={max_model_len}, so no chunk "
            f"could ever be stored ({fix})"
        )
    for group_id, group in enumerate(layout.groups):
        if chunk_tokens % group.block_size and group.block_size > max_model_len:
            problems.append(
                f"group {group_id} block_size={group.block_size} exceeds "
                f"max_model_len={max_model_len}, so no block of it, and hence no hit, could "
                f"ever be stored ({fix})"
            )
    if problems:
        raise ValueError("invalid chunk plan: " + "; ".join(problems))


def _suggest_chunk_tokens(smallest: int, chunk_tokens: int, max_model_len: int) -> str:
    """A chunk size every group divides, near the requested one and within max_model_len."""
    if smallest > max_model_len:
        return (
            f"no chunk size up to max_model_len={max_model_len} suits every group: raise "
            f"max_model_len to at least {smallest} and use chunk_tokens={smallest}"
        )
    near = max(smallest, chunk_tokens // smallest * smallest)
    if near > max_model_len:
        near = max_model_len // smallest * smallest
    return f"to chunk every group, use a multiple of {smallest}, e.g. chunk_tokens={near}"
