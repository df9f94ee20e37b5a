"""Full attention: every past token is needed, so a hit is the longest stored prefix."""

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


class FullRules(KindRules):
    kind: ClassVar[GroupKind] = GroupKind.FULL
    searched_once = True

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> Found:
        num_tokens = first_missing(have) * group.block_size
        if drop and num_tokens > 0:
            num_tokens -= group.block_size
        num_tokens -= num_tokens % align
        return Found(num_tokens, 0, num_tokens // group.block_size)
