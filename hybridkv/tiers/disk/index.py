"""The disk tier's key index: key digest -> segment number, slot and payload offset.

Any process that opens a disk tier; not thread-safe (``DiskTier`` calls it under
its lock). A terabyte of 16 KiB objects is 64 million objects: a dict of Python
objects per key cost 350-400 B each (22 GiB), so objects live in numpy arrays
instead, one row each (28 B: the key's 16-byte digest, the segment's number, the
slot, the payload offset in pages), found through an open-addressing table of
row numbers (linear probing, at most half full, so a probe for an absent key
reads about two buckets). Rows freed by removals are reused before the arrays
grow. The digest is xxh3-128 of the key (``codec.key_digest``), already
uniform: its first word picks the bucket. The loops are native (numba), one
call per batch of keys.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

import hybridkv.native  # noqa: F401  # before numba compiles: see its docstring
from hybridkv.tiers.disk.segments import PAGE

Digests = npt.NDArray[np.uint64]
"""Key digests, one per row of two words (the digest's 16 bytes, native order)."""
Rows = npt.NDArray[np.int64]
Buckets = npt.NDArray[np.int32]

NONE = -1
"""No row: in a bucket, an empty one; as an answer, an absent key."""
MAX_OFFSET = PAGE << 32
"""Payload offsets are kept in pages, in 32 bits."""
_GROWTH = 1.25
"""Rows grow by a quarter: a bigger step would leave more of them unused."""
_MIN_BUCKETS = 64

# The state words of one index (``meta``): rows in use, rows ever handed out (the
# ones past that were never used), the first freed row (its ``slots`` entry links
# to the next freed one).
_COUNT, _HANDED, _FREE = range(3)


def digest_words(digests: bytes) -> Digests:
    """Concatenated 16-byte digests as rows of two words."""
    return np.frombuffer(digests, np.uint64).reshape(-1, 2)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _bucket_of(buckets: Buckets, keys: Digests, row: int) -> int:  # pragma: no cover - native
    """The bucket that holds ``row``; NONE if none does."""
    b = np.int64(keys[row, 0] & np.uint64(len(buckets) - 1))
    while buckets[b] != row:
        if buckets[b] < 0:
            return NONE
        b = np.int64((b + 1) & (len(buckets) - 1))
    return int(b)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _find(buckets: Buckets, keys: Digests, queries: Digests, out: Rows) -> None:  # pragma: no cover
    mask = np.uint64(len(buckets) - 1)
    for i in range(len(queries)):
        first, second = queries[i, 0], queries[i, 1]
        b = np.int64(first & mask)
        while True:
            row = buckets[b]
            if row < 0 or (keys[row, 0] == first and keys[row, 1] == second):
                out[i] = row
                break
            b = np.int64((b + 1) & (len(buckets) - 1))


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _place(buckets: Buckets, keys: Digests, row: int) -> None:  # pragma: no cover - native
    """Put ``row`` (known absent) in the first empty bucket from its key's own."""
    b = np.int64(keys[row, 0] & np.uint64(len(buckets) - 1))
    while buckets[b] >= 0:
        b = np.int64((b + 1) & (len(buckets) - 1))
    buckets[b] = row


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _insert(
    buckets: Buckets,
    keys: Digests,
    segments: npt.NDArray[np.int32],
    slots: npt.NDArray[np.int32],
    pages: npt.NDArray[np.uint32],
    meta: Rows,
    new_keys: Digests,
    new_segment: int,
    new_slots: Rows,
    new_pages: Rows,
    out: Rows,
) -> None:  # pragma: no cover - native
    """Rows for new keys (``out``: the row, or NONE for a key already present, which
    keeps its row). The caller made room for all of them."""
    mask = np.uint64(len(buckets) - 1)
    for i in range(len(new_keys)):
        first, second = new_keys[i, 0], new_keys[i, 1]
        b = np.int64(first & mask)
        row = buckets[b]
        while row >= 0 and not (keys[row, 0] == first and keys[row, 1] == second):
            b = np.int64((b + 1) & (len(buckets) - 1))
            row = buckets[b]
        if row >= 0:
            out[i] = NONE
            continue
        row = meta[_FREE]
        if row >= 0:
            meta[_FREE] = slots[row]
        else:
            row = meta[_HANDED]
            meta[_HANDED] += 1
        keys[row, 0], keys[row, 1] = first, second
        segments[row], slots[row], pages[row] = new_segment, new_slots[i], new_pages[i]
        buckets[b] = row
        meta[_COUNT] += 1
        out[i] = row


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _remove(
    buckets: Buckets,
    keys: Digests,
    segments: npt.NDArray[np.int32],
    slots: npt.NDArray[np.int32],
    meta: Rows,
    rows: Rows,
) -> None:  # pragma: no cover - native
    """Empty each row's bucket, shifting later ones of the same probe run back (no
    tombstones), and free the row. A row not in use is skipped."""
    mask = len(buckets) - 1
    for row in rows:
        hole = _bucket_of(buckets, keys, row)
        if hole < 0 or segments[row] < 0:
            continue
        b = hole
        while True:
            b = (b + 1) & mask
            other = buckets[b]
            if other < 0:
                break
            home = np.int64(keys[other, 0] & np.uint64(mask))
            # ``other`` moves back into the hole unless its home lies in (hole, b], cyclically.
            stays = hole < home <= b if hole <= b else home > hole or home <= b
            if not stays:
                buckets[hole] = other
                hole = b
        buckets[hole] = NONE
        segments[row] = NONE
        slots[row] = meta[_FREE]
        meta[_FREE] = row
        meta[_COUNT] -= 1


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _rehash(
    buckets: Buckets, keys: Digests, segments: npt.NDArray[np.int32]
) -> None:  # pragma: no cover - native
    for row in range(len(segments)):
        if segments[row] >= 0:
            _place(buckets, keys, row)


class DigestIndex:
    """Stored objects by key digest: the segment number, slot and payload offset of each."""

    def __init__(self) -> None:
        self._buckets: Buckets = np.full(_MIN_BUCKETS, NONE, np.int32)
        self._keys: Digests = np.zeros((0, 2), np.uint64)
        self._segments = np.zeros(0, np.int32)
        """Per row: the segment's number, or NONE for a free row."""
        self._slots = np.zeros(0, np.int32)
        self._pages = np.zeros(0, np.uint32)
        self._meta: Rows = np.array([0, 0, NONE], np.int64)

    def __len__(self) -> int:
        return int(self._meta[_COUNT])

    @property
    def nbytes(self) -> int:
        arrays = (self._buckets, self._keys, self._segments, self._slots, self._pages)
        return sum(a.nbytes for a in arrays)

    def find(self, digests: Digests) -> Rows:
        """The row of each digest, NONE where absent."""
        out = np.empty(len(digests), np.int64)
        _find(self._buckets, self._keys, digests, out)
        return out

    def segment(self, rows: Rows) -> npt.NDArray[np.int32]:
        return self._segments[rows]

    def slot(self, rows: Rows) -> npt.NDArray[np.int32]:
        return self._slots[rows]

    def offset(self, rows: Rows) -> Rows:
        return self._pages[rows].astype(np.int64) * PAGE

    def digest(self, row: int) -> bytes:
        return bytes(self._keys[row].tobytes())

    def insert(self, digests: Digests, segment: int, slots: Rows, offsets: Rows) -> Rows:
        """Index objects of one segment; per object its row, or NONE where its key was
        indexed already (which keeps its own)."""
        assert np.all(offsets % PAGE == 0) and np.all(offsets < MAX_OFFSET)
        self.reserve(len(self) + len(digests))
        out = np.empty(len(digests), np.int64)
        _insert(
            self._buckets,
            self._keys,
            self._segments,
            self._slots,
            self._pages,
            self._meta,
            digests,
            segment,
            slots.astype(np.int64),
            offsets // PAGE,
            out,
        )
        return out

    def remove(self, rows: Rows) -> None:
        """Forget these rows (each in use, each once)."""
        _remove(self._buckets, self._keys, self._segments, self._slots, self._meta, rows)

    def reserve(self, num_rows: int) -> None:
        """Room for ``num_rows`` objects in all, without growing on the way."""
        if num_rows > len(self._segments):
            self._grow_rows(max(num_rows, int(len(self._segments) * _GROWTH)))
        num_buckets = len(self._buckets)
        while num_rows > num_buckets // 2:
            num_buckets *= 2
        if num_buckets != len(self._buckets):
            self._buckets = np.full(num_buckets, NONE, np.int32)
            _rehash(self._buckets, self._keys, self._segments)

    def _grow_rows(self, num_rows: int) -> None:
        extra = num_rows - len(self._segments)
        self._keys = np.concatenate([self._keys, np.zeros((extra, 2), np.uint64)])
        self._segments = np.concatenate([self._segments, np.full(extra, NONE, np.int32)])
        self._slots = np.concatenate([self._slots, np.zeros(extra, np.int32)])
        self._pages = np.concatenate([self._pages, np.zeros(extra, np.uint32)])

    def rows(self) -> Rows:
        """Every row in use (for integrity checks)."""
        return np.flatnonzero(self._segments >= 0).astype(np.int64)

    def check(self) -> None:
        """Raise AssertionError unless buckets and rows agree."""
        in_use = self.rows()
        assert len(in_use) == len(self), f"{len(in_use)} rows in use, {len(self)} counted"
        placed = self._buckets[self._buckets >= 0]
        assert np.array_equal(np.sort(placed), in_use), "buckets and rows in use differ"
        assert np.array_equal(self.find(self._keys[in_use]), in_use), "a row is not found"
        assert len(self) <= len(self._buckets) // 2


def warm_up() -> None:
    """Compile (or load) the native loops now rather than on a tier's first lookup."""
    index = DigestIndex()
    digests = digest_words(bytes(range(32)))
    rows = index.insert(digests, 0, np.zeros(2, np.int64), np.zeros(2, np.int64))
    index.find(digests)
    index.reserve(_MIN_BUCKETS)  # rehashes
    index.remove(rows)
