"""DiskTier keeps objects admitted as reused in segments of their own, evicts those
segments after every other (and of those, the ones hit since last), and keeps the
marks in the segment header across restarts."""

from __future__ import annotations

import os
from pathlib import Path

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.tier import DiskTier
from tests.support.disk import disk_tier, get_one, key, payload, segment_bytes

OBJECT = 8192
PER_SEGMENT = 2
SEGMENT = segment_bytes(PER_SEGMENT, OBJECT)


def tier(root: Path) -> DiskTier:
    return disk_tier(root, 4 * SEGMENT, segment_bytes=SEGMENT)


def keys(name: str, count: int = PER_SEGMENT) -> list[StoreKey]:
    return [key(f"{name}/{i}") for i in range(count)]


def put(disk: Tier, batch: list[StoreKey], *, reused: bool = False) -> None:
    buffers = [payload(k, OBJECT) for k in batch]
    put_many = disk.retention.put_reused if reused else disk.put_many
    assert put_many(batch, buffers) == [PutStatus.OK] * len(batch)


def header_of(root: Path, k: StoreKey) -> segments.SegmentHeader:
    """The header of the segment holding ``k``."""
    digest = key_digest(k).hex()
    (found,) = [r for r in segments.iter_records(root) if r.digest == digest]
    fd = os.open(found.path, os.O_RDONLY)
    try:
        header = segments.read_segment_header(fd)
    finally:
        os.close(fd)
    assert isinstance(header, segments.SegmentHeader), header
    return header


def flag_of(root: Path, k: StoreKey) -> bool:
    """Whether the header of the segment holding ``k`` says reused."""
    return header_of(root, k).reused


def test_reused_objects_get_segments_of_their_own_marked_on_disk(tmp_path: Path) -> None:
    plain, reused = keys("plain", 1), keys("reused", 1)
    with tier(tmp_path) as disk:
        put(disk, plain)
        put(disk, reused, reused=True)  # the plain segment has room left: not used
        assert not flag_of(tmp_path, plain[0]) and flag_of(tmp_path, reused[0])
        put(disk, keys("more plain", 1))  # fills the plain segment
        assert not flag_of(tmp_path, plain[0])
        three = 3 * PER_SEGMENT * OBJECT  # two free segments and the plain one
        assert disk.retention.evicts_reused(three) is False
        disk.retention.note_reused(plain)  # stored before as not reused: its segment is marked
        assert flag_of(tmp_path, plain[0])
        assert disk.retention.evicts_reused(three) is True
        assert disk.retention.evicts_reused(2 * PER_SEGMENT * OBJECT) is False
        disk.check_integrity()


def test_a_restarted_tier_evicts_unmarked_segments_first(tmp_path: Path) -> None:
    oldest, reused = keys("oldest"), keys("reused")
    with tier(tmp_path) as disk:
        put(disk, oldest)
        disk.retention.note_reused(oldest)
        put(disk, reused, reused=True)
    with tier(tmp_path) as disk:  # the marks come back from the headers
        assert disk.retention.evicts_reused(3 * PER_SEGMENT * OBJECT) is True  # two segments free
        later = keys("later", 4 * PER_SEGMENT)
        for start in range(0, len(later), PER_SEGMENT):
            put(disk, later[start : start + PER_SEGMENT])
        assert disk.stats().evictions > 0
        assert disk.contains_many([*oldest, *reused]) == [True] * 2 * PER_SEGMENT
        assert disk.contains_many(later[:PER_SEGMENT]) == [False] * PER_SEGMENT
        for k in [*oldest, *reused]:
            status, out = get_one(disk, k, OBJECT)
            assert status is GetStatus.OK and (out == payload(k, OBJECT)).all()
        disk.check_integrity()
    with tier(tmp_path):  # the seal at take-over kept the flags
        assert flag_of(tmp_path, oldest[0]) and flag_of(tmp_path, reused[0])


def test_a_smaller_capacity_at_restart_evicts_unmarked_segments_first(tmp_path: Path) -> None:
    reused, plain = keys("reused"), keys("plain", 2 * PER_SEGMENT)
    with tier(tmp_path) as disk:
        put(disk, reused, reused=True)  # the oldest segment
        put(disk, plain[:PER_SEGMENT])  # one put per segment: their order is known
        put(disk, plain[PER_SEGMENT:])
    with disk_tier(tmp_path, 2 * SEGMENT, segment_bytes=SEGMENT) as disk:
        assert disk.contains_many(reused) == [True] * PER_SEGMENT
        assert disk.contains_many(plain) == [False] * PER_SEGMENT + [True] * PER_SEGMENT
        disk.check_integrity()


def test_a_disk_full_of_marked_segments_still_takes_stores(tmp_path: Path) -> None:
    """With ``admission: all`` (or marks left from an earlier run) nothing asks first:
    a store evicts the oldest marked segment rather than being refused for ever."""
    marked = keys("marked", 4 * PER_SEGMENT)
    with tier(tmp_path) as disk:
        for start in range(0, len(marked), PER_SEGMENT):
            put(disk, marked[start : start + PER_SEGMENT], reused=True)
        assert disk.usage().used_bytes == disk.usage().capacity_bytes
        assert disk.retention.evicts_reused(1) is True
        put(disk, keys("plain"))
        assert disk.contains_many(marked[:PER_SEGMENT]) == [False] * PER_SEGMENT
        assert disk.contains_many(marked[PER_SEGMENT:]) == [True] * 3 * PER_SEGMENT
        assert disk.retention.evicts_reused(1) is False  # the plain segment goes next
        disk.check_integrity()


def test_a_hit_on_a_reused_segment_keeps_it_past_reused_ones_and_restarts(
    tmp_path: Path,
) -> None:
    plain, read, written = keys("plain"), keys("read"), keys("written")
    with tier(tmp_path) as disk:
        put(disk, plain)
        put(disk, read, reused=True)
        put(disk, written, reused=True)
        for k in (plain[0], read[0]):
            assert get_one(disk, k, OBJECT)[0] is GetStatus.OK
        assert not header_of(tmp_path, plain[0]).hit  # not reused: a hit leaves it plain
        assert header_of(tmp_path, read[0]).hit and not header_of(tmp_path, written[0]).hit
    with tier(tmp_path) as disk:  # the hit comes back from the header
        later = keys("later", 3 * PER_SEGMENT)  # evicts two of the three old segments
        for start in range(0, len(later), PER_SEGMENT):
            put(disk, later[start : start + PER_SEGMENT], reused=True)
        assert disk.contains_many([*plain, *written]) == [False] * 2 * PER_SEGMENT
        assert disk.contains_many(read) == [True] * PER_SEGMENT
        disk.check_integrity()


def test_an_eviction_passing_over_a_hit_segment_clears_its_flag_on_disk(tmp_path: Path) -> None:
    read, written = keys("read"), [keys(f"written {i}") for i in range(3)]
    with tier(tmp_path) as disk:
        put(disk, read, reused=True)
        assert get_one(disk, read[0], OBJECT)[0] is GetStatus.OK
        assert header_of(tmp_path, read[0]).hit
        for batch in written:  # four reused segments, ``read`` the least recently used
            put(disk, batch, reused=True)
        put(disk, keys("new"), reused=True)  # evicts the oldest not hit, passing ``read``
        assert disk.contains_many([read[0], written[0][0]]) == [True, False]
        assert not header_of(tmp_path, read[0]).hit
        disk.check_integrity()
    with tier(tmp_path) as disk:  # ``read`` was stamped more recent than the rest passed
        put(disk, keys("newer 1"), reused=True)
        put(disk, keys("newer 2"), reused=True)
        assert disk.contains_many([written[1][0], written[2][0], read[0]]) == [0, 0, 1]


def test_putting_as_reused_a_key_stored_plain_marks_its_segment(tmp_path: Path) -> None:
    plain = keys("plain", 1)
    with tier(tmp_path) as disk:
        put(disk, plain)
        assert not flag_of(tmp_path, plain[0])
        buffers = [payload(k, OBJECT) for k in plain]
        assert disk.retention.put_reused(plain, buffers) == [PutStatus.EXISTS]
        assert flag_of(tmp_path, plain[0])  # marked where it is, not written again
        assert disk.usage().num_objects == 1
        disk.check_integrity()
