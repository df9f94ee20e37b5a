"""On-disk format of the disk tier: segment files with a slot table.

Pure functions over file descriptors, any process. Creating files, not
writing bytes, is the slow part of storing one object per file, so the disk
tier appends objects into large preallocated segment files and reuses a whole
file when it evicts one. A segment file is named
``<seq:016x>.seg`` (``disk.paths``; ``seq`` grows with every new or reused file) and holds:

    [0, 4096)               segment header
    [4096, data_offset)     slot table: ``num_slots`` slots of 72 bytes
    [data_offset, size)     payloads, each starting on a 4096-byte boundary

Segment header (little endian): magic ``b"HKVS"`` | u16 version | u16 flags
(bit 0: sealed, no slot will be filled any more; bit 1: reused, it holds an
object admitted as likely to be read again, evicted after the others; bit 2:
hit, one of its objects was read after it was marked reused, evicted last) | u64
seq | u64 size | u64 num_slots | u64 data_offset. Readers ignore flag bits
they do not know.

Slot: magic ``b"HKVR"`` | u16 state (1 live, 2 dead) | u16 reserved | u64
seq | u64 payload offset, followed by the codec header of the payload
(length, xxh3-64, key digest: see ``hybridkv.tiers.codec``). A slot is
written only after its payload, so a live slot carrying this segment's seq
(slots left from a reused file's previous life carry an older one) names a
payload that was written completely; damage after that is caught by the
checksum. Payloads need no header of their own, so objects of a whole
number of pages waste no space, and a scan reads the small table, not the
payloads.
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from hybridkv.tiers import codec
from hybridkv.tiers.base import Buffer, StoreKey
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError
from hybridkv.tiers.disk.files import io_all
from hybridkv.tiers.disk.paths import DiskPaths, is_temp, segment_seq

PAGE = 4096
SEGMENT_MAGIC = b"HKVS"
SLOT_MAGIC = b"HKVR"
VERSION = 1
FLAG_SEALED = 1
FLAG_REUSED = 2
FLAG_HIT = 4
_SEGMENT_HEADER = struct.Struct("<4sHHQQQQ")
_FRAME = struct.Struct("<4sHHQQ")
SLOT_BYTES = _FRAME.size + HEADER_BYTES
_SLOT = struct.Struct(_FRAME.format + codec.HEADER_FORMAT.removeprefix("<"))
assert _SLOT.size == SLOT_BYTES
_EMPTY, _LIVE, _DEAD = 0, 1, 2  # SlotState values, compared without enum lookups
BYTES_PER_SLOT = 8192
"""Data bytes per table slot in a standard segment: objects smaller than this
on average seal a segment before its data area is full."""
SCAN_CHUNK_SLOTS = 4096
"""Slots a scan reads at a time; it stops after a chunk with none filled."""
_ZEROS = memoryview(bytes(PAGE))


class SlotState(enum.IntEnum):
    EMPTY = 0
    LIVE = 1
    DEAD = 2


def align_up(value: int, to: int = PAGE) -> int:
    return -(-value // to) * to


def slot_offset(index: int) -> int:
    return PAGE + index * SLOT_BYTES


@dataclass(frozen=True)
class Geometry:
    size: int
    num_slots: int
    data_offset: int

    @property
    def data_bytes(self) -> int:
        return self.size - self.data_offset

    @classmethod
    def standard(cls, segment_bytes: int) -> Geometry:
        """A shared segment: one slot per ``BYTES_PER_SLOT`` of data."""
        size = segment_bytes // PAGE * PAGE
        num_slots = max(1, (size - PAGE) // (BYTES_PER_SLOT + SLOT_BYTES))
        return cls(size, num_slots, PAGE + align_up(num_slots * SLOT_BYTES))

    @classmethod
    def dedicated(cls, payload_bytes: int) -> Geometry:
        """A segment holding one object too big for a standard one."""
        data_offset = PAGE + align_up(SLOT_BYTES)
        return cls(data_offset + align_up(max(payload_bytes, 1)), 1, data_offset)


class SegmentHeader(NamedTuple):
    seq: int
    size: int
    num_slots: int
    data_offset: int
    sealed: bool
    reused: bool = False
    hit: bool = False

    def pack(self) -> bytes:
        flags = header_flags(sealed=self.sealed, reused=self.reused, hit=self.hit)
        raw = _SEGMENT_HEADER.pack(
            SEGMENT_MAGIC, VERSION, flags, self.seq, self.size, self.num_slots, self.data_offset
        )
        return raw.ljust(PAGE, b"\0")

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.size, self.num_slots, self.data_offset)


def read_segment_header(fd: int) -> SegmentHeader | str:
    """The header of an open segment file, or what is wrong with it."""
    raw = os.pread(fd, _SEGMENT_HEADER.size, 0)
    if len(raw) < _SEGMENT_HEADER.size:
        return "shorter than a segment header"
    magic, version, flags, seq, size, num_slots, data_offset = _SEGMENT_HEADER.unpack(raw)
    if magic != SEGMENT_MAGIC:
        return "bad magic"
    if version != VERSION:
        return "unsupported format version"
    if not (num_slots > 0 and slot_offset(num_slots) <= data_offset <= size):
        return "inconsistent segment geometry"
    if data_offset % PAGE or size % PAGE:
        return "inconsistent segment geometry"
    sealed, reused, hit = (bool(flags & flag) for flag in (FLAG_SEALED, FLAG_REUSED, FLAG_HIT))
    return SegmentHeader(seq, size, num_slots, data_offset, sealed, reused, hit)


def open_segment_file(path: str, seq: int, *, writable: bool) -> tuple[int, SegmentHeader] | str:
    """Open a segment file and read its header; what is wrong with it otherwise."""
    try:
        # A link put in place of a segment since the listing is never followed.
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags)
    except OSError as exc:
        return f"unreadable: {exc}"
    try:
        header = read_segment_header(fd)
    except OSError as exc:
        header = f"unreadable: {exc}"
    if isinstance(header, SegmentHeader) and header.seq != seq:
        header = "header names another segment"
    if isinstance(header, str):
        os.close(fd)
        return header
    return fd, header


def describe_files(paths: DiskPaths, seqs: set[int]) -> dict[int, str]:
    """What the header of each segment file ``seqs`` says (for the message of an
    integrity failure)."""
    described = {}
    for seq in sorted(seqs):
        opened = open_segment_file(paths.segment(seq), seq, writable=False)
        if isinstance(opened, str):
            described[seq] = opened
        else:
            os.close(opened[0])
            described[seq] = repr(opened[1])
    return described


class RootListing(NamedTuple):
    segments: dict[int, str]
    """seq -> path of every file named like a segment."""
    temps: list[str]
    others: list[os.DirEntry[str]]
    """Anything else, except the names the caller keeps."""


def list_root(root: Path, *, keep: frozenset[str] = frozenset()) -> RootListing:
    listing = RootListing({}, [], [])
    with os.scandir(root) as it:
        for entry in it:
            seq = segment_seq(entry.name)
            if seq is not None and entry.is_file(follow_symlinks=False):
                listing.segments[seq] = entry.path
            elif is_temp(entry.name):
                listing.temps.append(entry.path)
            elif entry.name not in keep:
                listing.others.append(entry)
    return listing


def header_flags(*, sealed: bool, reused: bool, hit: bool) -> int:
    flags = (FLAG_SEALED, FLAG_REUSED, FLAG_HIT)
    return sum(flag for flag, on in zip(flags, (sealed, reused, hit), strict=True) if on)


def write_flags(fd: int, *, sealed: bool, reused: bool, hit: bool) -> None:
    """Rewrite a segment header's flags (all: the caller knows the segment's state)."""
    os.pwrite(fd, struct.pack("<H", header_flags(sealed=sealed, reused=reused, hit=hit)), 6)


def pack_slot(seq: int, offset: int, state: SlotState, codec_header: bytes) -> bytes:
    return _FRAME.pack(SLOT_MAGIC, int(state), 0, seq, offset) + codec_header


def write_slot_state(fd: int, index: int, state: SlotState) -> None:
    os.pwrite(fd, struct.pack("<H", int(state)), slot_offset(index) + 4)


class Slot(NamedTuple):
    state: SlotState
    offset: int
    length: int
    checksum: int
    digest: bytes
    """xxh3-128 of the key (the codec header's key digest)."""


def parse_slot(raw: bytes, header: SegmentHeader, file_bytes: int) -> Slot | str | None:
    """A slot of this segment's life, None when empty or stale, or what is wrong.
    One unpack of frame and codec header: this runs once per object a get reads."""
    if len(raw) < SLOT_BYTES:
        return None
    magic, state, _, seq, offset, h_magic, version, _, length, checksum, digest = _SLOT.unpack_from(
        raw
    )
    if magic != SLOT_MAGIC or seq != header.seq or state == _EMPTY:
        return None
    if state == _DEAD:  # whatever else it holds is not served
        return Slot(SlotState.DEAD, offset, length, 0, digest)
    if state != _LIVE:
        return "bad slot state"
    if h_magic != codec.MAGIC:
        return str(HeaderError.BAD_MAGIC.value)
    if version != codec.VERSION:
        return str(HeaderError.BAD_VERSION.value)
    if offset % PAGE or offset < header.data_offset or offset + length > header.size:
        return "payload outside its segment"
    if offset + length > file_bytes:
        return str(HeaderError.TRUNCATED.value)
    return Slot(SlotState.LIVE, offset, length, checksum, digest)


def read_slots(
    fd: int, header: SegmentHeader, first: int, file_bytes: int
) -> Iterator[tuple[int, Slot | str | None]]:
    """Slots from ``first`` on, in chunks, stopping after a chunk with none filled."""
    index = first
    while index < header.num_slots:
        count = min(SCAN_CHUNK_SLOTS, header.num_slots - index)
        raw = os.pread(fd, count * SLOT_BYTES, slot_offset(index))
        parsed = [
            parse_slot(raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES], header, file_bytes)
            for i in range(count)
        ]
        yield from zip(range(index, index + count), parsed, strict=True)
        if all(slot is None for slot in parsed):
            return
        index += count


class RecordInfo(NamedTuple):
    """Where one stored object lives (for tools and tests)."""

    path: Path
    seq: int
    slot: int
    slot_offset: int
    offset: int
    length: int
    digest: str
    state: SlotState


def iter_records(root: Path) -> Iterator[RecordInfo]:
    """Every live or dead object in the segment files under ``root``, read-only."""
    for path in sorted(root.iterdir()):
        if segment_seq(path.name) is None:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = read_segment_header(fd)
            if isinstance(header, str):
                continue
            file_bytes = os.fstat(fd).st_size
            for index, slot in read_slots(fd, header, 0, file_bytes):
                if isinstance(slot, Slot):
                    yield RecordInfo(
                        path,
                        header.seq,
                        index,
                        slot_offset(index),
                        slot.offset,
                        slot.length,
                        slot.digest.hex(),
                        slot.state,
                    )
        finally:
            os.close(fd)


PIECE_BYTES = 1 << 20
"""Payload bytes checksummed and then written at a time: about what stays in
a core's cache between the two (a whole run would be read from memory twice)."""


class Placed(NamedTuple):
    """One object of a run: its slot, where its payload goes, its key and bytes, and
    the payload's checksum when the caller already took it."""

    slot: int
    offset: int
    key: StoreKey
    payload: Buffer
    checksum: int | None = None


def write_run(
    fd: int, seq: int, run: Sequence[Placed], *, sync_data: bool, sync_slots: bool
) -> None:
    """Write the payloads of consecutive slots, then their slots.

    Payloads go in pieces of about ``PIECE_BYTES``, each checksummed right before
    its ``pwritev`` so the copy into the file finds it in cache. Gaps up to each
    page boundary are written as zeros, so a reused file never needs a page read
    back first.
    """
    headers: list[bytes] = []
    for piece in pieces(run):
        headers += [codec.pack_header(p.key, p.payload, p.checksum) for p in piece]
        views: list[memoryview] = []
        position = piece[0].offset
        for placed in piece:
            if placed.offset > position:
                views.append(_ZEROS[: placed.offset - position])
            views.append(placed.payload.data)
            position = placed.offset + len(placed.payload)
        if align_up(position) > position:
            views.append(_ZEROS[: align_up(position) - position])
        io_all(os.pwritev, fd, views, piece[0].offset)
    if sync_data:
        os.fdatasync(fd)
    table = b"".join(
        pack_slot(seq, p.offset, SlotState.LIVE, header)
        for p, header in zip(run, headers, strict=True)
    )
    io_all(os.pwritev, fd, [memoryview(table)], slot_offset(run[0].slot))
    if sync_slots:
        os.fdatasync(fd)


def pieces(run: Sequence[Placed]) -> list[Sequence[Placed]]:
    """The run cut into pieces, each closed once it holds ``PIECE_BYTES``."""
    pieces: list[Sequence[Placed]] = []
    start, num_bytes = 0, 0
    for i, placed in enumerate(run):
        num_bytes += len(placed.payload)
        if num_bytes >= PIECE_BYTES or i == len(run) - 1:
            pieces.append(run[start : i + 1])
            start, num_bytes = i + 1, 0
    return pieces


GONE = "gone"
"""A read found the slot dead or filled by a later life of the file: a miss."""
