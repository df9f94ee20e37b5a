"""Write-back: stored blocks queued for the slower tiers, written by one thread.

Worker process. A block arrives either as a buffer its caller reuses at once,
copied into this queue's own arena (allocated on first use), or as a borrowed
view of the first tier's memory, queued without a copy and released once
written. Both share one byte budget: past it a block is skipped (a borrowed
one released at once). Borrowed views pin the first tier's memory, which then
cannot evict them to make room for new stores: past ``borrow_limit_bytes`` a
borrowed view is copied like a buffer and its borrow released at once.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridkv.tiers.base import Buffer, StoreKey
from hybridkv.tiers.memory import ExtentAllocator, allocate_arena

logger = logging.getLogger(__name__)

WRITE_BACK_BATCH_KEYS = 64
"""Keys written to the lower tiers in one call."""


@dataclass(kw_only=True)
class WriteBackStats:
    num_queued: int = 0
    num_copied: int = 0
    """Of the queued keys, those copied into the queue's arena (the rest were borrowed)."""
    num_written: int = 0
    """Keys whose write-back finished (each lower tier answered)."""
    num_skipped: int = 0
    """Keys not queued: the byte budget was spent (or the queue closed)."""
    num_failed: int = 0
    """(key, tier) writes that answered ERROR or raised."""
    num_pending: int = 0
    """Keys queued or being written now (a snapshot, not a counter)."""


class _Queued(NamedTuple):
    view: Buffer
    extent: int | None
    """Offset of the copy in this queue's arena, freed once written; None: a borrowed
    view of the first tier's memory, released once written."""


class _Taken(enum.Enum):
    """What became of a borrowed view offered to the queue."""

    KEPT = "kept"
    """Queued; the queue releases the borrow once written."""
    QUEUED_ALREADY = "queued_already"
    OVER_LIMIT = "over_limit"
    """Borrowed views queued reach ``borrow_limit_bytes``: copy it instead."""
    SKIPPED = "skipped"


class WriteBack:
    """Stored blocks written to the lower tiers by one thread, copied or borrowed."""

    def __init__(
        self,
        write: Callable[[list[StoreKey], list[Buffer]], int],
        release: Callable[[list[StoreKey]], None],
        capacity_bytes: int,
        *,
        borrow_limit_bytes: int | None = None,
    ) -> None:
        self._write = write
        """Puts a batch into the lower tiers; returns the number of failed (key, tier) writes."""
        self._release = release
        """Ends one borrow of each key in the first tier."""
        self.capacity_bytes = capacity_bytes
        limit = borrow_limit_bytes
        self.borrow_limit_bytes = capacity_bytes if limit is None else limit
        """Bytes of borrowed views queued at most; more are copied."""
        self._arena: Buffer | None = None
        self._allocator = ExtentAllocator(capacity_bytes)
        self._borrowed_bytes = 0
        self._queued: OrderedDict[StoreKey, _Queued] = OrderedDict()
        self._in_flight: dict[StoreKey, _Queued] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.stats = WriteBackStats()
        self._thread = threading.Thread(target=self._run, name="hybridkv-write-back", daemon=True)
        self._thread.start()

    def submit_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[bool]:
        """Copy and queue each block; False where it was skipped (no room)."""
        return [self._submit_copy(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def submit_borrowed_many(self, keys: Sequence[StoreKey], views: Sequence[Buffer]) -> list[bool]:
        """Queue each borrowed view as it is while borrowed views stay within
        ``borrow_limit_bytes``, else a copy of it. Takes over one borrow of each key,
        released once written, or at once where it was copied, queued already (True)
        or skipped (False)."""
        answers: list[bool] = []
        released: list[StoreKey] = []
        for key, view in zip(keys, views, strict=True):
            with self._cond:
                taken = self._submit_borrowed(key, view)
            if taken is not _Taken.KEPT:
                released.append(key)
            if taken is _Taken.OVER_LIMIT:
                answers.append(self._submit_copy(key, view))
            else:
                answers.append(taken is not _Taken.SKIPPED)
        self._release_quietly(released)
        return answers

    def _submit_copy(self, key: StoreKey, buf: Buffer) -> bool:
        with self._cond:  # copying under the lock keeps cancel() exact; it takes microseconds
            if key in self._queued or key in self._in_flight:
                return True
            room = self._fits(self._allocator.rounded(len(buf)))
            offset = self._allocator.allocate(len(buf)) if room else None
            if offset is None:
                self.stats.num_skipped += 1
                return False
            if self._arena is None:
                self._arena, _ = allocate_arena(self.capacity_bytes, pin_memory=False)
            copy = self._arena[offset : offset + len(buf)]
            np.copyto(copy, buf)
            self._enqueue(key, _Queued(copy, offset))
            self.stats.num_copied += 1
        return True

    def _submit_borrowed(self, key: StoreKey, view: Buffer) -> _Taken:
        if key in self._queued or key in self._in_flight:
            return _Taken.QUEUED_ALREADY
        if self._borrowed_bytes + len(view) > self.borrow_limit_bytes:
            return _Taken.OVER_LIMIT
        if not self._fits(len(view)):
            self.stats.num_skipped += 1
            return _Taken.SKIPPED
        self._borrowed_bytes += len(view)
        self._enqueue(key, _Queued(view, None))
        return _Taken.KEPT

    def _fits(self, num_bytes: int) -> bool:
        return not self._closed and self._used_bytes() + num_bytes <= self.capacity_bytes

    def _used_bytes(self) -> int:
        """Of the byte budget: copies in the arena and borrowed views (under the lock)."""
        return self._allocator.allocated_bytes + self._borrowed_bytes

    def _enqueue(self, key: StoreKey, item: _Queued) -> None:
        self._queued[key] = item
        self.stats.num_queued += 1
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queued) or self._closed)
                if not self._queued:
                    return
                while self._queued and len(self._in_flight) < WRITE_BACK_BATCH_KEYS:
                    key, item = self._queued.popitem(last=False)
                    self._in_flight[key] = item
                batch = list(self._in_flight.items())
            keys = [key for key, _ in batch]
            try:
                num_failed = self._write(keys, [item.view for _, item in batch])
            except Exception:  # a bug must not kill the thread and hang flush()
                logger.exception("write-back of %d blocks failed", len(keys))
                num_failed = len(keys)
            # Released before the batch leaves flight: flush() then means no borrow is held.
            self._release_quietly([key for key, item in batch if item.extent is None])
            with self._cond:
                for _, item in batch:
                    self._forget(item)
                self._in_flight.clear()
                self.stats.num_written += len(batch)
                self.stats.num_failed += num_failed
                self._cond.notify_all()

    def _forget(self, item: _Queued) -> None:
        """Return a dequeued item's room to the budget (its borrow is released apart)."""
        if item.extent is None:
            self._borrowed_bytes -= len(item.view)
        else:
            self._allocator.free(item.extent)

    def _release_quietly(self, keys: list[StoreKey]) -> None:
        if not keys:
            return
        try:
            self._release(keys)
        except Exception:  # the first tier closed under us: nothing left to release
            logger.exception("write-back could not release %d borrowed blocks", len(keys))

    def cancel(self, keys: Sequence[StoreKey]) -> None:
        """Drop queued writes of ``keys`` (releasing their borrows) and wait for an
        in-flight batch holding any."""
        with self._cond:
            dropped = {key: self._queued.pop(key) for key in keys if key in self._queued}
            for item in dropped.values():
                self._forget(item)
        self._release_quietly([key for key, item in dropped.items() if item.extent is None])
        wanted = set(keys)
        with self._cond:
            self._cond.wait_for(lambda: not wanted & self._in_flight.keys())

    def flush(self, timeout_s: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queued and not self._in_flight, timeout=timeout_s
            )

    def close(self, timeout_s: float) -> None:
        """Flush (up to ``timeout_s``), then drop what is left, releasing its borrows."""
        finished = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            dropped = list(self._queued.items())
            for _, item in dropped:
                self._forget(item)
            self.stats.num_skipped += len(dropped)
            self._queued.clear()
            self._cond.notify_all()
        self._release_quietly([key for key, item in dropped if item.extent is None])
        if finished:
            self._thread.join(timeout_s)

    def queued_bytes(self) -> int:
        """Bytes queued and not written yet (copies and borrowed views)."""
        with self._cond:
            return self._used_bytes()

    def snapshot(self) -> WriteBackStats:
        with self._cond:
            stats = WriteBackStats(**vars(self.stats))
            stats.num_pending = len(self._queued) + len(self._in_flight)
            return stats

    def check_integrity(self) -> None:
        with self._cond:
            self._allocator.check_integrity()
            items = [*self._queued.values(), *self._in_flight.values()]
            copies = {item.extent: len(item.view) for item in items if item.extent is not None}
            allocated = self._allocator.allocated()
            assert allocated.keys() == copies.keys(), "staging extents leaked"
            assert all(self._allocator.rounded(copies[o]) == s for o, s in allocated.items())
            borrowed = sum(len(item.view) for item in items if item.extent is None)
            assert self._borrowed_bytes == borrowed, "borrowed bytes miscounted"
            assert self._allocator.allocated_bytes + borrowed <= self.capacity_bytes
            assert not self._queued.keys() & self._in_flight.keys()
