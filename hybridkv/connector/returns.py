"""Whether holding first sightings back from the slower tiers pays: the share of
blocks first seen lately that were seen again.

Scheduler process; not thread-safe. ``Admission.REUSED`` holds a block back from
a full disk or pool until a second request reaches it. That pays where most
first sightings are never read again (one-off prompts among shared ones) and
costs where most are (documents asked several questions): each is then missed
once where plain recency would still have had it. So the scheduler counts, over
about the last ``WINDOW_TOKENS`` tokens noted, the hashes seen for the first
time and those seen for the second, and once the second reach ``ENTER`` of the
first the tiers go plain LRU (every store sent on, nothing admitted, no
tier keeping marked or read blocks over others), until they fall to ``LEAVE``.

In ``benchmarks/bench_eviction.py`` the share stays under 0.25 on the mixed
workload and passes 0.6 about a third of the way into long-doc-qa (question
tails are the first sightings there that never come back).
"""

from __future__ import annotations

WINDOW_TOKENS = 32768
"""Tokens of hashes noted over which the counts decay by a factor e."""
ENTER, LEAVE = 0.6, 0.4
"""Share of first sightings seen again at which the tiers go plain LRU, and back."""
MIN_FIRST_TOKENS = 3072
"""Tokens first seen, in all, before the share decides anything: early on a few
prompts that come back at once (a system prompt's second request) decide it alone."""


class ReturnShare:
    """Decayed counts of first and second sightings, and the mode they decide."""

    def __init__(self, hash_tokens: int) -> None:
        if hash_tokens < 1:
            raise ValueError(f"hash_tokens={hash_tokens} must be >= 1")
        self._keep = 1.0 - hash_tokens / max(WINDOW_TOKENS, 2 * hash_tokens)
        self._min_first = MIN_FIRST_TOKENS / hash_tokens
        self.first = 0.0
        """Hashes seen for the first time (decayed)."""
        self.returned = 0.0
        """Hashes seen for the second time (decayed)."""
        self._num_first = 0
        """Hashes seen for the first time, in all."""
        self.plain_lru = False
        """The tiers evict by recency alone and take every store."""

    @property
    def share(self) -> float:
        return self.returned / self.first if self.first else 0.0

    def noted(self, num_first: int, num_returned: int) -> None:
        """``num_first`` hashes were seen for the first time, ``num_returned`` for the
        second."""
        count = num_first + num_returned
        if not count:
            return
        keep = self._keep**count
        self.first = self.first * keep + num_first
        self.returned = self.returned * keep + num_returned
        self._num_first += num_first
        if self._num_first < self._min_first:
            return
        if self.share >= ENTER:
            self.plain_lru = True
        elif self.share <= LEAVE:
            self.plain_lru = False
