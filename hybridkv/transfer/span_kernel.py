"""One kernel launch that moves every span of a piece's blocks between a KV cache and a chunk.

Worker process; ``ChunkedCopies`` uses it on CUDA when Triton imports. A
group's block is a list of spans (one per layer, or per layer and K/V), each
at its own address in the cache; the per-span path launches one indexed op
per span and piece, dozens of launches from Python per piece. Here a table of
the group's spans (address, row stride, offset in the block object, length)
lives on the device, made once, and one launch per piece moves all of them:
program ``(row, tile, span)`` copies one tile of one span of one block.

Elements are the widest integers (8 bytes at most) whose size divides every
address, row stride, offset, length and the piece's pitch, so a span whose
bytes only allow 1-byte elements makes the whole launch bytewise; the bytes
moved are the same either way. The same kernel runs under Triton's
interpreter (``TRITON_INTERPRET=1`` before this module is imported) on CPU
tensors, which is how it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch
import triton
import triton.language as tl

TILE_BYTES = 4096
"""Bytes of one span one program moves (fewer at a span's end)."""

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_HINT_BYTES = 16
"""The widest alignment hinted to the compiler (one 16-byte vector per access)."""


class SpanBytes(NamedTuple):
    """One span of a group's blocks in the cache, in bytes."""

    address: int
    """Where block 0's span starts (``data_ptr()``)."""
    row_stride: int
    """Bytes from one block's span to the next block's."""
    object_offset: int
    """Where the span sits in the block object (a row of the chunk)."""
    num_bytes: int


@triton.jit  # type: ignore[untyped-decorator]
def _copy_spans(  # type: ignore[no-untyped-def]
    table,  # (num_spans, 4) int64: address in bytes, row stride, offset, length in elements
    ids,  # the piece's block ids, one per row
    chunk,  # the rows, ``pitch`` elements apart
    pitch,
    num_tiles,
    TILE: tl.constexpr,
    ALIGN: tl.constexpr,  # bytes every address is a multiple of
    VEC: tl.constexpr,  # elements every stride, offset and length is a multiple of
    TO_CACHE: tl.constexpr,
):
    row = tl.program_id(0) // num_tiles
    tile = tl.program_id(0) % num_tiles
    entry = table + tl.program_id(1) * 4
    address = tl.load(entry).to(tl.pointer_type(chunk.dtype.element_ty))
    cache = tl.multiple_of(address, ALIGN)
    row_stride = tl.multiple_of(tl.load(entry + 1), VEC)
    object_offset = tl.multiple_of(tl.load(entry + 2), VEC)
    num_elements = tl.multiple_of(tl.load(entry + 3), VEC)
    block = tl.load(ids + row)
    offsets = tile * TILE + tl.arange(0, TILE)
    mask = offsets < num_elements
    in_cache = cache + tl.multiple_of(block * row_stride, VEC) + offsets
    row_start = tl.multiple_of(row.to(tl.int64) * pitch, VEC)
    in_chunk = chunk + row_start + object_offset + offsets
    if TO_CACHE:
        tl.store(in_cache, tl.load(in_chunk, mask=mask), mask=mask)
    else:
        tl.store(in_chunk, tl.load(in_cache, mask=mask), mask=mask)


def _widest(value: int, limit: int) -> int:
    """The largest power of two up to ``limit`` that divides ``value``."""
    width = limit
    while value % width:
        width //= 2
    return width


class SpanTable:
    """A group's spans on the device, once per element width they allow."""

    def __init__(self, spans: Sequence[SpanBytes], device: torch.device) -> None:
        if not spans:
            raise ValueError("a group's block has at least one span")
        bits = 0
        for span in spans:
            bits |= span.address | span.row_stride | span.object_offset | span.num_bytes
        self.bits = bits
        """What an element's size (and the hinted alignment) must divide, pitch aside."""
        self.num_bytes = [span.num_bytes for span in spans]
        self._tables: dict[int, torch.Tensor] = {}
        for width in _DTYPES:
            if bits % width == 0:
                rows = [
                    (
                        s.address,
                        s.row_stride // width,
                        s.object_offset // width,
                        s.num_bytes // width,
                    )
                    for s in spans
                ]
                self._tables[width] = torch.tensor(rows, dtype=torch.int64, device=device)

    def copy(
        self,
        ids: torch.Tensor,
        chunk: torch.Tensor,
        pitch: int,
        *,
        to_cache: bool,
        spans: slice = slice(None),
    ) -> None:
        """Move ``spans`` of block ``ids[r]`` to or from row ``r`` of ``chunk`` (uint8,
        rows ``pitch`` bytes apart), in one launch on the current stream."""
        align = _widest(self.bits | pitch | chunk.data_ptr(), _HINT_BYTES)
        width = min(align, 8)
        table = self._tables[width][spans]
        num_tiles = -(-max(self.num_bytes[spans]) // TILE_BYTES)
        grid = (len(ids) * num_tiles, len(table))
        usable = chunk.numel() // width * width  # a view needs whole elements
        # Triton launches on the current device's current stream: make it the chunk's.
        on_device = torch.cuda.device(chunk.device) if chunk.is_cuda else nullcontext()
        with on_device:
            _copy_spans[grid](
                table,
                ids,
                chunk[:usable].view(_DTYPES[width]),
                pitch // width,
                num_tiles,
                TILE=TILE_BYTES // width,
                ALIGN=align,
                VEC=align // width,
                TO_CACHE=to_cache,
                num_warps=4,
            )
