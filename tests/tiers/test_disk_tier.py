"""DiskTier on a real directory: round trips, restart, LRU, corruption, crashes, threads."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import HEADER_BYTES, key_digest
from hybridkv.tiers.disk import DiskConfig, DiskTier, FsyncPolicy

REPO_ROOT = Path(__file__).resolve().parents[2]


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/disk/{i}")


def payload(k: str, num_bytes: int, version: int = 0) -> np.ndarray:
    """Deterministic bytes of a key (a random 4 KiB pattern repeated: cheap for big sizes)."""
    rng = np.random.default_rng(zlib.crc32(k.encode()) + 7919 * version)
    return np.resize(rng.integers(0, 256, min(num_bytes, 4096), dtype=np.uint8), num_bytes)


def disk_tier(path: Path, capacity_bytes: int = 64 << 20, **kwargs: object) -> DiskTier:
    return DiskTier(DiskConfig(path=path, capacity_bytes=capacity_bytes, **kwargs))  # type: ignore[arg-type]


def get_one(tier: DiskTier, k: StoreKey, num_bytes: int) -> tuple[GetStatus, np.ndarray]:
    out = np.zeros(num_bytes, dtype=np.uint8)
    return tier.get_many_into([k], [out])[0], out


def object_path(root: Path, k: StoreKey) -> Path:
    digest = key_digest(k).hex()
    return root / digest[:2] / f"{digest}.kv"


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/.tmp.*"))


@pytest.mark.parametrize("fsync", list(FsyncPolicy))
def test_round_trip_random_sizes_and_restart(tmp_path: Path, fsync: FsyncPolicy) -> None:
    rng = random.Random(2)
    sizes = {key(i): rng.choice([0, 1, 4095, rng.randrange(1, 600_000)]) for i in range(40)}
    tier = disk_tier(tmp_path, fsync=fsync)
    assert tier.put_many(list(sizes), [payload(k, n) for k, n in sizes.items()]) == [
        PutStatus.OK
    ] * len(sizes)
    tier.check_integrity()
    tier.close()

    reopened = disk_tier(tmp_path, fsync=fsync)
    assert reopened.scan_report.num_objects == len(sizes)
    assert reopened.scan_report.num_bytes == sum(sizes.values()) + HEADER_BYTES * len(sizes)
    assert reopened.contains_many(list(sizes)) == [True] * len(sizes)
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes.values()]
    assert reopened.get_many_into(list(sizes), outs) == [GetStatus.OK] * len(sizes)
    for (k, n), out in zip(sizes.items(), outs, strict=True):
        assert np.array_equal(out, payload(k, n))
    reopened.check_integrity()


def test_lru_eviction_order_survives_restart(tmp_path: Path) -> None:
    size = 10_000
    file_bytes = HEADER_BYTES + size
    tier = disk_tier(tmp_path, capacity_bytes=4 * file_bytes)
    keys = [key(i) for i in range(7)]
    tier.put_many(keys[:4], [payload(k, size) for k in keys[:4]])
    assert get_one(tier, keys[0], size)[0] is GetStatus.OK  # order now 1, 2, 3, 0
    tier.put_many([keys[4]], [payload(keys[4], size)])  # evicts 1
    assert tier.contains_many(keys[:5]) == [True, False, True, True, True]
    tier.close()

    reopened = disk_tier(tmp_path, capacity_bytes=4 * file_bytes)  # order from mtimes: 2, 3, 0, 4
    reopened.put_many(keys[5:7], [payload(k, size) for k in keys[5:7]])  # evicts 2, 3
    assert reopened.contains_many(keys) == [True, False, False, False, True, True, True]
    assert reopened.stats().evictions == 2
    assert reopened.usage().used_bytes == 4 * file_bytes
    reopened.check_integrity()


def test_restart_with_a_smaller_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + 1000
    tier = disk_tier(tmp_path)
    keys = [key(i) for i in range(5)]
    for k in keys:  # one batch each: five distinct mtimes, oldest first
        tier.put_many([k], [payload(k, 1000)])
    tier.close()
    reopened = disk_tier(tmp_path, capacity_bytes=3 * file_bytes)
    assert reopened.scan_report.num_evicted == 2
    assert reopened.contains_many(keys) == [False, False, True, True, True]
    reopened.check_integrity()


def test_capacity_is_respected_on_disk(tmp_path: Path) -> None:
    capacity = 300_000
    tier = disk_tier(tmp_path, capacity_bytes=capacity)
    rng = random.Random(3)
    for i in range(80):
        k = key(i)
        n = rng.randrange(1, 60_000)
        assert tier.put_many([k], [payload(k, n)]) == [PutStatus.OK]
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*/*.kv"))
        assert on_disk == tier.usage().used_bytes <= capacity
    too_big = key("too-big")
    num_objects = tier.usage().num_objects
    assert tier.put_many([too_big], [payload(too_big, capacity)]) == [PutStatus.FULL]
    assert tier.stats().put_skipped_full == 1
    assert tier.usage().num_objects == num_objects  # nothing evicted for it
    tier.check_integrity()


def test_a_full_tier_reuses_evicted_files_for_new_objects(tmp_path: Path) -> None:
    """Steady state: each put overwrites the file it evicted (no new file created),
    and a smaller object truncates it to its own size."""
    tier = disk_tier(tmp_path, capacity_bytes=2 * (HEADER_BYTES + 50_000))
    old = [key("old0"), key("old1")]
    tier.put_many(old, [payload(k, 50_000) for k in old])
    inodes = {object_path(tmp_path, k).stat().st_ino for k in old}
    new = [key("new0"), key("new1")]
    sizes = [30_000, 50_000]
    assert (
        tier.put_many(new, [payload(k, n) for k, n in zip(new, sizes, strict=True)])
        == [PutStatus.OK] * 2
    )
    assert {object_path(tmp_path, k).stat().st_ino for k in new} == inodes
    assert object_path(tmp_path, new[0]).stat().st_size == HEADER_BYTES + 30_000
    assert tier.contains_many(old + new) == [False, False, True, True]
    tier.close()
    reopened = disk_tier(tmp_path, capacity_bytes=2 * (HEADER_BYTES + 50_000))
    for k, n in zip(new, sizes, strict=True):
        status, out = get_one(reopened, k, n)
        assert status is GetStatus.OK and np.array_equal(out, payload(k, n))
    assert temp_files(tmp_path) == []
    reopened.check_integrity()


def test_exists_keeps_the_first_value(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    k = key("first")
    tier.put_many([k], [payload(k, 900, version=1)])
    assert tier.put_many([k], [payload(k, 900, version=2)]) == [PutStatus.EXISTS]
    status, out = get_one(tier, k, 900)
    assert status is GetStatus.OK and np.array_equal(out, payload(k, 900, version=1))


def _flip_payload_byte(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 100] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _other_keys_file(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)  # same size, valid header, but written under another key


def _garbage(path: Path, other: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _wrong_version(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[4:6] = (99).to_bytes(2, "little")
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "bit_flip": (_flip_payload_byte, "checksum"),
    "truncated": (_truncate, "shorter"),
    "wrong_key": (_other_keys_file, "another_key"),
    "garbage": (_garbage, "magic"),
    "wrong_version": (_wrong_version, "version"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_file_is_detected_counted_and_quarantined(tmp_path: Path, kind: str) -> None:
    damage, reason = CORRUPTIONS[kind]
    tier = disk_tier(tmp_path)
    victim, other = key("victim"), key("other")
    tier.put_many([victim, other], [payload(victim, 5000), payload(other, 5000)])
    damage(object_path(tmp_path, victim), object_path(tmp_path, other))

    status, _ = get_one(tier, victim, 5000)
    assert status is GetStatus.CORRUPT
    assert tier.stats().corrupt == 1
    assert not object_path(tmp_path, victim).exists()
    quarantined = [p.name for p in (tmp_path / "quarantine").iterdir()]
    assert len(quarantined) == 1 and reason in quarantined[0], quarantined
    assert tier.contains_many([victim, other]) == [False, True]
    assert get_one(tier, other, 5000)[0] is GetStatus.OK
    tier.check_integrity()


@pytest.mark.parametrize("kind", ["truncated", "garbage", "wrong_version"])
def test_start_up_scan_quarantines_bad_files(tmp_path: Path, kind: str) -> None:
    damage, _ = CORRUPTIONS[kind]
    tier = disk_tier(tmp_path)
    victim, other = key("victim"), key("other")
    tier.put_many([victim, other], [payload(victim, 5000), payload(other, 5000)])
    tier.close()
    damage(object_path(tmp_path, victim), object_path(tmp_path, other))
    (tmp_path / "00" / "notes.txt").write_text("not ours")

    reopened = disk_tier(tmp_path)
    assert reopened.scan_report.num_quarantined == 2
    assert reopened.scan_report.num_objects == 1
    assert reopened.stats().corrupt == 2
    assert len(list((tmp_path / "quarantine").iterdir())) == 2
    assert get_one(reopened, victim, 5000)[0] is GetStatus.MISS
    assert get_one(reopened, other, 5000)[0] is GetStatus.OK
    reopened.check_integrity()


def test_buffer_of_another_size_is_corrupt(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    k = key("size")
    tier.put_many([k], [payload(k, 5000)])
    assert get_one(tier, k, 4999)[0] is GetStatus.CORRUPT
    assert tier.stats().corrupt == 1
    tier.check_integrity()


def test_leftover_temp_files_are_removed_on_start_unless_their_writer_lives(
    tmp_path: Path,
) -> None:
    disk_tier(tmp_path).close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        digest = "ab" * 16
        dead_temp = tmp_path / "ab" / f".tmp.{dead.pid}.0.{digest}"
        own_temp = tmp_path / "ab" / f".tmp.{os.getpid()}.7.{digest}"
        alive_temp = tmp_path / "ab" / f".tmp.{alive.pid}.0.{digest}"
        for path in (dead_temp, own_temp, alive_temp):
            path.write_bytes(b"partial")
        tier = disk_tier(tmp_path)
        assert tier.scan_report.num_temp_removed == 2
        assert temp_files(tmp_path) == [alive_temp]
        assert tier.scan_report.num_quarantined == 0
        tier.check_integrity()
    finally:
        alive.kill()
        alive.wait()


WRITER = """
import sys, zlib
import numpy as np
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.disk import DiskConfig, DiskTier
tier = DiskTier(DiskConfig(path=sys.argv[1], capacity_bytes=1 << 40))
i = int(sys.argv[2])
while True:
    k = StoreKey(f"kill/{i}")
    rng = np.random.default_rng(zlib.crc32(k.encode()))  # as payload(k, n) in the test
    tier.put_many([k], [np.resize(rng.integers(0, 256, 4096, dtype=np.uint8), 8 << 20)])
    print(i, flush=True)
    i += 1
"""


def test_writer_killed_mid_write_leaves_only_whole_objects(tmp_path: Path) -> None:
    """SIGKILL a writer of 8 MiB objects; a new tier cleans its temp files, and every
    object that reads back OK is exactly what was written."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    confirmed: set[int] = set()  # printed by the writer after put_many returned
    next_index, killed_mid_write = 0, 0
    rng = random.Random(4)
    for _ in range(6):
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
        killed_mid_write += bool(temp_files(tmp_path))
        if killed_mid_write >= 2:
            break
    assert killed_mid_write >= 1, "no kill landed during a write; the test proved nothing"
    num_temp = len(temp_files(tmp_path))

    tier = disk_tier(tmp_path, capacity_bytes=1 << 40)
    assert tier.scan_report.num_temp_removed == num_temp
    assert temp_files(tmp_path) == []
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
        finally:
            os.umask(old)
        for directory in (root, root / "quarantine", object_path(root, k).parent):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
        assert stat.S_IMODE(object_path(root, k).stat().st_mode) == 0o600


def test_second_instance_sees_objects_written_after_its_start(tmp_path: Path) -> None:
    """A lookup-only instance (the scheduler's) finds what the writer stores later."""
    writer, reader = disk_tier(tmp_path), disk_tier(tmp_path)
    k = key("late")
    writer.put_many([k], [payload(k, 3000)])
    assert reader.contains_many([k]) == [True]
    status, out = get_one(reader, k, 3000)
    assert status is GetStatus.OK and np.array_equal(out, payload(k, 3000))
    writer.delete_many([k])
    assert get_one(reader, k, 3000)[0] is GetStatus.MISS
    writer.check_integrity()
    reader.check_integrity()


def test_a_lookup_only_instance_never_deletes_the_writers_files(tmp_path: Path) -> None:
    writer = disk_tier(tmp_path)
    reader = disk_tier(tmp_path, capacity_bytes=2 * (HEADER_BYTES + 3000))
    keys = [key(i) for i in range(4)]
    writer.put_many(keys, [payload(k, 3000) for k in keys])
    assert reader.contains_many(keys) == [True] * 4  # its index forgets the oldest two
    assert reader.usage().num_objects == 2
    assert writer.contains_many(keys) == [True] * 4
    writer.check_integrity()
    statuses = writer.get_many_into(keys, [np.zeros(3000, dtype=np.uint8) for _ in keys])
    assert statuses == [GetStatus.OK] * 4


def test_io_failures_are_errors_not_exceptions(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "cache")
    k = key("io")
    tier.put_many([k], [payload(k, 100)])
    shutil.rmtree(tmp_path / "cache")
    other = key("io-other")
    assert tier.put_many([other], [payload(other, 100)]) == [PutStatus.ERROR]
    assert get_one(tier, k, 100)[0] is GetStatus.MISS
    assert tier.stats().errors == 1
    assert temp_files(tmp_path) == []


def test_threads_under_eviction_pressure_keep_index_and_files_consistent(
    tmp_path: Path,
) -> None:
    sizes = [1000, 5000, 20_000]
    tier = disk_tier(tmp_path, capacity_bytes=120_000)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            i = rng.randrange(40)
            k, n = key(i), sizes[i % 3]
            op = rng.random()
            if op < 0.4:
                put = tier.put_many([k], [payload(k, n)])[0]
                if put not in (PutStatus.OK, PutStatus.EXISTS, PutStatus.FULL):
                    errors.append(f"put {k}: {put}")
            elif op < 0.8:
                status, out = get_one(tier, k, n)
                if status is GetStatus.OK and not np.array_equal(out, payload(k, n)):
                    errors.append(f"wrong bytes for {k}")
                elif status not in (GetStatus.OK, GetStatus.MISS):
                    errors.append(f"get {k}: {status}")
            elif op < 0.9:
                tier.contains_many([k, key(i + 1)])
            else:
                tier.delete_many([k])

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert tier.stats().evictions > 0
    assert temp_files(tmp_path) == []
    tier.check_integrity()
    reopened = disk_tier(tmp_path, capacity_bytes=120_000)
    assert reopened.usage() == tier.usage()
    reopened.check_integrity()
