"""Throughput of the CPU and disk tiers against plain copies and plain file I/O.

Run: ``.venv/bin/python benchmarks/bench_tiers.py [--dir DIR] [--total-mib 256]``.
Every limit is measured in this run, back to back with the tier it bounds, and
the ratio is the median over ``--repeat`` repetitions of limit time / tier
time.

The CPU tier is compared with the same work done by plain copies: the same
objects copied one by one into pre-faulted memory (the best of ``np.copyto``
per object and one ``copy_runs`` call over all of them). Not with one
``memcpy`` of all the bytes: past a few MiB glibc switches to non-temporal
stores, which skip reading the destination into cache first; no copy of an
object of a few hundred KiB takes that path, so that figure (printed for
reference) bounds no tier. The
disk tier against one big file of the same total size, same fsync policy:

* put into an empty tier (a fresh directory: every segment file is new) vs
  writing a new file;
* put into a full tier (room for one generation of keys: every put evicts,
  the steady state of a cache, and reuses evicted segment files) vs writing
  a new file or rewriting an existing one, whichever is faster;
* get vs reading a file back from the page cache, as the tier's objects are.

A new file is written both with and without ``posix_fallocate`` first (the
tier preallocates) and the faster counts; removing the previous file is not
timed, and each empty tier's directory is removed after its repetition, so
neither side carries the other's dirty pages.

Prints GB/s and ratios (target for the disk tier: >= 0.70 of plain file I/O).
Exits 0 unless it crashes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from hybridkv.cli.bench import describe_machine, machine
from hybridkv.tiers.base import Buffer, StoreKey, Tier
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier, FsyncPolicy
from hybridkv.transfer.runs import Runs, copy_runs, warm_up

TARGET_DISK_RATIO = 0.70
_BATCH = 32
_CHUNK_BYTES = 64 << 20


class Pair:
    """Times of an operation and of the limit it is compared with, run back to back."""

    def __init__(self, name: str, limit_name: str) -> None:
        self.name, self.limit_name = name, limit_name
        self.seconds: list[float] = []
        self.limit_seconds: list[float] = []

    def measure(self, run: Callable[[], object], limits: list[Callable[[], object]]) -> None:
        """Time the limit (the fastest of ``limits``, each run once) and then ``run``."""
        self.limit_seconds.append(min(timed(limit) for limit in limits))
        self.seconds.append(timed(run))

    @property
    def ratio(self) -> float:
        """Median over repetitions of limit time / operation time: load from other
        processes hits both sides of each ratio alike."""
        pairs = zip(self.limit_seconds, self.seconds, strict=True)
        return statistics.median(limit / op for limit, op in pairs)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def put_all(tier: Tier, keys: list[StoreKey], objects: list[Buffer]) -> None:
    for i in range(0, len(keys), _BATCH):
        tier.put_many(keys[i : i + _BATCH], objects[i : i + _BATCH])


def get_all(tier: Tier, keys: list[StoreKey], targets: list[Buffer]) -> None:
    for i in range(0, len(keys), _BATCH):
        statuses = tier.get_many_into(keys[i : i + _BATCH], targets[i : i + _BATCH])
        assert all(status.value == "ok" for status in statuses), statuses


def copy_objects(targets: list[Buffer], objects: list[Buffer]) -> None:
    """Copy each object into its target with ``memcpy``."""
    for target, source in zip(targets, objects, strict=True):
        np.copyto(target, source)


def object_runs(targets: list[Buffer], objects: list[Buffer]) -> Runs:
    """The runs for ``copy_runs`` that copy each object into its target."""
    pairs = zip(targets, objects, strict=True)
    return np.array([(t.ctypes.data, s.ctypes.data, len(s)) for t, s in pairs], np.int64).T.copy()


def plain_write(path: Path, data: Buffer, fsync: FsyncPolicy, *, preallocate: bool) -> None:
    """Write ``data`` into ``path`` (removed beforehand, untimed, for a new file) in
    big chunks; ``preallocate`` reserves the blocks first, as the tier does."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if preallocate:
            os.posix_fallocate(fd, 0, len(data))
        view = data.data
        for start in range(0, len(view), _CHUNK_BYTES):
            chunk, offset = view[start : start + _CHUNK_BYTES], start
            while chunk:
                written = os.pwrite(fd, chunk, offset)
                chunk, offset = chunk[written:], offset + written
        if fsync is not FsyncPolicy.NEVER:
            os.fsync(fd)
    finally:
        os.close(fd)


def remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def plain_read(path: Path, out: Buffer) -> None:
    with open(path, "rb", buffering=0) as file:
        view, done = out.data, 0
        while done < len(view):
            done += file.readinto(view[done : done + _CHUNK_BYTES]) or 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk runs go")
    parser.add_argument("--object-kib", type=int, default=256)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fsync", choices=[p.value for p in FsyncPolicy], default="never")
    parser.add_argument("--io-threads", type=int, default=4)
    args = parser.parse_args()
    object_bytes = args.object_kib << 10
    num_objects = (args.total_mib << 20) // object_bytes
    total_bytes = num_objects * object_bytes
    fsync = FsyncPolicy(args.fsync)

    source = np.random.default_rng(0).integers(0, 256, total_bytes, dtype=np.uint8)
    out = np.zeros_like(source)
    out.fill(0)
    objects = [source[i * object_bytes : (i + 1) * object_bytes] for i in range(num_objects)]
    targets = [out[i * object_bytes : (i + 1) * object_bytes] for i in range(num_objects)]

    def keys(generation: int) -> list[StoreKey]:
        return [StoreKey(f"bench/{generation}/{i}") for i in range(num_objects)]

    cpu = CpuTier(CpuConfig(capacity_bytes=total_bytes + (1 << 20), pin_memory=False))
    warm_up()
    runs = object_runs(targets, objects)
    copies = [partial(copy_objects, targets, objects), partial(copy_runs, runs, streaming=False)]
    cpu_put, cpu_get = Pair("cpu put", "copy objects"), Pair("cpu get", "copy objects")
    one_memcpy = Pair("one memcpy", "(reference)")
    for _ in range(args.repeat):
        cpu.delete_many(keys(0))
        cpu_put.measure(lambda: put_all(cpu, keys(0), objects), copies)
        cpu_get.measure(lambda: get_all(cpu, keys(0), targets), copies)
        one_memcpy.measure(lambda: np.copyto(out, source), copies)
    assert np.array_equal(out, source), "cpu tier returned wrong bytes"
    cpu.check_integrity()
    cpu.close()

    work = Path(tempfile.mkdtemp(prefix="hybridkv-bench-", dir=args.dir))
    pairs = [
        Pair("disk put, empty tier", "write new file"),
        Pair("disk put, full tier", "write file"),
        Pair("disk get", "read file"),
    ]
    try:

        def disk_config(name: str) -> DiskConfig:
            return DiskConfig(
                path=work / name,
                capacity_bytes=int(total_bytes * 1.1),  # one generation of keys, not two
                fsync=fsync,
                num_io_threads=args.io_threads,
            )

        full = DiskTier(disk_config("full"))
        big, grown, kept = work / "plain.bin", work / "grown.bin", work / "kept.bin"
        new_file = [
            partial(plain_write, big, source, fsync, preallocate=True),
            partial(plain_write, grown, source, fsync, preallocate=False),
        ]
        plain_write(kept, source, fsync, preallocate=False)
        put_all(full, keys(0), objects)  # from now on every put evicts
        for generation in range(1, args.repeat + 1):
            empty = DiskTier(disk_config(f"empty{generation}"))  # a fresh directory each time
            remove(big, grown)  # untimed: a new file is written without removing one
            pairs[0].measure(partial(put_all, empty, keys(0), objects), new_file)
            remove(big, grown)
            rewrite = partial(plain_write, kept, source, fsync, preallocate=False)
            pairs[1].measure(
                partial(put_all, full, keys(generation), objects), [*new_file, rewrite]
            )
            out.fill(0)
            pairs[2].measure(
                partial(get_all, full, keys(generation), targets),
                [lambda: plain_read(kept, out)],
            )
            assert np.array_equal(out, source), "disk tier returned wrong bytes"
            empty.check_integrity()
            empty.close()
            shutil.rmtree(work / f"empty{generation}")  # its dirty pages go, like a removed file's
        full.check_integrity()
        full.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(describe_machine(machine()))
    print(
        f"{num_objects} objects x {args.object_kib} KiB = {total_bytes / 2**20:.0f} MiB, "
        f"fsync={fsync.value}, io threads={args.io_threads}, dir={args.dir}, "
        f"GB/s: best of {args.repeat}; ratio: median over repetitions of limit time / "
        f"tier time, each pair run back to back; load average {load}"
    )
    print(f"{'operation':<22} {'GB/s':>6}   {'limit':<15} {'GB/s':>6}   {'ratio':>5}")
    for pair in [cpu_put, cpu_get, one_memcpy, *pairs]:
        rate = total_bytes / min(pair.seconds) / 1e9
        limit = total_bytes / min(pair.limit_seconds) / 1e9
        target = f"  (target >= {TARGET_DISK_RATIO:.2f})" if pair.name.startswith("disk") else ""
        print(
            f"{pair.name:<22} {rate:6.2f}   {pair.limit_name:<15} {limit:6.2f}   "
            f"{pair.ratio:5.2f}{target}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
