"""Hybrid longest-hit search: how many tokens of a request an external store can resume.

Runs in the scheduler process; a pure algorithm whose only I/O is the caller's
``contains`` callback, which only answers: what a caller does about blocks found
absent it does after the search, from ``Hit.first_miss_token``. The answer
equals vLLM's hybrid coordinator (cache-hit alignment ``alignment_tokens``, no
sub-block hits): each kind of group either accepts the candidate length or
shrinks it, and sweeps repeat until no group shrinks it. Unlike the engine's
per-block dictionary probes, every group is asked at most twice per sweep,
batched over the block indices it needs in that sweep: first, where its rule
has one, only the blocks that settle the longest hit (a window's last run, the
last state), then, if one of them is missing, the rest. Answers are remembered
across sweeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from hybridkv.groups import KVGroup
from hybridkv.groups.kinds import Found, KindRules, rules_for

Contains = Callable[[int, Sequence[int]], Sequence[bool]]
"""``contains(group_id, block_ids)``: does the store hold each block of that group."""

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Hit:
    """Where a request can resume and which stored blocks each group needs for it."""

    num_tokens: int
    blocks_to_load: tuple[tuple[int, ...], ...]
    """Per group (same order as the groups), increasing block indices to load."""
    first_miss_token: int | None = field(default=None, compare=False)
    """First token of the earliest block ``contains`` answered absent (any group); None:
    none was. A by-product of the search, not part of the answer."""


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


class _GroupSearch:
    """Groups with equal search keys, searched together; remembers answers across sweeps."""

    def __init__(self, group_ids: list[int], group: KVGroup, num_blocks: int) -> None:
        self.group_ids = group_ids
        self.group = group
        self.rule: KindRules = rules_for(group.kind)
        self.asked = [np.zeros(num_blocks, np.bool_) for _ in group_ids]  # per group
        self.missing = np.zeros(num_blocks, np.bool_)  # some group of the search key lacks it
        self.any_missing = False
        self.never_asked = [True] * len(group_ids)
        self.found: Found | None = None
        self.drafts = False
        """EAGLE-style drafting drops these groups' last hit block."""

    def search(self, bound: int, drop: bool, align: int, contains: Contains) -> Found:
        """These groups' hit for ``bound``; asks each of its groups at most twice."""
        lo, hi = self.rule.window(self.group, bound)
        hi = max(lo, hi)
        a = align // self.group.block_size
        probe = None if self.any_missing else self.rule.probe(self.group, lo, hi, drop, a)
        if probe is not None and 2 * len(probe) < hi - lo:
            for member, group_id in enumerate(self.group_ids):
                ids = np.flatnonzero(~self.asked[member][probe.start : probe.stop]) + probe.start
                if ids.size == len(probe):
                    self._ask(member, group_id, probe, contains)
                elif ids.size:
                    self._ask(member, group_id, ids, contains)
            if not self.any_missing:  # held: the longest hit there is, whatever else is
                self.found = self.rule.find(self.group, lo, b"\x01" * (hi - lo), drop, align)
                return self.found
        for member, group_id in enumerate(self.group_ids):
            block_ids = self._to_ask(member, lo, hi, drop, a)
            if len(block_ids):
                self._ask(member, group_id, block_ids, contains)
        have = (~self.missing[lo:hi]).tobytes()
        self.found = self.rule.find(self.group, lo, have, drop, align)
        return self.found

    def _ask(
        self,
        member: int,
        group_id: int,
        block_ids: range | npt.NDArray[np.intp],
        contains: Contains,
    ) -> None:
        self.never_asked[member] = False
        where: slice | npt.NDArray[np.intp]
        if isinstance(block_ids, range):
            got = _as_bools(contains(group_id, block_ids), len(block_ids), group_id)
            where = slice(block_ids.start, block_ids.stop, block_ids.step)
        else:
            got = _as_bools(contains(group_id, block_ids.tolist()), block_ids.size, group_id)
            where = block_ids
        self.asked[member][where] = True
        if got is not None:
            self.missing[where] |= ~got
            self.any_missing = True

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

    def first_miss_token(self) -> int | None:
        """First token of the earliest block some of these groups lacks."""
        if not self.any_missing:
            return None
        return int(np.argmax(self.missing)) * self.group.block_size


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
        problems.append(f"groups{bad} are not KVGroup; pass ModelGroups.groups")
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
            problem = rules_for(g.kind).alignment_problem(g, align)
            if problem:
                problems.append(f"group {i}: {problem}")
    eagle_less = [i for i, g in enumerate(groups) if not rules_for(g.kind).supports_eagle]
    if use_eagle is True and eagle_less:
        problems.append(
            f"use_eagle=True with groups {eagle_less} is unsupported (vLLM rejects EAGLE with "
            "chunked local attention); pass use_eagle=False"
        )
    if problems:
        raise ValueError("find_longest_hit: " + "; ".join(problems))
    assert isinstance(align, int)
    return align


def _group_searches(groups: Sequence[KVGroup], max_hit_tokens: int) -> list[_GroupSearch]:
    """One search per distinct search key, in first-seen order, full attention first."""
    by_key: list[tuple[tuple[object, ...], list[int]]] = []  # a few groups: a scan beats hashing
    for group_id, group in enumerate(groups):
        key = group.search_key
        ids = next((ids for other, ids in by_key if other == key), None)
        if ids is None:
            by_key.append((key, [group_id]))
        else:
            ids.append(group_id)
    searches = [
        _GroupSearch(ids, groups[ids[0]], (max_hit_tokens + 1) // groups[ids[0]].block_size)
        for _, ids in by_key
    ]
    searches.sort(key=lambda s: not s.rule.searched_once)
    return searches


def find_longest_hit(
    groups: Sequence[KVGroup],
    max_hit_tokens: int,
    contains: Contains,
    *,
    alignment_tokens: int | None = None,
    use_eagle: bool = False,
    eagle_group_ids: Collection[int] | None = None,
) -> Hit:
    """Longest hit of at most ``max_hit_tokens`` tokens that every group can resume.

    ``contains(group_id, block_ids)`` says, for one group, whether the store
    holds each block (group block i = tokens ``[i*block_size, (i+1)*block_size)``);
    it is called at most twice per group per sweep. ``alignment_tokens`` (default:
    LCM of the block sizes) is the granularity of the hit. ``use_eagle`` drops
    one block as vLLM does for EAGLE/MTP drafting, in the groups
    ``eagle_group_ids`` (None: every group, as vLLM when no group is flagged);
    the request is taken to be ``max_hit_tokens + 1`` tokens long (the engine
    asks with ``num_tokens - 1``).
    A single group is searched once, without the EAGLE widening, as the engine's
    single-group coordinator does. ``contains`` should answer False for blocks it
    cannot confirm (a store failure costs hits); its exceptions propagate.
    """
    align = _validate(groups, max_hit_tokens, contains, alignment_tokens, use_eagle)
    searches = _group_searches(groups, max_hit_tokens)
    drops = drafting_groups(groups, use_eagle, eagle_group_ids)
    for search in searches:
        search.drafts = drops[search.group_ids[0]]
    if len(groups) == 1:  # the engine's single-group coordinator: one lookup, no widening
        drop = searches[0].drafts
        hit_tokens = searches[0].search(max_hit_tokens, drop, align, contains).num_tokens
    else:
        hit_tokens = _converge(searches, max_hit_tokens, contains, align)
    blocks: list[tuple[int, ...]] = [()] * len(groups)
    for search in searches:
        found = search.found
        assert found is not None
        first, end = found.first_block, found.end_block
        if search.rule.searched_once:
            end = hit_tokens // search.group.block_size
        for group_id in search.group_ids:
            blocks[group_id] = _block_ids(first, end)
    misses = [t for search in searches if (t := search.first_miss_token()) is not None]
    return Hit(hit_tokens, tuple(blocks), min(misses, default=None))


def drafting_groups(
    groups: Sequence[KVGroup], use_eagle: bool, eagle_group_ids: Collection[int] | None
) -> tuple[bool, ...]:
    """Per group: whether its hits drop the last block for EAGLE-style drafting.

    ``eagle_group_ids`` None means every group (as vLLM when none is flagged). A
    group drops when any group of its search key drafts: they are searched together.
    """
    if not use_eagle:
        return (False,) * len(groups)
    eagle = set(range(len(groups)) if eagle_group_ids is None else eagle_group_ids)
    drafting_keys = {groups[i].search_key for i in eagle if 0 <= i < len(groups)}
    return tuple(g.search_key in drafting_keys for g in groups)


def _converge(
    searches: list[_GroupSearch], max_hit_tokens: int, contains: Contains, align: int
) -> int:
    """Sweeps over all searches until none shrinks the candidate (vLLM's fixed point)."""
    hit_tokens = max_hit_tokens
    # EAGLE drops a block once per search key and candidate; a shrink re-arms the drop.
    eagle_done: set[int] = set()
    # One full-attention search plus one other: a single sweep settles it.
    one_sweep = len(searches) == 2 and searches[0].rule.searched_once
    while True:
        candidate = hit_tokens
        for index, search in enumerate(searches):
            if search.rule.searched_once and search.found is not None:
                candidate = min(candidate, search.found.num_tokens)
                continue
            drop = search.drafts and index not in eagle_done
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
        if one_sweep:
            return hit_tokens
