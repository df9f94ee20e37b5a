"""Batched block copies between canonical KV caches and staging rows.

Runs in the worker process. ``gather`` copies the blocks of one group into
consecutive staging rows of ``block_bytes`` (one object per block); ``scatter``
copies rows back. There is no Python loop over blocks.

CPU, grid path: when every span of a group has the same size and starts on one
grid of that size in one storage (block-major rows as wide as the group block;
layer-major slots as wide as the page, as ``allocate_kv_caches`` and vLLM's
one-buffer caches lay them out), the cache is viewed as one 1-D array of
span-sized ``void`` elements, and a whole call is one ``np.take(out=...)``
(gather) or ``np.put`` (scatter) over element indices (block id times the row
step, plus each span's start, precomputed), block by block in object order.
Each element is one ``memcpy``, which beats ``torch.index_select``'s copy
loop on small spans, and one op per call instead of one per layer is what
counts with few blocks per call (``benchmarks/bench_transfer.py``). Spans
that would share an element (aliased layers) never take this path, so both
paths write in the same order.

CPU, general path (a tensor per layer, padded rows, slots of different row
strides): each span moves all requested blocks in one indexed op, viewed as the
widest integer type the alignment allows: gather with
``torch.index_select(out=...)``, scatter with numpy assignment over whole-span
``void`` elements (one memcpy per block and span).

Block ids become a numpy array once per call with ``np.array`` (cheaper than
``torch.as_tensor`` for a list) and are range-checked (numpy would wrap a
negative id). Copies run on the calling thread only.

CUDA: per-span indexed ops on a side stream that first waits for the compute
stream, device <-> pinned host copies on that stream, and an event the call
waits on before returning, so the bytes are in place when a job is reported.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.layout import BlockSpan, CanonicalKVCaches

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


class _Span(NamedTuple):
    src: torch.Tensor
    """(num_blocks, num_bytes // width) view of the KV bytes, widest dtype."""
    src_bytes: torch.Tensor
    """The same bytes as int8, for staging buffers not aligned to ``width``."""
    rows: npt.NDArray[np.void] | None
    """(num_blocks,) numpy view, one ``void`` element per block (CPU only)."""
    object_offset: int
    num_bytes: int
    width: int
    dtype: torch.dtype


class _Grid(NamedTuple):
    """A group whose spans all start on one grid of ``span_bytes`` in one storage."""

    chunks: npt.NDArray[np.void]
    """1-D contiguous numpy view, one ``void`` element per ``span_bytes`` of the grid."""
    block_step: int
    """Elements from one block's span to the next block's."""
    span_starts: npt.NDArray[np.int64]
    """(num_spans,) element of each span of block 0, in object order."""
    span_bytes: int


def _widest(*values: int) -> tuple[int, torch.dtype]:
    """The widest integer type whose size divides every value (addresses, strides, sizes)."""
    combined = 0
    for value in values:
        combined |= value
    return next((w, d) for w, d in _WIDE if combined % w == 0)


def _index(values: Sequence[int], bound: int, what: str) -> npt.NDArray[np.int64]:
    """``values`` as an int64 array, each in ``[0, bound)`` (else IndexError)."""
    index = np.array(values, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of ints, got shape {index.shape}")
    if len(index) and (index.min() < 0 or index.max() >= bound):
        bad = index[(index < 0) | (index >= bound)]
        raise IndexError(f"{what} {bad[:5].tolist()} not in [0, {bound})")
    return index


class BlockCopier:
    """Gathers and scatters blocks of one ``CanonicalKVCaches``; stateless per call."""

    def __init__(self, caches: CanonicalKVCaches) -> None:
        self.caches = caches
        self.device = caches.device
        self.is_cuda = self.device.type == "cuda"
        self._spans = [
            [self._span(g, span) for span in caches.group_block_spans(g)]
            for g in range(caches.layout.num_groups)
        ]
        self._grids = [
            None if self.is_cuda else self._grid(g) for g in range(caches.layout.num_groups)
        ]
        self._stream: torch.cuda.Stream | None = None
        if self.is_cuda:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def block_bytes(self, group_id: int) -> int:
        return self.caches.layout.groups[group_id].block_bytes

    def copies_per_block(self, group_id: int) -> int:
        """Spans per block: 1 for a block-major group, its layer count otherwise."""
        return len(self._spans[group_id])

    def uses_grid(self, group_id: int) -> bool:
        """Whether the group's CPU copies take the one-op grid path (see module doc)."""
        return self._grids[group_id] is not None

    def check_block_ids(self, group_id: int, block_ids: Sequence[int]) -> str | None:
        """A problem with the block ids, or None when all are valid and distinct."""
        num_blocks = self.caches.num_blocks
        bad = [b for b in block_ids if isinstance(b, bool) or not isinstance(b, int | np.integer)]
        if bad:
            return f"group {group_id}: block ids {bad[:5]} are not ints"
        out_of_range = [int(b) for b in block_ids if not 0 <= b < num_blocks]
        if out_of_range:
            return f"group {group_id}: block ids {out_of_range[:5]} not in [0, {num_blocks})"
        if len(set(block_ids)) != len(block_ids):
            return f"group {group_id}: block ids {list(block_ids)} has duplicates"
        return None

    def gather(self, group_id: int, block_ids: Sequence[int], out: npt.NDArray[np.uint8]) -> None:
        """Copy blocks into ``out`` (1-D uint8, ``len(block_ids) * block_bytes``)."""
        self._check_buffer(group_id, len(block_ids), out)
        ids = self._block_index(block_ids)
        grid = self._grids[group_id]
        if grid is not None:
            # "clip" never clips (ids are checked); "raise" would copy ``out`` first.
            rows_void = out.view(np.dtype((np.void, grid.span_bytes)))
            np.take(grid.chunks, self._chunk_index(grid, ids), out=rows_void, mode="clip")
            return
        idx = torch.from_numpy(ids)
        rows = torch.from_numpy(out).view(len(block_ids), self.block_bytes(group_id))
        if self.is_cuda:
            self._gather_cuda(group_id, idx, rows)
            return
        address = out.ctypes.data
        for span in self._spans[group_id]:
            dst = rows[:, span.object_offset : span.object_offset + span.num_bytes]
            if address % span.width == 0:
                torch.index_select(span.src, 0, idx, out=dst.view(span.dtype))
            else:
                torch.index_select(span.src_bytes, 0, idx, out=dst.view(torch.int8))

    def scatter(
        self,
        group_id: int,
        block_ids: Sequence[int],
        src: npt.NDArray[np.uint8],
        *,
        only_rows: Sequence[int] | None = None,
    ) -> None:
        """Copy rows of ``src`` back into the blocks; ``only_rows`` picks a subset."""
        self._check_buffer(group_id, len(block_ids), src)
        ids = self._block_index(block_ids)
        rows = src.reshape(len(block_ids), self.block_bytes(group_id))
        if only_rows is not None:
            pick = _index(only_rows, len(block_ids), "only_rows")
            rows, ids = rows[pick], ids[pick]
        if self.is_cuda:
            self._scatter_cuda(group_id, torch.from_numpy(ids), torch.from_numpy(rows))
            return
        grid = self._grids[group_id]
        if grid is not None:
            rows_void = rows.view(np.dtype((np.void, grid.span_bytes))).reshape(-1)
            np.put(grid.chunks, self._chunk_index(grid, ids), rows_void)
            return
        for span in self._spans[group_id]:
            assert span.rows is not None
            part = rows[:, span.object_offset : span.object_offset + span.num_bytes]
            span.rows[ids] = part.view(np.dtype((np.void, span.num_bytes)))[:, 0]

    def _span(self, group_id: int, span: BlockSpan) -> _Span:
        block_tensor = self.caches.tensors[span.tensor_idx]
        narrow = block_tensor[:, span.offset_bytes : span.offset_bytes + span.num_bytes]
        width, dtype = _widest(
            narrow.data_ptr(),
            block_tensor.stride(0),
            span.num_bytes,
            span.object_offset_bytes,
            self.block_bytes(group_id),
        )
        rows = None
        if not self.is_cuda:
            rows = narrow.numpy().view(np.dtype((np.void, span.num_bytes)))[:, 0]
        return _Span(
            narrow.view(dtype), narrow, rows, span.object_offset_bytes, span.num_bytes, width, dtype
        )

    def _grid(self, group_id: int) -> _Grid | None:
        """The group's spans as elements of one grid of ``span_bytes`` over one storage,
        or None when they differ in size, storage or row stride, start off the grid, or
        would share an element (so the general path keeps its exact behaviour)."""
        spans = self.caches.group_block_spans(group_id)
        tensors = [self.caches.tensors[s.tensor_idx] for s in spans]
        first, span_bytes = tensors[0], spans[0].num_bytes
        row_stride = first.stride(0) if self.caches.num_blocks > 1 else span_bytes
        storage = first.untyped_storage().data_ptr()
        if any(
            t.untyped_storage().data_ptr() != storage
            or (self.caches.num_blocks > 1 and t.stride(0) != row_stride)
            or s.num_bytes != span_bytes
            for t, s in zip(tensors, spans, strict=True)
        ):
            return None
        starts = [
            int(t.storage_offset()) + s.offset_bytes for t, s in zip(tensors, spans, strict=True)
        ]
        base = min(starts)
        if row_stride % span_bytes or any((start - base) % span_bytes for start in starts):
            return None
        block_step = row_stride // span_bytes
        elements = [(start - base) // span_bytes for start in starts]
        # Blocks b, b' of spans i, j share an element iff e_i - e_j == (b' - b) * block_step.
        for i, j in itertools.combinations(elements, 2):
            distance = abs(i - j)
            if distance == 0 or (
                distance % block_step == 0 and distance // block_step < self.caches.num_blocks
            ):
                return None
        length = (self.caches.num_blocks - 1) * block_step + max(elements) + 1
        flat = first.as_strided((length * span_bytes,), (1,), base)
        chunks = flat.numpy().view(np.dtype((np.void, span_bytes)))
        return _Grid(chunks, block_step, np.array(elements, dtype=np.int64), span_bytes)

    @staticmethod
    def _chunk_index(grid: _Grid, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Grid elements of the requested blocks' spans, block by block in object order."""
        if len(grid.span_starts) == 1 and grid.block_step == 1:
            return ids + grid.span_starts[0] if grid.span_starts[0] else ids
        return (ids[:, None] * grid.block_step + grid.span_starts).reshape(-1)

    def _check_buffer(self, group_id: int, num_ids: int, buf: npt.NDArray[np.uint8]) -> None:
        block_bytes = self.block_bytes(group_id)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != num_ids * block_bytes:
            raise ValueError(
                f"staging buffer is {buf.dtype} {buf.shape}; expected 1-D uint8 of "
                f"{num_ids} blocks x {block_bytes} bytes"
            )
        if not buf.flags.c_contiguous:
            raise ValueError("staging buffer must be C-contiguous")

    def _block_index(self, block_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        """Block ids as int64; IndexError when one is outside the cache (numpy would
        otherwise wrap a negative id around)."""
        return _index(block_ids, self.caches.num_blocks, "block ids")

    def _gather_cuda(self, group_id: int, idx: torch.Tensor, rows: torch.Tensor) -> None:
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            idx_dev = idx.to(self.device, non_blocking=True)
            obj = torch.empty(rows.shape, dtype=torch.uint8, device=self.device)
            for span in self._spans[group_id]:
                part = obj[:, span.object_offset : span.object_offset + span.num_bytes]
                torch.index_select(span.src, 0, idx_dev, out=part.view(span.dtype))
            rows.copy_(obj, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        done.synchronize()

    def _scatter_cuda(self, group_id: int, idx: torch.Tensor, rows: torch.Tensor) -> None:
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            idx_dev = idx.to(self.device, non_blocking=True)
            obj = rows.to(self.device, non_blocking=True)
            for span in self._spans[group_id]:
                part = obj[:, span.object_offset : span.object_offset + span.num_bytes]
                span.src.index_copy_(0, idx_dev, part.view(span.dtype))
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        done.synchronize()
