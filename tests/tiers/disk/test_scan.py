"""The array scan of a slot table decides every slot as ``segments.parse_slot`` does
(hypothesis: slots of random fields, tables cut short, gaps longer than a chunk)."""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers import codec
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.scan import scan_slots
from hybridkv.tiers.disk.segments import (
    PAGE,
    SCAN_CHUNK_SLOTS,
    SLOT_BYTES,
    SLOT_MAGIC,
    SegmentHeader,
    Slot,
    SlotState,
)

NUM_SLOTS = 2 * SCAN_CHUNK_SLOTS + 5
DATA_OFFSET = segments.align_up(PAGE + NUM_SLOTS * SLOT_BYTES)
HEADER = SegmentHeader(
    seq=7, size=DATA_OFFSET + 16 * PAGE, num_slots=NUM_SLOTS, data_offset=DATA_OFFSET, sealed=False
)
_SLOT = struct.Struct("<4sHHQQ4sHHQQ16s8x")

U64 = (1 << 64) - 1
GOOD = {
    "magic": SLOT_MAGIC,
    "state": 1,
    "seq": HEADER.seq,
    "offset": DATA_OFFSET + PAGE,
    "codec_magic": codec.MAGIC,
    "version": codec.VERSION,
    "length": 3 * PAGE,
}
"""A live slot whose payload fits the segment; past the end of a file of
``DATA_OFFSET + 2 * PAGE`` bytes."""
WRONG: dict[str, list[object]] = {
    "magic": [b"HKVX"],
    "state": [0, 2, 3],
    "seq": [6],
    "offset": [DATA_OFFSET, DATA_OFFSET + 1, PAGE, HEADER.size, HEADER.size + PAGE, U64 - PAGE + 1],
    "codec_magic": [b"HKV0"],
    "version": [9],
    "length": [0, 1, PAGE, 15 * PAGE, 16 * PAGE, U64],
}
"""Other values of each field, one (or two) of which a slot takes."""
changes = st.sampled_from([(f, v) for f, values in WRONG.items() for v in values])
slots = st.builds(
    lambda wrong, digest: {**GOOD, **dict(wrong), "digest": digest},
    st.lists(changes, max_size=2),
    st.binary(min_size=16, max_size=16),
)
tables = st.lists(st.one_of(st.none(), slots), max_size=40)


def pack(slot: dict[str, object] | None) -> bytes:
    if slot is None:
        return bytes(SLOT_BYTES)
    s = slot
    return _SLOT.pack(
        s["magic"],
        s["state"],
        0,
        s["seq"],
        s["offset"],
        s["codec_magic"],
        s["version"],
        0,
        s["length"],
        5,
        s["digest"],
    )


FILE_PAGES = [1, 3, DATA_OFFSET // PAGE + 2, HEADER.size // PAGE, HEADER.size // PAGE + 20]
"""File sizes: cutting the slot table, cutting payloads short, whole, grown."""


def check_scan(table: list[dict[str, object] | None], first: int, file_pages: int) -> None:
    """Scan ``table`` (from slot ``first`` of a file of ``file_pages``) both ways."""
    with tempfile.TemporaryFile() as file:
        fd = file.fileno()
        os.pwrite(fd, HEADER.pack(), 0)
        os.pwrite(fd, b"".join(map(pack, table)), PAGE)
        os.ftruncate(fd, file_pages * PAGE)  # may cut the table short
        file_bytes = os.fstat(fd).st_size
        expected = list(segments.read_slots(fd, HEADER, first, file_bytes))
        scanned = scan_slots(fd, HEADER, first, file_bytes)

    live = [(i, s) for i, s in expected if isinstance(s, Slot) and s.state is SlotState.LIVE]
    assert scanned.live.tolist() == [i for i, _ in live]
    assert scanned.offsets.tolist() == [s.offset for _, s in live]
    assert [d.tobytes() for d in scanned.digests] == [s.digest for _, s in live]
    dead = [i for i, s in expected if isinstance(s, Slot) and s.state is SlotState.DEAD]
    assert scanned.dead.tolist() == dead
    assert scanned.damaged == [(i, s) for i, s in expected if isinstance(s, str)]
    empty = [i for i, s in expected if s is None]
    past_last = expected[-1][0] + 1 if expected else first
    assert scanned.next_slot == (empty[0] if empty else past_last)


@pytest.mark.parametrize("file_pages", FILE_PAGES)
def test_each_wrong_field_is_decided_like_parse_slot(file_pages: int) -> None:
    table: list[dict[str, object] | None] = [{**GOOD, "digest": bytes(16)}]
    for field, values in WRONG.items():
        table += [{**GOOD, field: value, "digest": bytes(range(16))} for value in values]
    check_scan(table, 0, file_pages)


@settings(max_examples=200, deadline=None)
@given(
    head=tables,
    gap=st.sampled_from([0, 3, SCAN_CHUNK_SLOTS - 10, SCAN_CHUNK_SLOTS + 10]),
    tail=tables,
    first=st.sampled_from([0, 2, SCAN_CHUNK_SLOTS + 1]),
    file_pages=st.sampled_from(FILE_PAGES),
)
def test_the_scan_decides_like_parse_slot(
    head: list[dict[str, object] | None],
    gap: int,
    tail: list[dict[str, object] | None],
    first: int,
    file_pages: int,
) -> None:
    check_scan([*head, *([None] * gap), *tail][:NUM_SLOTS], first, file_pages)


def test_an_empty_table_scans_to_its_first_slot() -> None:
    with tempfile.TemporaryFile() as file:
        os.pwrite(file.fileno(), HEADER.pack(), 0)
        os.ftruncate(file.fileno(), HEADER.size)
        scanned = scan_slots(file.fileno(), HEADER, 0, HEADER.size)
    assert scanned.next_slot == 0 and len(scanned.live) == len(scanned.dead) == 0
    assert scanned.damaged == [] and np.shape(scanned.digests) == (0, 2)
