"""The chunked copy path (CUDA's), run on CPU tensors: piece planning against a
brute-force model, rows anywhere in host memory, scratch gaps, and a device
footprint that does not grow with the job."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import BlockCopier
from hybridkv.transfer.chunked import (
    HALF_ALIGN_BYTES,
    MAX_SCRATCH_GAP_BYTES,
    ChunkedCopies,
    Piece,
    plan_pieces,
)
from hybridkv.transfer.copier import HostRows

BLOCK = 192


def brute_pieces(
    offsets: list[int], block_bytes: int, chunk_bytes: int, scratch_gaps: bool
) -> list[Piece]:
    """Greedy from the first row: extend while the next row sits one pitch further on."""
    pieces, start = [], 0
    while start < len(offsets):
        pitch = block_bytes
        if start + 1 < len(offsets):
            step = offsets[start + 1] - offsets[start]
            ok = step == block_bytes or (
                scratch_gaps and block_bytes <= step <= block_bytes + MAX_SCRATCH_GAP_BYTES
            )
            pitch = step if ok else block_bytes
        stop = start + 1
        while (
            stop < len(offsets)
            and (stop - start + 1) * pitch <= max(chunk_bytes, pitch)
            and offsets[stop] - offsets[stop - 1] == pitch
        ):
            stop += 1
        pieces.append(Piece(start, stop, pitch))
        start = stop
    return pieces


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.sampled_from([0, 0, 0, 64, 64, 5000, -BLOCK * 3]), max_size=40),
    chunk_rows=st.integers(1, 9),
    scratch_gaps=st.booleans(),
)
def test_pieces_match_a_brute_force_model(
    gaps: list[int], chunk_rows: int, scratch_gaps: bool
) -> None:
    offsets = [10_000]
    for gap in gaps:
        offsets.append(offsets[-1] + BLOCK + gap)
    chunk = chunk_rows * BLOCK + 17
    got = plan_pieces(np.array(offsets, np.int64), BLOCK, chunk, scratch_gaps=scratch_gaps)
    assert got == brute_pieces(offsets, BLOCK, chunk, scratch_gaps)
    # Every row in exactly one piece, in order; a piece fits the chunk and never
    # reaches bytes that are not its rows' or (scratch) the gaps between them.
    assert [r for p in got for r in range(p.start, p.stop)] == list(range(len(offsets)))
    for p in got:
        assert (p.stop - p.start) * p.pitch <= chunk or p.stop - p.start == 1
        assert p.pitch == BLOCK or scratch_gaps
        steps = np.diff(offsets[p.start : p.stop])
        assert all(s == p.pitch for s in steps)


def test_a_block_larger_than_the_chunk_is_refused_by_the_planner() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        plan_pieces(np.zeros(1, np.int64), 4096, 1024, scratch_gaps=False)


def model_groups() -> ModelGroups:
    groups = tuple(
        KVGroup(
            kind=kind,
            block_size=16,
            page_size_bytes=BLOCK,
            layer_names=tuple(f"{kind.value}.{i}" for i in range(3)),
            sliding_window=64 if kind is GroupKind.SLIDING_WINDOW else None,
        )
        for kind in (GroupKind.FULL, GroupKind.SLIDING_WINDOW)
    )
    return ModelGroups(groups=groups)


@pytest.mark.parametrize("kind", list(KVLayoutKind))
@pytest.mark.parametrize("chunked", [False, True], ids=["native", "chunked"])
def test_rows_anywhere_in_host_memory_round_trip_exactly(kind: KVLayoutKind, chunked: bool) -> None:
    """Rows at scattered offsets (a tier's extents): each block lands in its own row and
    nowhere else, and comes back into only its own block."""
    spec = model_groups()
    alloc = allocate_kv_caches(spec, 64, kind=kind)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    copier = BlockCopier(alloc.canonical, chunked=chunked, chunk_bytes=4 * 3 * BLOCK)
    block_bytes = spec.groups[0].block_bytes
    rng = random.Random(3)
    ids = rng.sample(range(64), 20)
    # Runs of adjacent rows and rows alone, in and out of order; one row 64 bytes off.
    slots = [*range(0, 10), *range(20, 25), 30, 38, 33, 35, 12]
    offsets = np.array([s * block_bytes + 64 * (s == 38) for s in slots], np.int64)
    memory = torch.full((41 * block_bytes + 64,), 0xA5, dtype=torch.uint8)
    expected = memory.clone()
    native = BlockCopier(alloc.canonical, chunked=False)
    for row, block in zip(offsets.tolist(), ids, strict=True):
        one = np.empty(block_bytes, np.uint8)
        native.gather(0, [block], one)
        expected[row : row + block_bytes] = torch.from_numpy(one)
    copier.gather_at(0, ids, HostRows(memory, offsets))
    assert torch.equal(memory, expected), "a row landed wrong, or bytes between rows changed"
    saved = alloc.buffer.clone()
    for t in alloc.canonical.tensors:
        t[ids] = 0
    copier.scatter_at(0, ids, HostRows(memory, offsets))
    assert torch.equal(alloc.buffer, saved)


def test_rows_with_scratch_between_them_move_as_one_piece() -> None:
    """Header room in staging: one copy over rows and rooms; without leave to write the
    rooms, one copy per row and the rooms keep their bytes. Bytes before the first row
    and the payloads are right either way."""
    spec = model_groups()
    alloc = allocate_kv_caches(spec, 16, kind=KVLayoutKind.BLOCK_MAJOR)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    chunks = ChunkedCopies(alloc.canonical)
    block_bytes, room = spec.groups[0].block_bytes, 64
    offsets = room + np.arange(6, dtype=np.int64) * (block_bytes + room)
    ids = np.arange(1, 7, dtype=np.int64)
    want = np.empty(6 * block_bytes, np.uint8)
    BlockCopier(alloc.canonical, chunked=False).gather(0, ids.tolist(), want)
    for scratch, num_pieces in ((False, 6), (True, 1)):
        memory = torch.full((int(offsets[-1]) + block_bytes,), 7, dtype=torch.uint8)
        assert chunks.gather(0, ids, memory, offsets, scratch_gaps=scratch) == num_pieces
        rows = [memory[int(o) : int(o) + block_bytes].numpy() for o in offsets]
        assert np.array_equal(np.concatenate(rows), want)
        assert bool((memory[:room] == 7).all()), "bytes before the first row are never written"
        if not scratch:
            assert all(bool((memory[int(o) - room : int(o)] == 7).all()) for o in offsets)


def test_device_memory_is_one_chunk_whatever_the_job() -> None:
    spec = model_groups()
    block_bytes = spec.groups[0].block_bytes
    alloc = allocate_kv_caches(spec, 512, kind=KVLayoutKind.LAYER_MAJOR)
    chunks = ChunkedCopies(alloc.canonical, chunk_bytes=8 * 512)
    assert chunks.chunk_bytes == 8 * 512 and chunks.half_bytes == 4 * 512
    per_piece = chunks.half_bytes // block_bytes
    for n in (1, 50, 500):
        ids = np.arange(1, n + 1, dtype=np.int64)[::-1].copy()
        memory = torch.empty(n * block_bytes, dtype=torch.uint8)
        pieces = chunks.gather(0, ids, memory, np.arange(n, dtype=np.int64) * block_bytes)
        assert pieces == -(-n // per_piece), "consecutive rows move half a chunk at a time"
    assert chunks.chunk_bytes == 8 * 512
    huge = ChunkedCopies(alloc.canonical, chunk_bytes=1)
    largest = max(g.block_bytes for g in spec.groups)
    assert huge.half_bytes >= largest and huge.half_bytes % HALF_ALIGN_BYTES == 0
    assert huge.chunk_bytes == 2 * huge.half_bytes < 2 * (largest + HALF_ALIGN_BYTES), (
        "each half holds one block, aligned up"
    )
