"""Store plans and resume points against brute-force references (property tests)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.connector import (
    BlockTransfer,
    ConnectorScheduler,
    KeyLookup,
    LoadResult,
    LoadSpec,
    ScheduledRequest,
    StepInput,
)
from hybridkv.connector.rules import resume_tokens
from hybridkv.keys import KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.spec import GroupKind, KVGroup, KVLayoutSpec
from hybridkv.tiers.cpu import CpuConfig, CpuTier

KINDS = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA]


@st.composite
def layouts(draw: st.DrawFn) -> KVLayoutSpec:
    base = draw(st.sampled_from([2, 4]))
    groups = []
    for g in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        block_size = base * draw(st.sampled_from([1, 2]))
        window = draw(st.integers(1, 3 * block_size)) if kind is GroupKind.SLIDING_WINDOW else None
        groups.append(
            KVGroup(
                kind=kind,
                block_size=block_size,
                page_size_bytes=16,
                layer_names=(f"l{g}",),
                sliding_window=window,
            )
        )
    return KVLayoutSpec(groups=tuple(groups))


def empty_lookup() -> KeyLookup:
    tier = CpuTier(CpuConfig(capacity_bytes=4096))
    return KeyLookup([tier], [1.0], union_view=tier)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), data=st.data())
def test_stores_cover_exactly_the_blocks_a_run_completes(
    layout: KVLayoutSpec, data: st.DataObject
) -> None:
    align = layout.scheduler_block_size * data.draw(st.sampled_from([1, 2]))
    num_tokens = data.draw(st.integers(1, 6 * align))
    chunks = data.draw(st.lists(st.integers(1, 3 * align), min_size=1, max_size=12))
    tokens = data.draw(st.lists(st.integers(0, 999), min_size=num_tokens, max_size=num_tokens))
    scheduler = ConnectorScheduler(layout, empty_lookup(), alignment_tokens=align)
    scheduler.add_request("r")
    planned: list[tuple[int, int, int, str]] = []
    step_ends: list[int] = []
    done, next_id, chunk_iter = 0, 1, iter(chunks * (num_tokens + 1))
    while done < num_tokens:
        n = min(next(chunk_iter), num_tokens - done)
        new_ids = []
        for group in layout.groups:  # every block a real id (the rule itself must skip)
            have = math.ceil(done / group.block_size) if done else 0
            need = math.ceil((done + n) / group.block_size)
            new_ids.append(list(range(next_id, next_id + need - have)))
            next_id += need - have
        req = ScheduledRequest(
            req_id="r",
            num_computed_tokens=done,
            num_scheduled_tokens=n,
            token_ids=tokens,
            new_block_ids=new_ids,
            replaces_block_ids=done == 0,
        )
        meta = scheduler.build_metadata(StepInput(scheduled=(req,)))
        for spec in meta.stores:
            for t in spec.transfers:
                planned += [
                    (t.group_id, i, b, k)
                    for i, b, k in zip(t.block_indices, t.block_ids, t.keys, strict=True)
                ]
        done += n
        step_ends.append(done)
    expected: set[tuple[int, int]] = set()
    for g, group in enumerate(layout.groups):
        if group.kind is GroupKind.MAMBA:
            expected |= {(g, e // group.block_size - 1) for e in step_ends if e % align == 0}
        else:
            expected |= {(g, i) for i in range(num_tokens // group.block_size)}
    got = [(g, i) for g, i, _, _ in planned]
    assert len(got) == len(set(got)), "a block was planned twice"
    assert set(got) == expected
    hasher = RequestBlockHasher(layout.hash_block_size)
    hasher.extend(tokens)
    builder = KeyBuilder(layout, KeyNamespace.for_layout(layout))
    for g, i, _, key in planned:
        assert key == builder.keys(g, hasher.block_hashes, [i])[0]


def brute_resume(layout: KVLayoutSpec, spec: LoadSpec, failed: list[set[int]], align: int) -> int:
    """The largest point every group can serve, by trying them all."""

    def serves(g: int, t: int) -> bool:
        group = layout.groups[g]
        transfer = next((x for x in spec.transfers if x.group_id == g), None)
        bad = (
            []
            if transfer is None
            else [
                i
                for i, b in zip(transfer.block_indices, transfer.block_ids, strict=True)
                if b in failed[g]
            ]
        )
        if t <= spec.fallback_tokens:
            return True
        if group.kind is GroupKind.FULL:
            return not bad or t <= min(bad) * group.block_size
        return t == spec.num_tokens and not bad

    points = [spec.fallback_tokens, *range(spec.num_tokens, spec.fallback_tokens, -1)]
    points = [t for t in points if t == spec.fallback_tokens or t % align == 0]
    return int(max(t for t in points if all(serves(g, t) for g in range(layout.num_groups))))


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), data=st.data())
def test_resume_point_matches_brute_force(layout: KVLayoutSpec, data: st.DataObject) -> None:
    align = layout.scheduler_block_size
    fallback = align * data.draw(st.integers(0, 3))
    target = fallback + align * data.draw(st.integers(1, 4))
    transfers: list[BlockTransfer] = []
    failed: list[set[int]] = []
    next_id = 1
    for g, group in enumerate(layout.groups):
        first = fallback // group.block_size
        indices = list(range(first, target // group.block_size))
        if group.kind is GroupKind.MAMBA:
            indices = indices[-1:]
        ids = list(range(next_id, next_id + len(indices)))
        next_id += len(indices)
        lose = bool(ids) and data.draw(st.booleans())
        lost: set[int] = data.draw(st.sets(st.sampled_from(ids))) if lose else set()
        failed.append(lost)
        if ids:
            transfers.append(
                BlockTransfer(
                    group_id=g,
                    keys=tuple(f"k{b}" for b in ids),  # type: ignore[misc]
                    block_ids=tuple(ids),
                    block_indices=tuple(indices),
                )
            )
    spec = LoadSpec(
        req_id="r", num_tokens=target, fallback_tokens=fallback, transfers=tuple(transfers)
    )
    result = LoadResult(req_id="r", failed_block_ids=tuple(tuple(sorted(f)) for f in failed))
    assert resume_tokens(layout, spec, result, align) == brute_resume(layout, spec, failed, align)
    timed_out = LoadResult(req_id="r", failed_block_ids=result.failed_block_ids, timed_out=True)
    assert resume_tokens(layout, spec, timed_out, align) == fallback
