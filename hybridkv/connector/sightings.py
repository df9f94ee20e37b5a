"""Sightings of block hashes kept in a shared pool, so that engines sharing it judge
reuse together.

Scheduler process. ``Admission.REUSED`` admits a prefix to a full pool once it was
reached twice; each engine remembers what it saw (``connector.seen``), so a
prefix two engines each computed once would reach the pool from neither. With a
tier that can mark keys (``Tier.marks_sightings``: Valkey, ``SET NX EX``), each hash an
engine sees for the first time is marked in the pool, and a mark another engine
(or this one before a restart) left makes it a second sighting. A mark expires
after ``ttl_s``; the server may evict it sooner, like any key. A pool that does
not answer makes every hash a first sighting: admission then judges alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.connector.stats import SchedulerStats
from hybridkv.keys import BlockHash, KeyBuilder
from hybridkv.tiers.base import Tier

DEFAULT_SIGHTING_TTL_S = 3600
"""Seconds a mark lasts: a prefix no engine reached for an hour is new again."""


class PoolSightings:
    """One engine's marks in a shared pool, named by block hash (for every rank);
    ``tier`` is one that ``marks_sightings``."""

    def __init__(
        self, tier: Tier, builder: KeyBuilder, *, ttl_s: int, stats: SchedulerStats
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s={ttl_s}: must be >= 1")
        if not tier.marks_sightings:
            raise ValueError(
                f"tier {tier.name} cannot mark sightings (marks_sightings is False); "
                "pass one that can (valkey)"
            )
        self.tier = tier
        self.builder = builder
        self.ttl_s = ttl_s
        self.stats = stats

    @classmethod
    def over(
        cls, tier: Tier | None, builder: KeyBuilder, ttl_s: int, stats: SchedulerStats
    ) -> PoolSightings | None:
        """Marks in ``tier``; None without one."""
        return None if tier is None else cls(tier, builder, ttl_s=ttl_s, stats=stats)

    def sight(self, hashes: Sequence[BlockHash]) -> npt.NDArray[np.bool_]:
        """Mark the hashes; True for each another engine (or a run before) marked."""
        if not hashes:
            return np.zeros(0, bool)
        before = np.array(self.tier.sight_many(self.builder.sighting_keys(hashes), self.ttl_s))
        self.stats.pool_sightings += len(hashes)
        self.stats.pool_sightings_before += int(np.count_nonzero(before))
        return before.astype(bool, copy=False)
