"""The native read of a run of a get: slots checked against the index, payloads read
from a real file with the codec's checksum, short reads at the end of the file and
failed reads sent back to Python; and a slot it passes is one Python's check passes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers import codec
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.disk import preads, reads
from hybridkv.tiers.disk.segments import (
    PAGE,
    SLOT_BYTES,
    SegmentHeader,
    Slot,
    SlotState,
    pack_slot,
    slot_offset,
)

NUM_SLOTS = 8
SEQ = 7
DATA_OFFSET = 2 * PAGE
OBJECT_BYTES = 3 * PAGE + 100
SIZE = DATA_OFFSET + NUM_SLOTS * 4 * PAGE
HEADER = SegmentHeader(
    seq=SEQ, size=SIZE, num_slots=NUM_SLOTS, data_offset=DATA_OFFSET, sealed=False
)


class Segment:
    """A segment file of NUM_SLOTS live objects, written as the tier lays them out."""

    def __init__(self, path: Path, seed: int = 5) -> None:
        rng = np.random.default_rng(seed)
        self.path = path
        self.keys = [StoreKey(f"k/{i}") for i in range(NUM_SLOTS)]
        self.payloads = [rng.integers(0, 256, OBJECT_BYTES, np.uint8) for _ in self.keys]
        self.offsets = [DATA_OFFSET + i * 4 * PAGE for i in range(NUM_SLOTS)]
        data = bytearray(SIZE)
        data[:PAGE] = HEADER.pack()
        for i, (key, payload) in enumerate(zip(self.keys, self.payloads, strict=True)):
            slot = pack_slot(SEQ, self.offsets[i], SlotState.LIVE, codec.pack_header(key, payload))
            data[slot_offset(i) : slot_offset(i) + SLOT_BYTES] = slot
            data[self.offsets[i] : self.offsets[i] + OBJECT_BYTES] = payload.tobytes()
        self.data = data
        path.write_bytes(bytes(data))

    def wanted(self, first: int, count: int, length: int = OBJECT_BYTES) -> list[reads.Wanted]:
        return [
            reads.Wanted(
                i, self.offsets[i], codec.key_digest(self.keys[i]), np.full(length, 0xEE, np.uint8)
            )
            for i in range(first, first + count)
        ]

    def read(self, wanted: list[reads.Wanted], fd: int | None = None) -> preads.RunRead:
        own = fd is None
        fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
        try:
            return reads.read_planned(reads.plan_run(fd, HEADER, wanted))
        finally:
            if own:
                os.close(fd)


@pytest.fixture
def segment(tmp_path: Path) -> Segment:
    return Segment(tmp_path / "0000000000000007.seg")


def test_a_run_of_intact_objects_is_read_whole_and_all_ok(segment: Segment) -> None:
    wanted = segment.wanted(2, 5)
    read = segment.read(wanted)
    assert read.status.tolist() == [preads.OK] * 5
    assert read.slots == bytes(segment.data[slot_offset(2) : slot_offset(7)])
    for w in wanted:
        assert np.array_equal(w.out, segment.payloads[w.slot])


@settings(max_examples=300, deadline=None)
@given(
    first=st.integers(0, NUM_SLOTS - 1),
    flips=st.lists(
        st.tuples(
            st.integers(0, NUM_SLOTS - 1), st.integers(0, SLOT_BYTES - 1), st.integers(1, 255)
        ),
        max_size=3,
    ),
    payload_flip=st.one_of(st.none(), st.integers(0, NUM_SLOTS - 1)),
)
def test_a_slot_passes_natively_only_where_python_passes_it(
    tmp_path_factory: pytest.TempPathFactory,
    first: int,
    flips: list[tuple[int, int, int]],
    payload_flip: int | None,
) -> None:
    segment = Segment(tmp_path_factory.mktemp("seg") / "s.seg")
    data = bytearray(segment.data)
    for slot, byte, mask in flips:
        data[slot_offset(slot) + byte] ^= mask
    if payload_flip is not None:
        data[segment.offsets[payload_flip] + 17] ^= 0x40
    segment.path.write_bytes(bytes(data))
    wanted = segment.wanted(first, NUM_SLOTS - first)
    fd = os.open(segment.path, os.O_RDONLY)
    try:
        read = segment.read(wanted, fd)
        outcomes = reads.verify_run(reads.plan_run(fd, HEADER, wanted), read, reader=False)
        for w, code, outcome in zip(wanted, read.status.tolist(), outcomes, strict=True):
            raw = bytes(data[slot_offset(w.slot) : slot_offset(w.slot) + SLOT_BYTES])
            slot = reads._checked_slot(fd, HEADER, raw, w, False)
            payload = data[w.offset : w.offset + OBJECT_BYTES]
            intact = isinstance(slot, Slot) and codec.checksum(payload) == slot.checksum
            assert (code == preads.OK) == intact, (w.slot, code, slot)
            assert (outcome is None) == intact, (w.slot, outcome)
            if code == preads.OK:
                assert w.out.tobytes() == bytes(payload)
    finally:
        os.close(fd)


def test_the_end_of_the_file_is_a_short_read_and_truncated(segment: Segment) -> None:
    os.truncate(segment.path, segment.offsets[3] + 1000)  # object 3 cut, 4.. gone
    wanted = segment.wanted(1, 4)
    read = segment.read(wanted)
    assert read.status.tolist() == [preads.OK, preads.OK, preads.SHORT, preads.SHORT]
    planned = reads.plan_run(-1, HEADER, wanted)
    outcomes = reads.verify_run(planned, read, reader=False)
    assert outcomes == [None, None, codec.HeaderError.TRUNCATED, codec.HeaderError.TRUNCATED]


def test_a_slot_table_cut_short_sends_the_rest_to_python(segment: Segment) -> None:
    os.truncate(segment.path, slot_offset(4) + 10)  # slots 4.. incomplete, no payloads
    read = segment.read(segment.wanted(2, 4))
    assert read.slots is not None and len(read.slots) == 2 * SLOT_BYTES + 10
    assert read.status.tolist() == [preads.SHORT, preads.SHORT] + [preads.SLOT_CHANGED] * 2


def test_a_wrong_length_or_key_is_not_read(segment: Segment) -> None:
    wanted = segment.wanted(0, 2, length=OBJECT_BYTES - 1)
    assert segment.read(wanted).status.tolist() == [preads.SLOT_CHANGED] * 2
    assert all((w.out == 0xEE).all() for w in wanted)  # nothing written into the buffers
    fd = os.open(segment.path, os.O_RDONLY)
    try:
        outcomes = reads.verify_run(
            reads.plan_run(fd, HEADER, wanted), segment.read(wanted, fd), reader=False
        )
    finally:
        os.close(fd)
    assert outcomes == [codec.HeaderError.WRONG_LENGTH] * 2
    other = segment.wanted(0, 1)[0]._replace(digest=codec.key_digest(StoreKey("other")))
    assert segment.read([other]).status.tolist() == [preads.SLOT_CHANGED]


def test_failed_reads_are_errors_from_python(segment: Segment) -> None:
    wanted = segment.wanted(0, 2)
    fd = os.open(segment.path, os.O_WRONLY)  # pread on it fails (EBADF)
    try:
        read = segment.read(wanted, fd)
        assert read.slots is None
        assert read.status.tolist() == [preads.SLOT_CHANGED] * 2
        outcomes = reads.verify_run(reads.plan_run(fd, HEADER, wanted), read, reader=False)
    finally:
        os.close(fd)
    assert all(isinstance(o, OSError) for o in outcomes), outcomes


def test_slots_that_failed_to_read_natively_are_read_and_checked_again(segment: Segment) -> None:
    # What verify_run gets when the native read of the slots failed (a transient error):
    # it reads them again from Python, and each object that is whole is served.
    wanted = segment.wanted(1, 3)
    failed = preads.RunRead(np.full(3, preads.SLOT_CHANGED, np.int64), None)
    fd = os.open(segment.path, os.O_RDONLY)
    try:
        outcomes = reads.verify_run(reads.plan_run(fd, HEADER, wanted), failed, reader=False)
    finally:
        os.close(fd)
    assert outcomes == [None, None, None]
    for w in wanted:
        assert np.array_equal(w.out, segment.payloads[w.slot])
