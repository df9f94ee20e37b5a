"""Room in a tiered store's slower tiers: ``Admission.REUSED`` holds back only what
would push out something reused.

Worker process, any thread. Holding a block back from a tier that still has
free room saves nothing and loses a hit (a restarted engine finds on disk only
what was sent there), so while every slower tier has room for a batch without
evicting, the batch goes on whether or not it was reused. Each tier's usage
is read at most once per ``refresh_s`` (a pool answers over the network), and
the bytes sent since are counted against it here (a write-back queue may not
have written them yet). Once a tier is full, a batch still goes on where what
it would evict there holds nothing admitted as reused
(``Tier.evicts_reused``, False): evicting one unreused block for another
is plain recency, which admission must not lose to. A tier that cannot tell
its capacity or its victim (Mooncake; Valkey without ``maxmemory``, or full)
takes only reused blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from hybridkv.tiers.base import Tier, TierUsage
from hybridkv.tiers.tiered.guard import TierGuard

REFRESH_S = 1.0
"""How old a slower tier's usage may be before it is read again."""


class SlowerRoom:
    """Whether every tier but the first can take some bytes without evicting."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        guard: TierGuard,
        *,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tiers = tuple(tiers)
        self._guard = guard
        self._refresh_s = refresh_s
        self._clock = clock
        self._free: list[int | None] = []
        """Bytes each slower tier could take without evicting (None: unknown), as last
        read."""
        self._sent = 0
        """Bytes sent on since (a write-back queue may not have written them yet)."""
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> bool:
        """True when every slower tier has room for ``num_bytes`` besides what was sent
        since its usage was read, or would make it by evicting nothing admitted as
        reused; the bytes then count as sent."""
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self._refresh_s:
                self._free = [self._read_free(i) for i in range(1, len(self._tiers))]
                self._sent = 0
                self._read_at = now
            if not self._free:
                return False
            wanted = self._sent + num_bytes
            short = any(free is None or free < wanted for free in self._free)
            if short and not self._victims_unreused(wanted):
                return False
            self._sent = wanted
            return True

    def _victims_unreused(self, num_bytes: int) -> bool:
        for index in range(1, len(self._tiers)):
            tier = self._tiers[index]
            evicts = self._guard.call(index, "victim", None, tier.evicts_reused, num_bytes)
            if evicts is not False:
                return False
        return True

    def _read_free(self, index: int) -> int | None:
        usage: TierUsage | None = self._guard.call(index, "usage", None, self._tiers[index].usage)
        if usage is None or usage.capacity_bytes is None:
            return None
        return max(0, usage.capacity_bytes - usage.used_bytes)
