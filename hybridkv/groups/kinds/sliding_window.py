"""Sliding-window attention: only the last ``sliding_window - 1`` tokens are needed.

A hit ends on the rightmost run of ``cdiv(window - 1, block_size)`` stored
blocks whose end lands on the alignment (else the run from block 0); only
that run is loaded. So only the tail of each aligned segment is stored: the
run that ends on its boundary (with EAGLE, one block later), as vLLM caches
sliding blocks (``SlidingWindowManager.reachable_block_mask``). DeepSeek-V4's
compressor states are sliding-window groups too: per 256-token segment their
tails are blocks 62-63 of 64 (window 8, block 4) and 16-31 of 32 (window 128,
block 8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hybridkv.groups.kinds.base import BoolArray, Found, GroupKind, KindRules, first_missing

if TYPE_CHECKING:
    from hybridkv.groups.model_groups import KVGroup


class SlidingWindowRules(KindRules):
    kind: ClassVar[GroupKind] = GroupKind.SLIDING_WINDOW
    param = "sliding_window"
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

    def probe(self, group: KVGroup, lo: int, hi: int, drop: bool, a: int) -> range | None:
        # The run ending on the last qualifying block: held, no run further right exists.
        need, phase = self._need(group, drop), 0 if drop else a - 1
        last = hi - 1 - (hi - 1 - phase) % a
        return range(last - need + 1, last + 1) if last - need + 1 >= lo else None

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

    def stored_blocks(
        self, group: KVGroup, start: int, end: int, align: int, drop: bool
    ) -> Sequence[int]:
        first, stop = start // group.block_size, end // group.block_size
        a, need, shift = align // group.block_size, self._need(group, False), int(drop)
        if align % group.block_size or need + shift >= a:
            return range(first, stop)  # every block can end up in some hit's run
        # Segment k's tail: blocks [k*a - need, k*a), one more with EAGLE (its run ends
        # on block k*a; a search that already dropped reads the plain tail).
        stored: list[int] = []
        seg_end = max(1, (first - shift) // a + 1) * a  # the first boundary whose tail can reach
        while seg_end - need < stop:
            stored.extend(range(max(first, seg_end - need), min(stop, seg_end + shift)))
            seg_end += a
        return stored
