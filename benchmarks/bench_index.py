"""RAM per stored object, reopen time and lookup cost of the disk and CPU tiers' indexes.

Run: ``.venv/bin/python benchmarks/bench_index.py [--objects 1000000] [--dir DIR]``.

A 1 TB disk tier of 16 KiB objects holds 64 million objects, so what its index
costs per object decides whether it fits in RAM and how long a restart takes.
The parent process fills a disk tier and closes it; a fresh child process
opens and closes an empty tier first (numba and every module loaded, so that
is not counted), reads its resident set size from ``/proc/self/statm``, opens
the filled tier and reads it again: the growth per object is the disk row. The
CPU tier is measured the same way in a child that fills it (the growth after
its arena is touched and its first put made), with keys shaped like the
connector's (about 80 characters).

Objects are empty and segments hold one slot per 64 data bytes (the module
constant is set in this process only): the index and the start-up scan only
ever read slot tables, never payloads, so the figures are those of any object
size, while a million objects take about 140 MB of segment files instead of
the 8 GB that the default of one slot per 8 KiB would preallocate. The
directory is removed at the end.

Each figure has its goal and a ratio; the reference columns are the physical
work measured in the same run: reading the slot tables' bytes (reopen) and
hashing the keys into digests (a lookup). Times per key are the best of three
passes. Exits 0 unless it crashes or a tier
answers wrongly; a missed goal is reported, not fatal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hybridkv.cli.bench import describe_machine, machine
from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier

GOAL_BYTES_PER_OBJECT = 64
GOAL_REOPEN_S_PER_MILLION = 1.0
GOAL_LOOKUP_US = 1.0
BYTES_PER_SLOT = 64
"""Slot density of the benchmark's segments (see the module docstring)."""
CPU_OBJECT_BYTES = 64
REPEAT = 3
_PUT_BATCH = 4096


def key(i: int) -> StoreKey:
    """A key shaped like the connector's: namespace, group, then a block hash."""
    block_hash = xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little", signed=True))
    return StoreKey(f"bench-model|5f3a9c0e1b2d4f60|tp0of1|g{i % 3}|{block_hash}")


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    gc.collect()
    return int(Path("/proc/self/statm").read_text().split()[1]) * page_size()


def disk_config(path: Path, capacity_bytes: int) -> DiskConfig:
    return DiskConfig(path=path, capacity_bytes=capacity_bytes, num_io_threads=1)


def fill_disk(path: Path, num_objects: int) -> int:
    """Store ``num_objects`` empty objects; returns the capacity used."""
    segments.BYTES_PER_SLOT = BYTES_PER_SLOT
    capacity = max(64 << 20, 2 * num_objects * (BYTES_PER_SLOT + segments.SLOT_BYTES))
    tier = DiskTier(disk_config(path, capacity))
    empty = np.zeros(0, np.uint8)
    for start in range(0, num_objects, _PUT_BATCH):
        keys = [key(i) for i in range(start, min(num_objects, start + _PUT_BATCH))]
        assert set(tier.put_many(keys, [empty] * len(keys))) == {PutStatus.OK}
    assert tier.usage().num_objects == num_objects
    tier.close()
    return capacity


def slot_table_seconds(path: Path) -> float:
    """The physical part of a reopen: reading every segment's filled slots."""
    start = time.perf_counter()
    for file in sorted(path.glob("*.seg")):
        fd = os.open(file, os.O_RDONLY)
        try:
            header = segments.read_segment_header(fd)
            assert not isinstance(header, str)
            end = header.data_offset
            for offset in range(segments.PAGE, end, 1 << 20):
                os.pread(fd, min(1 << 20, end - offset), offset)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def sample(num_objects: int, count: int, batch: int) -> list[list[StoreKey]]:
    """Batches of stored keys picked at random."""
    rng = np.random.default_rng(1)
    picked = rng.choice(num_objects, min(count, num_objects), replace=False)
    keys = [key(int(i)) for i in picked]
    return [keys[i : i + batch] for i in range(0, len(keys), batch)]


def sample_runs(num_objects: int, count: int, batch: int) -> list[list[StoreKey]]:
    """Batches of keys stored one after another (a prefix's blocks), at random places."""
    rng = np.random.default_rng(2)
    starts = rng.integers(0, num_objects - batch, max(1, count // batch))
    return [[key(int(i)) for i in range(s, s + batch)] for s in starts]


def per_key_us(batches: list[list[StoreKey]], one: Any) -> float:
    """Microseconds per key of ``one`` over all ``batches``: the best of ``REPEAT`` passes
    (other processes on a shared machine only ever add time)."""
    best = float("inf")
    for _ in range(REPEAT):
        start = time.perf_counter()
        for keys in batches:
            one(keys)
        best = min(best, time.perf_counter() - start)
    return best / sum(map(len, batches)) * 1e6


def child_disk(args: argparse.Namespace) -> dict[str, float]:
    empty_dir = Path(args.dir) / "empty"
    DiskTier(disk_config(empty_dir, args.capacity)).close()  # loads and compiles everything
    before = rss_bytes()
    start = time.perf_counter()
    tier = DiskTier(disk_config(Path(args.dir) / "tier", args.capacity))
    open_s = time.perf_counter() - start
    after = rss_bytes()
    assert tier.usage().num_objects == args.objects
    result = {"bytes_per_object": (after - before) / args.objects, "open_s": open_s}
    batches = sample(args.objects, args.lookups, args.batch)
    empty = np.zeros(0, np.uint8)

    def contains(keys: list[StoreKey]) -> None:
        assert all(tier.contains_many(keys))

    def get(keys: list[StoreKey]) -> None:
        assert set(tier.get_many_into(keys, [empty] * len(keys))) == {GetStatus.OK}

    in_a_row = sample_runs(args.objects, args.lookups, args.batch)
    result["contains_us"] = per_key_us(batches, contains)
    result["contains_run_us"] = per_key_us(in_a_row, contains)
    result["get_us"] = per_key_us(batches, get)
    result["get_run_us"] = per_key_us(in_a_row, get)
    result["digest_us"] = per_key_us(batches, lambda keys: [key_digest(k) for k in keys])
    tier.close()
    return result


def child_cpu(args: argparse.Namespace) -> dict[str, float]:
    num_bytes = CPU_OBJECT_BYTES
    tier = CpuTier(CpuConfig(capacity_bytes=args.objects * num_bytes + (1 << 20), pin_memory=False))
    payload = np.ones(num_bytes, np.uint8)
    tier.put_many([key(-1)], [payload])  # first calls made, then forgotten
    tier.delete_many([key(-1)])
    before = rss_bytes()
    put_s = 0.0
    for start in range(0, args.objects, _PUT_BATCH):
        keys = [key(i) for i in range(start, min(args.objects, start + _PUT_BATCH))]
        began = time.perf_counter()
        for i in range(0, len(keys), args.batch):
            part = keys[i : i + args.batch]
            assert set(tier.put_many(part, [payload] * len(part))) == {PutStatus.OK}
        put_s += time.perf_counter() - began
        del keys
    after = rss_bytes()
    assert tier.usage().num_objects == args.objects
    batches = sample(args.objects, args.lookups, args.batch)
    outs = [np.zeros(num_bytes, np.uint8) for _ in range(args.batch)]

    def contains(keys: list[StoreKey]) -> None:
        assert all(tier.contains_many(keys))

    def get(keys: list[StoreKey]) -> None:
        assert set(tier.get_many_into(keys, outs[: len(keys)])) == {GetStatus.OK}

    return {
        "bytes_per_object": (after - before) / args.objects,
        "put_us": put_s / args.objects * 1e6,
        "contains_us": per_key_us(batches, contains),
        "get_us": per_key_us(batches, get),
    }


def run_child(args: argparse.Namespace, kind: str, *extra: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", kind, "--dir", args.dir]
    command += ["--objects", str(args.objects), "--capacity", str(args.capacity)]
    command += ["--lookups", str(args.lookups), "--batch", str(args.batch), *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def row(name: str, measured: float, unit: str, goal: float, reference: str = "") -> str:
    ratio = measured / goal
    verdict = "met" if ratio <= 1 else "**missed**"
    return (
        f"| {name} | {measured:.3g} {unit} | <= {goal:g} {unit} | {ratio:.2f} | {verdict} "
        f"| {reference} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the tier's files go")
    parser.add_argument("--lookups", type=int, default=100_000, help="keys looked up per figure")
    parser.add_argument("--batch", type=int, default=64, help="keys per contains_many/get call")
    parser.add_argument("--child", choices=["disk", "cpu"], help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "disk":
        print(json.dumps(child_disk(args)))
        return 0
    if args.child == "cpu":
        print(json.dumps(child_cpu(args)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="hybridkv-bench-index-", dir=args.dir))
    try:
        start = time.perf_counter()
        args.capacity = fill_disk(work / "tier", args.objects)
        fill_s = time.perf_counter() - start
        files_bytes = sum(f.stat().st_size for f in (work / "tier").glob("*.seg"))
        child_args = argparse.Namespace(**{**vars(args), "dir": str(work)})
        disk = run_child(child_args, "disk")
        read_s = min(slot_table_seconds(work / "tier") for _ in range(3))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu = run_child(args, "cpu")

    millions = args.objects / 1e6
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(describe_machine(machine()))
    print(
        f"{args.objects} objects ({files_bytes / 2**20:.0f} MiB of segment files, filled in "
        f"{fill_s:.0f} s), lookups of {args.lookups} stored keys in batches of {args.batch}, "
        f"load average {load}; RAM: resident set growth in a fresh process"
    )
    print("| figure | measured | goal | ratio | | reference in this run |")
    print("|---|---|---|---|---|---|")
    reopen = disk["open_s"] / millions
    lines = [
        row("disk: RAM per object", disk["bytes_per_object"], "B", GOAL_BYTES_PER_OBJECT),
        row(
            "disk: reopen per million objects",
            reopen,
            "s",
            GOAL_REOPEN_S_PER_MILLION,
            f"reading the slot tables: {read_s / millions:.3f} s",
        ),
        row(
            "disk: contains_many per key, random keys",
            disk["contains_us"],
            "us",
            GOAL_LOOKUP_US,
            f"hashing the key: {disk['digest_us']:.2f} us",
        ),
        row(
            "disk: contains_many per key, keys stored in a row",
            disk["contains_run_us"],
            "us",
            GOAL_LOOKUP_US,
        ),
        f"| disk: get_many_into per key, random keys (empty objects) | {disk['get_us']:.3g} us "
        "| - | - | - | |",
        f"| disk: get_many_into per key, keys stored in a row | {disk['get_run_us']:.3g} us "
        "| - | - | - | |",
        row("cpu: RAM per object", cpu["bytes_per_object"], "B", GOAL_BYTES_PER_OBJECT),
        row("cpu: contains_many per key", cpu["contains_us"], "us", GOAL_LOOKUP_US),
        f"| cpu: put_many per key ({CPU_OBJECT_BYTES} B objects) | {cpu['put_us']:.3g} us "
        "| - | - | - | |",
        f"| cpu: get_many_into per key ({CPU_OBJECT_BYTES} B objects) | {cpu['get_us']:.3g} us "
        "| - | - | - | |",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
