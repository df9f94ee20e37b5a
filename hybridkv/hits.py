"""Hybrid longest-hit search: how many tokens of a request an external store can resume.

Runs in the scheduler process; a pure algorithm whose only I/O is the caller's
``contains`` callback. The answer equals vLLM's hybrid coordinator (cache-hit
alignment ``alignment_tokens``, no sub-block hits): each kind of group either
accepts the candidate length or shrinks it, and passes repeat until no group
shrinks it. Unlike the engine's per-block dictionary probes, every group is
asked at most once per pass, batched over every block index it needs in that
pass; answers are remembered across passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from hybridkv.spec import GroupKind, KVGroup

Contains = Callable[[int, Sequence[int]], Sequence[bool]]
"""``contains(group_id, block_ids)``: does the store hold each block of that group."""

BoolArray = npt.NDArray[np.bool_]


class Hit(NamedTuple):
    """Where a request can resume and which stored blocks each group needs for it."""

    num_tokens: int
    blocks_to_load: tuple[tuple[int, ...], ...]
    """Per group (same order as the groups), increasing block indices to load."""


class _Found(NamedTuple):
    """One group's answer for one bound: hit length and the blocks it loads."""

    num_tokens: int
    first_block: int
    end_block: int


class _Rule:
    """How one kind of group turns "which blocks are stored" into a hit length.

    A rule reads a window ``[lo, hi)`` of block indices, says which of them can
    still change its answer (so later groups of an equal spec are asked less),
    and finds the hit from the combined answers ``have`` (True: every group of
    the spec holds the block) over that window.
    """

    searched_once: ClassVar[bool] = False
    """Hits are prefixes: found once, later passes only trim to the candidate."""
    widens_for_eagle: ClassVar[bool] = True
    """With EAGLE the lookup bound grows by one block before one is dropped."""

    def window(self, group: KVGroup, bound: int) -> tuple[int, int]:
        return 0, bound // group.block_size

    def stride(self, a: int) -> tuple[int, int]:
        """(offset, step): the only block indices the rule ever reads (``a``: alignment
        in blocks)."""
        return 0, 1

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        """Which indices of the window (``maybe``: no group said missing) matter."""
        return maybe

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> _Found:
        raise NotImplementedError


def _prefix(mask: BoolArray) -> BoolArray:
    """``mask`` cut at its first False: only a prefix can matter."""
    out = np.zeros_like(mask)
    stop = int(np.argmin(mask)) if not mask.all() else mask.size
    out[:stop] = True
    return out


def _first_missing(have: bytes) -> int:
    pos = have.find(b"\x00")
    return len(have) if pos < 0 else pos


class _FullRule(_Rule):
    """Full attention: the longest stored prefix."""

    searched_once = True

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        return _prefix(maybe)

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> _Found:
        num_tokens = _first_missing(have) * group.block_size
        if drop and num_tokens > 0:
            num_tokens -= group.block_size
        num_tokens -= num_tokens % align
        return _Found(num_tokens, 0, num_tokens // group.block_size)


class _SlidingWindowRule(_Rule):
    """Sliding window: the rightmost run of ``cdiv(window - 1, block_size)`` stored
    blocks whose end lands on the alignment, else the run from block 0."""

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

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> _Found:
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
                return _Found(num_blocks * bs, e - need + 1, num_blocks)
            if run_start == 0:
                break
            end = run_start - 1
        # No long run: the run from block 0, ended on a qualifying block, re-aligned.
        leading = _first_missing(have)
        num_blocks = 0 if leading == 0 else leading - (leading - 1 - phase) % a
        num_blocks = max(num_blocks, 0)
        num_blocks -= num_blocks % a
        if drop and num_blocks > 0:
            num_blocks -= 1
            num_blocks -= num_blocks % a
        return _Found(num_blocks * bs, 0, num_blocks)


class _ChunkedLocalRule(_Rule):
    """Chunked local attention: stored blocks from the start of the bound's chunk."""

    def window(self, group: KVGroup, bound: int) -> tuple[int, int]:
        assert group.attention_chunk_size is not None
        chunk_start = bound // group.attention_chunk_size * group.attention_chunk_size
        return chunk_start // group.block_size, bound // group.block_size

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        return _prefix(maybe)

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> _Found:
        end_block = lo + _first_missing(have)
        return _Found(end_block * group.block_size, lo, end_block)


class _MambaRule(_Rule):
    """Mamba: the last stored state whose end lands on the alignment."""

    widens_for_eagle = False

    def stride(self, a: int) -> tuple[int, int]:
        return a - 1, a

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        out = np.zeros_like(maybe)
        out[a - 1 :: a] = maybe[a - 1 :: a]
        return out

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> _Found:
        a = align // group.block_size
        pos = have[a - 1 :: a].rfind(b"\x01")
        if pos < 0:
            return _Found(0, 0, 0)
        block = pos * a + a - 1
        return _Found((block + 1) * group.block_size, block, block + 1)


_RULES: dict[GroupKind, _Rule] = {
    GroupKind.FULL: _FullRule(),
    GroupKind.SLIDING_WINDOW: _SlidingWindowRule(),
    GroupKind.CHUNKED_LOCAL: _ChunkedLocalRule(),
    GroupKind.MAMBA: _MambaRule(),
}


def _as_bools(answer: object, num_asked: int, group_id: int) -> BoolArray | None:
    """One ``contains`` answer as a bool array (None: all stored), length checked."""
    if type(answer) is list:  # the common case first
        all_stored = len(answer) == num_asked > 0 and answer[-1] is True
        if all_stored and answer.count(True) == num_asked:
            return None  # count() compares by identity: fast when all are stored
        try:  # bytes() converts bools at C speed
            got = np.frombuffer(bytes(answer), np.uint8) != 0
        except (TypeError, ValueError):
            got = np.fromiter((bool(x) for x in answer), np.bool_, count=len(answer))
    elif isinstance(answer, np.ndarray):
        got = answer.astype(np.bool_, copy=False)
    elif isinstance(answer, bytes | bytearray | memoryview):
        got = np.frombuffer(answer, np.uint8) != 0
    elif isinstance(answer, Sequence) and not isinstance(answer, str):
        got = np.fromiter((bool(x) for x in answer), np.bool_, count=len(answer))
    else:
        raise TypeError(
            f"contains({group_id}, ...) returned {type(answer).__name__}; "
            "it must return a sequence of bools, one per block index asked"
        )
    if got.shape != (num_asked,):
        raise ValueError(
            f"contains({group_id}, ...) returned {got.size} answers for {num_asked} "
            "block indices; it must answer every index it is asked, in order"
        )
    return None if got.all() else got


class _SpecSearch:
    """Groups with equal specs, searched together; remembers answers across passes."""

    def __init__(self, group_ids: list[int], group: KVGroup, num_blocks: int) -> None:
        self.group_ids = group_ids
        self.group = group
        self.rule = _RULES[group.kind]
        self.asked = [np.zeros(num_blocks, np.bool_) for _ in group_ids]  # per group
        self.missing = np.zeros(num_blocks, np.bool_)  # some group of the spec lacks it
        self.any_missing = False
        self.never_asked = [True] * len(group_ids)
        self.found: _Found | None = None

    def search(self, bound: int, drop: bool, align: int, contains: Contains) -> _Found:
        """The spec's hit for ``bound``; asks each of its groups at most once."""
        lo, hi = self.rule.window(self.group, bound)
        hi = max(lo, hi)
        a = align // self.group.block_size
        for member, (group_id, asked) in enumerate(zip(self.group_ids, self.asked, strict=True)):
            block_ids = self._to_ask(member, lo, hi, drop, a)
            if len(block_ids) == 0:
                continue
            self.never_asked[member] = False
            where: slice | npt.NDArray[np.intp]
            if isinstance(block_ids, range):
                got = _as_bools(contains(group_id, block_ids), len(block_ids), group_id)
                where = slice(block_ids.start, block_ids.stop, block_ids.step)
            else:
                got = _as_bools(contains(group_id, block_ids.tolist()), block_ids.size, group_id)
                where = block_ids
            asked[where] = True
            if got is not None:
                self.missing[where] |= ~got
                self.any_missing = True
        have = (~self.missing[lo:hi]).tobytes()
        self.found = self.rule.find(self.group, lo, have, drop, align)
        return self.found

    def _to_ask(
        self, member: int, lo: int, hi: int, drop: bool, a: int
    ) -> range | npt.NDArray[np.intp]:
        """Block indices to ask one group: unasked ones that can still change the hit."""
        if self.never_asked[member] and not self.any_missing:  # all the rule reads
            offset, step = self.rule.stride(a)
            return range(lo + (offset - lo) % step, hi, step)
        maybe = ~self.missing[lo:hi]
        unasked = ~self.asked[member][lo:hi]
        ask = np.flatnonzero(self.rule.relevant(self.group, lo, maybe, drop, a) & unasked) + lo
        if ask.size and ask[-1] - ask[0] + 1 == ask.size:
            return range(int(ask[0]), int(ask[-1]) + 1)
        return ask


_BLOCK_IDS: tuple[int, ...] = tuple(range(1024))
_MAX_SHARED_BLOCK_IDS = 1 << 18


def _block_ids(first: int, end: int) -> tuple[int, ...]:
    """``tuple(range(first, end))``, sliced from shared ints (making 100k ints is slow)."""
    global _BLOCK_IDS
    if end > len(_BLOCK_IDS):
        if end > _MAX_SHARED_BLOCK_IDS:
            return tuple(range(first, end))
        _BLOCK_IDS = tuple(range(min(max(end, 2 * len(_BLOCK_IDS)), _MAX_SHARED_BLOCK_IDS)))
    return _BLOCK_IDS[first:end]


def _validate(
    groups: Sequence[KVGroup],
    max_hit_tokens: int,
    contains: Contains,
    alignment_tokens: int | None,
    use_eagle: bool,
) -> int:
    """Check every input at once; return the alignment in tokens."""
    problems: list[str] = []
    if isinstance(groups, str | bytes) or not isinstance(groups, Sequence) or not groups:
        problems.append(f"groups={groups!r} must be a non-empty sequence of KVGroup")
        groups = ()
    bad = [i for i, g in enumerate(groups) if not isinstance(g, KVGroup)]
    if bad:
        problems.append(f"groups{bad} are not KVGroup; pass the layout's KVGroup objects")
        groups = ()
    if isinstance(max_hit_tokens, bool) or not isinstance(max_hit_tokens, int):
        problems.append(f"max_hit_tokens={max_hit_tokens!r} must be an int")
    elif max_hit_tokens < 0:
        problems.append(f"max_hit_tokens={max_hit_tokens} must be >= 0 (request tokens - 1)")
    if not callable(contains):
        problems.append(f"contains={contains!r} must be callable(group_id, block_ids)")
    if not isinstance(use_eagle, bool):
        problems.append(f"use_eagle={use_eagle!r} must be a bool")
    sizes = [g.block_size for g in groups]
    lcm = math.lcm(*sizes) if sizes else 1
    align = lcm if alignment_tokens is None else alignment_tokens
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
        problems.append(f"alignment_tokens={alignment_tokens!r} must be a positive int or None")
    else:
        odd = [i for i, size in enumerate(sizes) if align % size]
        if odd:
            problems.append(
                f"alignment_tokens={align} is not a multiple of the block_size of groups "
                f"{odd} (block sizes {sizes}); use a multiple of their LCM {lcm}, or None"
            )
        for i, g in enumerate(groups):
            if g.kind is GroupKind.CHUNKED_LOCAL and g.block_size != align:
                problems.append(
                    f"group {i} is CHUNKED_LOCAL with block_size={g.block_size} != "
                    f"alignment_tokens={align}; chunked local attention needs every group's "
                    "block size to divide its own and the alignment to equal it (as in vLLM)"
                )
    if use_eagle is True and any(g.kind is GroupKind.CHUNKED_LOCAL for g in groups):
        problems.append(
            "use_eagle=True with a CHUNKED_LOCAL group is unsupported (vLLM rejects EAGLE with "
            "chunked local attention); pass use_eagle=False"
        )
    if problems:
        raise ValueError("find_longest_hit: " + "; ".join(problems))
    assert isinstance(align, int)
    return align


def _spec_searches(groups: Sequence[KVGroup], max_hit_tokens: int) -> list[_SpecSearch]:
    """One search per distinct spec, in first-seen order, full attention first."""
    specs: list[tuple[tuple[object, ...], list[int]]] = []  # a few groups: a scan beats hashing
    for group_id, group in enumerate(groups):
        key = group.spec_key
        ids = next((ids for other, ids in specs if other == key), None)
        if ids is None:
            specs.append((key, [group_id]))
        else:
            ids.append(group_id)
    searches = [
        _SpecSearch(ids, groups[ids[0]], (max_hit_tokens + 1) // groups[ids[0]].block_size)
        for _, ids in specs
    ]
    searches.sort(key=lambda s: s.group.kind is not GroupKind.FULL)
    return searches


def find_longest_hit(
    groups: Sequence[KVGroup],
    max_hit_tokens: int,
    contains: Contains,
    *,
    alignment_tokens: int | None = None,
    use_eagle: bool = False,
) -> Hit:
    """Longest hit of at most ``max_hit_tokens`` tokens that every group can resume.

    ``contains(group_id, block_ids)`` says, for one group, whether the store
    holds each block (group block i = tokens ``[i*block_size, (i+1)*block_size)``);
    it is called at most once per group per pass. ``alignment_tokens`` (default:
    LCM of the block sizes) is the granularity of the hit. ``use_eagle`` drops
    one block as vLLM does for EAGLE/MTP drafting; the request is taken to be
    ``max_hit_tokens + 1`` tokens long (the engine asks with ``num_tokens - 1``).
    A single group is searched once, without the EAGLE widening, as the engine's
    single-group coordinator does. ``contains`` should answer False for blocks it
    cannot confirm (a store failure costs hits); its exceptions propagate.
    """
    align = _validate(groups, max_hit_tokens, contains, alignment_tokens, use_eagle)
    searches = _spec_searches(groups, max_hit_tokens)
    if len(groups) == 1:  # the engine's single-group coordinator: one lookup, no widening
        hit_tokens = searches[0].search(max_hit_tokens, use_eagle, align, contains).num_tokens
    else:
        hit_tokens = _converge(searches, max_hit_tokens, contains, align, use_eagle)
    blocks: list[tuple[int, ...]] = [()] * len(groups)
    for search in searches:
        found = search.found
        assert found is not None
        first, end = found.first_block, found.end_block
        if search.rule.searched_once:
            end = hit_tokens // search.group.block_size
        for group_id in search.group_ids:
            blocks[group_id] = _block_ids(first, end)
    return Hit(hit_tokens, tuple(blocks))


def _converge(
    searches: list[_SpecSearch], max_hit_tokens: int, contains: Contains, align: int, eagle: bool
) -> int:
    """Passes over all specs until none shrinks the candidate (vLLM's fixed point)."""
    hit_tokens = max_hit_tokens
    # EAGLE drops a block once per spec and candidate; a shrink re-arms the drop.
    eagle_done: set[int] = set()
    # One full-attention spec plus one other: a single pass settles it.
    one_pass = len(searches) == 2 and searches[0].group.kind is GroupKind.FULL
    while True:
        candidate = hit_tokens
        for index, search in enumerate(searches):
            if search.rule.searched_once and search.found is not None:
                candidate = min(candidate, search.found.num_tokens)
                continue
            drop = eagle and index not in eagle_done
            bound = candidate
            if drop and search.rule.widens_for_eagle:
                bound = min(candidate + search.group.block_size, max_hit_tokens + 1)
            num_tokens = search.search(bound, drop, align, contains).num_tokens
            if drop:
                eagle_done.add(index)
            elif num_tokens < candidate:
                eagle_done.clear()
            candidate = num_tokens
        if candidate >= hit_tokens:
            return hit_tokens
        hit_tokens = candidate
        if one_pass:
            return hit_tokens
