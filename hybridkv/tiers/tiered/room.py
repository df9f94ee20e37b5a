"""Room in a tiered store's slower tiers: ``Admission.REUSED`` holds back only what
would push out something reused.

Worker process, any thread. Holding a block back from a tier that still has
free room saves nothing and loses a hit (a restarted engine finds on disk only
what was sent there), so while every slower tier has room for a batch without
evicting, the batch goes on whether or not it was reused. A tier that answers
its usage from memory (``Tier.local_usage``: the disk) is asked for every
batch, with the bytes still queued for write-back counted against it; a pool
answers over the network, so its usage is read at most once per
``reread_s`` and the bytes sent since are counted against it. (The disk's usage
read once a second would make a full disk look fuller the more batches came in
that second, and hold back more the busier the machine.) Once a tier is full, a
batch still goes on where what it would evict there holds nothing admitted as
reused (``TierRetention.evicts_reused``, False): evicting one unreused block for
another is plain recency, which admission must not lose to. A tier that
cannot tell its capacity or its victim (Mooncake; Valkey without
``maxmemory``, or full) takes only reused blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from hybridkv.tiers.base import Tier, TierUsage
from hybridkv.tiers.tiered.guard import TierGuard

REREAD_S = 1.0
"""How old a slower tier's usage may be before it is read again."""


class SlowerRoom:
    """Whether every tier but the first can take some bytes without evicting."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        guard: TierGuard,
        *,
        queued: Callable[[], int] = lambda: 0,
        reread_s: float = REREAD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tiers = tuple(tiers)
        self._guard = guard
        self._queued = queued
        """Bytes queued for the slower tiers and not written yet (write-back)."""
        self._reread_s = reread_s
        self._clock = clock
        self._remote = [i for i in range(1, len(self._tiers)) if not self._tiers[i].local_usage]
        self._free: dict[int, int | None] = {}
        """Bytes each remote slower tier could take without evicting (None: unknown),
        as last read."""
        self._sent = 0
        """Bytes sent on since (a write-back queue may not have written them yet)."""
        self._read_at: float | None = None
        self._lock = threading.Lock()
        self.free_only = False
        """Only free room counts: nothing is evicted for what goes on
        (``StackMode.KEEP_SLOWER``)."""

    def take(self, num_bytes: int) -> bool:
        """True when every slower tier has room for ``num_bytes`` besides what is still
        to be written there, or (unless ``free_only``) would make it by evicting nothing
        admitted as reused; the bytes then count as sent."""
        return self._take(num_bytes, admitted=False)

    def take_admitted(self, num_bytes: int) -> bool:
        """While ``free_only``: ``take`` for ``num_bytes`` of blocks admitted as reused,
        where a tier without free room may also make it by evicting blocks admitted
        before, or cannot tell (a server evicts by its own rule); never by evicting
        blocks not admitted as reused (the first sightings kept are not pushed out for
        them). Otherwise always True: admitted blocks go on."""
        return not self.free_only or self._take(num_bytes, admitted=True)

    def _take(self, num_bytes: int, *, admitted: bool) -> bool:
        if len(self._tiers) < 2:
            return False
        with self._lock:
            now = self._clock()
            if self._remote and (self._read_at is None or now - self._read_at >= self._reread_s):
                self._free = {i: self._read_free(i) for i in self._remote}
                self._sent = 0
                self._read_at = now
            queued = self._queued()
            for index in range(1, len(self._tiers)):
                remote = index in self._free
                wanted = (self._sent if remote else queued) + num_bytes
                free = self._free[index] if remote else self._read_free(index)
                if free is not None and free >= wanted:
                    continue
                if admitted:
                    if self._victim_reused(index, wanted) is False:
                        return False
                elif self.free_only or self._victim_reused(index, wanted) is not False:
                    return False
            self._sent += num_bytes
            return True

    def _victim_reused(self, index: int, num_bytes: int) -> bool | None:
        """``evicts_reused`` of the slower tier ``index`` (None: it cannot tell)."""
        retention = self._tiers[index].retention
        return self._guard.call(index, "victim", None, retention.evicts_reused, num_bytes)

    def _read_free(self, index: int) -> int | None:
        usage: TierUsage | None = self._guard.call(index, "usage", None, self._tiers[index].usage)
        if usage is None or usage.capacity_bytes is None:
            return None
        return max(0, usage.capacity_bytes - usage.used_bytes)
