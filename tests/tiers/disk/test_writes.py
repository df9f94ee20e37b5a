"""A run of objects is written in pieces, each checksummed just before its write:
every payload lands at its offset with zeros up to the next page, and every slot
names its own object, whatever piece it was in."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.codec import checksum, key_digest
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.segments import PAGE, Placed, Slot, SlotState, align_up


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(1, 700_000), min_size=1, max_size=12), st.integers(0, 1 << 30))
def test_a_run_written_in_pieces_reads_back_slot_by_slot(
    tmp_path: Path, sizes: list[int], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    first_slot, offset = 3, 2 * PAGE
    run = []
    for i, size in enumerate(sizes):
        payload = rng.integers(0, 256, size, dtype=np.uint8)
        run.append(Placed(first_slot + i, offset, StoreKey(f"k/{seed}/{i}"), payload))
        offset = align_up(offset + size)
    assert len(segments.pieces(run)) > 1 or sum(sizes) < 2 * segments.PIECE_BYTES

    path = tmp_path / f"{seed}.seg"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, b"\xff" * offset, 0)  # a reused file: old bytes everywhere
        segments.write_run(fd, 9, run, sync_data=False, sync_slots=False)
        header = segments.SegmentHeader(9, offset, first_slot + len(run), 2 * PAGE, False)
        data = os.pread(fd, offset, 0)
        for placed in run:
            raw = os.pread(fd, segments.SLOT_BYTES, segments.slot_offset(placed.slot))
            slot = segments.parse_slot(raw, header, offset)
            assert isinstance(slot, Slot) and slot.state is SlotState.LIVE, slot
            assert (slot.offset, slot.length) == (placed.offset, len(placed.payload))
            assert slot.digest == key_digest(placed.key)
            assert slot.checksum == checksum(placed.payload)
            end = placed.offset + len(placed.payload)
            assert data[placed.offset : end] == placed.payload.tobytes()
            assert data[end : align_up(end)] == bytes(align_up(end) - end)
    finally:
        os.close(fd)


def test_pieces_close_once_they_hold_piece_bytes() -> None:
    def placed(size: int) -> Placed:
        return Placed(0, 0, StoreKey("k"), np.zeros(size, np.uint8))

    piece = segments.PIECE_BYTES
    run = [placed(piece // 2), placed(piece // 2), placed(1), placed(piece + 1), placed(7)]
    assert [len(p) for p in segments.pieces(run)] == [2, 2, 1]
    assert segments.pieces(run[:1]) == [run[:1]]
