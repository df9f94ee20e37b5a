"""SegmentTable: reservations, LRU eviction of idle segments (segments holding reused
objects kept apart and protected), file reuse, runs and a get's tasks."""

from __future__ import annotations

from pathlib import Path

from hybridkv.tiers.digest_table import digest_words
from hybridkv.tiers.disk.batches import read_tasks, runs
from hybridkv.tiers.disk.paths import DiskPaths
from hybridkv.tiers.disk.records import Entry, FileWork, Reservation
from hybridkv.tiers.disk.segments import PAGE, Geometry
from hybridkv.tiers.disk.table import SegmentTable

SEGMENT = Geometry.standard(2 * PAGE + 2 * 8192)  # two 8 KiB objects per segment
NOWHERE = DiskPaths(Path("/nowhere"))


def digest(name: str) -> bytes:
    """A key digest standing for the key ``name``."""
    return name.encode().ljust(16, b".")


def indexed(t: SegmentTable) -> set[str]:
    return {found.rstrip(b".").decode() for found, _ in t.items()}


def table(num_segments: int) -> SegmentTable:
    return SegmentTable(NOWHERE, num_segments * SEGMENT.size, SEGMENT)


def open_all(work: FileWork) -> None:
    for segment in work.to_open:  # what DiskTier._open does once the file is ready
        segment.fd = 3
        segment.reuse = None
        segment.ready.set()


def put(
    t: SegmentTable, name: str, num_bytes: int = 8192, *, reused: bool = False
) -> tuple[Reservation | str, FileWork]:
    work = FileWork()
    reserved = t.reserve(0, digest(name), num_bytes, work, reused=reused)
    open_all(work)
    if isinstance(reserved, Reservation):
        assert t.commit_part([reserved], written=True) == 1
    return reserved, work


def test_objects_fill_the_active_segment_then_a_new_one() -> None:
    t = table(4)
    first, work = put(t, "a")
    assert isinstance(first, Reservation) and len(work.to_open) == 1
    assert (first.slot, first.offset) == (0, SEGMENT.data_offset)
    second, work = put(t, "b")
    assert isinstance(second, Reservation) and work.to_open == []
    assert (second.slot, second.offset) == (1, SEGMENT.data_offset + 8192)
    third, work = put(t, "c")
    assert isinstance(third, Reservation) and third.segment is not first.segment
    assert work.superseded == [first.segment] and first.segment.superseded
    assert put(t, "a")[0] == "exists"
    t.check()


def test_the_least_recently_used_idle_segment_is_evicted_and_its_file_reused() -> None:
    t = table(2)
    for name in "abcd":  # A = (a, b), B = (c, d)
        put(t, name)
    a, c = t.entry(digest("a")), t.entry(digest("c"))
    assert a is not None and c is not None
    segment_a, segment_b = a.segment, c.segment
    t.use(segment_a)  # a hit: B is now the least recently used
    work = FileWork()
    reserved = t.reserve(0, digest("e"), 8192, work)
    assert isinstance(reserved, Reservation) and work.to_open == [reserved.segment]
    assert reserved.segment.reuse is segment_b and work.discarded == []
    assert segment_b.seq not in t.segments and segment_a.seq in t.segments
    assert indexed(t) == {"a", "b"} and t.num_evicted == 2
    open_all(work)
    assert t.commit_part([reserved], written=True) == 1
    assert indexed(t) == {"a", "b", "e"}
    t.check()


def segment_of(t: SegmentTable, name: str) -> int:
    entry = t.entry(digest(name))
    assert entry is not None, name
    return entry.segment.seq


def test_reused_objects_go_into_segments_of_their_own() -> None:
    t = table(8)
    for name, reused in [("a", False), ("r1", True), ("b", False), ("r2", True), ("r3", True)]:
        assert isinstance(put(t, name, reused=reused)[0], Reservation)
    plain, protected = segment_of(t, "a"), segment_of(t, "r1")
    assert plain != protected
    assert segment_of(t, "b") == plain and segment_of(t, "r2") == protected
    assert segment_of(t, "r3") not in (plain, protected)  # the reused one was full
    assert not t.segments[plain].reused and t.segments[protected].reused
    assert t.reused_bytes == 2 * SEGMENT.size
    t.check()


def test_segments_holding_reused_objects_are_evicted_after_all_others() -> None:
    t = table(4)
    for i in range(3):  # the three oldest segments: reused
        put(t, f"r{i}a", reused=True)
        put(t, f"r{i}b", reused=True)
    put(t, "p0a")
    put(t, "p0b")
    assert t.allocated == t.capacity_bytes and t.reused_bytes == 3 * SEGMENT.size
    victims = t.victims(SEGMENT.size)
    assert victims is not None and [v.seq for v in victims] == [segment_of(t, "p0a")]
    put(t, "p1")  # a plain store evicts the plain segment
    assert t.entry(digest("p0a")) is None and t.entry(digest("r0a")) is not None
    put(t, "r3a", reused=True)  # so does a reused one, while a plain segment is idle
    assert t.entry(digest("p1")) is None and t.entry(digest("r0a")) is not None
    put(t, "r3b", reused=True)
    put(t, "r4", reused=True)  # only reused segments are left: the oldest goes
    assert t.entry(digest("r0a")) is None and t.entry(digest("r1a")) is not None
    assert t.reused_bytes == t.allocated
    t.check()


def test_reused_segments_go_last_and_only_idle_ones_go() -> None:
    t = table(3)
    for name in ("r1", "r2", "p1", "p2", "r3", "r4"):
        put(t, name, reused=name.startswith("r"))
    victims = t.victims(2 * SEGMENT.size)
    assert victims is not None
    assert [v.seq for v in victims] == [segment_of(t, "p1"), segment_of(t, "r1")]
    for name in ("p3", "p4", "p5", "p6"):  # plain ones evict plain ones, oldest first
        reserved, _ = put(t, name)
        assert isinstance(reserved, Reservation) and not reserved.segment.reused
    assert [t.entry(digest(name)) is None for name in ("p1", "p3", "p5")] == [1, 1, 0]
    t.segments[segment_of(t, "p5")].pending += 1  # busy: the reused ones go next
    victims = t.victims(SEGMENT.size)
    assert victims is not None and [v.seq for v in victims] == [segment_of(t, "r1")]
    t.segments[segment_of(t, "r1")].readers += 1
    t.segments[segment_of(t, "r3")].readers += 1
    assert t.victims(SEGMENT.size) is None  # every segment busy
    assert put(t, "p7")[0] == "full"  # and nothing was evicted for it
    assert t.entry(digest("r1")) is not None and t.entry(digest("p5")) is not None
    for name, busy in (("p5", "pending"), ("r1", "readers"), ("r3", "readers")):
        setattr(t.segments[segment_of(t, name)], busy, 0)
    reserved, _ = put(t, "p7")  # the plain segment again, not a marked one
    assert isinstance(reserved, Reservation) and t.entry(digest("p5")) is None
    assert t.entry(digest("r1")) is not None
    t.check()


def test_reused_segments_hit_since_go_after_those_only_written() -> None:
    t = table(4)
    for name in ("h1", "h2", "w1", "w2", "p1", "p2"):  # h: hit later, w: written only
        put(t, name, reused=not name.startswith("p"))
    hit, written = t.segments[segment_of(t, "h1")], t.segments[segment_of(t, "w1")]
    plain = t.segments[segment_of(t, "p1")]
    assert not t.mark_hit(plain) and not plain.hit  # unmarked stays unmarked: plain LRU
    assert t.mark_hit(hit) and hit.hit and not t.mark_hit(hit)  # once
    assert (plain.kept, written.kept, hit.kept) == (0, 1, 2)
    t.use(written)  # the most recently used now, yet it goes before the hit one
    victims = t.victims(3 * SEGMENT.size)
    assert victims is not None and [v.seq for v in victims] == [plain.seq, written.seq]
    for name in ("r1", "r2", "r3", "r4", "r5"):  # reused ones: the free room, plain, w
        put(t, name, reused=True)
    assert t.entry(digest("h1")) is not None and t.entry(digest("w1")) is None
    t.check()


def test_an_eviction_passing_over_a_hit_segment_takes_its_hit() -> None:
    """A clock over reused segments: a hit keeps a segment one more time round."""
    t = table(3)
    for name in ("h1", "h2", "w1", "w2", "v1", "v2"):  # three reused segments, h oldest
        put(t, name, reused=True)
    hit = t.segments[segment_of(t, "h1")]
    assert t.mark_hit(hit)
    work = FileWork()
    reserved = t.reserve(0, digest("n1"), 8192, work, reused=True)
    assert isinstance(reserved, Reservation)
    assert t.entry(digest("w1")) is None and t.entry(digest("h1")) is not None
    assert work.passed == [hit] and not hit.hit  # passed over: the most recent, not hit
    assert list(t.segments.values())[-2:] == [hit, reserved.segment]
    open_all(work)
    t.commit_part([reserved], written=True)
    put(t, "n2", reused=True)
    put(t, "n3", reused=True)  # evicts v; h is no longer hit, but more recent
    assert t.entry(digest("v1")) is None and t.entry(digest("h1")) is not None
    put(t, "n4", reused=True)
    put(t, "n5", reused=True)  # now h goes
    assert t.entry(digest("h1")) is None
    t.check()


def test_plain_lru_evicts_least_recently_used_first_marks_or_not() -> None:
    """While most first sightings come back (``connector.returns``) the levels and the
    clock rest: segments go in plain recency order, and come back when it ends."""
    t = table(3)
    for name in ("h1", "h2", "w1", "w2", "p1", "p2"):  # oldest first; the table is full
        put(t, name, reused=not name.startswith("p"))
    hit, written = t.segments[segment_of(t, "h1")], t.segments[segment_of(t, "w1")]
    plain = t.segments[segment_of(t, "p1")]
    assert t.mark_hit(hit)
    by_level = t.victims(2 * SEGMENT.size)
    assert by_level is not None and [v.seq for v in by_level] == [plain.seq, written.seq]
    t.plain_lru = True
    victims = t.victims(2 * SEGMENT.size)
    assert victims is not None and [v.seq for v in victims] == [hit.seq, written.seq]
    work = FileWork()
    reserved = t.reserve(0, digest("n1"), 8192, work, reused=True)
    assert isinstance(reserved, Reservation)
    assert work.passed == [] and hit.hit, "no clock: the hit segment went as it was"
    assert t.entry(digest("h1")) is None and t.entry(digest("p1")) is not None
    open_all(work)
    t.commit_part([reserved], written=True)
    t.plain_lru = False
    victims = t.victims(SEGMENT.size)
    assert victims is not None and [v.seq for v in victims] == [plain.seq]
    t.check()


def test_a_batch_stores_again_what_its_own_reservations_evicted() -> None:
    t = table(2)
    for name in "abcd":  # A = (a, b), B = (c, d): A least recently used
        put(t, name)
    work = FileWork()
    # "a" is found by the batch's one lookup, then "e" evicts its segment.
    names = [digest(name) for name in "eac"]
    rows = t.index.find(digest_words(b"".join(names)))
    reserved = t.reserve_many(names, [8192] * 3, rows, work)
    assert [r if isinstance(r, str) else r.item for r in reserved] == [0, 1, "exists"]
    assert indexed(t) == {"c", "d"}
    open_all(work)
    assert t.commit_part([r for r in reserved if isinstance(r, Reservation)], written=True) == 2
    assert indexed(t) == {"a", "c", "d", "e"}
    t.check()


def test_busy_segments_are_not_evicted_and_the_put_is_full() -> None:
    t = table(2)
    for name in "abcd":
        put(t, name)
    for segment in t.segments.values():
        segment.readers += 1  # both being read
    reserved, work = put(t, "e")
    assert reserved == "full" and work.to_open == [] and work.discarded == []
    assert indexed(t) == set("abcd")
    for segment in t.segments.values():
        segment.readers -= 1
    t.check()


def test_a_big_object_evicts_several_segments_and_reuses_the_first_file() -> None:
    t = table(3)
    for name in "abcdef":
        put(t, name)
    segments_before = list(t.segments.values())
    reserved, work = put(t, "big", 3 * SEGMENT.data_bytes)  # needs a dedicated segment
    assert isinstance(reserved, Reservation) and reserved.segment.superseded
    assert reserved.segment.size == Geometry.dedicated(3 * SEGMENT.data_bytes).size
    assert work.discarded == segments_before[1:3]  # the first victim's file was taken over
    assert indexed(t) == {"big"} and t.num_evicted == 6
    t.check()


def test_runs_follow_consecutive_slots() -> None:
    t = table(8)
    work = FileWork()
    reserved = [t.reserve(i, digest(f"k{i}"), 8192, work) for i in range(3)]
    assert all(isinstance(r, Reservation) for r in reserved)
    grouped = runs([r for r in reversed(reserved) if isinstance(r, Reservation)])
    assert [[r.item for r in run] for run in grouped] == [[0, 1], [2]]  # two segments
    big = Geometry.standard(64 << 20)
    t2 = SegmentTable(NOWHERE, 64 << 20, big)
    many = [t2.reserve(i, digest(f"m{i}"), 1 << 20, FileWork()) for i in range(8)]
    run = [r for r in many if isinstance(r, Reservation)]
    assert [[r.item for r in run] for run in runs(run)] == [list(range(8))]


def test_a_get_is_cut_into_one_task_per_thread_of_similar_bytes() -> None:
    big = Geometry.standard(64 << 20)
    t = SegmentTable(NOWHERE, 3 * big.size, big)
    work = FileWork()
    # 70 objects of 1 MiB: two segments' worth (63 and 7), so two runs of slots.
    reserved = [t.reserve(i, digest(f"k{i}"), 1 << 20, work) for i in range(70)]
    open_all(work)
    assert all(isinstance(r, Reservation) for r in reserved)
    entries = {r.item: Entry(r.segment, r.slot, r.offset, r.length) for r in reserved}  # type: ignore[union-attr]
    assert len({e.segment.seq for e in entries.values()}) == 2
    found = [(item, entries[item]) for item in reversed(range(70)) if item != 30]  # a hole

    tasks = read_tasks(found, 2)
    assert len(tasks) == 2
    items = [[j for run in task for j, _ in run] for task in tasks]
    assert sorted(items[0] + items[1]) == sorted(j for j, _ in found)  # each item once
    assert [len(i) for i in items] == [35, 34]  # of similar bytes, not a task per run
    for task in tasks:
        for run in task:  # runs: consecutive slots of one segment
            assert all(e.segment is run[0][1].segment for _, e in run)
            assert [e.slot for _, e in run] == list(
                range(run[0][1].slot, run[0][1].slot + len(run))
            )
    # The hole at 30 and the second segment each start a run.
    assert [[run[0][0] for run in task] for task in tasks] == [[0, 31], [36, 63]]
    assert len(read_tasks(found[:1], 2)) == 1  # never more tasks than objects
    assert len(read_tasks(found, 1)) == 1
    assert read_tasks([], 2) == []
