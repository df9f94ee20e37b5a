"""Reading objects from a segment file and hashing them, in one native call.

Runs wherever a disk tier serves gets, on the thread that reads a part of a
get, without the GIL: each object's bytes come with one ``pread`` (more at
the end of a file or after a short read) and are hashed right after, while
they are in cache. Python's per-object work for a get of objects of a few
hundred KiB (slicing, a call per stretch and per checksum) cost as much as
a third of the page-cache copy itself, and held the GIL that the other I/O
thread needs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

from hybridkv.native import PREAD_ADDRESS, XXH3_ADDRESS, call_hash, call_pread

Int64s = npt.NDArray[np.int64]


class ReadHashed(NamedTuple):
    """Per object: the bytes read (-1 on an error, fewer at the end of the file) and,
    when all were read, their xxh3-64 (``hybridkv.tiers.codec.checksum``)."""

    got: Int64s
    hashes: npt.NDArray[np.uint64]


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _read_hashed(
    fd: int,
    offsets: Int64s,
    lengths: Int64s,
    addresses: Int64s,
    read_fn: int,
    hash_fn: int,
    got: Int64s,
    hashes: npt.NDArray[np.uint64],
) -> None:  # pragma: no cover - native
    for i in range(len(offsets)):
        done = 0
        while done < lengths[i]:
            n = call_pread(read_fn, fd, addresses[i] + done, lengths[i] - done, offsets[i] + done)
            if n <= 0:
                if n < 0:
                    done = -1
                break
            done += n
        got[i] = done
        if done == lengths[i]:  # (a conditional expression would make it a float)
            hashes[i] = call_hash(hash_fn, addresses[i], lengths[i])


def read_hashed(fd: int, offsets: Int64s, lengths: Int64s, addresses: Int64s) -> ReadHashed:
    """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``fd`` into ``addresses[i]`` (each a
    buffer the caller holds, of at least that size) and hash each one read whole."""
    got = np.empty(len(offsets), np.int64)
    hashes = np.zeros(len(offsets), np.uint64)
    if len(offsets):
        _read_hashed(fd, offsets, lengths, addresses, PREAD_ADDRESS, XXH3_ADDRESS, got, hashes)
    return ReadHashed(got, hashes)


def warm_up() -> None:
    """Compile (or load) the native read now rather than on a tier's first get."""
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        one = np.zeros(1, np.int64)
        _read_hashed(fd, one, one, one, PREAD_ADDRESS, XXH3_ADDRESS, one, np.zeros(1, np.uint64))
    finally:
        os.close(fd)
