"""Host memory copies of many scattered runs of bytes in one native call.

Runs in the worker process, on the calling thread, without the GIL. A run is
(destination address, source address, size in bytes). ``copy_runs`` copies
them in order with inlined 128-byte vector moves and, while it copies one
run, prefetches the next run, a line for each line it copies (at least
``PREFETCH_BYTES`` of it), so the whole next run is on its way when it starts.

Why not ``memcpy`` per run (``np.take`` over ``void`` elements, torch's
``index_select``): at the start of each scattered run the hardware
prefetcher has nothing to go on, so every run of a few KiB stalls on memory
first; and glibc picks ``rep movsb`` for runs under half of L2, which some
CPUs run slower than their vector loop. Prefetching the whole next run brings
scattered blocks of a few KiB close to a long copy's speed
(``benchmarks/bench_transfer.py``; figures in docs/DECISIONS.md).

Runs that continue each other on both sides (blocks adjacent in the cache
and in the staging rows) are joined and move as one run.

Calls that move at least ``STREAM_MIN_BYTES`` store with non-temporal moves
(each run's whole destination cache lines) and fence before returning, as
glibc's memcpy does past its non-temporal threshold: an ordinary store first
reads each destination line into cache, which large scatters do not need.
Smaller calls keep ordinary stores: what they write is likely read soon.

``copy_runs_hashed`` also takes each staging row's xxh3-64 right after the
row's runs are copied, while it is still in cache: a tier that frames
objects in staging then needs no second pass over the payloads, which would
read them back from memory. It calls the xxhash package's own compiled XXH3 through its
exported symbol, so the checksum is the codec's by construction (checked at
import).

Addresses are raw: callers pass only runs inside buffers they hold.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from hybridkv.native import (
    LINE_BYTES,
    XXH3_ADDRESS,
    call_hash,
    move_line,
    move_tail,
    prefetch_read,
    prefetch_write,
    store_fence,
    stream_line,
)

PREFETCH_BYTES = 1024
"""The least of the next run to prefetch, however short the run being copied."""
STREAM_MIN_BYTES = 8 << 20
"""Calls moving at least this many bytes use streaming stores (see the module doc)."""

Runs = npt.NDArray[np.int64]
"""(3, num_runs) int64: destination addresses, source addresses, sizes in bytes."""
Hashes = npt.NDArray[np.uint64]
"""One xxh3-64 (seed 0) per row, as ``hybridkv.tiers.codec.checksum`` computes it."""


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _copy_runs(dst: Runs, src: Runs, sizes: Runs, streaming: bool) -> int:  # pragma: no cover
    copied: int = _copy_range(dst, src, sizes, 0, len(sizes), streaming)
    if streaming:
        store_fence()
    return copied


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _copy_range(
    dst: Runs, src: Runs, sizes: Runs, first: int, stop: int, streaming: bool
) -> int:  # pragma: no cover - native
    """Copy runs ``first`` to ``stop`` (joined within that range only); the run after
    the range, when there is one, is prefetched as any next run is. ``streaming``:
    each run's whole cache lines go with non-temporal stores (the caller fences);
    the partial lines at either end, with ordinary ones (a line written both ways
    is flushed from cache, which costs more than the streaming saves)."""
    num_runs = len(sizes)
    copied = 0
    start, end = first, _merged_end(dst, src, sizes, first, stop)
    while start < stop:
        following = _merged_end(dst, src, sizes, end, stop)
        d, s, size = dst[start], src[start], _sum(sizes, start, end)
        # The next run: the next joined stretch in the range, else the run after it.
        after = max(following, min(end + 1, num_runs))
        next_dst, next_src = (dst[end], src[end]) if end < num_runs else (d, s)
        next_size = _sum(sizes, end, after)
        offset = 0
        if streaming:  # ordinary stores up to the first cache line of its own
            offset = min(size, -d % 64)
            if offset:
                move_tail(d, s, offset)
        whole = offset + (size - offset) // LINE_BYTES * LINE_BYTES
        # The next run is prefetched a line for each line copied, so the whole of it is
        # on its way by the time it starts. Two loops, not one with a branch on
        # ``streaming`` per line: numba leaves that branch in the loop, which slows it.
        ahead = 0
        if streaming:
            while offset < whole:
                if ahead < next_size:
                    prefetch_read(next_src + ahead)
                    prefetch_read(next_src + ahead + 64)
                    ahead += LINE_BYTES
                stream_line(d + offset, s + offset)
                offset += LINE_BYTES
        else:
            while offset < whole:
                if ahead < next_size:
                    prefetch_read(next_src + ahead)
                    prefetch_read(next_src + ahead + 64)
                    prefetch_write(next_dst + ahead)
                    prefetch_write(next_dst + ahead + 64)
                    ahead += LINE_BYTES
                move_line(d + offset, s + offset)
                offset += LINE_BYTES
        # A run shorter than PREFETCH_BYTES still starts that much of the next one.
        while ahead < min(next_size, PREFETCH_BYTES):
            prefetch_read(next_src + ahead)
            if not streaming:
                prefetch_write(next_dst + ahead)
            ahead += 64
        if offset < size:
            move_tail(d + offset, s + offset, size - offset)
        copied += 1
        start, end = end, following
    return copied


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _merged_end(
    dst: Runs, src: Runs, sizes: Runs, i: int, stop: int
) -> int:  # pragma: no cover - native
    """End of the stretch of runs from ``i`` (before ``stop``) that continue each other
    on both sides."""
    if i >= stop:
        return i
    end_dst, end_src = dst[i] + sizes[i], src[i] + sizes[i]
    j = i + 1
    while j < stop and dst[j] == end_dst and src[j] == end_src:
        end_dst += sizes[j]
        end_src += sizes[j]
        j += 1
    return j


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _sum(sizes: Runs, start: int, end: int) -> int:  # pragma: no cover - native
    total = 0
    for i in range(start, end):
        total += sizes[i]
    return total


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _copy_and_hash(
    dst: Runs,
    src: Runs,
    sizes: Runs,
    runs_per_row: int,
    rows: Runs,
    row_bytes: int,
    hash_fn: int,
    out: Hashes,
) -> int:  # pragma: no cover - native
    """Copy each row's runs, then hash the row while it is still in cache."""
    copied = 0
    for r in range(len(rows)):
        copied += _copy_range(dst, src, sizes, r * runs_per_row, (r + 1) * runs_per_row, False)
        out[r] = call_hash(hash_fn, rows[r], row_bytes)
    return copied


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _hash_rows(rows: Runs, row_bytes: int, hash_fn: int, out: Hashes) -> None:  # pragma: no cover
    for r in range(len(rows)):
        out[r] = call_hash(hash_fn, rows[r], row_bytes)


def copy_runs(runs: Runs, *, streaming: bool | None = None) -> int:
    """Copy every run of ``runs`` (see ``Runs``), in order; runs that continue each
    other on both sides go as one. Returns how many runs it copied after joining.

    ``streaming`` (default: when the runs add up to ``STREAM_MIN_BYTES``): store
    each run's whole destination cache lines with non-temporal moves, so they are
    not read into cache first, and fence before returning."""
    assert runs.dtype == np.int64 and runs.ndim == 2 and runs.shape[0] == 3, runs.shape
    if not runs.shape[1]:
        return 0
    if streaming is None:
        streaming = int(runs[2].sum()) >= STREAM_MIN_BYTES
    return int(_copy_runs(runs[0], runs[1], runs[2], streaming))


def copy_runs_hashed(runs: Runs, runs_per_row: int, rows: Runs, row_bytes: int) -> Hashes:
    """Copy runs as ``copy_runs`` does, ``runs_per_row`` at a time, each batch filling
    the ``row_bytes`` at ``rows[r]``; hash each row right after its runs, while it is in
    cache. Returns the hashes (see ``Hashes``)."""
    assert runs.dtype == np.int64 and runs.ndim == 2 and runs.shape[0] == 3, runs.shape
    assert rows.dtype == np.int64 and runs.shape[1] == len(rows) * runs_per_row, rows.shape
    out = np.empty(len(rows), np.uint64)
    if len(rows):
        _copy_and_hash(runs[0], runs[1], runs[2], runs_per_row, rows, row_bytes, XXH3_ADDRESS, out)
    return out


def hash_rows(rows: Runs, row_bytes: int) -> Hashes:
    """The hash (see ``Hashes``) of the ``row_bytes`` at each address of ``rows``."""
    assert rows.dtype == np.int64 and rows.ndim == 1, rows.shape
    out = np.empty(len(rows), np.uint64)
    _hash_rows(rows, row_bytes, XXH3_ADDRESS, out)
    return out


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def block_runs(
    ids: Runs,
    row_addresses: Runs,
    spans: Runs,
    block_order: bool,
    to_rows: bool,
) -> Runs:  # pragma: no cover - native
    """The runs that move blocks ``ids[i]`` to (``to_rows``) or from the object row at
    ``row_addresses[i]``. ``spans`` is (4, num_spans): address of each span in block 0,
    bytes from one block's span to the next's, offset in the block object, size. Runs
    go block by block (``block_order``) or span by span."""
    num_ids, num_spans = len(ids), spans.shape[1]
    runs = np.empty((3, num_ids * num_spans), np.int64)
    for b in range(num_ids):
        row = row_addresses[b]
        for k in range(num_spans):
            r = b * num_spans + k if block_order else k * num_ids + b
            cache = spans[0, k] + ids[b] * spans[1, k]
            target = row + spans[2, k]
            runs[0, r] = target if to_rows else cache
            runs[1, r] = cache if to_rows else target
            runs[2, r] = spans[3, k]
    return runs


def warm_up() -> None:
    """Compile (or load) the native copy now rather than on the first transfer."""
    buffer = np.zeros(2 * LINE_BYTES + 2, np.uint8)
    address = buffer.ctypes.data
    one_run = np.array([[address], [address + LINE_BYTES + 1], [LINE_BYTES + 1]], np.int64)
    copy_runs(one_run, streaming=False)
    copy_runs(one_run, streaming=True)
    copy_runs_hashed(one_run, 1, one_run[0], LINE_BYTES + 1)
    hash_rows(one_run[0], 1)
    one = np.zeros(1, np.int64)
    spans = np.array([[address], [0], [0], [1]], np.int64)
    for block_order in (False, True):
        for to_rows in (False, True):
            block_runs(one, one + address, spans, block_order, to_rows)
