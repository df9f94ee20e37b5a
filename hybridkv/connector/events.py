"""Which blocks each tier holds on every rank, as stored and removed events.

Scheduler process; engine-neutral (an engine adapter names the blocks in its
own event format). The workers report what each of their tiers stored and
removed (``RankReport.tier_changes``); a block is loadable from a tier only when
every rank with layers of its group holds its part there, so it is announced
stored when the last of them reports it and removed when the first loses it. Each removal
follows the announcement of the same block on the same tier.

Bounded: at most ``max_blocks`` (tier, block) pairs are followed, least recently
stored first out; one dropped while announced is announced removed (a router
then under-counts, never over-counts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from hybridkv.connector.metadata import BlockRef, TierChange, WorkerReport
from hybridkv.tiers.base import TierMedium

if TYPE_CHECKING:
    from hybridkv.tiers.registry import TierConfig

MAX_BLOCKS = 1 << 18
"""(tier, block) pairs followed; each costs a few hundred bytes."""


class EventSource(NamedTuple):
    """How the events of one tier name it: vLLM's medium (``CPU``, ``STORAGE``; its own
    prefix cache is ``GPU``), locality and ownership, as vLLM's offloading names its tiers."""

    medium: str
    locality: str | None
    ownership: str | None

    @property
    def name(self) -> str:
        """One string per tier kind: ``CPU``, ``STORAGE/disk``, ``STORAGE/valkey``..."""
        return source_name(self.medium, self.ownership)


def source_name(medium: str | None, ownership: str | None) -> str:
    """What an event's medium and ownership name; no medium is the engine's own cache."""
    base = medium or "GPU"
    return base if ownership is None else f"{base}/{ownership}"


def event_source(config: TierConfig) -> EventSource:
    if config.medium is TierMedium.MEMORY:
        return EventSource(medium="CPU", locality=None, ownership=None)
    locality = "LOCAL" if config.medium is TierMedium.DISK else "REMOTE"
    return EventSource(medium="STORAGE", locality=locality, ownership=config.kind)


class TierEvent(NamedTuple):
    tier_index: int
    ref: BlockRef
    stored: bool
    """False: removed."""


class TierEvents:
    """Turns the ranks' tier changes into events every rank agrees on."""

    def __init__(
        self,
        num_ranks: int = 1,
        *,
        holders: Sequence[Sequence[int]] | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        """``holders``: per group, the ranks with its layers (``EngineRanks.holders``);
        None: every rank holds every group."""
        if num_ranks < 1 or max_blocks < 1:
            raise ValueError(f"num_ranks={num_ranks} and max_blocks={max_blocks} must be >= 1")
        self.max_blocks = max_blocks
        self._every_rank = (1 << num_ranks) - 1
        self._group_ranks = (
            None if holders is None else tuple(sum(1 << r for r in ranks) for ranks in holders)
        )
        """Per group, the ranks that hold its blocks, one bit each."""
        self._held: OrderedDict[tuple[int, BlockRef], int] = OrderedDict()
        """(tier, block) -> the ranks holding it, one bit each."""
        self._events: list[TierEvent] = []

    def take_report(self, report: WorkerReport) -> None:
        for rank_report in report.ranks:
            rank = 1 << rank_report.rank
            for change in rank_report.tier_changes:
                self._change(rank, change)

    def take(self) -> list[TierEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events

    @property
    def num_blocks(self) -> int:
        """(tier, block) pairs some rank holds."""
        return len(self._held)

    def _change(self, rank: int, change: TierChange) -> None:
        slot = (change.tier_index, change.ref)
        before = self._held.get(slot, 0)
        after = before | rank if change.stored else before & ~rank
        if after:
            self._held[slot] = after
            self._held.move_to_end(slot)
        elif before:
            del self._held[slot]
        everyone = self._holders(change.ref)
        if after == everyone != before:
            self._events.append(TierEvent(change.tier_index, change.ref, True))
        elif before == everyone != after:
            self._events.append(TierEvent(change.tier_index, change.ref, False))
        while len(self._held) > self.max_blocks:
            (tier_index, ref), ranks = self._held.popitem(last=False)
            if ranks == self._holders(ref):
                self._events.append(TierEvent(tier_index, ref, False))

    def _holders(self, ref: BlockRef) -> int:
        return self._every_rank if self._group_ranks is None else self._group_ranks[ref.group_id]

    def check_integrity(self) -> None:
        assert len(self._held) <= self.max_blocks
        assert all(0 < ranks <= self._every_rank for ranks in self._held.values())
