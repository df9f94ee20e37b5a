"""Block copies between a KV cache on a device and host rows, through one bounded chunk.

Worker process; the path ``BlockCopier`` takes for caches on CUDA (it also
runs on CPU tensors, which is how its logic is tested without a GPU). A call
moves the blocks of one group between the cache and rows of host memory (the
CPU tier's own memory, or staging): per piece of at most ``chunk_bytes``,
indexed ops gather each span of the blocks into the chunk, laid out exactly
as the piece of host rows it fills, and one contiguous copy moves the piece;
a load runs the same steps backwards. So device memory taken is the chunk
(allocated once), whatever the size of a job, and a run of adjacent host rows
costs one copy: per-block copies of 16-64 KiB run at 0.1-0.3 of the link,
one copy of a megabyte or more at its full speed (``docs/ARCHITECTURE.md``).

Rows are adjacent when each starts ``block_bytes`` after the previous one,
or, when the caller says the bytes between rows are scratch (header room in
staging that the tier writes after the copy), a fixed ``pitch`` after it.

On CUDA every op of a call is enqueued on the copier's own stream and the
call returns at once; the caller orders the stream after the compute that
wrote the blocks and learns completion from an event (``BlockCopier``). One
lock keeps the ops of two calls from interleaving on the shared chunk.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.layout import CanonicalKVCaches

DEVICE_CHUNK_BYTES = 32 << 20
"""Default size of the one device buffer a copier allocates."""
MAX_SCRATCH_GAP_BYTES = 4096
"""Scratch between rows that a piece may copy over (staging's header room)."""

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
    address_bits: int
    """The cache-side values a wider view must divide (address, row stride)."""


class ChunkedCopies:
    """Gathers and scatters blocks of ``caches`` through one chunk on their device."""

    def __init__(self, caches: CanonicalKVCaches, chunk_bytes: int = DEVICE_CHUNK_BYTES) -> None:
        largest = max(group.block_bytes for group in caches.model_groups.groups)
        self.chunk_bytes = max(chunk_bytes, largest)
        """Device bytes this copier holds: ``chunk_bytes``, or the largest block if larger."""
        self.caches = caches
        self.device = caches.device
        groups = range(caches.model_groups.num_groups)
        self._spans = [self._group_spans(g) for g in groups]
        self._span_order = [caches.spans_may_share_bytes(g) for g in groups]
        self._chunk = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
        self._lock = threading.Lock()

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
        pieces = plan_pieces(offsets, block_bytes, self.chunk_bytes, scratch_gaps=scratch_gaps)
        with self._lock:
            for piece in pieces:
                rows = self._chunk_rows(piece, block_bytes)
                index = self._index(ids[piece.start : piece.stop])
                for span in self._spans[group_id]:
                    src, dst = self._views(span, rows, piece.pitch)
                    torch.index_select(src, 0, index, out=dst)
                nbytes = piece.num_bytes(block_bytes)
                first = int(offsets[piece.start])
                memory[first : first + nbytes].copy_(self._chunk[:nbytes], non_blocking=True)
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
        layer written wins as it would there; each piece is then read in once a span."""
        block_bytes = self.caches.model_groups.groups[group_id].block_bytes
        pieces = plan_pieces(offsets, block_bytes, self.chunk_bytes, scratch_gaps=scratch_gaps)
        spans = self._spans[group_id]
        rounds = [[span] for span in spans] if self._span_order[group_id] else [spans]
        with self._lock:
            for round_spans in rounds:
                for piece in pieces:
                    nbytes = piece.num_bytes(block_bytes)
                    first = int(offsets[piece.start])
                    self._chunk[:nbytes].copy_(memory[first : first + nbytes], non_blocking=True)
                    rows = self._chunk_rows(piece, block_bytes)
                    index = self._index(ids[piece.start : piece.stop])
                    for span in round_spans:
                        dst, src = self._views(span, rows, piece.pitch)
                        dst.index_copy_(0, index, src)
        return len(pieces)

    def _chunk_rows(self, piece: Piece, block_bytes: int) -> torch.Tensor:
        """(rows, block_bytes) view of the chunk, ``piece.pitch`` bytes apart."""
        num_rows = piece.stop - piece.start
        flat = self._chunk[: num_rows * piece.pitch] if num_rows > 1 else self._chunk[:block_bytes]
        return flat.as_strided((num_rows, block_bytes), (piece.pitch, 1))

    def _index(self, ids: npt.NDArray[np.int64]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(ids)).to(self.device, non_blocking=True)

    @staticmethod
    def _views(span: _Span, rows: torch.Tensor, pitch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The span in the cache and in the chunk rows, as the widest integers both allow."""
        part = rows[:, span.object_offset : span.object_offset + span.num_bytes]
        _, dtype = _width(span.address_bits, pitch, span.object_offset, span.num_bytes)
        return span.raw.view(dtype), part.view(dtype)

    def _group_spans(self, group_id: int) -> list[_Span]:
        spans = []
        for span in self.caches.group_block_spans(group_id):
            tensor = self.caches.tensors[span.tensor_idx]
            raw = tensor[:, span.offset_bytes : span.offset_bytes + span.num_bytes].view(
                torch.uint8
            )
            bits = raw.data_ptr() | (tensor.stride(0) if tensor.shape[0] > 1 else 0)
            spans.append(_Span(raw, span.object_offset_bytes, span.num_bytes, bits))
        return spans
