"""Write-back: staged copies of stored blocks, written to the slower tiers by one thread.

Worker process. Callers reuse their buffers at once, so every block is
copied into this queue's own arena first; a full arena skips the block.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.tiers.base import Buffer, StoreKey
from hybridkv.tiers.memory import ExtentAllocator, allocate_arena

logger = logging.getLogger(__name__)

WRITE_BACK_BATCH_KEYS = 64
"""Keys written to the lower tiers in one call."""


@dataclass(kw_only=True)
class WriteBackStats:
    num_queued: int = 0
    num_written: int = 0
    """Keys whose write-back finished (each lower tier answered)."""
    num_skipped: int = 0
    """Keys not queued: the staging arena was full (or closed)."""
    num_failed: int = 0
    """(key, tier) writes that answered ERROR or raised."""


class WriteBack:
    """Staged copies of stored blocks, written to the lower tiers by one thread."""

    def __init__(
        self, write: Callable[[list[StoreKey], list[Buffer]], int], capacity_bytes: int
    ) -> None:
        self._write = write
        """Puts a batch into the lower tiers; returns the number of failed (key, tier) writes."""
        self._arena, self._arena_owner = allocate_arena(capacity_bytes, pin_memory=False)
        self._allocator = ExtentAllocator(capacity_bytes)
        self._queued: OrderedDict[StoreKey, tuple[int, int]] = OrderedDict()
        self._in_flight: dict[StoreKey, tuple[int, int]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.stats = WriteBackStats()
        self._thread = threading.Thread(target=self._run, name="hybridkv-write-back", daemon=True)
        self._thread.start()

    def submit_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[bool]:
        """Copy and queue each block; False where it was skipped (no room)."""
        return [self._submit(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def _submit(self, key: StoreKey, buf: Buffer) -> bool:
        with self._cond:  # copying under the lock keeps cancel() exact; it takes microseconds
            if key in self._queued or key in self._in_flight:
                return True
            offset = None if self._closed else self._allocator.allocate(len(buf))
            if offset is None:
                self.stats.num_skipped += 1
                return False
            np.copyto(self._arena[offset : offset + len(buf)], buf)
            self._queued[key] = (offset, len(buf))
            self.stats.num_queued += 1
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queued) or self._closed)
                if not self._queued:
                    return
                while self._queued and len(self._in_flight) < WRITE_BACK_BATCH_KEYS:
                    key, extent = self._queued.popitem(last=False)
                    self._in_flight[key] = extent
                batch = list(self._in_flight.items())
            keys = [key for key, _ in batch]
            views = [self._arena[offset : offset + size] for _, (offset, size) in batch]
            try:
                num_failed = self._write(keys, views)
            except Exception:  # a bug must not kill the thread and hang flush()
                logger.exception("write-back of %d blocks failed", len(keys))
                num_failed = len(keys)
            with self._cond:
                for offset, _ in self._in_flight.values():
                    self._allocator.free(offset)
                self._in_flight.clear()
                self.stats.num_written += len(batch)
                self.stats.num_failed += num_failed
                self._cond.notify_all()

    def cancel(self, keys: Sequence[StoreKey]) -> None:
        """Drop queued writes of ``keys`` and wait for an in-flight batch holding any."""
        with self._cond:
            for key in keys:
                extent = self._queued.pop(key, None)
                if extent is not None:
                    self._allocator.free(extent[0])
            wanted = set(keys)
            self._cond.wait_for(lambda: not wanted & self._in_flight.keys())

    def flush(self, timeout_s: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queued and not self._in_flight, timeout=timeout_s
            )

    def close(self, timeout_s: float) -> None:
        finished = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            for offset, _ in self._queued.values():
                self._allocator.free(offset)
            self.stats.num_skipped += len(self._queued)
            self._queued.clear()
            self._cond.notify_all()
        if finished:
            self._thread.join(timeout_s)

    def snapshot(self) -> WriteBackStats:
        with self._cond:
            return WriteBackStats(**vars(self.stats))

    def check_integrity(self) -> None:
        with self._cond:
            self._allocator.check_integrity()
            extents = {offset: size for offset, size in self._queued.values()}
            extents.update(self._in_flight.values())
            allocated = self._allocator.allocated()
            assert allocated.keys() == extents.keys(), "staging extents leaked"
            assert all(self._allocator.rounded(extents[o]) == s for o, s in allocated.items())
            assert not self._queued.keys() & self._in_flight.keys()
