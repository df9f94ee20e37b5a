"""Admission to the slower tiers: which stored blocks go on past the first tier.

Any process; plain data. A ``TieredStore`` stores every block in its first
tier (CPU memory). With ``Admission.ALL`` it also writes every one to each
slower tier (disk, pool); with ``Admission.REUSED`` a block goes on while
the slower tiers have free room (``tiers.tiered.room``), and once they are
full only when someone admits it (``StackRetention.admit``: the
connector's scheduler decides, ``connector.admission``); one never admitted
then lives in the first tier only, until evicted there.
"""

from __future__ import annotations

import enum


class Admission(enum.Enum):
    ALL = "all"
    """Every stored block is written to every slower tier (LRU everywhere)."""
    REUSED = "reused"
    """A full slower tier receives a block only once it is likely to be read again."""
