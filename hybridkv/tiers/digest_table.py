"""Key digests -> row numbers, in numpy arrays: the core of the tiers' object indexes.

Any process; not thread-safe (each tier calls it under its lock). A dict of Python
objects per stored key costs several times a row's bytes (docs/DECISIONS.md);
a tier that holds millions of objects keeps each one as a row of numpy arrays
instead: this table owns the rows' key
digests (16 bytes, xxh3-128 of the key: ``codec.key_digest``) and finds a row by
digest through an open-addressing table of row numbers (linear probing, at most
half full, so a probe for an absent key reads about two buckets; removals shift
later buckets back instead of leaving tombstones). The tier keeps its own
parallel arrays of whatever else a row holds, as long as ``capacity``. Freed rows
are handed out again before new ones. The digest is already uniform: its first
word picks the bucket. The loops are native (numba), one call per batch.
"""

from __future__ import annotations

import mmap
import struct
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from numba import njit

import hybridkv.native  # noqa: F401  # before numba compiles: see its docstring

Digests = npt.NDArray[np.int64]
"""Key digests, one per row of two words (the digest's 16 bytes, native order, signed:
a Python int passes as a native argument only within int64)."""
Rows = npt.NDArray[np.int64]
Buckets = npt.NDArray[np.int32]
T = TypeVar("T", bound=np.generic)
_WORDS = struct.Struct("=qq")

NONE = -1
"""No row: in a bucket, an empty one; as an answer, an absent key."""
GROWTH = 1.25
"""Rows grow by a quarter: a bigger step would leave more of them unused."""
_MIN_BUCKETS = 64
_MAPPED_BYTES = 1 << 20
"""Arrays from this size on are mapped from the OS (``grown``)."""

# The state words of one table (``meta``): rows in use, rows ever handed out (the
# ones past that were never used), the first freed row (a freed row's first key
# word holds the next one plus one: 0 ends the list).
_COUNT, _HANDED, _FREE = range(3)


def digest_words(digests: bytes) -> Digests:
    """Concatenated 16-byte digests as rows of two words."""
    return np.frombuffer(digests, np.int64).reshape(-1, 2)


def words(digest: bytes) -> tuple[int, int]:
    """One 16-byte digest as its two words (as ``digest_words`` reads them)."""
    first, second = _WORDS.unpack(digest)
    return first, second


def grown(array: npt.NDArray[T], num_rows: int, fill: int = 0) -> npt.NDArray[T]:
    """``array`` copied into a new one of ``num_rows`` rows, the new ones ``fill``.

    Big ones are mapped from the OS, so their memory goes back to it once dropped:
    the C heap keeps freed blocks (glibc: up to 32 MiB each), and growing an index
    by steps would leave the process holding the arrays it outgrew.
    """
    shape = (num_rows, *array.shape[1:])
    num_bytes = int(np.prod(shape)) * array.itemsize
    if num_bytes < _MAPPED_BYTES:
        new = np.full(shape, fill, array.dtype)
    else:
        new = np.frombuffer(mmap.mmap(-1, num_bytes), array.dtype).reshape(shape)  # zeros
        if fill:
            new[len(array) :] = fill
    new[: len(array)] = array
    return new


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def find_one(buckets: Buckets, keys: Digests, first: int, second: int) -> int:  # pragma: no cover
    """The row of one digest (its two words), NONE if absent."""
    b = first & (len(buckets) - 1)
    while True:
        row = buckets[b]
        if row < 0 or (keys[row, 0] == first and keys[row, 1] == second):
            return int(row)
        b = (b + 1) & (len(buckets) - 1)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _find(buckets: Buckets, keys: Digests, queries: Digests, out: Rows) -> None:  # pragma: no cover
    for i in range(len(queries)):
        out[i] = find_one(buckets, keys, queries[i, 0], queries[i, 1])


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def claim_one(
    buckets: Buckets, keys: Digests, meta: Rows, first: int, second: int
) -> int:  # pragma: no cover - native
    """A row for a new digest, or NONE if present (it keeps its row). The caller made
    room for it (``DigestTable.make_room``)."""
    b = first & (len(buckets) - 1)
    row = buckets[b]
    while row >= 0 and not (keys[row, 0] == first and keys[row, 1] == second):
        b = (b + 1) & (len(buckets) - 1)
        row = buckets[b]
    if row >= 0:
        return NONE
    row = meta[_FREE]
    if row >= 0:
        meta[_FREE] = np.int64(keys[row, 0]) - 1
    else:
        row = meta[_HANDED]
        meta[_HANDED] += 1
    keys[row, 0], keys[row, 1] = first, second
    buckets[b] = row
    meta[_COUNT] += 1
    return int(row)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _claim(
    buckets: Buckets, keys: Digests, meta: Rows, new_keys: Digests, out: Rows
) -> None:  # pragma: no cover - native
    for i in range(len(new_keys)):
        out[i] = claim_one(buckets, keys, meta, new_keys[i, 0], new_keys[i, 1])


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _release(buckets: Buckets, keys: Digests, meta: Rows, rows: Rows) -> None:  # pragma: no cover
    """Empty each row's bucket, shifting later ones of the same probe run back, and
    free the row. A row in no bucket (not in use) is skipped."""
    mask = len(buckets) - 1
    for row in rows:
        hole = keys[row, 0] & mask
        while buckets[hole] != row and buckets[hole] >= 0:
            hole = (hole + 1) & mask
        if buckets[hole] != row:
            continue
        b = hole
        while True:
            b = (b + 1) & mask
            other = buckets[b]
            if other < 0:
                break
            home = keys[other, 0] & mask
            # ``other`` moves back into the hole unless its home lies in (hole, b], cyclically.
            stays = hole < home <= b if hole <= b else home > hole or home <= b
            if not stays:
                buckets[hole] = other
                hole = b
        buckets[hole] = NONE
        keys[row, 0], keys[row, 1] = meta[_FREE] + 1, 0
        meta[_FREE] = row
        meta[_COUNT] -= 1


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _rehash(buckets: Buckets, old: Buckets, keys: Digests) -> None:  # pragma: no cover - native
    mask = len(buckets) - 1
    for row in old:
        if row >= 0:
            b = keys[row, 0] & mask
            while buckets[b] >= 0:
                b = (b + 1) & (len(buckets) - 1)
            buckets[b] = row


class DigestTable:
    """Rows by key digest. The owner keeps parallel arrays of ``capacity`` rows."""

    def __init__(self) -> None:
        self.buckets: Buckets = np.full(_MIN_BUCKETS, NONE, np.int32)
        self.keys: Digests = np.zeros((0, 2), np.int64)
        """Per row: its key digest (for a free row, the next free one)."""
        self.meta: Rows = np.array([0, 0, NONE], np.int64)
        """Rows in use, rows ever handed out, the first free row (``claim_one``)."""

    def __len__(self) -> int:
        return int(self.meta[_COUNT])

    @property
    def capacity(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return int(self.buckets.nbytes + self.keys.nbytes)

    def find(self, digests: Digests) -> Rows:
        """The row of each digest, NONE where absent."""
        out = np.empty(len(digests), np.int64)
        _find(self.buckets, self.keys, digests, out)
        return out

    def claim(self, digests: Digests) -> Rows:
        """Rows for these digests, in order; NONE for a digest present already (before, or
        earlier in ``digests``), which keeps its row. Grows ``capacity`` if it must."""
        self.make_room(len(digests))
        out = np.empty(len(digests), np.int64)
        _claim(self.buckets, self.keys, self.meta, digests, out)
        return out

    def release(self, rows: Rows) -> None:
        """Free these rows (a row not in use is skipped)."""
        _release(self.buckets, self.keys, self.meta, rows)

    def make_room(self, num_new: int) -> None:
        """Room for ``num_new`` more rows (``claim_one`` needs it made first)."""
        num_rows = int(self.meta[_COUNT]) + num_new
        if num_rows > len(self.keys) or num_rows > len(self.buckets) // 2:
            self.reserve(num_rows)

    def reserve(self, num_rows: int) -> None:
        """Room for ``num_rows`` rows in all, without growing on the way."""
        if num_rows > self.capacity:
            self.keys = grown(self.keys, max(num_rows, int(self.capacity * GROWTH)))
        num_buckets = len(self.buckets)
        while num_rows > num_buckets // 2:
            num_buckets *= 2
        if num_buckets != len(self.buckets):
            old, self.buckets = self.buckets, grown(self.buckets[:0], num_buckets, NONE)
            _rehash(self.buckets, old, self.keys)

    def digest(self, row: int) -> bytes:
        return bytes(self.keys[row].tobytes())

    def digests(self, rows: Rows) -> Digests:
        return self.keys[rows]

    def rows(self) -> Rows:
        """Every row in use, in order."""
        return np.sort(self.buckets[self.buckets >= 0]).astype(np.int64)

    def check(self) -> None:
        """Raise AssertionError unless buckets and rows agree."""
        in_use = self.rows()
        assert len(in_use) == len(self), f"{len(in_use)} rows in buckets, {len(self)} counted"
        assert len(np.unique(in_use)) == len(in_use), "a row in two buckets"
        assert np.array_equal(self.find(self.keys[in_use]), in_use), "a row is not found"
        assert len(self) <= len(self.buckets) // 2


def warm_up() -> None:
    """Compile (or load) the native loops now rather than on a tier's first lookup: for
    digests read-only (from bytes) and writable (copies), as callers pass both."""
    for digests in warm_up_digests():
        table = DigestTable()
        rows = table.claim(digests)
        table.find(digests)
        table.reserve(_MIN_BUCKETS)  # rehashes
        table.release(rows)


def warm_up_digests() -> tuple[Digests, Digests]:
    """Two digests, read-only and writable: numba compiles each kind apart."""
    digests = digest_words(bytes(range(32)))
    return digests, digests.copy()
