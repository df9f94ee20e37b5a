"""Hit-search test data: group makers, a recording store, random layouts and stores, and
a brute-force reference of vLLM's coordinator rules, block by block."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from hybridkv.groups import GroupKind, KVGroup
from hybridkv.hits import Hit, find_longest_hit

# ---------------------------------------------------------------- helpers


def _group(kind: GroupKind, block_size: int, page: int, name: str, **kind_field: int) -> KVGroup:
    """One single-layer group; ``kind_field`` is the kind's own setting, if it has one."""
    return KVGroup(
        kind=kind, block_size=block_size, page_size_bytes=page, layer_names=(name,), **kind_field
    )


def full(block_size: int, page: int = 64, name: str = "f") -> KVGroup:
    return _group(GroupKind.FULL, block_size, page, name)


def swa(block_size: int, window: int, page: int = 64, name: str = "s") -> KVGroup:
    return _group(GroupKind.SLIDING_WINDOW, block_size, page, name, sliding_window=window)


def chunked(block_size: int, chunk: int, page: int = 64, name: str = "c") -> KVGroup:
    return _group(GroupKind.CHUNKED_LOCAL, block_size, page, name, attention_chunk_size=chunk)


def mamba(block_size: int, page: int = 64, name: str = "m") -> KVGroup:
    return _group(GroupKind.MAMBA, block_size, page, name)


@dataclass
class Store:
    """Existence sets per group; records every ``contains`` call."""

    stored: list[set[int]]
    calls: list[tuple[int, list[int]]] = field(default_factory=list)

    def contains(self, group_id: int, block_ids: Sequence[int]) -> list[bool]:
        block_ids = list(block_ids)
        self.calls.append((group_id, block_ids))
        return [i in self.stored[group_id] for i in block_ids]

    def calls_of(self, group_id: int) -> list[list[int]]:
        return [ids for g, ids in self.calls if g == group_id]


def lookup(
    groups: list[KVGroup], stored: list[set[int]], max_hit_tokens: int, **kwargs: object
) -> tuple[Hit, Store]:
    store = Store(stored)
    hit = find_longest_hit(groups, max_hit_tokens, store.contains, **kwargs)  # type: ignore[arg-type]
    return hit, store


# ------------------------------------------------- brute-force reference
# Written from the rules, block by block, with no batching and no tricks.


def _ref_find(
    group: KVGroup, has: list[bool], bound: int, drop: bool, align: int
) -> tuple[int, list[int]]:
    """(hit tokens, blocks loaded) of one spec for one bound; ``has[i]``: all hold i."""
    bs = group.block_size
    a = align // bs
    nb = bound // bs
    if group.kind is GroupKind.FULL:
        n = 0
        while n < nb and has[n]:
            n += 1
        tokens = n * bs
        if drop and tokens > 0:
            tokens -= bs
        tokens -= tokens % align
        return tokens, list(range(tokens // bs))
    if group.kind is GroupKind.MAMBA:
        for i in reversed(range(nb)):
            if has[i] and (i + 1) % a == 0:
                return (i + 1) * bs, [i]
        return 0, []
    if group.kind is GroupKind.CHUNKED_LOCAL:
        assert group.attention_chunk_size is not None
        start = bound // group.attention_chunk_size * group.attention_chunk_size // bs
        i = start
        while i < nb and has[i]:
            i += 1
        return i * bs, list(range(start, i))
    assert group.sliding_window is not None
    need = math.ceil((group.sliding_window - 1) / bs) + (1 if drop else 0)
    count = 0
    for i in reversed(range(nb)):
        if not has[i]:
            count = 0
            continue
        # A run may only start (from the right) where the hit would be aligned.
        end_after_drop = i if drop else i + 1
        if count == 0 and end_after_drop % a != 0:
            continue
        count += 1
        if count >= need:
            end = i + count
            if drop:
                end -= 1
                while end % a:
                    end -= 1
            return end * bs, list(range(i, end))
    # No long enough run: the run from block 0 (``count`` blocks), re-aligned.
    n = count
    while n % a:
        n -= 1
    if drop and n > 0:
        n -= 1
        while n % a:
            n -= 1
    return n * bs, list(range(n))


def reference(
    groups: list[KVGroup],
    stored: list[set[int]],
    max_hit_tokens: int,
    alignment_tokens: int | None = None,
    use_eagle: bool = False,
) -> tuple[Hit, int]:
    """(hit, number of sweeps) by the coordinator's rules, one block at a time."""
    align = alignment_tokens or math.lcm(*(g.block_size for g in groups))
    specs: list[list[int]] = []
    for g_id, g in enumerate(groups):
        for spec in specs:
            if groups[spec[0]].search_key == g.search_key:
                spec.append(g_id)
                break
        else:
            specs.append([g_id])
    specs.sort(key=lambda s: groups[s[0]].kind is not GroupKind.FULL)
    request_tokens = max_hit_tokens + 1

    def has(spec: list[int]) -> list[bool]:
        nb = request_tokens // groups[spec[0]].block_size
        return [all(i in stored[g] for g in spec) for i in range(nb)]

    loaded: dict[int, list[int]] = {}
    found: dict[int, int] = {}
    if len(groups) == 1:
        hit, blocks = _ref_find(groups[0], has(specs[0]), max_hit_tokens, use_eagle, align)
        return Hit(hit, (tuple(blocks),)), 1
    hit_tokens, sweeps, eagle_done = max_hit_tokens, 0, set()
    while True:
        sweeps += 1
        cand = hit_tokens
        for idx, spec in enumerate(specs):
            g = groups[spec[0]]
            if g.kind is GroupKind.FULL and idx in found:
                cand = min(cand, found[idx])
                continue
            drop = use_eagle and idx not in eagle_done
            bound = cand
            if drop and g.kind is not GroupKind.MAMBA:
                bound = min(cand + g.block_size, request_tokens)
            new, loaded[idx] = _ref_find(g, has(spec), bound, drop, align)
            found[idx] = new
            if drop:
                eagle_done.add(idx)
            elif new < cand:
                eagle_done.clear()
            cand = new
        if cand >= hit_tokens:
            break
        hit_tokens = cand
        if len(specs) == 2 and groups[specs[0][0]].kind is GroupKind.FULL:
            break
    per_group: list[tuple[int, ...]] = [()] * len(groups)
    for idx, spec in enumerate(specs):
        blocks = loaded[idx]
        if groups[spec[0]].kind is GroupKind.FULL:
            blocks = list(range(hit_tokens // groups[spec[0]].block_size))
        for g_id in spec:
            per_group[g_id] = tuple(blocks)
    return Hit(hit_tokens, tuple(per_group)), sweeps


# ----------------------------------------------------- property testing


@st.composite
def layouts(draw: st.DrawFn, max_groups: int = 4) -> tuple[list[KVGroup], int | None, bool]:
    """Random hybrid layouts (some groups sharing a spec), alignment and EAGLE flag."""
    num = draw(st.integers(1, max_groups))
    with_chunked = draw(st.booleans()) and draw(st.booleans())
    groups: list[KVGroup] = []
    if with_chunked:
        chunk_bs = draw(st.sampled_from([2, 4, 8]))
        groups.append(chunked(chunk_bs, chunk_bs * draw(st.integers(1, 4)), name="l0"))
    sizes = [1, 2, 4, 8, 3, 6] if not with_chunked else [d for d in (1, 2, 4, 8) if d <= chunk_bs]
    while len(groups) < num:
        name = f"l{len(groups)}"
        if groups and draw(st.integers(0, 2)) == 0:  # a group with an existing spec
            g = draw(st.sampled_from(groups))
            groups.append(KVGroup(**{**g.to_dict(), "kind": g.kind, "layer_names": (name,)}))
            continue
        kinds = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA]
        kind = draw(st.sampled_from(kinds))
        bs = draw(st.sampled_from(sizes))
        page = draw(st.sampled_from([32, 64]))
        if kind is GroupKind.SLIDING_WINDOW:
            groups.append(swa(bs, draw(st.integers(1, 4 * bs + 3)), page=page, name=name))
        elif kind is GroupKind.MAMBA:
            groups.append(mamba(bs, page=page, name=name))
        else:
            groups.append(full(bs, page=page, name=name))
    draw(st.randoms(use_true_random=False)).shuffle(groups)
    lcm = math.lcm(*(g.block_size for g in groups))
    alignment = None if with_chunked or draw(st.booleans()) else lcm * draw(st.integers(1, 2))
    use_eagle = not with_chunked and draw(st.booleans())
    return groups, alignment, use_eagle


STYLES = ("dense", "holes", "sparse", "prefix", "empty")


def random_stores(
    rng: random.Random, groups: list[KVGroup], max_tokens: int, styles: Sequence[str] = STYLES
) -> list[set[int]]:
    """Per-group existence sets: prefixes with holes, sparse tails, empty or full.

    Groups sharing a spec mostly agree (a shared base with a few blocks removed),
    which is where narrowing the later groups' questions could go wrong.
    """
    stored: list[set[int]] = []
    base: dict[tuple[object, ...], set[int]] = {}
    for g in groups:
        nb = max_tokens // g.block_size + 2
        if g.search_key in base and rng.random() < 0.8:
            drop_rate = rng.choice([0.0, 0.05, 0.2])
            stored.append({i for i in base[g.search_key] if rng.random() >= drop_rate})
            continue
        style = rng.choice(styles)
        density = {"dense": 1.0, "holes": 0.85, "sparse": 0.3, "prefix": 1.0, "empty": 0.0}[style]
        limit = rng.randint(0, nb) if style == "prefix" else nb
        stored.append({i for i in range(limit) if rng.random() < density})
        base.setdefault(g.search_key, stored[-1])
    return stored


def random_groups(
    rng: random.Random, max_groups: int = 4
) -> tuple[list[KVGroup], int | None, bool]:
    """Like ``layouts`` but from a seeded generator (for many cheap cases)."""
    groups: list[KVGroup] = []
    chunk_bs = rng.choice([2, 4, 8]) if rng.random() < 0.2 else 0
    if chunk_bs:
        groups.append(chunked(chunk_bs, chunk_bs * rng.randint(1, 4), name="l0"))
    sizes = [d for d in (1, 2, 4, 8) if d <= chunk_bs] if chunk_bs else [1, 2, 4, 8, 3, 6, 16]
    for i in range(len(groups), rng.randint(max(1, len(groups)), max_groups)):
        if groups and rng.random() < 0.35:
            g = rng.choice(groups)
            groups.append(KVGroup(**{**g.to_dict(), "kind": g.kind, "layer_names": (f"l{i}",)}))
            continue
        kind = rng.choice([GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA])
        bs, page = rng.choice(sizes), rng.choice([32, 64])
        if kind is GroupKind.SLIDING_WINDOW:
            groups.append(swa(bs, rng.randint(1, 4 * bs + 3), page=page, name=f"l{i}"))
        elif kind is GroupKind.MAMBA:
            groups.append(mamba(bs, page=page, name=f"l{i}"))
        else:
            groups.append(full(bs, page=page, name=f"l{i}"))
    rng.shuffle(groups)
    lcm = math.lcm(*(g.block_size for g in groups))
    alignment = None if chunk_bs or rng.random() < 0.6 else lcm * rng.randint(1, 2)
    return groups, alignment, not chunk_bs and rng.random() < 0.4
