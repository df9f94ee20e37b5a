"""What one rank's worker finished since its last report, gathered for the scheduler.

Worker process. The worker appends as transfer jobs end and tiers change;
``take`` hands it all over as one ``RankReport`` and starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.connector.metadata import BlockRef, LoadResult, RankReport, TierChange


@dataclass
class ReportBuilder:
    """What this rank finished since its last report."""

    rank: int
    finished_loads: list[LoadResult] = field(default_factory=list)
    stored: list[BlockRef] = field(default_factory=list)
    missing: list[BlockRef] = field(default_factory=list)
    dropped: list[BlockRef] = field(default_factory=list)
    tier_changes: list[TierChange] = field(default_factory=list)

    def take(self) -> RankReport:
        report = RankReport(
            rank=self.rank,
            finished_loads=tuple(self.finished_loads),
            stored=tuple(self.stored),
            missing=tuple(self.missing),
            dropped=tuple(self.dropped),
            tier_changes=tuple(self.tier_changes),
        )
        self.finished_loads, self.stored, self.missing, self.dropped = [], [], [], []
        self.tier_changes = []
        return report
