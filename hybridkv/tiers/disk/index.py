"""The disk tier's key index: key digest -> segment number, slot and payload offset.

Any process that opens a disk tier; not thread-safe (``DiskTier`` calls it under
its lock). A terabyte of 16 KiB objects is 64 million objects, too many for a
dict of Python objects per key (docs/DECISIONS.md), so each object is a row of
numpy arrays instead (28 B: the key's 16-byte digest, in ``DigestTable``, then the
segment's number, the slot and the payload offset in pages) plus its share of
the table's buckets.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

import hybridkv.native  # noqa: F401  # before numba compiles: see its docstring
from hybridkv.tiers import digest_table
from hybridkv.tiers.digest_table import (
    NONE,
    Buckets,
    Digests,
    DigestTable,
    Rows,
    claim_one,
    grown,
)
from hybridkv.tiers.disk.segments import PAGE

MAX_OFFSET = PAGE << 32
"""Payload offsets are kept in pages, in 32 bits: segments stay below 16 TiB."""


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _insert(
    buckets: Buckets,
    keys: Digests,
    meta: Rows,
    segments: npt.NDArray[np.int32],
    slots: npt.NDArray[np.int32],
    pages: npt.NDArray[np.uint32],
    new_keys: Digests,
    segment: int,
    new_slots: Rows,
    new_offsets: Rows,
    out: Rows,
) -> None:  # pragma: no cover - native
    for i in range(len(new_keys)):
        row = claim_one(buckets, keys, meta, new_keys[i, 0], new_keys[i, 1])
        out[i] = row
        if row >= 0:
            segments[row], slots[row], pages[row] = segment, new_slots[i], new_offsets[i] // PAGE


class DigestIndex:
    """Stored objects by key digest: the segment number, slot and payload offset of each."""

    def __init__(self) -> None:
        self._table = DigestTable()
        self._segments = np.zeros(0, np.int32)
        """Per row: the segment's number, or NONE for a free row."""
        self._slots = np.zeros(0, np.int32)
        self._pages = np.zeros(0, np.uint32)
        self.reserve(1)  # callers may read whole columns at row NONE, the last one

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        arrays = (self._segments, self._slots, self._pages)
        return self._table.nbytes + sum(a.nbytes for a in arrays)

    def find(self, digests: Digests) -> Rows:
        """The row of each digest, NONE where absent."""
        return self._table.find(digests)

    def segment(self, rows: Rows) -> npt.NDArray[np.int32]:
        return self._segments[rows]

    def slot(self, rows: Rows) -> npt.NDArray[np.int32]:
        return self._slots[rows]

    def offset(self, rows: Rows) -> Rows:
        return self._pages[rows].astype(np.int64) * PAGE

    def digest(self, row: int) -> bytes:
        return self._table.digest(row)

    def insert(self, digests: Digests, segment: int, slots: Rows, offsets: Rows) -> Rows:
        """Index objects of one segment; per object its row, or NONE where its key was
        indexed already (which keeps its own)."""
        table = self._table
        table.make_room(len(digests))
        self._grow()
        out = np.empty(len(digests), np.int64)
        columns = (self._segments, self._slots, self._pages)
        _insert(
            table.buckets, table.keys, table.meta, *columns, digests, segment, slots, offsets, out
        )
        return out

    def remove(self, rows: Rows) -> None:
        """Forget these rows (each in use, each once)."""
        assert np.all(self._segments[rows] >= 0), "a row not in use"
        self._table.release(rows)
        self._segments[rows] = NONE

    def reserve(self, num_rows: int) -> None:
        """Room for ``num_rows`` objects in all, without growing on the way."""
        self._table.reserve(num_rows)
        self._grow()

    def _grow(self) -> None:
        size = self._table.capacity
        if size > len(self._segments):
            self._segments = grown(self._segments, size, NONE)
            self._slots = grown(self._slots, size)
            self._pages = grown(self._pages, size)

    def rows(self) -> Rows:
        """Every row in use (for integrity checks)."""
        return self._table.rows()

    def check(self) -> None:
        """Raise AssertionError unless the table and the rows in use agree."""
        self._table.check()
        in_use = np.flatnonzero(self._segments >= 0)
        assert np.array_equal(in_use, self._table.rows()), "rows in use differ from the table's"


def warm_up() -> None:
    """Compile (or load) the native loops now rather than on a tier's first put or scan."""
    digest_table.warm_up()
    for digests in digest_table.warm_up_digests():
        index = DigestIndex()
        index.insert(digests, 0, np.zeros(2, np.int64), np.zeros(2, np.int64))
