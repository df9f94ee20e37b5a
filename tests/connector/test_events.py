"""TierEvents: the workers' tier changes as events every rank agrees on.

Against a brute-force reference, and on a real scheduler/worker pair whose CPU
tier is too small for a request (evictions) in front of a disk tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.connector.events import TierEvent, TierEvents
from hybridkv.connector.metadata import BlockRef, RankReport, TierChange, WorkerReport
from hybridkv.groups import GroupKind
from hybridkv.keys import BlockHash
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuTier
from hybridkv.tiers.tiered.changes import ChangeLog
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.drive import run_to_end
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import block_keys, block_refs


def ref(i: int, group_id: int = 0) -> BlockRef:
    return BlockRef(group_id, BlockHash(bytes([i]) * 16))


def report(rank: int, *changes: tuple[int, BlockRef, bool]) -> WorkerReport:
    tier_changes = tuple(TierChange(*change) for change in changes)
    return WorkerReport(ranks=(RankReport(rank=rank, tier_changes=tier_changes),))


def replay(events: Sequence[TierEvent]) -> set[tuple[int, BlockRef]]:
    """The (tier, block) pairs announced and not removed since, failing on a removal of
    one never announced or an announcement of one already announced."""
    held: set[tuple[int, BlockRef]] = set()
    for event in events:
        slot = (event.tier_index, event.ref)
        assert (slot in held) != event.stored, event
        if event.stored:
            held.add(slot)
        else:
            held.remove(slot)
    return held


def test_a_block_is_announced_once_every_rank_holds_it_and_removed_when_one_loses_it() -> None:
    events = TierEvents(num_ranks=2)
    events.take_report(report(0, (1, ref(1), True)))
    assert events.take() == []
    events.take_report(report(1, (1, ref(1), True), (1, ref(1), True)))  # twice: once
    assert events.take() == [TierEvent(1, ref(1), True)]
    events.take_report(report(0, (0, ref(1), True), (1, ref(1), False)))
    assert events.take() == [TierEvent(1, ref(1), False)]
    events.take_report(report(1, (1, ref(1), False), (1, ref(2), False)))  # nothing announced
    assert events.take() == []
    assert events.num_blocks == 1  # rank 0 still holds it in tier 0
    events.check_integrity()


CHANGES = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 5), st.booleans()),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(CHANGES, st.integers(1, 12))
def test_events_follow_what_every_rank_holds(
    changes: list[tuple[int, int, int, bool]], max_blocks: int
) -> None:
    """Unbounded, the announced pairs are exactly those every rank holds; bounded, a
    subset of them (withdrawn, never invented) of at most ``max_blocks`` pairs."""
    tp_size = 3
    exact, bounded = TierEvents(tp_size), TierEvents(tp_size, max_blocks=max_blocks)
    holds: dict[tuple[int, BlockRef], set[int]] = {}
    exact_events: list[TierEvent] = []
    bounded_events: list[TierEvent] = []
    for rank, tier, block, stored in changes:
        change = report(rank, (tier, ref(block), stored))
        ranks = holds.setdefault((tier, ref(block)), set())
        if stored:
            ranks.add(rank)
        else:
            ranks.discard(rank)
        for events, seen in ((exact, exact_events), (bounded, bounded_events)):
            events.take_report(change)
            seen += events.take()
            events.check_integrity()
        everyone = {slot for slot, ranks in holds.items() if len(ranks) == tp_size}
        assert replay(exact_events) == everyone
        announced = replay(bounded_events)
        assert announced <= everyone and len(announced) <= max_blocks


def test_worker_reports_follow_a_small_cpu_tier_and_the_disk_behind_it(tmp_path: Path) -> None:
    model_groups = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL))
    config = make_config(
        tmp_path,
        tiers=[
            {"kind": "cpu", "capacity_bytes": 8 * 256},  # 8 of the 2 x 9 blocks
            {"kind": "disk", "path": str(tmp_path / "kv"), "capacity_bytes": "64MiB"},
        ],
    )
    engine = make_engine(model_groups, config)
    store = engine.worker.store
    store.record_changes(ChangeLog())
    tokens = prompt(37)
    engine.add("req", tokens)
    run_to_end(engine, "req", chunk=6)
    assert store.flush(10)
    engine.settle()

    events = TierEvents()
    for worker_report in engine.reports:
        events.take_report(worker_report)
    announced = replay(events.take())
    every_block = {
        block: key
        for group_id in range(model_groups.num_groups)
        for block, key in zip(
            block_refs(model_groups, tokens, group_id, range(9)),
            block_keys(model_groups, tokens, group_id, range(9)),
            strict=True,
        )
    }
    cpu = store.tiers[0]
    assert isinstance(cpu, CpuTier)
    held = set(cpu.lru_digests())  # the CPU tier keeps key digests, not keys
    in_cpu = {block for block, key in every_block.items() if key_digest(key) in held}
    assert len(in_cpu) == len(held)
    assert {r for tier, r in announced if tier == 0} == in_cpu
    assert cpu.stats().evictions > 0

    found = store.tiers[1].contains_many(list(every_block.values()))
    on_disk = {block for block, hit in zip(every_block, found, strict=True) if hit}
    assert {r for tier, r in announced if tier == 1} == on_disk
    assert len(on_disk) > len(in_cpu)
    close_engine(engine)
