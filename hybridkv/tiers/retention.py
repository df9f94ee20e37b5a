"""What a tier lets a retention policy tell it: which of its objects to keep longest.

Worker process, any thread. A tier's data path (``Tier``: contains, put, get,
delete) stores and finds objects; which ones it evicts when full is its own
rule, plain recency unless it keeps more. The retention policy of a tier stack
(``connector.retention``) steers that rule through each tier's ``retention``,
this small interface: the order objects age in and the passes they get
(``touch``), objects likely to be read again (``note_reused``, ``put_reused``),
plain recency for now (``use_plain_lru``), and whether room for more would cost
a reused object (``evicts_reused``). This base ignores every hint: a tier that
evicts by another rule, or on a server, keeps it. The CPU tier answers from its
native LRU (``tiers.cpu_lru``), the disk by segment (``tiers.disk.table``), a
tiered store for all of its tiers (``tiers.tiered.retention``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.tiers.base import Buffer, PutStatus, StoreKey, Tier

MAX_PASSES = 3
"""The most passes ``TierRetention.touch`` gives an object: what a policy may ask of any
tier (the CPU tier keeps them in two bits of a row's marks)."""


class StackMode(enum.Enum):
    """How a tier stack keeps and sends on its objects for now. The scheduler sets it
    every step (``connector.returns``, with ``Admission.REUSED``); otherwise it stays
    ``OWN_RULES``."""

    OWN_RULES = "own_rules"
    """Each tier by its own rule: chain order, passes, second chance, reused marks, and
    the slower tiers' admission."""
    PLAIN_LRU = "plain_lru"
    """Every store goes on past the first tier, and every tier evicts least recently
    used first: most blocks seen once come back, so marks only misjudge them."""
    KEEP_SLOWER = "keep_slower"
    """The slower tiers keep what they hold: stores go on only into their free room, and
    admitted blocks only where they evict blocks admitted before. Most returning
    prefixes were lost: a cycle longer than the tiers hold."""


class TierRetention:
    """The hints a retention policy gives one tier; this base ignores them (its tier
    evicts by its own rule)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def touch(self, keys: Sequence[StoreKey], passes: int | None = None) -> None:
        """Make the stored ones of these keys the most recently used, in order (the last
        key ends most recent; absent keys are skipped); ``passes`` where given: the
        times each is passed over when it comes round to be evicted, 0 to
        ``MAX_PASSES`` (what it saves per byte, ``connector.worth``)."""

    def note_reused(self, keys: Sequence[StoreKey]) -> None:
        """These stored keys were admitted as likely to be read again
        (``Admission.REUSED``): a tier that can keep them from being evicted for others
        remembers it."""

    def put_reused(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """``put_many`` of keys admitted as likely to be read again, then ``note_reused``
        of them. A tier that keeps such objects apart (the disk: segments of their own)
        writes them there."""
        results = self.tier.put_many(keys, buffers, checksums)
        self.note_reused(keys)
        return results

    def use_plain_lru(self, on: bool) -> None:
        """While ``on``, evict least recently used first, whatever was noted reused or
        read (``StackMode.PLAIN_LRU``); off, by the tier's own rule again."""

    def evicts_reused(self, num_bytes: int) -> bool | None:
        """Whether storing ``num_bytes`` more, not admitted as reused, would evict (or be
        refused for) an object noted reused; None: the tier cannot tell (a server evicts
        by its own rule)."""
        return None
