"""DiskTier on a real directory: round trips, restart, LRU, corruption, crashes, threads."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import checksum, key_digest
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.segments import PAGE, SLOT_BYTES, Geometry, RecordInfo, SlotState
from hybridkv.tiers.disk.tier import DiskTierInUse, FsyncPolicy
from tests.support.corrupt import flip_payload_byte
from tests.support.disk import disk_tier, get_one, key, payload, segment_bytes
from tests.support.threads import random_calls_on_threads

REPO_ROOT = Path(__file__).resolve().parents[3]


def record(root: Path, k: StoreKey) -> RecordInfo:
    digest = key_digest(k).hex()
    found = [r for r in segments.iter_records(root) if r.digest == digest]
    assert len(found) == 1, found
    return found[0]


def patch(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        file.write(data)


def segment_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.seg"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob(".tmp.*"))


@pytest.mark.parametrize("fsync", list(FsyncPolicy))
def test_round_trip_random_sizes_and_restart(tmp_path: Path, fsync: FsyncPolicy) -> None:
    rng = random.Random(2)
    sizes = {key(i): rng.choice([0, 1, 4095, rng.randrange(1, 600_000)]) for i in range(40)}
    sizes[key("bigger-than-a-segment")] = 3 << 20
    tier = disk_tier(tmp_path, fsync=fsync)
    assert tier.geometry.size == 2 << 20  # 64 MiB / 32
    assert tier.put_many(list(sizes), [payload(k, n) for k, n in sizes.items()]) == [
        PutStatus.OK
    ] * len(sizes)
    tier.check_integrity()
    usage = tier.usage()
    assert usage.num_objects == len(sizes)
    assert usage.used_bytes == sum(p.stat().st_size for p in segment_files(tmp_path))
    tier.close()

    reopened = disk_tier(tmp_path, fsync=fsync)
    report = reopened.scan_report
    assert (report.num_objects, report.num_bytes) == (len(sizes), usage.used_bytes)
    assert report.num_segments == len(segment_files(tmp_path)) >= 2
    assert reopened.contains_many(list(sizes)) == [True] * len(sizes)
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes.values()]
    assert reopened.get_many_into(list(sizes), outs) == [GetStatus.OK] * len(sizes)
    for (k, n), out in zip(sizes.items(), outs, strict=True):
        assert np.array_equal(out, payload(k, n))
    reopened.check_integrity()


def test_payloads_are_page_aligned_and_slots_follow_the_table(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    keys = [key(i) for i in range(5)]
    sizes = [PAGE, 3 * PAGE, 100, 0, 2 * PAGE + 1]
    tier.put_many(keys, [payload(k, n) for k, n in zip(keys, sizes, strict=True)])
    records = [record(tmp_path, k) for k in keys]
    assert [r.slot for r in records] == list(range(5))
    assert [r.slot_offset for r in records] == [PAGE + i * SLOT_BYTES for i in range(5)]
    offsets = [r.offset for r in records]
    assert all(offset % PAGE == 0 for offset in offsets)
    assert (
        offsets[1:] == [o + segments.align_up(n) for o, n in zip(offsets, sizes, strict=False)][:4]
    )


def test_lru_order_of_segments_survives_restart(tmp_path: Path) -> None:
    size = 2 * PAGE  # two objects per segment, four segments
    config = {"capacity_bytes": 4 * segment_bytes(2, size), "segment_bytes": segment_bytes(2, size)}
    tier = disk_tier(tmp_path, **config)  # type: ignore[arg-type]
    keys = [key(i) for i in range(11)]
    for k in keys[:8]:  # segments A=(0, 1), B=(2, 3), C=(4, 5), D=(6, 7)
        assert tier.put_many([k], [payload(k, size)]) == [PutStatus.OK]
    assert get_one(tier, keys[0], size)[0] is GetStatus.OK  # order now B, C, D, A
    tier.put_many([keys[8]], [payload(keys[8], size)])  # evicts B
    assert tier.contains_many(keys[:9]) == [True, True, False, False] + [True] * 5
    assert tier.stats().evictions == 2
    tier.close()

    reopened = disk_tier(tmp_path, **config)  # type: ignore[arg-type]  # order from mtimes
    for k in keys[9:11]:  # F evicts C (segments are appended to by their writer only)
        reopened.put_many([k], [payload(k, size)])
    expected = [True, True, False, False, False, False, True, True, True, True, True]
    assert reopened.contains_many(keys) == expected
    assert reopened.stats().evictions == 2
    assert reopened.usage().used_bytes == 4 * segment_bytes(2, size)
    reopened.check_integrity()


def test_a_chain_touched_last_block_first_keeps_its_first_blocks_longest(tmp_path: Path) -> None:
    size = 2 * PAGE  # two objects per segment, four segments
    config = {"capacity_bytes": 4 * segment_bytes(2, size), "segment_bytes": segment_bytes(2, size)}
    tier = disk_tier(tmp_path, **config)  # type: ignore[arg-type]
    chain = [key(f"chain/{i}") for i in range(4)]  # written first block first: A=(0, 1), B=(2, 3)
    others = [key(f"other/{i}") for i in range(6)]
    for k in [*chain, *others[:4]]:  # C=(o0, o1), D=(o2, o3)
        assert tier.put_many([k], [payload(k, size)]) == [PutStatus.OK]
    tier.retention.touch(chain[::-1])  # order now C, D, B, A: the chain's first blocks newest
    tier.put_many(others[4:5], [payload(others[4], size)])  # evicts C
    tier.put_many(others[5:6], [payload(others[5], size)])  # fills E
    assert tier.contains_many(chain) == [True] * 4
    more = [key(f"more/{i}") for i in range(4)]
    for k in more:  # two more segments evict D, then B (the chain's last blocks) before A
        tier.put_many([k], [payload(k, size)])
    assert tier.contains_many(chain) == [True, True, False, False]
    assert tier.stats().evictions == 6
    tier.close()

    reopened = disk_tier(tmp_path, **config)  # type: ignore[arg-type]  # the touch persisted
    assert reopened.contains_many(chain) == [True, True, False, False]
    reopened.check_integrity()


def test_keys_a_read_only_tier_is_told_to_touch_change_nothing(tmp_path: Path) -> None:
    size = 2 * PAGE
    config = {"capacity_bytes": 2 * segment_bytes(2, size), "segment_bytes": segment_bytes(2, size)}
    writer = disk_tier(tmp_path, **config)  # type: ignore[arg-type]
    keys = [key(i) for i in range(4)]
    for k in keys:
        writer.put_many([k], [payload(k, size)])
    reader = disk_tier(tmp_path, read_only=True, **config)  # type: ignore[arg-type]
    mtimes = [p.stat().st_mtime_ns for p in segment_files(tmp_path)]
    reader.retention.touch(keys[::-1])
    assert [p.stat().st_mtime_ns for p in segment_files(tmp_path)] == mtimes
    reader.close()
    writer.close()


def test_restart_with_a_smaller_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    seg = segment_bytes(1, 1000)
    tier = disk_tier(tmp_path, segment_bytes=seg)
    keys = [key(i) for i in range(5)]
    for k in keys:  # one segment each, oldest first
        tier.put_many([k], [payload(k, 1000)])
    tier.close()
    reopened = disk_tier(tmp_path, capacity_bytes=3 * seg, segment_bytes=seg)
    assert reopened.scan_report.num_evicted == 2
    assert reopened.contains_many(keys) == [False, False, True, True, True]
    assert len(segment_files(tmp_path)) == 3
    reopened.check_integrity()


def test_capacity_is_respected_on_disk(tmp_path: Path) -> None:
    capacity = 400_000
    tier = disk_tier(tmp_path, capacity_bytes=capacity, segment_bytes=64 * 1024)
    rng = random.Random(3)
    for i in range(80):
        k = key(i)
        n = rng.randrange(1, 60_000)
        assert tier.put_many([k], [payload(k, n)]) == [PutStatus.OK]
        on_disk = sum(p.stat().st_size for p in segment_files(tmp_path))
        assert on_disk == tier.usage().used_bytes <= capacity
    assert tier.stats().evictions > 0
    too_big = key("too-big")
    num_objects = tier.usage().num_objects
    assert tier.put_many([too_big], [payload(too_big, capacity)]) == [PutStatus.FULL]
    assert tier.stats().put_skipped_full == 1
    assert tier.usage().num_objects == num_objects  # nothing evicted for it
    tier.check_integrity()


def test_a_full_tier_reuses_evicted_segment_files(tmp_path: Path) -> None:
    """Steady state: a new segment takes over the file it evicted (no file created)."""
    seg = segment_bytes(2, 50_000)
    tier = disk_tier(tmp_path, capacity_bytes=2 * seg, segment_bytes=seg)
    old = [key(f"old{i}") for i in range(4)]
    tier.put_many(old, [payload(k, 50_000) for k in old])
    inodes = {p.stat().st_ino for p in segment_files(tmp_path)}
    assert len(inodes) == 2
    new = [key("new0"), key("new1")]
    assert tier.put_many(new, [payload(k, 50_000) for k in new]) == [PutStatus.OK] * 2
    assert {p.stat().st_ino for p in segment_files(tmp_path)} == inodes
    assert tier.contains_many(old + new) == [False, False, True, True, True, True]
    tier.close()
    reopened = disk_tier(tmp_path, capacity_bytes=2 * seg, segment_bytes=seg)
    assert reopened.contains_many(old + new) == [False, False, True, True, True, True]
    for k in old[2:] + new:
        status, out = get_one(reopened, k, 50_000)
        assert status is GetStatus.OK and np.array_equal(out, payload(k, 50_000))
    assert temp_files(tmp_path) == []
    reopened.check_integrity()


def test_exists_keeps_the_first_value(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    k = key("first")
    tier.put_many([k], [payload(k, 900, version=1)])
    assert tier.put_many([k], [payload(k, 900, version=2)]) == [PutStatus.EXISTS]
    assert tier.put_many([key("x"), key("x")], [payload("x", 9), payload("x", 9)]) == [
        PutStatus.OK,
        PutStatus.EXISTS,
    ]
    status, out = get_one(tier, k, 900)
    assert status is GetStatus.OK and np.array_equal(out, payload(k, 900, version=1))


def _flip_payload_byte(victim: RecordInfo, other: RecordInfo) -> None:
    flip_payload_byte(victim)


def _truncate(victim: RecordInfo, other: RecordInfo) -> None:
    os.truncate(victim.path, victim.offset + victim.length - 10)


def _other_key(victim: RecordInfo, other: RecordInfo) -> None:
    digest_at = victim.slot_offset + SLOT_BYTES - 24  # the key digest in the codec header
    patch(victim.path, digest_at, bytes.fromhex(other.digest))


def _wrong_version(victim: RecordInfo, other: RecordInfo) -> None:
    patch(victim.path, victim.slot_offset + 24 + 4, (99).to_bytes(2, "little"))


CORRUPTIONS = {
    "bit_flip": (_flip_payload_byte, "checksum"),
    "truncated": (_truncate, "shorter"),
    "wrong_key": (_other_key, "another_key"),
    "wrong_version": (_wrong_version, "version"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_object_is_detected_counted_and_quarantined(tmp_path: Path, kind: str) -> None:
    damage, reason = CORRUPTIONS[kind]
    tier = disk_tier(tmp_path)
    other, victim = key("other"), key("victim")  # the victim last: truncation spares other
    tier.put_many([other, victim], [payload(other, 5000), payload(victim, 5000)])
    damage(record(tmp_path, victim), record(tmp_path, other))

    status, _ = get_one(tier, victim, 5000)
    assert status is GetStatus.CORRUPT
    assert tier.stats().corrupt == 1
    quarantined = [p.name for p in (tmp_path / "quarantine").iterdir()]
    assert len(quarantined) == 1 and reason in quarantined[0], quarantined
    assert tier.contains_many([victim, other]) == [False, True]
    assert get_one(tier, other, 5000)[0] is GetStatus.OK
    tier.check_integrity()
    tier.close()
    reopened = disk_tier(tmp_path)  # the slot was marked dead: not served again
    assert reopened.contains_many([victim, other]) == [False, True]
    assert reopened.scan_report.num_quarantined == 0
    reopened.check_integrity()


def test_start_up_scan_quarantines_bad_files_and_counts_bad_slots(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path, segment_bytes=segment_bytes(2, 5000))
    keys = [key(i) for i in range(4)]  # two segments
    tier.put_many(keys, [payload(k, 5000) for k in keys])
    tier.close()
    first, second = segment_files(tmp_path)
    patch(first, 0, os.urandom(64))  # segment header destroyed: keys 0 and 1 gone
    _wrong_version(record(tmp_path, keys[2]), record(tmp_path, keys[3]))
    (tmp_path / "notes.txt").write_text("not ours")

    reopened = disk_tier(tmp_path)
    report = reopened.scan_report
    assert (report.num_objects, report.num_segments, report.num_quarantined) == (1, 1, 3)
    assert reopened.stats().corrupt == 3
    assert len(list((tmp_path / "quarantine").iterdir())) == 3
    assert segment_files(tmp_path) == [second]
    statuses = [get_one(reopened, k, 5000)[0] for k in keys]
    assert statuses == [GetStatus.MISS, GetStatus.MISS, GetStatus.MISS, GetStatus.OK]
    reopened.check_integrity()


def test_buffer_of_another_size_is_corrupt(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    k = key("size")
    tier.put_many([k], [payload(k, 5000)])
    assert get_one(tier, k, 4999)[0] is GetStatus.CORRUPT
    assert tier.stats().corrupt == 1
    tier.check_integrity()


def test_given_checksums_go_into_the_headers(tmp_path: Path) -> None:
    """With checksums (the engine took them while gathering) the tier writes them instead
    of hashing the payloads: across the parts of a batch written by several threads, each
    object with its right checksum reads back, each with a wrong one reads back CORRUPT."""
    tier = disk_tier(tmp_path, num_io_threads=2)
    keys = [key(f"given/{i}") for i in range(12)]
    values = [payload(k, 600_000) for k in keys]
    sums = [checksum(v) if i % 3 else checksum(v) ^ 1 for i, v in enumerate(values)]
    assert tier.put_many(keys, values, sums) == [PutStatus.OK] * len(keys)
    statuses = [get_one(tier, k, 600_000)[0] for k in keys]
    expected = [GetStatus.OK if i % 3 else GetStatus.CORRUPT for i in range(len(keys))]
    assert statuses == expected
    assert tier.stats().corrupt == 4
    tier.check_integrity()


def test_leftover_temp_files_are_removed_by_the_writer_only(tmp_path: Path) -> None:
    disk_tier(tmp_path).close()
    leftover = tmp_path / ".tmp.12345.0"
    leftover.write_bytes(b"partial segment")
    reader = disk_tier(tmp_path, read_only=True)
    assert reader.scan_report.num_temp_removed == 0 and leftover.exists()
    writer = disk_tier(tmp_path)
    assert writer.scan_report.num_temp_removed == 1
    assert temp_files(tmp_path) == []
    writer.check_integrity()


def test_one_writer_per_directory(tmp_path: Path) -> None:
    writer = disk_tier(tmp_path)
    with pytest.raises(DiskTierInUse, match=f"process {os.getpid()}"):
        disk_tier(tmp_path)
    reader = disk_tier(tmp_path, read_only=True)
    k = key("w")
    with pytest.raises(RuntimeError, match="read-only"):
        reader.put_many([k], [payload(k, 10)])
    with pytest.raises(RuntimeError, match="read-only"):
        reader.delete_many([k])
    writer.close()
    disk_tier(tmp_path).close()  # the lock went with the first writer


WRITER = """
import sys, zlib
import numpy as np
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
tier = DiskTier(
    DiskConfig(path=sys.argv[1], capacity_bytes=1 << 40, segment_bytes=64 << 20, num_io_threads=1)
)
i = int(sys.argv[2])
while True:
    k = StoreKey(f"kill/{i}")
    rng = np.random.default_rng(zlib.crc32(k.encode()))  # as payload(k, n) in the test
    tier.put_many([k], [np.resize(rng.integers(0, 256, 4096, dtype=np.uint8), 8 << 20)])
    print(i, flush=True)
    i += 1
"""


def _written_past_last_slot(root: Path) -> bool:
    """Payload bytes beyond the last object that has a slot: a kill during a write."""
    records = list(segments.iter_records(root))
    newest = max(records, key=lambda r: (r.seq, r.offset), default=None)
    for path in segment_files(root):
        if newest is not None and path == newest.path:
            start = newest.offset + newest.length
        elif any(r.path == path for r in records):
            continue
        else:
            start = Geometry.standard(path.stat().st_size).data_offset
        with path.open("rb") as file:
            file.seek(start)
            data = file.read()
        if data.count(0) != len(data):
            return True
    return False


def test_writer_killed_mid_write_leaves_only_whole_objects(tmp_path: Path) -> None:
    """SIGKILL a writer of 8 MiB objects; every object that reads back OK after a
    restart is exactly what was written, and every confirmed one does."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    confirmed: set[int] = set()  # printed by the writer after put_many returned
    next_index, killed_mid_write = 0, 0
    rng = random.Random(4)
    for _ in range(8):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(next_index)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        assert writer.stdout is not None
        for _ in range(3):
            confirmed.add(int(writer.stdout.readline()))
        time.sleep(rng.uniform(0, 0.01))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        next_index = max(confirmed) + 3  # the objects in flight may or may not have landed
        killed_mid_write += _written_past_last_slot(tmp_path)
        if killed_mid_write >= 2:
            break
    assert killed_mid_write >= 1, "no kill landed during a write; the test proved nothing"

    tier = disk_tier(tmp_path, capacity_bytes=1 << 40)
    keys = [StoreKey(f"kill/{i}") for i in range(next_index)]
    outs = [np.zeros(8 << 20, dtype=np.uint8) for _ in keys]
    statuses = tier.get_many_into(keys, outs)
    assert {i for i, s in enumerate(statuses) if s is GetStatus.OK} >= confirmed
    assert set(statuses) <= {GetStatus.OK, GetStatus.MISS}
    for k, status, out in zip(keys, statuses, outs, strict=True):
        if status is GetStatus.OK:
            assert np.array_equal(out, payload(k, 8 << 20)), k
    tier.check_integrity()


def test_permissions_are_private_whatever_the_umask(tmp_path: Path) -> None:
    for umask, name in ((0o000, "open"), (0o277, "strict")):
        old = os.umask(umask)
        try:
            root = tmp_path / name / "cache"
            tier = disk_tier(root)
            k = key(name)
            tier.put_many([k], [payload(k, 100)])
            tier.close()
        finally:
            os.umask(old)
        for directory in (root, root / "quarantine"):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
        for file in [*segment_files(root), root / "writer.lock"]:
            assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


def test_read_only_instance_follows_the_writer(tmp_path: Path) -> None:
    """The scheduler's instance sees later stores, dead slots and evicted segments."""
    n = 8000
    seg = segment_bytes(2, n)
    writer = disk_tier(tmp_path, capacity_bytes=2 * seg, segment_bytes=seg)
    reader = disk_tier(tmp_path, read_only=True)
    keys = [key(i) for i in range(6)]
    writer.put_many(keys[:1], [payload(keys[0], n)])
    assert reader.contains_many(keys[:1]) == [True]
    status, out = get_one(reader, keys[0], n)
    assert status is GetStatus.OK and np.array_equal(out, payload(keys[0], n))

    writer.put_many(keys[1:2], [payload(keys[1], n)])
    writer.delete_many(keys[1:2])
    assert reader.contains_many(keys[1:2]) == [False]  # dead before the reader saw it

    writer.put_many(keys[2:6], [payload(k, n) for k in keys[2:6]])  # evicts keys 0, 1
    assert writer.contains_many(keys) == [False, False, True, True, True, True]
    assert reader.contains_many(keys) == [False, False, True, True, True, True]
    assert get_one(reader, keys[0], n)[0] is GetStatus.MISS
    assert reader.usage().num_objects == 4
    reader.check_integrity()
    writer.check_integrity()


def test_read_only_instance_writes_nothing(tmp_path: Path) -> None:
    writer = disk_tier(tmp_path)
    keys = [key(i) for i in range(4)]
    writer.put_many(keys, [payload(k, 3000) for k in keys])
    writer.close()
    patch(segment_files(tmp_path)[0], record(tmp_path, keys[0]).offset, b"\xff" * 8)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()}
    reader = disk_tier(tmp_path, capacity_bytes=3 * PAGE, read_only=True)
    assert reader.contains_many(keys) == [True] * 4  # its capacity binds the writer only
    assert get_one(reader, keys[0], 3000)[0] is GetStatus.CORRUPT
    assert get_one(reader, keys[1], 3000)[0] is GetStatus.OK
    reader.close()
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_io_failures_are_errors_not_exceptions(tmp_path: Path) -> None:
    seg = segment_bytes(1, 100)
    tier = disk_tier(tmp_path / "cache", segment_bytes=seg)
    k = key("io")
    tier.put_many([k], [payload(k, 100)])
    shutil.rmtree(tmp_path / "cache")
    other = key("io-other")  # needs a new segment file in a directory that is gone
    assert tier.put_many([other], [payload(other, 100)]) == [PutStatus.ERROR]
    assert tier.stats().errors == 1
    assert tier.contains_many([other]) == [False]
    assert not (tmp_path / "cache").exists()  # and no temp file left behind anywhere
    assert list(tmp_path.rglob("*")) == []


FILE_SIZE_LIMIT = """
import resource, signal, sys
import numpy as np
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
tier = DiskTier(DiskConfig(path=sys.argv[1], capacity_bytes=64 << 20, segment_bytes=512 << 10))
small, big = StoreKey("small"), StoreKey("big")
print(tier.put_many([small], [np.ones(1000, np.uint8)])[0].value)
print(tier.put_many([big], [np.ones(4 << 20, np.uint8)])[0].value)
print(tier.stats().errors, tier.contains_many([small, big]))
tier.check_integrity()
print("consistent")
"""


def test_a_file_size_limit_fails_puts_not_the_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["ok", "error", "1 [True, False]", "consistent"]


def test_threads_under_eviction_pressure_keep_index_and_files_consistent(
    tmp_path: Path,
) -> None:
    sizes = [1000, 5000, 20_000]
    tier = disk_tier(tmp_path, capacity_bytes=160_000, segment_bytes=40_000)
    assert random_calls_on_threads(tier, key, payload, sizes, num_calls=150) == []
    assert tier.stats().evictions > 0
    assert temp_files(tmp_path) == []
    tier.check_integrity()
    live = {r.digest for r in segments.iter_records(tmp_path) if r.state is SlotState.LIVE}
    assert len(live) == tier.usage().num_objects
    tier.close()
    reopened = disk_tier(tmp_path, capacity_bytes=160_000, segment_bytes=40_000)
    assert reopened.usage() == tier.usage()
    reopened.check_integrity()
