"""The native run copy against a byte-by-byte reference, and the copier over it for
block lists full of adjacent runs in every storage layout."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layout import KVLayoutKind, allocate_kv_caches, canonicalize
from hybridkv.spec import GroupKind, KVGroup, KVLayoutSpec
from hybridkv.transfer import BlockCopier
from hybridkv.transfer.runs import LINE_BYTES, PREFETCH_BYTES, copy_runs, merge_runs

SIZES = st.sampled_from([0, 1, 7, LINE_BYTES - 1, LINE_BYTES, LINE_BYTES + 1, 1000])
SIZES |= st.sampled_from([PREFETCH_BYTES, PREFETCH_BYTES + 3 * LINE_BYTES + 5, 3 * 4096])


def runs_over(
    dst: np.ndarray, src: np.ndarray, dst_starts: list[int], src_starts: list[int], sizes: list[int]
) -> np.ndarray:
    return np.array(
        [
            [dst.ctypes.data + d for d in dst_starts],
            [src.ctypes.data + s for s in src_starts],
            sizes,
        ],
        dtype=np.int64,
    ).reshape(3, -1)


@st.composite
def run_lists(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Runs into disjoint destination ranges (in shuffled order, some adjacent),
    from anywhere in a 64 KiB source."""
    sizes = draw(st.lists(SIZES, max_size=24))
    gaps = draw(st.lists(st.sampled_from([0, 0, 1, 64]), min_size=len(sizes), max_size=len(sizes)))
    dst_starts, position = [], draw(st.integers(0, 63))
    for size, gap in zip(sizes, gaps, strict=True):
        dst_starts.append(position + gap)
        position += gap + size
    order = draw(st.permutations(range(len(sizes))))
    if draw(st.booleans()):
        order = sorted(order)  # keep neighbours next to each other: merges happen
    src_starts = [draw(st.integers(0, (64 << 10) - size)) for size in sizes]
    if draw(st.booleans()):  # sources that continue each other as the destinations do
        src_starts = [d + 5 for d in dst_starts]
    return (
        [dst_starts[i] for i in order],
        [src_starts[i] for i in order],
        [sizes[i] for i in order],
    )


@settings(max_examples=150, deadline=None)
@given(run_lists())
def test_copy_runs_and_merged_runs_write_what_a_byte_loop_writes(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    dst_starts, src_starts, sizes = case
    src = np.frombuffer(random.Random(len(sizes)).randbytes(80 << 10), np.uint8).copy()
    want = np.zeros(80 << 10, np.uint8)
    for d, s, n in zip(dst_starts, src_starts, sizes, strict=True):
        want[d : d + n] = src[s : s + n]
    for merge in (False, True):
        dst = np.zeros_like(want)
        runs = runs_over(dst, src, dst_starts, src_starts, sizes)
        if merge:
            merged = merge_runs(runs)
            assert merged[2].sum() == sum(sizes)
            ends = merged[:2, :-1] + merged[2, :-1]
            continues = (merged[0, 1:] == ends[0]) & (merged[1, 1:] == ends[1])
            assert not continues.any(), "a run that continues its predecessor was left"
            runs = merged
        copy_runs(runs)
        assert np.array_equal(dst, want)


def test_merge_runs_joins_exactly_the_runs_that_continue_on_both_sides() -> None:
    runs = np.array(
        [
            [100, 110, 120, 200, 210],  # destinations: 0-2 continue, 3-4 continue
            [500, 510, 520, 700, 999],  # sources: 0-2 continue, 3-4 do not
            [10, 10, 5, 10, 10],
        ],
        dtype=np.int64,
    )
    assert merge_runs(runs).tolist() == [[100, 200, 210], [500, 700, 999], [25, 10, 10]]


def layout_of(pages: tuple[int, ...]) -> KVLayoutSpec:
    full = KVGroup(
        kind=GroupKind.FULL,
        block_size=16,
        page_size_bytes=pages[0],
        layer_names=tuple(f"f.{i}" for i in range(len(pages))),
    )
    mamba = KVGroup(
        kind=GroupKind.MAMBA,
        block_size=16,
        page_size_bytes=pages[0],
        layer_names=tuple(f"m.{i}" for i in range(len(pages))),
    )
    return KVLayoutSpec(groups=(full, mamba))


def caches(storage: str, num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    layout = layout_of((1056, 1056, 1056))
    gen = torch.Generator().manual_seed(seed)
    if storage == "separate":  # a tensor per layer
        names = [n for g in layout.groups for n in g.layer_names]
        return {
            n: torch.randint(-128, 128, (num_blocks, 1056), dtype=torch.int8, generator=gen)
            for n in names
        }
    alloc = allocate_kv_caches(layout, num_blocks, kind=KVLayoutKind(storage))
    alloc.buffer.copy_(
        torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8, generator=gen)
    )
    return alloc.kv_caches


@pytest.mark.parametrize("storage", ["block_major", "layer_major", "separate"])
def test_copier_moves_runs_of_adjacent_blocks_exactly(storage: str) -> None:
    num_blocks, layout = 40, layout_of((1056, 1056, 1056))
    rng = random.Random(storage)
    for trial in range(6):
        kv, ref = caches(storage, num_blocks, trial), caches(storage, num_blocks, trial)
        copier = BlockCopier(canonicalize(kv, layout))
        starts = rng.sample(range(0, num_blocks, 5), 4)  # runs of up to 5 adjacent blocks
        ids = [b for s in starts for b in range(s, s + rng.randint(1, 5))]
        if trial % 2:
            rng.shuffle(ids)
        group_id = trial % 2
        names = layout.groups[group_id].layer_names
        want = b"".join(kv[n][b].numpy().tobytes() for b in ids for n in names)
        out = np.zeros(len(want) + 1, np.uint8)[trial % 2 :][: len(want)]
        copier.gather(group_id, ids, out)
        assert out.tobytes() == want
        rows = np.frombuffer(rng.randbytes(len(want)), np.uint8).copy()
        copier.scatter(group_id, ids, rows)
        page = 1056
        for i, b in enumerate(ids):
            for j, n in enumerate(names):
                start = (i * len(names) + j) * page
                ref[n][b].copy_(
                    torch.from_numpy(rows[start : start + page].copy()).view(torch.int8)
                )
        assert all(torch.equal(kv[n], ref[n]) for n in kv)
