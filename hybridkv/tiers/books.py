"""What a tier that keeps its own objects' books reports from them: its change log, its
usage and its counters, read under the tier's lock.

Worker process (and the disk tier's read-only copy in the scheduler). The CPU
tier's ``ArenaIndex`` and the disk tier's ``SegmentTable`` are such books: each
counts its objects, their bytes and its evictions, and tells a ``TierChanges``
of every commit and removal it records.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from typing import Protocol

from hybridkv.tiers.base import Tier, TierChanges, TierStats, TierUsage


class Books(Protocol):
    """A tier's record of the objects it holds."""

    changes: TierChanges | None

    @property
    def num_objects(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def num_evicted(self) -> int: ...


class BookkeepingTier(Tier):
    """A ``Tier`` whose ``log_changes``, ``usage`` and ``stats`` come from its books.

    A subclass sets ``capacity_bytes``, ``_lock`` (held around every change to its
    books) and ``_stats`` (the counters of its calls), and names its books.
    """

    capacity_bytes: int
    _lock: threading.Lock
    _stats: TierStats

    @abstractmethod
    def _books(self) -> Books:
        """The books, read under ``_lock``."""

    @abstractmethod
    def _check_open(self) -> None:
        """Raise if the tier is closed."""

    def log_changes(self, changes: TierChanges) -> bool:
        """Objects committed, by key; every removal (evictions, deletes, objects found
        corrupt, on disk also objects removed from outside) by key digest, as the books
        record them under this tier's lock."""
        changes.keep_digests()
        with self._lock:
            self._check_open()
            self._books().changes = changes
        return True

    def usage(self) -> TierUsage:
        with self._lock:
            books = self._books()
            return TierUsage(
                num_objects=books.num_objects,
                used_bytes=books.used_bytes,
                capacity_bytes=self.capacity_bytes,
            )

    def stats(self) -> TierStats:
        with self._lock:
            stats = TierStats(**self._stats.as_dict())
            stats.evictions = self._books().num_evicted
            return stats
