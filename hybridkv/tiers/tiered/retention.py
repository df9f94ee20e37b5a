"""A tiered store's retention: the hints of its policy, passed to each of its tiers.

Worker process, any thread. The worker's retention policy (``connector.retention``)
speaks to a ``TieredStore`` as to one tier: a touch reaches every tier (each
reorders by its own rule, ``tiers.retention``), a mode (``StackMode``) sets how
the store sends stores on past its first tier (``SlowerAdmission``) and whether
its tiers evict by recency alone, and ``admit`` sends on what the scheduler
judged worth keeping (``Admission.REUSED``). A tier that raises is logged and
counted, never fatal (``TierGuard``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.tiers.base import StoreKey, Tier
from hybridkv.tiers.retention import StackMode, TierRetention
from hybridkv.tiers.tiered.admission import SlowerAdmission
from hybridkv.tiers.tiered.guard import TierGuard


class StackRetention(TierRetention):
    """``TieredStore.retention``: hints for all of ``tiers``, and the store's mode."""

    def __init__(
        self, store: Tier, tiers: Sequence[Tier], guard: TierGuard, admission: SlowerAdmission
    ) -> None:
        super().__init__(store)
        self._tiers = tuple(tiers)
        self._guard = guard
        self._admission = admission
        self.mode = StackMode.OWN_RULES

    def touch(self, keys: Sequence[StoreKey], passes: int | None = None) -> None:
        """Passed to every tier (those that evict by recency reorder)."""
        for index, tier in enumerate(self._tiers):
            self._guard.call(index, "touch", None, tier.retention.touch, keys, passes)

    def use_plain_lru(self, on: bool) -> None:
        self.use_mode(StackMode.PLAIN_LRU if on else StackMode.OWN_RULES)

    def use_mode(self, mode: StackMode) -> None:
        """From now on keep and send on by ``mode``: with ``PLAIN_LRU`` every store goes on
        past the first tier and each tier evicts least recently used first; with
        ``KEEP_SLOWER`` the slower tiers keep what they hold, so it is hit when it comes
        back, not pushed out by the next conversation of a cycle too long for them."""
        if mode is self.mode:
            return
        plain_before = self.mode is StackMode.PLAIN_LRU
        self.mode = mode
        self._admission.use_mode(mode)
        plain = mode is StackMode.PLAIN_LRU
        if plain != plain_before:
            for index, tier in enumerate(self._tiers):
                self._guard.call(index, "plain lru", None, tier.retention.use_plain_lru, plain)

    def admit(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> int:
        """Send blocks held in the first tier on to the slower tiers; returns how many
        were there to send (``SlowerAdmission.admit_many``). ``sizes``: each block's
        bytes."""
        return self._admission.admit_many(keys, sizes)
