"""Batched block copies between canonical KV caches and staging rows.

Runs in the worker process. ``gather`` copies the blocks of one group into
consecutive staging rows of ``block_bytes`` (one object per block); ``scatter``
copies rows back. Each span of a group (one per block-major group, one per
layer otherwise) moves all requested blocks in one indexed op, viewed as the
widest integer type the alignment allows: no Python loop over blocks.

CPU: gather with ``torch.index_select(out=...)``, scatter with numpy
assignment over whole-span ``void`` elements (one memcpy per block and span).
CUDA: indexed ops on a side stream that first waits for the compute stream,
device <-> pinned host copies on that stream, and an event the call waits on
before returning, so the bytes are in place when a job is reported.
"""

from __future__ import annotations

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
        self._stream: torch.cuda.Stream | None = None
        if self.is_cuda:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def block_bytes(self, group_id: int) -> int:
        return self.caches.layout.groups[group_id].block_bytes

    def copies_per_block(self, group_id: int) -> int:
        """Spans per block: 1 for a block-major group, its layer count otherwise."""
        return len(self._spans[group_id])

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
        rows, idx = self._prepare(group_id, block_ids, out)
        if self.is_cuda:
            self._gather_cuda(group_id, idx, rows)
            return
        aligned = out.ctypes.data % 8 == 0
        for span in self._spans[group_id]:
            dst = rows[:, span.object_offset : span.object_offset + span.num_bytes]
            if aligned:
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
        rows, idx = self._prepare(group_id, block_ids, src)
        if only_rows is not None:
            pick = torch.as_tensor(list(only_rows), dtype=torch.int64)
            rows, idx = rows.index_select(0, pick), idx.index_select(0, pick)
        if self.is_cuda:
            self._scatter_cuda(group_id, idx, rows)
            return
        ids = idx.numpy()
        for span in self._spans[group_id]:
            assert span.rows is not None
            part = rows.numpy()[:, span.object_offset : span.object_offset + span.num_bytes]
            span.rows[ids] = part.view(np.dtype((np.void, span.num_bytes)))[:, 0]

    def _span(self, group_id: int, span: BlockSpan) -> _Span:
        block_tensor = self.caches.tensors[span.tensor_idx]
        narrow = block_tensor[:, span.offset_bytes : span.offset_bytes + span.num_bytes]
        layout = (
            narrow.data_ptr()
            | block_tensor.stride(0)
            | span.num_bytes
            | span.object_offset_bytes
            | self.block_bytes(group_id)
        )
        width, dtype = next((w, d) for w, d in _WIDE if layout % w == 0)
        rows = None
        if not self.is_cuda:
            rows = narrow.numpy().view(np.dtype((np.void, span.num_bytes)))[:, 0]
        return _Span(
            narrow.view(dtype), narrow, rows, span.object_offset_bytes, span.num_bytes, width, dtype
        )

    def _prepare(
        self, group_id: int, block_ids: Sequence[int], buf: npt.NDArray[np.uint8]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block_bytes = self.block_bytes(group_id)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != len(block_ids) * block_bytes:
            raise ValueError(
                f"staging buffer is {buf.dtype} {buf.shape}; expected 1-D uint8 of "
                f"{len(block_ids)} blocks x {block_bytes} bytes"
            )
        if not buf.flags.c_contiguous:
            raise ValueError("staging buffer must be C-contiguous")
        rows = torch.from_numpy(buf).view(len(block_ids), block_bytes)
        return rows, torch.as_tensor(list(block_ids), dtype=torch.int64)

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
