"""Block hashes seen lately, each with a level, in bounded memory.

Scheduler process; not thread-safe. Admission (``connector.admission``) asks
whether a prefix was reached before; a dict of hashes would cost over 100
bytes each, so this keeps each hash's first 16 bytes as a row of a
``DigestTable`` (16 bytes, plus its buckets, at most half full: 8 to 16),
a level (1 byte) and its place in a ring of rows by first sighting (4 bytes):
29 to 37 bytes a hash. Past ``capacity`` hashes the one seen first is
forgotten first, whatever its level.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.keys import BlockHash
from hybridkv.tiers import digest_table
from hybridkv.tiers.digest_table import NONE, DigestTable, digest_words

Levels = npt.NDArray[np.uint8]
NOT_SEEN = 0
"""The level of a hash not remembered."""


class SeenHashes:
    """At most ``capacity`` hashes, each with a level above ``NOT_SEEN``."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity}: must be > 0")
        self.capacity = capacity
        # Compiled (or loaded) now, not at the first request: a scheduler in a process
        # of its own may open no tier that would have done it.
        digest_table.warm_up()
        self._table = DigestTable()
        self._table.reserve(capacity)
        self._levels: Levels = np.zeros(capacity, np.uint8)
        """Per row of the table."""
        self._ring = np.full(capacity, NONE, np.int32)
        """Rows by first sighting: slot ``i`` holds the row of the i-th hash mod capacity."""
        self._next = 0
        """The ring's next slot (once full, the oldest row's)."""

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + self._levels.nbytes + self._ring.nbytes

    def levels(self, hashes: Sequence[BlockHash]) -> Levels:
        """Each hash's level (``NOT_SEEN`` if not remembered); changes nothing."""
        rows = self._table.find(digest_words(b"".join(h[:16] for h in hashes)))
        known = rows != NONE
        out = np.zeros(len(hashes), np.uint8)
        out[known] = self._levels[rows[known]]
        return out

    def raise_to(self, hashes: Sequence[BlockHash], level: int) -> Levels:
        """Each hash's level before the call (``NOT_SEEN`` if not remembered); then each
        is remembered at ``level`` or above."""
        return self.sight(hashes, level, level)

    def sight(self, hashes: Sequence[BlockHash], first: int, again: int) -> Levels:
        """Each hash's level before the call (``NOT_SEEN`` if not remembered); then one
        remembered at ``first`` is at ``again``, and each is at ``first`` or above."""
        top = np.iinfo(np.uint8).max
        if not NOT_SEEN < first <= again <= top:
            raise ValueError(f"levels {first}, {again}: must be 1 <= first <= again <= {top}")
        words = digest_words(b"".join(h[:16] for h in hashes))  # every algorithm gives >= 16
        rows = self._table.find(words)
        known = rows != NONE
        before = np.zeros(len(hashes), np.uint8)
        before[known] = self._levels[rows[known]]
        was = before[known]
        self._levels[rows[known]] = np.where(was == first, again, np.maximum(was, first))
        self._add(words[~known], first)
        return before

    def _add(self, words: npt.NDArray[np.int64], level: int) -> None:
        """Remember new hashes (repeats among them once), forgetting the oldest."""
        _, first = np.unique(words, axis=0, return_index=True)
        words = words[np.sort(first)][-self.capacity :]
        slots = (self._next + np.arange(len(words))) % self.capacity
        oldest = self._ring[slots]
        self._table.release(oldest[oldest != NONE].astype(np.int64))
        rows = self._table.claim(words)
        self._ring[slots] = rows
        self._levels[rows] = level
        self._next = (self._next + len(words)) % self.capacity

    def check_integrity(self) -> None:
        self._table.check()
        in_ring = self._ring[self._ring != NONE]
        assert len(in_ring) == len(self._table) <= self.capacity
        assert np.array_equal(np.sort(in_ring), self._table.rows()), "ring and table differ"
