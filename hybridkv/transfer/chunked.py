"""Block copies between a KV cache on a device and host rows, through one bounded chunk.

Worker process; the path ``BlockCopier`` takes for caches on CUDA (it also
runs on CPU tensors, which is how its logic is tested without a GPU). A call
moves the blocks of one group between the cache and rows of host memory (the
CPU tier's own memory, or staging): per piece of at most half the chunk,
the spans of the blocks are gathered into that half, laid out exactly as the
piece of host rows it fills, and one contiguous copy moves the piece; a load
runs the same steps backwards. On CUDA with Triton one kernel launch per
piece moves every span (``span_kernel``; ``fused``), else one indexed op per
span does (``HYBRIDKV_FUSED_COPIES=0`` picks it where the caller passes no
``fused``). So device memory taken is the chunk (allocated once), whatever
the size of a job, and a run of adjacent host rows costs one copy: a copy of
one small block uses a fraction of the link, one copy of a megabyte or more
all of it (figures in docs/DECISIONS.md).

Rows are adjacent when each starts ``block_bytes`` after the previous one,
or, when the caller says the bytes between rows are scratch (header room in
staging that the tier writes after the copy), a fixed ``pitch`` after it.

On CUDA every op of a call is enqueued and the call returns at once: the
block ids go up in one asynchronous copy from pinned memory (a copy from
pageable memory would wait for the stream to drain, so the host could never
run ahead of the link), and the two halves of the chunk take turns, each on
a stream of its own (the caller's current one, the copier's stream, and a
side stream joined back into it before the call returns), so one half's
gather or scatter runs while the other half crosses the link. The caller
orders its stream after the compute that wrote the blocks and learns
completion from an event (``BlockCopier``). One lock keeps the ops of two
calls from interleaving on the shared chunk.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.layout import CanonicalKVCaches

if TYPE_CHECKING:
    from hybridkv.transfer.span_kernel import SpanTable

logger = logging.getLogger(__name__)

DEVICE_CHUNK_BYTES = 32 << 20
"""Default size of the one device buffer a copier allocates."""
HALF_ALIGN_BYTES = 512
"""Each half of the chunk starts this aligned (wide integer views need it)."""
MAX_SCRATCH_GAP_BYTES = 4096
"""Scratch between rows that a piece may copy over (staging's header room)."""
FUSED_ENV = "HYBRIDKV_FUSED_COPIES"
"""Set to ``0``: one indexed op per span even where the kernel could run (``fused`` unset)."""

_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))

Offsets = npt.NDArray[np.int64]


class Piece(NamedTuple):
    """Rows ``[start, stop)`` of a call, ``pitch`` bytes apart in host memory and in the chunk."""

    start: int
    stop: int
    pitch: int

    def num_bytes(self, block_bytes: int) -> int:
        """Bytes moved: from the first row's start to the last row's end."""
        return (self.stop - self.start - 1) * self.pitch + block_bytes


def plan_pieces(
    offsets: Offsets, block_bytes: int, chunk_bytes: int, *, scratch_gaps: bool
) -> list[Piece]:
    """Split rows at ``offsets`` into pieces of adjacent rows that fit the chunk.

    Rows ``i`` and ``i + 1`` are adjacent when ``offsets[i + 1] - offsets[i]``
    equals ``block_bytes``, or (``scratch_gaps``) the piece's pitch, at most
    ``MAX_SCRATCH_GAP_BYTES`` more. A piece holds at most ``chunk_bytes // pitch``
    rows; a row never splits.
    """
    if block_bytes > chunk_bytes:
        raise ValueError(f"a {block_bytes}-byte block does not fit a {chunk_bytes}-byte chunk")
    num_rows = len(offsets)
    if num_rows == 0:
        return []
    steps = np.diff(offsets)
    if scratch_gaps:
        fits = (steps >= block_bytes) & (steps <= block_bytes + MAX_SCRATCH_GAP_BYTES)
    else:
        fits = steps == block_bytes
    pieces: list[Piece] = []
    start = 0
    while start < num_rows:
        pitch = int(steps[start]) if start < num_rows - 1 and fits[start] else block_bytes
        limit = max(1, chunk_bytes // pitch)
        stop = start + 1
        while stop < num_rows and stop - start < limit and fits[stop - 1]:
            if steps[stop - 1] != pitch:
                break
            stop += 1
        pieces.append(Piece(start, stop, pitch))
        start = stop
    return pieces


def _width(*values: int) -> tuple[int, torch.dtype]:
    """The widest integer type whose size divides every value."""
    combined = 0
    for value in values:
        combined |= value
    return next((w, d) for w, d in _WIDTHS if combined % w == 0)


class _Span(NamedTuple):
    raw: torch.Tensor
    """(num_blocks, num_bytes) uint8 view of the span's bytes in the cache."""
    object_offset: int
    num_bytes: int
    bits: int
    """What a wider view must divide on the cache side and in the object (address,
    row stride, offset, length); the chunk rows' pitch comes on top per call."""
    wide: dict[torch.dtype, torch.Tensor]
    """``raw`` viewed as each integer type ``bits`` allows (made once, not per call)."""


class ChunkedCopies:
    """Gathers and scatters blocks of ``caches`` through one chunk on their device."""

    def __init__(
        self,
        caches: CanonicalKVCaches,
        chunk_bytes: int = DEVICE_CHUNK_BYTES,
        *,
        fused: bool | None = None,
    ) -> None:
        largest = max(group.block_bytes for group in caches.model_groups.groups)
        half = max(chunk_bytes // 2, largest)
        self.half_bytes = -(-half // HALF_ALIGN_BYTES) * HALF_ALIGN_BYTES
        """The most one piece moves: half the chunk, or the largest block if larger
        (aligned up, so the second half starts as aligned as the first)."""
        self.chunk_bytes = 2 * self.half_bytes
        """Device bytes this copier holds: ``chunk_bytes`` (even), or two of the largest
        block if that is larger."""
        self.caches = caches
        self.device = caches.device
        groups = range(caches.model_groups.num_groups)
        self._spans = [self._group_spans(g) for g in groups]
        self._rounds = [self._write_rounds(g) for g in groups]
        self.fused = _use_fused(self.device, fused)
        """One kernel launch per piece (``span_kernel``) instead of one op per span."""
        self._tables = [self._span_table(g) for g in groups] if self.fused else []
        chunk = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
        self._halves = (chunk[: self.half_bytes], chunk[self.half_bytes :])
        self._side: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Compile (or load) the span kernel now, not on the copy thread during the first
        stores: each group's block 0 goes into the chunk and back, both ways, with its
        ids at both alignments a piece's ids start at, its spans in the rounds a scatter
        uses. The cache's bytes are unchanged. Where the kernel fails, copies go one op
        per span instead (a warning says why)."""
        if not self.fused:
            return
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        half = self._halves[0]
        try:
            for group_id, table in enumerate(self._tables):
                pitch = self.caches.model_groups.groups[group_id].block_bytes
                for part in (ids[:1], ids[1:]):
                    table.copy(part, half, pitch, to_cache=False)
                    for spans in self._rounds[group_id]:
                        table.copy(part, half, pitch, to_cache=True, spans=spans)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # the per-span path still moves every block
            logger.warning("hybridkv: the span kernel failed (%r); copying one op per span", exc)
            self.fused = False

    def gather(
        self,
        group_id: int,
        ids: npt.NDArray[np.int64],
        memory: torch.Tensor,
        offsets: Offsets,
        *,
        scratch_gaps: bool = False,
    ) -> int:
        """Copy block ``ids[i]`` to ``memory[offsets[i]:]``; returns the pieces moved."""
        block_bytes = self.caches.model_groups.groups[group_id].block_bytes
        pieces = plan_pieces(offsets, block_bytes, self.half_bytes, scratch_gaps=scratch_gaps)
        with self._lock, _Turns(self._side, self._halves) as turns:
            index = turns.upload(ids)
            for k, piece in enumerate(pieces):
                with turns.take(k) as half:
                    part = index[piece.start : piece.stop]
                    if self.fused:
                        self._tables[group_id].copy(part, half, piece.pitch, to_cache=False)
                    else:
                        rows = self._chunk_rows(half, piece, block_bytes)
                        for span in self._spans[group_id]:
                            src, dst = self._views(span, rows, piece.pitch)
                            torch.index_select(src, 0, part, out=dst)
                    nbytes = piece.num_bytes(block_bytes)
                    first = int(offsets[piece.start])
                    memory[first : first + nbytes].copy_(half[:nbytes], non_blocking=True)
        return len(pieces)

    def scatter(
        self,
        group_id: int,
        ids: npt.NDArray[np.int64],
        memory: torch.Tensor,
        offsets: Offsets,
        *,
        scratch_gaps: bool = False,
    ) -> int:
        """Copy ``memory[offsets[i]:]`` into block ``ids[i]``; returns the pieces moved.

        Spans that may share bytes (aliased layers) are written span by span over
        all pieces, the order writes through the per-layer views take, so the last
        layer written wins as it would there; each piece is then read in once a span,
        and a round starts only after the one before it is done on both streams."""
        block_bytes = self.caches.model_groups.groups[group_id].block_bytes
        pieces = plan_pieces(offsets, block_bytes, self.half_bytes, scratch_gaps=scratch_gaps)
        with self._lock, _Turns(self._side, self._halves) as turns:
            index = turns.upload(ids)
            for round_spans in self._rounds[group_id]:
                turns.join()
                for k, piece in enumerate(pieces):
                    with turns.take(k) as half:
                        nbytes = piece.num_bytes(block_bytes)
                        first = int(offsets[piece.start])
                        half[:nbytes].copy_(memory[first : first + nbytes], non_blocking=True)
                        part = index[piece.start : piece.stop]
                        if self.fused:
                            table = self._tables[group_id]
                            table.copy(part, half, piece.pitch, to_cache=True, spans=round_spans)
                            continue
                        rows = self._chunk_rows(half, piece, block_bytes)
                        for span in self._spans[group_id][round_spans]:
                            dst, src = self._views(span, rows, piece.pitch)
                            dst.index_copy_(0, part, src)
        return len(pieces)

    @staticmethod
    def _chunk_rows(half: torch.Tensor, piece: Piece, block_bytes: int) -> torch.Tensor:
        """(rows, block_bytes) view of a half of the chunk, ``piece.pitch`` bytes apart."""
        num_rows = piece.stop - piece.start
        flat = half[: num_rows * piece.pitch] if num_rows > 1 else half[:block_bytes]
        return flat.as_strided((num_rows, block_bytes), (piece.pitch, 1))

    @staticmethod
    def _views(span: _Span, rows: torch.Tensor, pitch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The span in the cache and in the chunk rows, as the widest integers both allow."""
        part = rows[:, span.object_offset : span.object_offset + span.num_bytes]
        _, dtype = _width(span.bits, pitch)
        return span.wide[dtype], part.view(dtype)

    def _group_spans(self, group_id: int) -> list[_Span]:
        spans = []
        for span in self.caches.group_block_spans(group_id):
            tensor = self.caches.tensors[span.tensor_idx]
            raw = tensor[:, span.offset_bytes : span.offset_bytes + span.num_bytes].view(
                torch.uint8
            )
            bits = raw.data_ptr() | (tensor.stride(0) if tensor.shape[0] > 1 else 0)
            bits |= span.object_offset_bytes | span.num_bytes
            wide = {dtype: raw.view(dtype) for width, dtype in _WIDTHS if bits % width == 0}
            spans.append(_Span(raw, span.object_offset_bytes, span.num_bytes, bits, wide))
        return spans

    def _write_rounds(self, group_id: int) -> list[slice]:
        """The spans a scatter writes in each round: one at a time where they may share
        bytes (see ``scatter``), else all in one."""
        if not self.caches.spans_may_share_bytes(group_id):
            return [slice(None)]
        return [slice(i, i + 1) for i in range(len(self._spans[group_id]))]

    def _span_table(self, group_id: int) -> SpanTable:
        from hybridkv.transfer.span_kernel import SpanBytes, SpanTable

        spans = [
            SpanBytes(
                address=span.raw.data_ptr(),
                row_stride=span.raw.stride(0) if span.raw.shape[0] > 1 else 0,
                object_offset=span.object_offset,
                num_bytes=span.num_bytes,
            )
            for span in self._spans[group_id]
        ]
        return SpanTable(spans, self.device)


def _use_fused(device: torch.device, fused: bool | None) -> bool:
    """``fused`` if given; else whether the caches are on CUDA, Triton imports and
    ``FUSED_ENV`` is not ``0``."""
    if fused is None:
        setting = os.environ.get(FUSED_ENV, "1")
        if setting not in ("0", "1"):
            raise ValueError(f"{FUSED_ENV}={setting!r}: set it to 0 or 1, or unset it")
        fused = None if setting == "1" else False
    if fused is False or (fused is None and device.type != "cuda"):
        return False
    try:
        import hybridkv.transfer.span_kernel  # noqa: F401
    except ImportError:
        if fused:
            raise
        return False
    return True


class _Turns:
    """The two halves of the chunk taking turns within one call, each on its own stream.

    Entered on the caller's current stream (``main``; the copier's stream on
    CUDA). The side stream first waits for everything ``main`` has queued (the
    compute the call is ordered after, the block ids' upload); on leaving,
    ``main`` waits for everything the side stream queued, so a mark recorded
    on ``main`` afterwards covers the whole call. Half 0 is only ever used on
    ``main`` and half 1 only on the side stream, so a half is reused only after
    its stream finished with it. Without a device stream (CPU tensors) the same
    steps run in order."""

    def __init__(
        self, side: torch.cuda.Stream | None, halves: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        self.side = side
        self.halves = halves
        self.main: torch.cuda.Stream | None = None
        self.device = halves[0].device

    def __enter__(self) -> _Turns:
        if self.side is not None:
            self.main = torch.cuda.current_stream(self.device)
        return self

    def upload(self, ids: npt.NDArray[np.int64]) -> torch.Tensor:
        """The block ids on the device, from pinned memory without a wait (the host
        allocator keeps that memory until the copy is done)."""
        host = torch.from_numpy(np.ascontiguousarray(ids))
        if self.side is None:
            return host.to(self.device)
        index = host.pin_memory().to(self.device, non_blocking=True)
        index.record_stream(self.side)  # freed only after the side stream's use, too
        self.join()
        return index

    def join(self) -> None:
        """Order each stream after all the other queued so far."""
        if self.side is not None and self.main is not None:
            self.side.wait_stream(self.main)
            self.main.wait_stream(self.side)

    @contextmanager
    def take(self, turn: int) -> Iterator[torch.Tensor]:
        """Enqueue piece ``turn`` on its half's stream; yields that half."""
        half = self.halves[turn % 2]
        if self.side is None or turn % 2 == 0:
            yield half
        else:
            with torch.cuda.stream(self.side):
                yield half

    def __exit__(self, *exc: object) -> None:
        if self.side is not None and self.main is not None:
            self.main.wait_stream(self.side)
