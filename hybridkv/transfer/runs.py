"""Host memory copies of many scattered runs of bytes in one native call.

Runs in the worker process, on the calling thread, without the GIL. A run is
(destination address, source address, size in bytes). ``copy_runs`` copies
them in order with inlined 128-byte vector moves and, while it copies one
run, prefetches the start of the next run's source and destination.

Why not ``memcpy`` per run (``np.take`` over ``void`` elements, torch's
``index_select``): at the start of each scattered run the hardware
prefetcher has nothing to go on, so every run of a few KiB stalls on memory
first; and glibc picks ``rep movsb`` for runs under half of L2, which some
CPUs (AMD EPYC under KVM) run slower than their vector loop. Together that
left 4-16 KiB blocks at 0.75-0.85 of one long copy; prefetching the next run
brings them to the long copy's speed (``benchmarks/bench_transfer.py``).

Runs that continue each other on both sides (blocks adjacent in the cache
and in the staging rows) are joined and move as one run.

``copy_runs_hashed`` also takes each staging row's xxh3-64 right after the
row's runs are copied, while it is still in cache: a tier that frames
objects in staging then needs no second pass over the payloads (hashing
256 KiB rows in cache runs at about 2.5x the speed of hashing them back from
memory here). It calls the xxhash package's own compiled XXH3 through its
exported symbol, so the checksum is the codec's by construction (checked at
import).

Addresses are raw: callers pass only runs inside buffers they hold.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash
from llvmlite import ir
from llvmlite.binding import ffi
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


class _LibWithDict:
    """llvmlite's ``binding.ffi.lib`` behind an object with a real ``__dict__``.

    vLLM (0.32) rebinds its Triton kernels at every engine start by scanning the
    attributes of every imported module and reading ``vars(value)`` of each.
    llvmlite's ``lib`` answers any attribute, ``__dict__`` included, with a C
    function wrapper, so once numba has compiled in a process the next engine
    started in it fails (``'_lib_fn_wrapper' object has no attribute 'get'``).
    Every other attribute passes through to the library.
    """

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)


if not isinstance(ffi.lib, _LibWithDict):
    ffi.lib = _LibWithDict(ffi.lib)

LINE_BYTES = 128
"""Bytes per inlined vector move (four 32-byte AVX2 registers)."""
PREFETCH_BYTES = 1024
"""How much of the next run to prefetch; the hardware prefetcher streams the rest."""

Runs = npt.NDArray[np.int64]
"""(3, num_runs) int64: destination addresses, source addresses, sizes in bytes."""
Hashes = npt.NDArray[np.uint64]
"""One xxh3-64 (seed 0) per row, as ``hybridkv.tiers.codec.checksum`` computes it."""


def _find_xxh3() -> int:
    """The address of the xxhash package's own one-shot XXH3-64 (the CPU-dispatched
    variant when it has one), checked against ``xxhash.xxh3_64_intdigest``."""
    extension = importlib.import_module("xxhash._xxhash")
    library = ctypes.CDLL(extension.__file__)
    data = bytes(range(256)) * 5
    probe = np.frombuffer(data, np.uint8)
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        function = getattr(library, name, None)
        if function is None:
            continue
        function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_uint64
        if function(probe.ctypes.data, probe.nbytes) == xxhash.xxh3_64_intdigest(data):
            return int(ctypes.cast(function, ctypes.c_void_p).value or 0)
    raise RuntimeError(
        f"the xxhash package at {xxhash.__file__} exports no XXH3_64bits matching "
        "xxh3_64_intdigest; reinstall it (pip install --force-reinstall 'xxhash>=3.4')"
    )


XXH3_ADDRESS = _find_xxh3()


@intrinsic  # type: ignore[untyped-decorator]
def _move_line(typingctx: Any, dst: Any, src: Any) -> Any:
    """memcpy of LINE_BYTES (a constant size, so LLVM inlines vector moves)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bytes_ptr = ir.IntType(8).as_pointer()
        dst_ptr = builder.inttoptr(args[0], bytes_ptr)
        src_ptr = builder.inttoptr(args[1], bytes_ptr)
        size = context.get_constant(types.intp, LINE_BYTES)
        cgutils.raw_memcpy(builder, dst_ptr, src_ptr, size, 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic  # type: ignore[untyped-decorator]
def _move_tail(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
    """memcpy of a run's last ``nbytes < LINE_BYTES``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bytes_ptr = ir.IntType(8).as_pointer()
        dst_ptr = builder.inttoptr(args[0], bytes_ptr)
        src_ptr = builder.inttoptr(args[1], bytes_ptr)
        cgutils.raw_memcpy(builder, dst_ptr, src_ptr, args[2], 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


def _prefetch_intrinsic(for_write: int) -> Any:
    """``llvm.prefetch`` of one cache line, for reading or writing, into all levels."""

    @intrinsic  # type: ignore[untyped-decorator]
    def prefetch(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            bytes_ptr = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn_type = ir.FunctionType(ir.VoidType(), [bytes_ptr, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fn_type, "llvm.prefetch.p0")
            pointer = builder.inttoptr(args[0], bytes_ptr)
            builder.call(fn, [pointer, i32(for_write), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(types.int64), codegen

    return prefetch


@intrinsic  # type: ignore[untyped-decorator]
def _call_hash(typingctx: Any, function: Any, address: Any, nbytes: Any) -> Any:
    """``XXH3_64bits(address, nbytes)`` through the function pointer ``function``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bytes_ptr = ir.IntType(8).as_pointer()
        u64 = ir.IntType(64)
        fn_type = ir.FunctionType(u64, [bytes_ptr, u64])
        fn = builder.inttoptr(args[0], fn_type.as_pointer())
        return builder.call(fn, [builder.inttoptr(args[1], bytes_ptr), args[2]])

    return types.uint64(types.int64, types.int64, types.int64), codegen


_prefetch_read = _prefetch_intrinsic(0)
_prefetch_write = _prefetch_intrinsic(1)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _copy_runs(dst: Runs, src: Runs, sizes: Runs) -> int:  # pragma: no cover - native
    copied: int = _copy_range(dst, src, sizes, 0, len(sizes))
    return copied


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _copy_range(
    dst: Runs, src: Runs, sizes: Runs, first: int, stop: int
) -> int:  # pragma: no cover - native
    """Copy runs ``first`` to ``stop`` (joined within that range only); the run after
    the range, when there is one, is prefetched as any next run is."""
    num_runs = len(sizes)
    copied = 0
    start, end = first, _merged_end(dst, src, sizes, first, stop)
    while start < stop:
        following = _merged_end(dst, src, sizes, end, stop)
        d, s, size = dst[start], src[start], _sum(sizes, start, end)
        next_dst, next_src = (dst[end], src[end]) if end < num_runs else (d, s)
        whole = size - size % LINE_BYTES
        ahead = min(PREFETCH_BYTES, whole)
        offset = 0
        while offset < ahead:
            _prefetch_read(next_src + offset)
            _prefetch_read(next_src + offset + 64)
            _prefetch_write(next_dst + offset)
            _prefetch_write(next_dst + offset + 64)
            _move_line(d + offset, s + offset)
            offset += LINE_BYTES
        while offset < whole:
            _move_line(d + offset, s + offset)
            offset += LINE_BYTES
        if offset < size:
            _move_tail(d + offset, s + offset, size - offset)
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
        copied += _copy_range(dst, src, sizes, r * runs_per_row, (r + 1) * runs_per_row)
        out[r] = _call_hash(hash_fn, rows[r], row_bytes)
    return copied


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _hash_rows(rows: Runs, row_bytes: int, hash_fn: int, out: Hashes) -> None:  # pragma: no cover
    for r in range(len(rows)):
        out[r] = _call_hash(hash_fn, rows[r], row_bytes)


def copy_runs(runs: Runs) -> int:
    """Copy every run of ``runs`` (see ``Runs``), in order; runs that continue each
    other on both sides go as one. Returns how many runs it copied after joining."""
    assert runs.dtype == np.int64 and runs.ndim == 2 and runs.shape[0] == 3, runs.shape
    if not runs.shape[1]:
        return 0
    return int(_copy_runs(runs[0], runs[1], runs[2]))


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
    rows: Runs,
    staging_address: int,
    row_bytes: int,
    spans: Runs,
    block_order: bool,
    to_staging: bool,
) -> Runs:  # pragma: no cover - native
    """The runs that move blocks ``ids[i]`` to (``to_staging``) or from staging row
    ``rows[i]``. ``spans`` is (4, num_spans): address of each span in block 0, bytes
    from one block's span to the next's, offset in the block object, size. Runs go
    block by block (``block_order``) or span by span."""
    num_ids, num_spans = len(ids), spans.shape[1]
    runs = np.empty((3, num_ids * num_spans), np.int64)
    for b in range(num_ids):
        row = staging_address + rows[b] * row_bytes
        for k in range(num_spans):
            r = b * num_spans + k if block_order else k * num_ids + b
            cache = spans[0, k] + ids[b] * spans[1, k]
            staging = row + spans[2, k]
            runs[0, r] = staging if to_staging else cache
            runs[1, r] = cache if to_staging else staging
            runs[2, r] = spans[3, k]
    return runs


def warm_up() -> None:
    """Compile (or load) the native copy now rather than on the first transfer."""
    buffer = np.zeros(2 * LINE_BYTES + 2, np.uint8)
    address = buffer.ctypes.data
    one_run = np.array([[address], [address + LINE_BYTES + 1], [LINE_BYTES + 1]], np.int64)
    copy_runs(one_run)
    copy_runs_hashed(one_run, 1, one_run[0], LINE_BYTES + 1)
    hash_rows(one_run[0], 1)
    one = np.zeros(1, np.int64)
    spans = np.array([[address], [0], [0], [1]], np.int64)
    for block_order in (False, True):
        for to_staging in (False, True):
            block_runs(one, one, address + 1, 1, spans, block_order, to_staging)
