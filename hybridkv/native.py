"""LLVM intrinsics the native copies are built from, and what they call.

Worker process, any thread. Each intrinsic inlines into the numba-compiled
loops of ``hybridkv.transfer.runs`` and ``hybridkv.tiers.disk.preads``:
fixed-size vector moves (cached or streaming), a tail move, prefetches, a
store fence, a call of the xxhash package's own compiled XXH3 through its
exported symbol, and one of the C library's ``pread``.

Importing this module also wraps llvmlite's ``binding.ffi.lib`` (see
``_LibWithDict``), so import it before numba compiles anything.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

import numpy as np
import xxhash
from llvmlite import ir
from llvmlite.binding import ffi
from numba import types
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

_libc_pread = ctypes.CDLL(None, use_errno=True).pread
PREAD_ADDRESS = int(ctypes.cast(_libc_pread, ctypes.c_void_p).value or 0)
"""The C library's ``pread``, for reads that run without the GIL (``call_pread``)."""


@intrinsic  # type: ignore[untyped-decorator]
def move_line(typingctx: Any, dst: Any, src: Any) -> Any:
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
def move_tail(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
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
def call_hash(typingctx: Any, function: Any, address: Any, nbytes: Any) -> Any:
    """``XXH3_64bits(address, nbytes)`` through the function pointer ``function``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bytes_ptr = ir.IntType(8).as_pointer()
        u64 = ir.IntType(64)
        fn_type = ir.FunctionType(u64, [bytes_ptr, u64])
        fn = builder.inttoptr(args[0], fn_type.as_pointer())
        return builder.call(fn, [builder.inttoptr(args[1], bytes_ptr), args[2]])

    return types.uint64(types.int64, types.int64, types.int64), codegen


@intrinsic  # type: ignore[untyped-decorator]
def call_pread(
    typingctx: Any, function: Any, fd: Any, address: Any, nbytes: Any, offset: Any
) -> Any:
    """``pread(fd, address, nbytes, offset)`` through the function pointer ``function``:
    the bytes read, 0 at the end of the file, negative on an error."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bytes_ptr = ir.IntType(8).as_pointer()
        i32, i64 = ir.IntType(32), ir.IntType(64)
        fn_type = ir.FunctionType(i64, [i32, bytes_ptr, i64, i64])
        fn = builder.inttoptr(args[0], fn_type.as_pointer())
        fd_arg = builder.trunc(args[1], i32)
        return builder.call(fn, [fd_arg, builder.inttoptr(args[2], bytes_ptr), args[3], args[4]])

    return types.int64(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


prefetch_read = _prefetch_intrinsic(0)
prefetch_write = _prefetch_intrinsic(1)


@intrinsic  # type: ignore[untyped-decorator]
def stream_line(typingctx: Any, dst: Any, src: Any) -> Any:
    """LINE_BYTES with non-temporal stores (``dst`` 32-byte aligned): the lines go to
    memory without being read into cache first. Needs ``store_fence`` before the
    bytes are handed to another thread."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vector = ir.VectorType(ir.IntType(64), 4)
        i64 = ir.IntType(64)
        streaming = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for k in range(LINE_BYTES // 32):
            step = ir.Constant(i64, 32 * k)
            source = builder.inttoptr(builder.add(args[1], step), vector.as_pointer())
            target = builder.inttoptr(builder.add(args[0], step), vector.as_pointer())
            store = builder.store(builder.load(source, align=1), target, align=32)
            store.set_metadata("nontemporal", streaming)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic  # type: ignore[untyped-decorator]
def store_fence(typingctx: Any) -> Any:
    """``sfence``: every earlier store, streaming ones included, is visible first."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn_type = ir.FunctionType(ir.VoidType(), [])
        fn = cgutils.get_or_insert_function(builder.module, fn_type, "llvm.x86.sse.sfence")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen
