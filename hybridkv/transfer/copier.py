"""Batched block copies between canonical KV caches and staging rows.

Runs in the worker process. ``gather`` copies the blocks of one group into
staging rows of ``block_bytes`` (one object per block), consecutive or
``row_stride`` bytes apart (room for a tier's header between them);
``scatter`` copies rows back. There is no Python loop over blocks.

CPU: every copy of a call is one run of bytes (one span of one block), and
all runs go to ``runs.copy_runs`` in one native call, which prefetches the
next run while it copies one (``memcpy`` per block left 4-16 KiB blocks at
0.75-0.85 of one long copy on AMD EPYC; see ``runs``). Runs that continue
each other on both sides (adjacent blocks of a block-major cache, in order)
merge into one. Runs go block by block in object order, so the staging side
is read or written front to back, unless spans of the group may share bytes
(aliased layers): then span by span, the order writes through the per-layer
views would take, so the last layer written wins as it would there.

Block ids become a numpy array once per call with ``np.array`` (cheaper than
``torch.as_tensor`` for a list) and are range-checked before any address is
formed. Copies run on the calling thread only, without the GIL.

CUDA: per-span indexed ops on a side stream that first waits for the compute
stream, device <-> pinned host copies on that stream, and an event the call
waits on before returning, so the bytes are in place when a job is reported.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.layout import BlockSpan, CanonicalKVCaches

Hashes = npt.NDArray[np.uint64]
"""One xxh3-64 per staging row (``runs.Hashes``)."""

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


class _Span(NamedTuple):
    """One span of a group's block, as the CUDA path moves it."""

    src: torch.Tensor
    """(num_blocks, num_bytes // width) view of the KV bytes, widest dtype."""
    object_offset: int
    num_bytes: int
    dtype: torch.dtype


class _Runs(NamedTuple):
    """Where a group's spans lie, for forming a call's runs (CPU)."""

    spans: npt.NDArray[np.int64]
    """(4, num_spans), in object order: address of the span in block 0, bytes from
    one block's span to the next block's, offset in the block object, size."""
    block_order: bool
    """Runs go block by block (no two spans share bytes), else span by span."""


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
        num_groups = caches.layout.num_groups
        self._spans: list[list[_Span]] = []
        self._runs: list[_Runs] = []
        self._stream: torch.cuda.Stream | None = None
        self._native: ModuleType | None = None
        if self.is_cuda:
            self._spans = [
                [self._span(g, span) for span in caches.group_block_spans(g)]
                for g in range(num_groups)
            ]
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        else:
            # Imported here: compiling (or loading) the native copy takes a second or
            # two, which only processes that copy on CPU should pay.
            from hybridkv.transfer import runs

            runs.warm_up()
            self._native = runs
            self._runs = [self._group_runs(g) for g in range(num_groups)]

    def block_bytes(self, group_id: int) -> int:
        return self.caches.layout.groups[group_id].block_bytes

    def copies_per_block(self, group_id: int) -> int:
        """Spans per block: 1 for a block-major group, its layer count otherwise."""
        return len(self.caches.group_block_spans(group_id))

    def copies_block_by_block(self, group_id: int) -> bool:
        """Whether the group's CPU copies go block by block (see module doc)."""
        return self._runs[group_id].block_order

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

    def gather(
        self,
        group_id: int,
        block_ids: Sequence[int],
        out: npt.NDArray[np.uint8],
        *,
        row_stride: int | None = None,
        hashed: bool = False,
    ) -> Hashes | None:
        """Copy blocks into rows of ``out`` (1-D uint8): row ``i`` starts ``i * row_stride``
        bytes in (default ``block_bytes``: consecutive rows); ``out`` ends with the last row.

        ``hashed``: also return each row's xxh3-64 (``tiers.codec.checksum``), taken
        on CPU right after the row is written, while it is in cache."""
        stride = self._check_buffer(group_id, len(block_ids), out, row_stride)
        ids = self._block_index(block_ids)
        if self.is_cuda:
            rows = torch.from_numpy(self._row_view(group_id, len(block_ids), out, stride))
            self._gather_cuda(group_id, torch.from_numpy(ids), rows)
            return self._hash_rows(group_id, len(ids), out, stride) if hashed else None
        return self._copy(
            group_id, ids, np.arange(len(ids)), out, stride, to_staging=True, hashed=hashed
        )

    def scatter(
        self,
        group_id: int,
        block_ids: Sequence[int],
        src: npt.NDArray[np.uint8],
        *,
        only_rows: Sequence[int] | None = None,
        row_stride: int | None = None,
    ) -> None:
        """Copy rows of ``src`` (laid out as ``gather`` writes them) back into the blocks;
        ``only_rows`` picks a subset."""
        stride = self._check_buffer(group_id, len(block_ids), src, row_stride)
        ids = self._block_index(block_ids)
        picked = np.arange(len(ids))
        if only_rows is not None:
            picked = _index(only_rows, len(block_ids), "only_rows")
            ids = ids[picked]
        if self.is_cuda:
            rows = self._row_view(group_id, len(block_ids), src, stride)
            if only_rows is not None:
                rows = rows[picked]
            self._scatter_cuda(group_id, torch.from_numpy(ids), torch.from_numpy(rows))
            return
        self._copy(group_id, ids, picked, src, stride, to_staging=False)

    def _copy(
        self,
        group_id: int,
        ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        staging: npt.NDArray[np.uint8],
        row_stride: int,
        *,
        to_staging: bool,
        hashed: bool = False,
    ) -> Hashes | None:
        """Move block ``ids[i]`` to or from staging row ``rows[i]``, in one native call
        to form the runs and one to copy them (and hash the rows, when ``hashed``)."""
        assert self._native is not None
        plan = self._runs[group_id]
        address = staging.ctypes.data
        runs = self._native.block_runs(
            ids, rows, address, row_stride, plan.spans, plan.block_order, to_staging
        )
        if not hashed:
            self._native.copy_runs(runs)
            return None
        if not plan.block_order:  # span by span: each row is done only at the end
            self._native.copy_runs(runs)
            return self._hash_rows(group_id, len(ids), staging, row_stride)
        row_addresses = address + rows * row_stride
        spans = plan.spans.shape[1]
        block_bytes = self.block_bytes(group_id)
        hashes: Hashes = self._native.copy_runs_hashed(runs, spans, row_addresses, block_bytes)
        return hashes

    def _hash_rows(
        self, group_id: int, num_rows: int, staging: npt.NDArray[np.uint8], row_stride: int
    ) -> Hashes:
        from hybridkv.transfer import runs

        rows = staging.ctypes.data + np.arange(num_rows, dtype=np.int64) * row_stride
        return runs.hash_rows(rows, self.block_bytes(group_id))

    def _span(self, group_id: int, span: BlockSpan) -> _Span:
        block_tensor = self.caches.tensors[span.tensor_idx]
        narrow = block_tensor[:, span.offset_bytes : span.offset_bytes + span.num_bytes]
        _, dtype = _widest(
            narrow.data_ptr(),
            block_tensor.stride(0),
            span.num_bytes,
            span.object_offset_bytes,
            self.block_bytes(group_id),
        )
        return _Span(narrow.view(dtype), span.object_offset_bytes, span.num_bytes, dtype)

    def _group_runs(self, group_id: int) -> _Runs:
        spans = self.caches.group_block_spans(group_id)
        tensors = [self.caches.tensors[s.tensor_idx] for s in spans]
        spans_at = [
            (t.data_ptr() + s.offset_bytes, t.stride(0), s.object_offset_bytes, s.num_bytes)
            for t, s in zip(tensors, spans, strict=True)
        ]
        return _Runs(
            spans=np.array(spans_at, dtype=np.int64).T.copy(),
            block_order=not self._may_share_bytes(group_id),
        )

    def _may_share_bytes(self, group_id: int) -> bool:
        """Whether two spans (of any blocks) of the group may share bytes. False when
        every span has its own storage, or when all have one size and row stride in
        one storage and start on one grid of that size without meeting."""
        spans = self.caches.group_block_spans(group_id)
        tensors = [self.caches.tensors[s.tensor_idx] for s in spans]
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        if len(set(storages)) == len(storages):
            return False
        first, span_bytes = tensors[0], spans[0].num_bytes
        row_stride = first.stride(0) if self.caches.num_blocks > 1 else span_bytes
        if any(
            storage != storages[0]
            or (self.caches.num_blocks > 1 and t.stride(0) != row_stride)
            or s.num_bytes != span_bytes
            for storage, t, s in zip(storages, tensors, spans, strict=True)
        ):
            return True
        starts = [
            int(t.storage_offset()) + s.offset_bytes for t, s in zip(tensors, spans, strict=True)
        ]
        base = min(starts)
        if row_stride % span_bytes or any((start - base) % span_bytes for start in starts):
            return True
        block_step = row_stride // span_bytes
        elements = [(start - base) // span_bytes for start in starts]
        # Blocks b, b' of spans i, j share bytes iff e_i - e_j == (b' - b) * block_step.
        for i, j in itertools.combinations(elements, 2):
            distance = abs(i - j)
            if distance == 0 or (
                distance % block_step == 0 and distance // block_step < self.caches.num_blocks
            ):
                return True
        return False

    def _check_buffer(
        self, group_id: int, num_ids: int, buf: npt.NDArray[np.uint8], row_stride: int | None
    ) -> int:
        """The row stride, after checking ``buf`` holds exactly ``num_ids`` rows."""
        block_bytes = self.block_bytes(group_id)
        stride = block_bytes if row_stride is None else row_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < block_bytes:
            raise ValueError(f"row_stride {row_stride!r} must be an int >= {block_bytes}")
        expected = (num_ids - 1) * stride + block_bytes if num_ids else 0
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != expected:
            raise ValueError(
                f"staging buffer is {buf.dtype} {buf.shape}; expected 1-D uint8 of "
                f"{expected} bytes ({num_ids} rows of {block_bytes} bytes, {stride} apart)"
            )
        if not buf.flags.c_contiguous:
            raise ValueError("staging buffer must be C-contiguous")
        return stride

    def _row_view(
        self, group_id: int, num_ids: int, buf: npt.NDArray[np.uint8], stride: int
    ) -> npt.NDArray[np.uint8]:
        """(num_ids, block_bytes) rows of ``buf``, ``stride`` bytes apart (no copy)."""
        shape = (num_ids, self.block_bytes(group_id))
        return np.lib.stride_tricks.as_strided(buf, shape, (stride, 1), writeable=True)

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
