"""A tiered store's admission: what its first tier sends on to the slower tiers.

Worker process. ``Admitting`` is the part of ``TieredStore`` that sends stored
blocks past the first tier and counts them per slower tier: every store with
``Admission.ALL``; with ``Admission.REUSED`` what ``admit_many`` names, and
every store while the slower tiers still have room for it (``tiers.admission``,
``tiers.tiered.room``). Blocks in the first tier's memory go on borrowed, not
copied (``tiers.tiered.in_place``); without that memory they are read out first.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from hybridkv.tiers.base import Buffer, GetStatus, StoreKey, Tier, TierMemory, TierStats
from hybridkv.tiers.tiered.guard import TierGuard
from hybridkv.tiers.tiered.in_place import StoreMemory
from hybridkv.tiers.tiered.room import SlowerRoom
from hybridkv.tiers.tiered.write_back import WriteBack


class Admitting:
    """Mixin of ``TieredStore``: sending blocks on past the first tier, and counting them.

    The store sets the attributes declared here and provides ``_get_from`` and
    ``_write_lower``.
    """

    tiers: tuple[Tier, ...]
    _sends_all: bool
    """Every store goes on to the slower tiers (else only what is admitted)."""
    _plain_lru: bool
    """For now every store goes on, and the tiers evict by recency alone
    (``use_plain_lru``)."""
    _room: SlowerRoom
    """Where not every store goes on: whether the slower tiers still have free room."""
    _memory: StoreMemory | None
    _first_memory: TierMemory | None
    _write_back: WriteBack | None
    _guard: TierGuard
    _lock: threading.Lock
    _stats: TierStats
    _num_admitted: int
    _num_rejected: int
    """Blocks sent on to (held back from) each slower tier: the same for each."""
    _num_lost: int
    """Blocks admitted that the first tier did not hold."""
    _reused_pending: set[StoreKey]
    """Admitted by ``admit_many``, not written yet: noted reused in the slower tiers
    once written (``Tier.note_reused_many``)."""

    def admit_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> int:
        """Send blocks held in the first tier on to the slower tiers (write-back, or now
        without it); returns how many were there to send. ``sizes``: each block's bytes.

        With ``Admission.ALL``, or while plain LRU, every store went on already:
        nothing to do (sending one the slower tiers evicted since would push out others
        that plain recency keeps). A key the
        first tier no longer holds (evicted, never stored) is skipped: recomputing it
        is the fallback. Reading a block to send it on counts as a get there and makes
        it most recent.
        """
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes; give one size per key")
        if self._sends_all or self._plain_lru or len(self.tiers) == 1 or not keys:
            return 0
        if self._memory is not None:
            held, views = self._borrow_first(keys, sizes)
            self._count_sent_on(len(held), 0, num_lost=len(keys) - len(held))
            if held:
                self._note_pending(held)
                self._send_borrowed(held, views)
            return len(held)
        buffers = [np.empty(size, np.uint8) for size in sizes]
        found = self._get_from(0, keys, buffers)
        ok = [j for j, status in enumerate(found) if status is GetStatus.OK]
        self._count_sent_on(len(ok), 0, num_lost=len(keys) - len(ok))
        ok_keys = [keys[j] for j in ok]
        self._note_pending(ok_keys)
        if self._write_back is not None:
            queued = self._write_back.submit_many(ok_keys, [buffers[j] for j in ok])
            self._take_reused([k for k, q in zip(ok_keys, queued, strict=True) if not q])
        elif ok:
            self._write_lower(ok_keys, [buffers[j] for j in ok])
        return len(ok)

    def use_plain_lru(self, on: bool) -> None:
        """While ``on`` (``connector.returns``), every store goes on past the first
        tier, and each tier evicts least recently used first."""
        self._plain_lru = on
        for index, tier in enumerate(self.tiers):
            self._guard.call(index, "plain lru", None, tier.use_plain_lru, on)

    def _note_pending(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            self._reused_pending.update(keys)

    def _take_reused(self, keys: Sequence[StoreKey]) -> list[StoreKey]:
        """Those of ``keys`` admitted as reused and not written yet; forgotten here."""
        with self._lock:
            if not self._reused_pending:
                return []
            taken = [key for key in keys if key in self._reused_pending]
            self._reused_pending.difference_update(taken)
        return taken

    def _send_on(self, keys: list[StoreKey], views: list[Buffer]) -> None:
        """Objects committed in place in the first tier: count them, then send them to
        the others; with other tiers this owns one borrow of each, released once sent."""
        with self._lock:
            self._stats.puts += len(keys)
            self._stats.put_bytes += sum(len(view) for view in views)
        if len(self.tiers) == 1:
            return
        if self._sends_all:
            self._count_sent_on(len(keys), 0)
            self._send_borrowed(keys, views)
        elif self._plain_lru or self._room.take(sum(len(view) for view in views)):
            held, held_views = self._borrow_first(keys, [len(view) for view in views])
            self._count_sent_on(len(held), len(keys) - len(held))
            if held:
                self._send_borrowed(held, held_views)
        else:
            self._count_sent_on(0, len(keys))

    def _send_borrowed(self, keys: list[StoreKey], views: list[Buffer]) -> None:
        """Send views of the first tier's memory on; owns one borrow of each."""
        if self._write_back is not None:
            queued = self._write_back.submit_borrowed_many(keys, views)
            self._take_reused([key for key, q in zip(keys, queued, strict=True) if not q])
            return
        try:
            self._write_lower(keys, views)
        finally:
            self._release_first(keys)

    def _count_sent_on(self, num_admitted: int, num_rejected: int, num_lost: int = 0) -> None:
        if len(self.tiers) > 1:
            with self._lock:
                self._num_admitted += num_admitted
                self._num_rejected += num_rejected
                self._num_lost += num_lost

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

    def _borrow_limit(self) -> int | None:
        """Bytes of the first tier the write-back may keep borrowed: half of it, so the
        tier can still evict for new stores while the slower tiers lag (None: no limit
        known)."""
        usage = self._guard.call(0, "usage", None, self.tiers[0].usage)
        capacity = None if usage is None else usage.capacity_bytes
        return None if capacity is None else capacity // 2

    def _release_first(self, keys: list[StoreKey]) -> None:
        if self._first_memory is not None:
            self._guard.call(0, "release", None, self._first_memory.release_many, keys)

    # Provided by the store ---------------------------------------------------------

    def _get_from(
        self, index: int, keys: Sequence[StoreKey], buffers: Sequence[Buffer]
    ) -> list[GetStatus]:
        raise NotImplementedError

    def _write_lower(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> int:
        raise NotImplementedError
