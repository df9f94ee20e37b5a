"""Sliding-window attention: only the last ``sliding_window - 1`` tokens are needed.

A hit ends on the rightmost run of ``cdiv(window - 1, block_size)`` stored
blocks whose end lands on the alignment (else the run from block 0); only
that run is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hybridkv.spec.kinds.base import BoolArray, Found, GroupKind, KindRules, first_missing

if TYPE_CHECKING:
    from hybridkv.spec.groups import KVGroup


class SlidingWindowRules(KindRules):
    kind: ClassVar[GroupKind] = GroupKind.SLIDING_WINDOW
    needs_every_block = False

    @staticmethod
    def _need(group: KVGroup, drop: bool) -> int:
        assert group.sliding_window is not None
        # EAGLE needs one more block, then drops it; a run is never shorter than 1.
        return max(1, -(-(group.sliding_window - 1) // group.block_size) + int(drop))

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        # Only runs long enough for a hit, or the run from block 0, can matter.
        edges = np.diff(np.concatenate(([0], maybe.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        keep = (ends - starts >= self._need(group, drop)) | (starts == 0)
        delta = np.zeros(maybe.size + 1, np.int8)
        delta[starts[keep]] = 1
        delta[ends[keep]] = -1
        return np.cumsum(delta[:-1]) > 0

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> Found:
        need, a, bs = self._need(group, drop), align // group.block_size, group.block_size
        # A run's last block e qualifies when the hit after the EAGLE drop is aligned.
        phase = 0 if drop else a - 1
        pattern = b"\x01" * need
        end = len(have)
        while (start := have.rfind(pattern, 0, end)) >= 0:
            last = start + need - 1  # rightmost block that ends a long enough run
            run_start = have.rfind(b"\x00", 0, last) + 1
            e = last - (last - phase) % a
            if e - need + 1 >= run_start:
                num_blocks = e if drop else e + 1
                return Found(num_blocks * bs, e - need + 1, num_blocks)
            if run_start == 0:
                break
            end = run_start - 1
        # No long run: the run from block 0, ended on a qualifying block, re-aligned.
        leading = first_missing(have)
        num_blocks = 0 if leading == 0 else leading - (leading - 1 - phase) % a
        num_blocks = max(num_blocks, 0)
        num_blocks -= num_blocks % a
        if drop and num_blocks > 0:
            num_blocks -= 1
            num_blocks -= num_blocks % a
        return Found(num_blocks * bs, 0, num_blocks)

    def param_problems(self, group: KVGroup) -> list[str]:
        problems = []
        window = group.sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            problems.append(
                f"sliding_window={window!r}: required for kind sliding_window, must be an int > 0"
            )
        if group.attention_chunk_size is not None:
            problems.append(
                f"attention_chunk_size={group.attention_chunk_size} is only allowed for "
                "kind chunked_local"
            )
        return problems
