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

It also judges whether the tiers kept what came back (``KeptReturns``): a
prefix seen twice and lost there was evicted before it returned, as a cycle of
prompts longer than the tiers evicts each just before it comes back. While
most returns are lost, the slower tiers keep what they hold.

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


KEPT_WINDOW = 32
"""Returning requests over which the kept share decays by a factor e."""
KEEP_ENTER, KEEP_LEAVE = 0.5, 0.25
"""Share of returning requests the tiers had lost at which the slower tiers keep what
they hold, and back."""


class KeptReturns:
    """Whether the tiers still held what came back: the share of requests whose prefix
    another request reached before (``RequestState.shared_hashes``) and that the tiers
    hit nothing of beyond the engine's own cache.

    Seen twice yet lost means what came back was evicted before it did: under
    recency a workload whose reuse distance exceeds the tiers evicts each prefix just
    before it comes back (a cyclic scan), and every write pushes out the next one
    to come. While most returns are lost, the slower tiers keep what they hold:
    stores go on only into free room, admitted blocks only where they evict nothing
    but blocks admitted before, so what they hold is hit when it comes back; once
    most returns are found again (in the first tier, or those kept), or are lost
    because keeping held them back, they go back to their rule.
    """

    def __init__(self) -> None:
        self._keep = 1.0 - 1.0 / KEPT_WINDOW
        self.returned = 0.0
        """Returning requests (decayed)."""
        self.lost = 0.0
        """Of them, those the tiers hit nothing of (decayed)."""
        self.keep_slower = False
        """The slower tiers take only what fits in their free room."""

    @property
    def share(self) -> float:
        return self.lost / self.returned if self.returned else 0.0

    def judged(self, *, lost: bool, held_back: bool) -> None:
        """A request came back: whether the tiers hit nothing of its shared prefix, and
        whether that prefix was first seen while the slower tiers kept what they held (so
        lost because they did not take it: keeping is what lost it)."""
        self.returned = self.returned * self._keep + 1
        self.lost = self.lost * self._keep + (lost and not held_back)
        if self.share >= KEEP_ENTER:
            self.keep_slower = True
        elif self.share <= KEEP_LEAVE:
            self.keep_slower = False
