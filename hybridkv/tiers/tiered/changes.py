"""What a worker's tiers stored and removed since it last asked (behind KV events).

Worker process; thread-safe: tiers record from copy, I/O and write-back threads,
the worker drains the log once a step. A tier that sees its own removals records
everything itself, in order (``Tier.log_changes``); for the others (shared pools,
which evict on their server) the tiered store records what it learns: writes that
succeed, reads that find an object or find it gone, deletes.

Bounded: the log keeps at most ``max_changes`` entries between two drains (the
oldest are dropped, counted and logged once), and a tier naming its removals by key
digest has its stored keys remembered up to ``max_digest_keys``; the oldest past
that is reported removed though it may still be there (a router then under-counts
that tier, never over-counts it).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier
from hybridkv.tiers.codec import key_digest

logger = logging.getLogger(__name__)

MAX_CHANGES = 1 << 16
"""Changes kept between two drains (a drain comes every engine step)."""
MAX_DIGEST_KEYS = 1 << 16
"""Stored keys remembered per tier that names removals by digest."""
_DIGEST_BYTES = 16


class KeyChange(NamedTuple):
    tier_index: int
    key: StoreKey
    stored: bool
    """False: removed."""


class ChangeLog:
    """The changes of one store's tiers (``tier_index`` is the tier's place in the store)."""

    def __init__(
        self, *, max_changes: int = MAX_CHANGES, max_digest_keys: int = MAX_DIGEST_KEYS
    ) -> None:
        self.max_changes = max_changes
        self.max_digest_keys = max_digest_keys
        self.num_lost = 0
        """Changes dropped because the log was full."""
        self._changes: deque[KeyChange] = deque()
        self._lock = threading.Lock()
        self._logs_itself: list[bool] = []

    def attach(self, tiers: Sequence[Tier]) -> None:
        """Ask each tier to record its own changes; remember those that cannot."""
        self._logs_itself = [tier.log_changes(TierLog(self, i)) for i, tier in enumerate(tiers)]

    def logs_itself(self, tier_index: int) -> bool:
        return self._logs_itself[tier_index]

    # What the tiered store learns about a tier that cannot record its own changes.

    def note_puts(
        self, tier_index: int, keys: Sequence[StoreKey], statuses: Sequence[PutStatus]
    ) -> None:
        if not self._logs_itself[tier_index]:
            held = (PutStatus.OK, PutStatus.EXISTS)
            pairs = zip(keys, statuses, strict=True)
            self.add(tier_index, [key for key, status in pairs if status in held], True)

    def note_gets(
        self, tier_index: int, keys: Sequence[StoreKey], statuses: Sequence[GetStatus]
    ) -> None:
        """A read that found an object shows it stored; one that missed or found it
        corrupt shows it gone (an error shows nothing)."""
        if self._logs_itself[tier_index]:
            return
        pairs = list(zip(keys, statuses, strict=True))
        self.add(tier_index, [k for k, s in pairs if s is GetStatus.OK], True)
        gone = (GetStatus.MISS, GetStatus.CORRUPT)
        self.add(tier_index, [k for k, s in pairs if s in gone], False)

    def note_deletes(self, tier_index: int, keys: Sequence[StoreKey]) -> None:
        if not self._logs_itself[tier_index]:
            self.add(tier_index, keys, False)

    # Recording and draining.

    def add(self, tier_index: int, keys: Sequence[StoreKey], stored: bool) -> None:
        if not keys:
            return
        with self._lock:
            self._changes.extend(KeyChange(tier_index, key, stored) for key in keys)
            over = len(self._changes) - self.max_changes
            if over > 0:
                if not self.num_lost:
                    logger.warning(
                        "tier change log: more than %d changes between two engine steps; "
                        "the oldest are dropped (KV events may miss them)",
                        self.max_changes,
                    )
                self.num_lost += over
                for _ in range(over):
                    self._changes.popleft()

    def take(self) -> list[KeyChange]:
        """The changes since the last call, in the order they happened."""
        with self._lock:
            changes = list(self._changes)
            self._changes.clear()
        return changes


class TierLog:
    """One tier's view of a ``ChangeLog`` (a ``TierChanges``)."""

    def __init__(self, log: ChangeLog, tier_index: int) -> None:
        self._log = log
        self._tier_index = tier_index
        self._digests: OrderedDict[bytes, StoreKey] | None = None
        self._lock = threading.Lock()

    def keep_digests(self) -> None:
        """The tier names removals by key digest: remember stored keys by digest."""
        self._digests = OrderedDict()

    def stored(self, keys: Sequence[StoreKey]) -> None:
        withdrawn: list[StoreKey] = []
        if self._digests is not None:
            with self._lock:
                for key in keys:
                    digest = key_digest(key)
                    self._digests[digest] = key
                    self._digests.move_to_end(digest)
                while len(self._digests) > self._log.max_digest_keys:
                    withdrawn.append(self._digests.popitem(last=False)[1])
        self._log.add(self._tier_index, keys, True)
        self._log.add(self._tier_index, withdrawn, False)

    def removed(self, keys: Sequence[StoreKey]) -> None:
        self._log.add(self._tier_index, keys, False)

    def removed_digests(self, digests: bytes) -> None:
        if self._digests is None:
            return
        with self._lock:
            found = [
                self._digests.pop(digests[i : i + _DIGEST_BYTES], None)
                for i in range(0, len(digests), _DIGEST_BYTES)
            ]
        self._log.add(self._tier_index, [key for key in found if key is not None], False)
