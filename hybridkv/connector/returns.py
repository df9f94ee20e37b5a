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


class DecayedShare:
    """A share of two decayed counts, and a switch it drives: on once the share
    reaches ``enter``, off once it falls to ``leave``, as it was between the two."""

    def __init__(self, keep: float, enter: float, leave: float) -> None:
        self._keep = keep
        """What a count keeps per step counted."""
        self._enter, self._leave = enter, leave
        self.part = 0.0
        self.whole = 0.0
        self.on = False

    @property
    def share(self) -> float:
        return self.part / self.whole if self.whole else 0.0

    def add(self, part: float, whole: float, steps: int) -> None:
        """Decay both counts by ``steps`` steps, then add to them."""
        keep = self._keep**steps
        self.part = self.part * keep + part
        self.whole = self.whole * keep + whole

    def decide(self) -> bool:
        if self.share >= self._enter:
            self.on = True
        elif self.share <= self._leave:
            self.on = False
        return self.on


class ReturnShare(DecayedShare):
    """Decayed counts of first sightings (``whole``) and second ones (``part``), and the
    mode they decide: ``plain_lru``."""

    def __init__(self, hash_tokens: int) -> None:
        if hash_tokens < 1:
            raise ValueError(f"hash_tokens={hash_tokens} must be >= 1")
        super().__init__(1.0 - hash_tokens / max(WINDOW_TOKENS, 2 * hash_tokens), ENTER, LEAVE)
        self._min_first = MIN_FIRST_TOKENS / hash_tokens
        self._num_first = 0
        """Hashes seen for the first time, in all."""

    @property
    def plain_lru(self) -> bool:
        """The tiers evict by recency alone and take every store."""
        return self.on

    def noted(self, num_first: int, num_returned: int) -> None:
        """``num_first`` hashes were seen for the first time, ``num_returned`` for the
        second."""
        count = num_first + num_returned
        if not count:
            return
        self.add(num_returned, num_first, count)
        self._num_first += num_first
        if self._num_first >= self._min_first:
            self.decide()


KEPT_WINDOW = 32
"""Returning requests over which the kept share decays by a factor e."""
KEEP_ENTER, KEEP_LEAVE = 0.5, 0.25
"""Share of returning requests the tiers had lost at which the slower tiers keep what
they hold, and back."""


class KeptReturns(DecayedShare):
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
        super().__init__(1.0 - 1.0 / KEPT_WINDOW, KEEP_ENTER, KEEP_LEAVE)

    @property
    def keep_slower(self) -> bool:
        """The slower tiers keep what they hold."""
        return self.on

    def judged(self, *, lost: bool, held_back: bool) -> None:
        """A request came back (``whole``): whether the tiers hit nothing of its shared
        prefix (``part``), unless that prefix was first seen while the slower tiers kept
        what they held (so lost because they did not take it: keeping is what lost it)."""
        self.add(float(lost and not held_back), 1.0, 1)
        self.decide()
