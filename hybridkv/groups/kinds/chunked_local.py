"""Chunked local attention: only the tokens since the current attention chunk began."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from hybridkv.groups.kinds.base import (
    Found,
    GroupKind,
    KindRules,
    first_missing,
)

if TYPE_CHECKING:
    from hybridkv.groups.model_groups import KVGroup


class ChunkedLocalRules(KindRules):
    kind: ClassVar[GroupKind] = GroupKind.CHUNKED_LOCAL
    param = "attention_chunk_size"
    needs_every_block = False
    supports_eagle = False  # vLLM rejects EAGLE with chunked local attention

    def window(self, group: KVGroup, bound: int) -> tuple[int, int]:
        assert group.attention_chunk_size is not None
        chunk_start = bound // group.attention_chunk_size * group.attention_chunk_size
        return chunk_start // group.block_size, bound // group.block_size

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> Found:
        end_block = lo + first_missing(have)
        return Found(end_block * group.block_size, lo, end_block)

    def param_problems(self, group: KVGroup) -> list[str]:
        problems = super().param_problems(group)
        chunk = group.attention_chunk_size
        if chunk is not None and chunk % group.block_size:
            problems.append(
                f"attention_chunk_size={chunk} must be a multiple of block_size={group.block_size}"
            )
        return problems

    def alignment_problem(self, group: KVGroup, align: int) -> str | None:
        if group.block_size == align:
            return None
        return (
            f"chunked_local block_size={group.block_size} != alignment {align}: chunked local "
            "attention needs every group's block size to divide its own and hits aligned to "
            "it (as in vLLM)"
        )
