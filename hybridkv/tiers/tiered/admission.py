"""A tiered store's admission: what its first tier sends on to the slower tiers.

Worker process, any thread. ``SlowerAdmission`` decides which stores of a
``TieredStore`` go past the first tier, sends them, and counts them per slower
tier: every store with ``Admission.ALL``; with ``Admission.REUSED`` what
``admit_many`` names (``StackRetention.admit``), and every store while the
slower tiers still have room for it (``tiers.admission``, ``tiers.tiered.room``).
Blocks in the first tier's memory go on borrowed, not copied
(``tiers.tiered.in_place``); without that memory they are read out first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hybridkv.tiers.base import Buffer, GetStatus, StoreKey, Tier
from hybridkv.tiers.retention import StackMode
from hybridkv.tiers.tiered.guard import TierGuard
from hybridkv.tiers.tiered.in_place import StoreMemory
from hybridkv.tiers.tiered.room import SlowerRoom
from hybridkv.tiers.tiered.write_back import WriteBack

ReadFirst = Callable[[Sequence[StoreKey], Sequence[Buffer]], list[GetStatus]]
"""Reads keys from the first tier into buffers, as the store's gets do."""
WriteLower = Callable[[Sequence[StoreKey], Sequence[Buffer]], int]
"""Puts blocks into every tier but the first now; returns the failed (key, tier) writes."""


class AdmissionCounts(NamedTuple):
    """Blocks counted for each slower tier: the same for each."""

    num_admitted: int
    """Sent on."""
    num_rejected: int
    """Held back."""
    num_lost: int
    """Admitted, but the first tier did not hold them."""


class SlowerAdmission:
    """What the first tier of ``tiers`` sends on to the slower tiers, and the counts of it.

    ``memory``: the store's view of the first tier's memory (None where it has
    none); ``write_back``: the queue to the slower tiers (None: written now with
    ``write_lower``). With ``sends_all`` the first tier's memory borrows every
    object it commits once more for this to send on (``StoreMemory``'s ``send_on``).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        guard: TierGuard,
        *,
        sends_all: bool,
        memory: StoreMemory | None,
        write_back: WriteBack | None,
        read_first: ReadFirst,
        write_lower: WriteLower,
    ) -> None:
        self._tiers = tuple(tiers)
        self._guard = guard
        self._sends_all = sends_all
        """Every store goes on to the slower tiers (else only what is admitted)."""
        self._plain_lru = False
        """For now every store goes on, and the tiers evict by recency alone
        (``StackMode.PLAIN_LRU``)."""
        self._memory = memory
        self._write_back = write_back
        self._read_first = read_first
        self._write_lower = write_lower
        self._room = SlowerRoom(self._tiers, guard, queued=self._queued_bytes)
        """Where not every store goes on: whether the slower tiers still have free room."""
        self._num_admitted = 0
        self._num_rejected = 0
        self._num_lost = 0
        self._reused_pending: set[StoreKey] = set()
        """Admitted by ``admit_many``, not written yet: noted reused in the slower tiers
        once written (``TierRetention.note_reused``)."""
        self._lock = threading.Lock()

    def goes_on(self, num_bytes: int) -> bool:
        """Whether a store of ``num_bytes`` goes on past the first tier: every one with
        ``sends_all`` or while plain LRU, else while the slower tiers have room for it
        (the bytes then count as sent)."""
        return self._sends_all or self._plain_lru or self._room.take(num_bytes)

    def use_mode(self, mode: StackMode) -> None:
        """With ``PLAIN_LRU`` every store goes on past the first tier; with ``KEEP_SLOWER``
        stores go on only into the slower tiers' free room, and admitted blocks only
        where they evict nothing but blocks admitted before (``connector.returns``)."""
        self._plain_lru = mode is StackMode.PLAIN_LRU
        self._room.free_only = mode is StackMode.KEEP_SLOWER

    def _note_reused_below(self, keys: Sequence[StoreKey]) -> None:
        """Admitted keys the first tier does not hold (a load read them from a slower
        tier, or it evicted them): each slower tier holding them notes them reused, so
        the blocks hit there are not evicted for first sightings."""
        if keys:
            for index, tier in enumerate(self._tiers[1:], start=1):
                self._guard.call(index, "note reused", None, tier.retention.note_reused, keys)

    def admit_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> int:
        """Send blocks held in the first tier on to the slower tiers (write-back, or now
        without it); returns how many were there to send. ``sizes``: each block's bytes.

        With ``sends_all``, or while plain LRU, every store went on already: nothing
        to do (sending one the slower tiers evicted since would push out others that
        plain recency keeps). A key the first tier no longer holds (evicted, never
        stored) is skipped: recomputing it is the fallback. Reading a block to send it
        on counts as a get there and makes it most recent.
        """
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes; give one size per key")
        if self._sends_all or self._plain_lru or len(self._tiers) == 1 or not keys:
            return 0
        if not self._room.take_admitted(sum(sizes)):
            self.count_sent_on(0, len(keys))
            self._note_reused_below(keys)
            return 0
        if self._memory is not None:
            held, views = self._borrow_first(keys, sizes)
            self.count_sent_on(len(held), 0, num_lost=len(keys) - len(held))
            taken = set(held)
            self._note_reused_below([key for key in keys if key not in taken])
            if held:
                self._note_pending(held)
                self._send_borrowed(held, views)
            return len(held)
        buffers = [np.empty(size, np.uint8) for size in sizes]
        found = self._read_first(keys, buffers)
        ok = [j for j, status in enumerate(found) if status is GetStatus.OK]
        self.count_sent_on(len(ok), 0, num_lost=len(keys) - len(ok))
        self._note_reused_below(
            [key for key, status in zip(keys, found, strict=True) if status is not GetStatus.OK]
        )
        ok_keys = [keys[j] for j in ok]
        self._note_pending(ok_keys)
        if self._write_back is not None:
            queued = self._write_back.submit_many(ok_keys, [buffers[j] for j in ok])
            self.take_reused([k for k, q in zip(ok_keys, queued, strict=True) if not q])
        elif ok:
            self._write_lower(ok_keys, [buffers[j] for j in ok])
        return len(ok)

    def send_on(self, keys: list[StoreKey], views: list[Buffer]) -> None:
        """Objects committed in place in the first tier: send them to the slower tiers
        where they go on; with ``sends_all`` this owns one borrow of each, released
        once sent."""
        if len(self._tiers) == 1:
            return
        if self._sends_all:
            self.count_sent_on(len(keys), 0)
            self._send_borrowed(keys, views)
        elif self.goes_on(sum(len(view) for view in views)):
            held, held_views = self._borrow_first(keys, [len(view) for view in views])
            self.count_sent_on(len(held), len(keys) - len(held))
            if held:
                self._send_borrowed(held, held_views)
        else:
            self.count_sent_on(0, len(keys))

    def take_reused(self, keys: Sequence[StoreKey]) -> list[StoreKey]:
        """Those of ``keys`` admitted as reused and not written yet; forgotten here."""
        with self._lock:
            if not self._reused_pending:
                return []
            taken = [key for key in keys if key in self._reused_pending]
            self._reused_pending.difference_update(taken)
        return taken

    def count_sent_on(self, num_admitted: int, num_rejected: int, num_lost: int = 0) -> None:
        if len(self._tiers) > 1:
            with self._lock:
                self._num_admitted += num_admitted
                self._num_rejected += num_rejected
                self._num_lost += num_lost

    def counts(self) -> AdmissionCounts:
        with self._lock:
            return AdmissionCounts(self._num_admitted, self._num_rejected, self._num_lost)

    def _note_pending(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            self._reused_pending.update(keys)

    def _send_borrowed(self, keys: list[StoreKey], views: list[Buffer]) -> None:
        """Send views of the first tier's memory on; owns one borrow of each."""
        if self._write_back is not None:
            queued = self._write_back.submit_borrowed_many(keys, views)
            self.take_reused([key for key, q in zip(keys, queued, strict=True) if not q])
            return
        try:
            self._write_lower(keys, views)
        finally:
            memory = self._memory
            assert memory is not None
            self._guard.call(0, "release", None, memory.release_many, keys)

    def _borrow_first(
        self, keys: Sequence[StoreKey], sizes: Sequence[int]
    ) -> tuple[list[StoreKey], list[Buffer]]:
        """The keys the first tier's memory holds, each borrowed once, and their views."""
        memory = self._memory
        assert memory is not None
        failed: list[int | GetStatus] = [GetStatus.ERROR] * len(keys)
        offsets = self._guard.call(0, "borrow", failed, memory.borrow_many, keys, sizes)
        array = memory.array()
        held: list[StoreKey] = []
        views: list[Buffer] = []
        for key, size, offset in zip(keys, sizes, offsets, strict=True):
            if isinstance(offset, int):
                held.append(key)
                views.append(array[offset : offset + size])
        return held, views

    def _queued_bytes(self) -> int:
        return 0 if self._write_back is None else self._write_back.queued_bytes()
