"""Mamba / linear attention: only the recurrent state after the hit's last block.

Only the state after a step's last token exists (earlier states of the step
are never materialized), and only an aligned one can ever be hit, so a step
stores at most one state: the one at its end, when that end is aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hybridkv.groups.kinds.base import BoolArray, Found, GroupKind, KindRules

if TYPE_CHECKING:
    from hybridkv.groups.model_groups import KVGroup


class MambaRules(KindRules):
    kind: ClassVar[GroupKind] = GroupKind.MAMBA
    widens_for_eagle = False
    blocks_stay_computed = False
    # A state exists only where an engine step ended, on the engine's alignment: on a
    # coarser one most prompts would have no state to hit.
    coarser_alignment_problem = (
        "Mamba states exist only where the engine's steps end, so most prompts would never hit"
    )

    def stride(self, a: int) -> tuple[int, int]:
        return a - 1, a

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        out = np.zeros_like(maybe)
        out[a - 1 :: a] = maybe[a - 1 :: a]
        return out

    def probe(self, group: KVGroup, lo: int, hi: int, drop: bool, a: int) -> range | None:
        last = hi - 1 - (hi - a) % a  # the last state at an aligned block end
        return range(last, last + 1) if last >= lo else None

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> Found:
        a = align // group.block_size
        pos = have[a - 1 :: a].rfind(b"\x01")
        if pos < 0:
            return Found(0, 0, 0)
        block = pos * a + a - 1
        return Found((block + 1) * group.block_size, block, block + 1)

    def stored_blocks(
        self, group: KVGroup, start: int, end: int, align: int, drop: bool
    ) -> Sequence[int]:
        if end <= start or end % align:
            return range(0)
        last = end // group.block_size - 1
        return range(last, last + 1)
