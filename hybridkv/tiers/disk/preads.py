"""Reading a run of objects from a segment file, checked and hashed, in one native call.

Runs wherever a disk tier serves gets, on the thread that reads a part of a
get, without the GIL. For objects in consecutive slots it reads their slots
with one ``pread``, checks each slot against what the tier indexed (the
frame's magic, state and seq; the codec header's magic and version; the
payload's offset, length and key digest), reads each payload whose slot
holds (more ``pread`` calls only at the end of a file or after a short
read), hashes it right after, while it is in cache, and compares the hash
with the slot's checksum. Python's per-object work for a get of objects of
a few hundred KiB (unpacking and checking each slot, slicing, a call per
payload and per checksum) cost as much as a third of the page-cache copy
itself, and held the GIL that the other I/O thread needs.

Only the path where everything holds is native: an object whose slot does
not hold, or whose read fails or comes up short, gets a status that sends
it to ``disk.reads``, which decides in Python what went wrong as it always
has. So a slot this check passes is one ``reads`` passes too
(``tests/tiers/disk/test_preads.py`` checks that on random slots).

Slot layout (``disk.segments``), as nine little-endian u64 words: 0 frame
magic | state | reserved; 1 seq; 2 payload offset; 3 codec magic | version
| reserved; 4 length; 5 checksum; 6-7 key digest; 8 padding.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

from hybridkv.native import PREAD_ADDRESS, XXH3_ADDRESS, call_hash, call_pread
from hybridkv.tiers import codec
from hybridkv.tiers.disk.segments import PAGE, SLOT_BYTES, SLOT_MAGIC, SegmentHeader, SlotState

Int64s = npt.NDArray[np.int64]
Words = npt.NDArray[np.uint64]

OK, SLOT_CHANGED, READ_FAILED, SHORT, BAD_CHECKSUM = range(5)
"""Per object: read and matching its slot's checksum; slot not as indexed (or not
read); the payload's read failed; the file ended first; checksum differs."""

SLOT_WORDS = SLOT_BYTES // 8
assert SLOT_WORDS * 8 == SLOT_BYTES
_LOW48 = (1 << 48) - 1
_FRAME_WORD = int.from_bytes(SLOT_MAGIC + int(SlotState.LIVE).to_bytes(2, "little"), "little")
_CODEC_WORD = int.from_bytes(codec.MAGIC + codec.VERSION.to_bytes(2, "little"), "little")


class RunRead(NamedTuple):
    """What ``read_run`` found."""

    status: Int64s
    """Per object: ``OK``, ``SLOT_CHANGED``, ``READ_FAILED``, ``SHORT`` or ``BAD_CHECKSUM``."""
    slots: bytes | None
    """The slots' bytes as read (fewer at the end of the file); None when that read
    failed (then every status is ``SLOT_CHANGED``)."""


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _read_all(
    fd: int, address: int, length: int, offset: int, read_fn: int
) -> int:  # pragma: no cover
    """``pread`` until ``length`` bytes are in, the file ends (fewer) or it fails (-1)."""
    done = 0
    while done < length:
        n = call_pread(read_fn, fd, address + done, length - done, offset + done)
        if n <= 0:
            return -1 if n < 0 else done
        done += n
    return done


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _read_run(
    fd: int,
    slot_at: int,
    slots: Words,
    frame: Words,
    offsets: Int64s,
    lengths: Int64s,
    digests: Words,
    addresses: Int64s,
    read_fn: int,
    hash_fn: int,
    status: Int64s,
) -> int:  # pragma: no cover - native
    """``frame``: frame word, codec word, seq, data offset, segment size. Returns the
    slot bytes read, or -1."""
    got: int = _read_all(fd, slots.ctypes.data, len(slots) * 8, slot_at, read_fn)
    if got < 0:
        return -1
    low48 = np.uint64(_LOW48)
    for i in range(len(offsets)):
        w = i * SLOT_WORDS
        offset, length = offsets[i], lengths[i]
        holds = (
            got >= (i + 1) * SLOT_BYTES
            and (slots[w] & low48) == frame[0]
            and slots[w + 1] == frame[2]
            and slots[w + 2] == np.uint64(offset)
            and (slots[w + 3] & low48) == frame[1]
            and slots[w + 4] == np.uint64(length)
            and slots[w + 6] == digests[2 * i]
            and slots[w + 7] == digests[2 * i + 1]
            and offset % PAGE == 0
            and offset >= np.int64(frame[3])
            and offset + length <= np.int64(frame[4])
        )
        if not holds:
            status[i] = SLOT_CHANGED
            continue
        done = _read_all(fd, addresses[i], length, offset, read_fn)
        if done < 0:
            status[i] = READ_FAILED
        elif done < length:
            status[i] = SHORT
        elif call_hash(hash_fn, addresses[i], length) != slots[w + 5]:
            status[i] = BAD_CHECKSUM
        else:
            status[i] = OK
    return got


def read_run(
    fd: int,
    header: SegmentHeader,
    first_slot_at: int,
    offsets: Int64s,
    lengths: Int64s,
    digests: bytes,
    addresses: Int64s,
) -> RunRead:
    """Read the slots at ``first_slot_at`` (one per object) and each object whose slot
    holds what the tier indexed (payload at ``offsets[i]``, ``lengths[i]`` bytes, key
    digest the i-th 16 bytes of ``digests``) into ``addresses[i]`` (a buffer the caller
    holds, of at least that size), checking its hash against the slot's."""
    count = len(offsets)
    slots = np.zeros(count * SLOT_WORDS, np.uint64)
    status = np.full(count, SLOT_CHANGED, np.int64)
    if not count:
        return RunRead(status, b"")
    assert len(digests) == 16 * count and len(lengths) == len(addresses) == count
    frame = np.array(
        [_FRAME_WORD, _CODEC_WORD, header.seq, header.data_offset, header.size], np.uint64
    )
    words = np.frombuffer(digests, np.uint64)
    args = (offsets, lengths, words, addresses, PREAD_ADDRESS, XXH3_ADDRESS, status)
    got = _read_run(fd, first_slot_at, slots, frame, *args)
    return RunRead(status, None if got < 0 else slots.view(np.uint8)[:got].tobytes())


def warm_up() -> None:
    """Compile (or load) the native read now rather than on a tier's first get."""
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        one = np.zeros(1, np.int64)
        header = SegmentHeader(seq=1, size=2 * PAGE, num_slots=1, data_offset=PAGE, sealed=False)
        read_run(fd, header, 0, one, one, bytes(16), one)
    finally:
        os.close(fd)
