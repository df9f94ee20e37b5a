"""What a Mooncake tier counts: its ``TierStats``, and what this process stored.

Any thread; one lock. Turns Mooncake's per-key return codes into tier
statuses and counts them. The pool evicts on its own and holds other
engines' objects too, so ``usage()`` is what this process stored less what it
deleted (deleted bytes estimated at the mean object size).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, TierStats, TierUsage
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError
from hybridkv.tiers.log_once import LogOnce
from hybridkv.tiers.mooncake.client import ABSENT, McCode


class MooncakeAccounting:
    def __init__(self, log: LogOnce) -> None:
        self.log = log
        self.lock = threading.Lock()
        self.stats = TierStats()
        self.num_objects = 0
        self.used_bytes = 0

    def looked_up(self, found: Sequence[bool]) -> None:
        with self.lock:
            self.stats.queries += len(found)
            self.stats.hits += sum(found)

    def deleted(self, num_removed: int) -> None:
        with self.lock:
            if num_removed and self.num_objects > 0:
                mean_bytes = self.used_bytes // self.num_objects
                self.num_objects = max(0, self.num_objects - num_removed)
                self.used_bytes = min(self.used_bytes, self.num_objects * mean_bytes)

    def usage(self) -> TierUsage:
        with self.lock:
            return TierUsage(
                num_objects=max(0, self.num_objects),
                used_bytes=self.used_bytes,
                capacity_bytes=None,
            )

    def snapshot(self) -> TierStats:
        with self.lock:
            return TierStats(**self.stats.as_dict())

    def check(self) -> None:
        with self.lock:
            stats = self.stats
            assert stats.hits <= stats.queries, stats
            assert all(value >= 0 for value in stats.as_dict().values()), stats
            assert 0 <= self.num_objects <= stats.puts, (self.num_objects, stats.puts)
            assert 0 <= self.used_bytes <= stats.put_bytes, (self.used_bytes, stats.put_bytes)

    def stored(self, num_objects: int, payload_bytes: int) -> None:
        """Count objects stored (each answered 0) at once: ``put_status`` for many."""
        with self.lock:
            self.stats.puts += num_objects
            self.stats.put_bytes += payload_bytes
            self.num_objects += num_objects
            self.used_bytes += payload_bytes

    def loaded(self, num_objects: int, payload_bytes: int) -> None:
        """Count objects read whole and verified at once: ``get_status`` for many."""
        with self.lock:
            self.stats.gets += num_objects
            self.stats.get_bytes += payload_bytes

    def put_status(self, code: int, payload_bytes: int, unexpected: list[int]) -> PutStatus:
        with self.lock:
            if code == 0:
                self.stats.puts += 1
                self.stats.put_bytes += payload_bytes
                self.num_objects += 1
                self.used_bytes += payload_bytes
                return PutStatus.OK
            if code == McCode.OBJECT_ALREADY_EXISTS:
                return PutStatus.EXISTS
            if code == McCode.NO_AVAILABLE_HANDLE:
                self.stats.put_skipped_full += 1
                full = True
            else:
                self.stats.errors += 1
                full = False
        if full:
            self.log.warning(
                "full",
                "the pool refused stores: no room (-200) until the master evicts; "
                "they are skipped and counted (fix: more daemon memory, or a lower "
                "eviction_high_watermark_ratio on the master)",
            )
            return PutStatus.FULL
        if code == McCode.INVALID_PARAMS:
            self.log.warning(
                "put-invalid",
                "the pool refused an object of %d bytes as invalid (-600); "
                "objects like it are skipped",
                payload_bytes + HEADER_BYTES,
            )
        unexpected.append(code)
        return PutStatus.ERROR

    def get_status(
        self,
        key: StoreKey,
        code: int,
        stored_bytes: int,
        problem: HeaderError | None,
        unexpected: list[int],
    ) -> GetStatus:
        """The answer for one object read with ``code``; ``problem`` is what checking it
        found (None: it passed), and means nothing unless it was read whole."""
        if code in ABSENT:
            return GetStatus.MISS
        if code == stored_bytes:
            if problem is None:  # already copied out
                with self.lock:
                    self.stats.gets += 1
                    self.stats.get_bytes += stored_bytes - HEADER_BYTES
                return GetStatus.OK
            reason = problem.value
        elif code >= 0 or code == McCode.INVALID_PARAMS:  # a shorter or a longer object
            reason = f"stored size differs from {stored_bytes} bytes (read {code})"
        else:
            unexpected.append(code)
            self.count(errors=1)
            return GetStatus.ERROR
        self.log.warning("corrupt", "object %s is corrupt: %s", key, reason)
        with self.lock:
            self.stats.corrupt += 1
        return GetStatus.CORRUPT

    # -- calls -------------------------------------------------------------------------

    def note_codes(self, what: str, codes: Sequence[int], *, count: bool) -> None:
        if codes:
            distinct = sorted(set(codes))
            self.log.warning(f"{what}{distinct}", "%s answered Mooncake codes %s", what, distinct)
            if count:
                self.count(errors=len(codes))

    def count(self, *, errors: int) -> None:
        if errors:
            with self.lock:
                self.stats.errors += errors
