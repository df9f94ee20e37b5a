"""Kind-specific rules of the connector, in one table.

Pure functions, scheduler process. For each kind of group: which blocks a
step stores, which blocks a load moves, whether a block the engine did not
allocate breaks a load, and where a request resumes when some blocks fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.connector.metadata import LoadResult, LoadSpec
from hybridkv.spec import GroupKind, KVGroup, KVLayoutSpec


def _blocks_completed(group: KVGroup, start: int, end: int, alignment_tokens: int) -> range:
    """Every block whose last token was computed in ``[start, end)``."""
    return range(start // group.block_size, end // group.block_size)


def _state_at_end(group: KVGroup, start: int, end: int, alignment_tokens: int) -> range:
    """The recurrent state after ``end`` tokens, when ``end`` is a hit boundary.

    Only the state after a step's last token exists (earlier states of the
    step are never materialized), and only an aligned one can ever be hit.
    """
    if end <= start or end % alignment_tokens:
        return range(0)
    last = end // group.block_size - 1
    return range(last, last + 1)


@dataclass(frozen=True, kw_only=True)
class KindRule:
    stores: Callable[[KVGroup, int, int, int], range]
    needs_every_block: bool
    """A needed block the engine left unallocated (null) makes the load impossible.
    False: the engine keeps only the blocks it reads (sliding windows, local chunks)."""
    resumes_inside: bool
    """After a failure the group can resume at the start of its first failed block
    (a prefix of blocks); else only where the engine's own blocks end."""


RULES: dict[GroupKind, KindRule] = {
    GroupKind.FULL: KindRule(stores=_blocks_completed, needs_every_block=True, resumes_inside=True),
    GroupKind.SLIDING_WINDOW: KindRule(
        stores=_blocks_completed, needs_every_block=False, resumes_inside=False
    ),
    GroupKind.CHUNKED_LOCAL: KindRule(
        stores=_blocks_completed, needs_every_block=False, resumes_inside=False
    ),
    GroupKind.MAMBA: KindRule(stores=_state_at_end, needs_every_block=True, resumes_inside=False),
}


def store_indices(group: KVGroup, start: int, end: int, alignment_tokens: int) -> range:
    """Block indices of ``group`` a step that computed tokens ``[start, end)`` stores."""
    return RULES[group.kind].stores(group, start, end, alignment_tokens)


def load_indices(group: KVGroup, hit_blocks: Sequence[int], base_tokens: int) -> list[int]:
    """The hit's blocks of ``group`` the engine does not hold yet (past ``base_tokens``)."""
    first = base_tokens // group.block_size
    return [i for i in hit_blocks if i >= first]


def needs_every_block(kind: GroupKind) -> bool:
    return RULES[kind].needs_every_block


def resume_tokens(
    layout: KVLayoutSpec, spec: LoadSpec, result: LoadResult, alignment_tokens: int
) -> int:
    """Where a request resumes after its load: the minimum every group can serve.

    All blocks loaded: the planned count. Otherwise groups that resume inside
    (full attention) can keep the prefix before their first failed block,
    provided every other group still resumes at the same point; the others can
    only fall back to the tokens the engine already had.
    """
    if not spec.planned or result.unplanned or result.timed_out or result.cancelled:
        return spec.fallback_tokens
    failed = result.failed_block_ids
    if not any(failed):
        return spec.num_tokens
    bound = spec.num_tokens
    for transfer in spec.transfers:
        group = layout.groups[transfer.group_id]
        bad = set(failed[transfer.group_id]) if transfer.group_id < len(failed) else set()
        starts = [
            i for i, b in zip(transfer.block_indices, transfer.block_ids, strict=True) if b in bad
        ]
        if starts:
            bound = min(bound, min(starts) * group.block_size)
    if bound < spec.num_tokens and not all(RULES[g.kind].resumes_inside for g in layout.groups):
        return spec.fallback_tokens
    bound -= bound % alignment_tokens
    return max(bound, spec.fallback_tokens)
