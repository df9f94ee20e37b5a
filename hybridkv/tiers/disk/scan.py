"""Reading a segment's slot table as arrays: which slots hold live objects, which are
dead, damaged or empty; and what a start-up scan found.

Any process; reads only. The start-up scan and a read-only instance's rescans
index what this finds. It takes the decisions of ``segments.parse_slot`` for a
chunk of slots at once, in numpy: parsing each slot in Python would make a restart
of a large tier take minutes. A slot that is neither empty, dead
nor a valid live one goes through ``parse_slot`` itself, which names what is wrong
with it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from hybridkv.tiers import codec
from hybridkv.tiers.digest_table import Digests, Rows
from hybridkv.tiers.disk.segments import (
    PAGE,
    SCAN_CHUNK_SLOTS,
    SLOT_BYTES,
    SLOT_MAGIC,
    SegmentHeader,
    SlotState,
    parse_slot,
    slot_offset,
)

SLOT_WORDS = SLOT_BYTES // 8
"""A slot as little-endian u64 words: 0 frame magic | state | reserved; 1 seq; 2 payload
offset; 3 codec magic | version | flags; 4 length; 5 checksum; 6-7 key digest; 8 padding."""
_LOW32 = np.uint64(0xFFFF_FFFF)
_U16 = np.uint64(0xFFFF)
_SLOT_MAGIC = np.uint64(int.from_bytes(SLOT_MAGIC, "little"))
_CODEC_MAGIC = np.uint64(int.from_bytes(codec.MAGIC, "little"))


class ScanReport(NamedTuple):
    """What the start-up scan found."""

    num_objects: int
    num_bytes: int
    """Bytes of the segment files indexed."""
    num_segments: int
    num_quarantined: int
    """Bad files plus damaged slots (counted in ``stats().corrupt`` too)."""
    num_temp_removed: int
    num_evicted: int
    """Objects evicted to fit a capacity smaller than what was on disk."""


class SlotScan(NamedTuple):
    """Slots of one segment from ``first`` on."""

    live: Rows
    """Slots holding an object of this life of the file, whole and within it."""
    digests: Digests
    """Their objects' key digests."""
    offsets: Rows
    """Their payloads' offsets."""
    dead: Rows
    damaged: list[tuple[int, str]]
    """Slots whose contents are wrong, and what is wrong."""
    next_slot: int
    """The first empty slot read; past the last one read if none was empty."""


def scan_slots(fd: int, header: SegmentHeader, first: int, file_bytes: int) -> SlotScan:
    """Slots from ``first`` on, read in chunks, stopping after a chunk with none filled
    (as ``segments.read_slots``)."""
    chunks: list[SlotScan] = []
    first_empty: int | None = None
    index = first
    while index < header.num_slots:
        count = min(SCAN_CHUNK_SLOTS, header.num_slots - index)
        raw = os.pread(fd, count * SLOT_BYTES, slot_offset(index))
        chunk, num_filled = _scan_chunk(raw, count, index, header, file_bytes)
        chunks.append(chunk)
        if first_empty is None and chunk.next_slot < index + count:
            first_empty = chunk.next_slot
        index += count
        if not num_filled:
            break
    empty = np.zeros(0, np.int64)
    return SlotScan(
        live=np.concatenate([empty, *(c.live for c in chunks)]),
        digests=np.concatenate([np.zeros((0, 2), np.int64), *(c.digests for c in chunks)]),
        offsets=np.concatenate([empty, *(c.offsets for c in chunks)]),
        dead=np.concatenate([empty, *(c.dead for c in chunks)]),
        damaged=[d for c in chunks for d in c.damaged],
        next_slot=index if first_empty is None else first_empty,
    )


def _scan_chunk(
    raw: bytes, count: int, first: int, header: SegmentHeader, file_bytes: int
) -> tuple[SlotScan, int]:
    """One chunk's slots (a short read: the missing ones empty), and how many are filled.
    Its ``next_slot``: its first empty slot, or its end."""
    whole = len(raw) // SLOT_BYTES
    words = np.zeros((count, SLOT_WORDS), np.uint64)
    words[:whole] = np.frombuffer(raw, np.uint64, whole * SLOT_WORDS).reshape(whole, SLOT_WORDS)
    frame, seq, offset, codec_word, length = (words[:, i] for i in range(5))
    state = (frame >> np.uint64(32)) & _U16
    filled = ((frame & _LOW32) == _SLOT_MAGIC) & (seq == header.seq) & (state != SlotState.EMPTY)
    dead = filled & (state == SlotState.DEAD)
    size, data_offset, end = np.uint64(header.size), np.uint64(header.data_offset), file_bytes
    live = (
        filled
        & (state == SlotState.LIVE)
        & ((codec_word & _LOW32) == _CODEC_MAGIC)
        & (((codec_word >> np.uint64(32)) & _U16) == codec.VERSION)
        & (offset % np.uint64(PAGE) == 0)
        & (offset >= data_offset)
        & (offset <= size)
        & (length <= size - offset)  # no overflow: offset <= size
        & (offset <= np.uint64(end))
        & (length <= np.uint64(end) - offset)
    )
    damaged = [
        (first + i, _reason(raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES], header, file_bytes))
        for i in np.flatnonzero(filled & ~dead & ~live).tolist()
    ]
    empty = np.flatnonzero(~filled)
    chunk = SlotScan(
        live=np.flatnonzero(live) + first,
        digests=words[live][:, 6:8].view(np.int64),
        offsets=offset[live].astype(np.int64),
        dead=np.flatnonzero(dead) + first,
        damaged=damaged,
        next_slot=first + (int(empty[0]) if len(empty) else count),
    )
    return chunk, int(np.count_nonzero(filled))


def _reason(raw: bytes, header: SegmentHeader, file_bytes: int) -> str:
    reason = parse_slot(raw, header, file_bytes)
    assert isinstance(reason, str), f"a slot the scan finds wrong parses as {reason}"
    return reason
