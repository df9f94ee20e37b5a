"""Batched block copies between canonical KV caches and rows of host memory.

Runs in the worker process. ``gather`` copies the blocks of one group into
rows of host memory of ``block_bytes`` each (one object per block): the CPU
tier's own memory, or staging rows ``row_stride`` bytes apart (room for a
tier's header between them); ``scatter`` copies rows back. There is no
Python loop over blocks.

CPU: every copy of a call is one run of bytes (one span of one block), and
all runs go to ``runs.copy_runs`` in one native call, which prefetches the
next run while it copies one (``memcpy`` per block stalls at the start of
each block; see ``runs``). Runs that continue
each other on both sides (adjacent blocks of a block-major cache, in order)
merge into one. Runs go block by block in object order, so the row side is
read or written front to back, unless spans of the group may share bytes
(aliased layers): then span by span, the order writes through the per-layer
views would take, so the last layer written wins as it would there. Copies
run on the calling thread only, without the GIL.

CUDA: through one bounded chunk of device memory (``chunked``), enqueued on
the copier's own stream: ``gather_at`` and ``scatter_at`` return once the
copies are enqueued, after the stream was told to wait for ``after`` (a
``compute_mark`` taken where the engine's compute stream is current); a
``copies_mark`` says when they are done. ``gather`` and ``scatter`` wait for
them before returning.

Block ids become a numpy array once per call with ``np.array`` (cheaper than
``torch.as_tensor`` for a list) and are range-checked before any address is
formed.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.layout import CanonicalKVCaches
from hybridkv.transfer.chunked import DEVICE_CHUNK_BYTES, ChunkedCopies

Hashes = npt.NDArray[np.uint64]
"""One xxh3-64 per row (``runs.Hashes``)."""

CopyMark = Any
"""A point in a CUDA stream (``torch.cuda.Event``); None where copies are synchronous."""


class HostRows(NamedTuple):
    """Where a call's block objects lie in host memory: row ``i`` at ``memory[offsets[i]:]``."""

    memory: torch.Tensor
    """1-D uint8 CPU tensor (page-locked for asynchronous CUDA copies)."""
    offsets: npt.NDArray[np.int64]
    scratch_gaps: bool = False
    """The bytes between consecutive rows may be overwritten (header room in staging
    that the tier writes after the copy): lets the CUDA path move them in one copy."""


class _Runs(NamedTuple):
    """Where a group's spans lie, for forming a call's runs (CPU)."""

    spans: npt.NDArray[np.int64]
    """(4, num_spans), in object order: address of the span in block 0, bytes from
    one block's span to the next block's, offset in the block object, size."""
    block_order: bool
    """Runs go block by block (no two spans share bytes), else span by span."""


def _index(values: Sequence[int], bound: int, what: str) -> npt.NDArray[np.int64]:
    """``values`` as an int64 array, each in ``[0, bound)`` (else IndexError)."""
    index = np.array(values, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of ints, got shape {index.shape}")
    if len(index) and (index.min() < 0 or index.max() >= bound):
        bad = index[(index < 0) | (index >= bound)]
        raise IndexError(f"{what} {bad[:5].tolist()} not in [0, {bound})")
    return index


def rows_of(buffer: npt.NDArray[np.uint8], num_rows: int, row_stride: int) -> HostRows:
    """Rows ``row_stride`` bytes apart from the start of ``buffer`` (a numpy array)."""
    offsets = np.arange(num_rows, dtype=np.int64) * row_stride
    return HostRows(torch.from_numpy(buffer), offsets)


class BlockCopier:
    """Gathers and scatters blocks of one ``CanonicalKVCaches``; stateless per call.

    ``chunked`` picks the path (default: the chunked one for caches off the
    CPU); ``chunk_bytes`` bounds the device memory that path takes.
    """

    def __init__(
        self,
        caches: CanonicalKVCaches,
        *,
        chunked: bool | None = None,
        chunk_bytes: int = DEVICE_CHUNK_BYTES,
    ) -> None:
        self.caches = caches
        self.device = caches.device
        self.is_cuda = self.device.type == "cuda"
        self.chunked = self.device.type != "cpu" if chunked is None else chunked
        num_groups = caches.model_groups.num_groups
        self._runs: list[_Runs] = []
        self._chunks: ChunkedCopies | None = None
        self._stream: torch.cuda.Stream | None = None
        self._native: ModuleType | None = None
        if self.chunked:
            self._chunks = ChunkedCopies(caches, chunk_bytes)
            self._chunks.warm_up()  # compiled now, not while serving
            if self.is_cuda:
                self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        else:
            if self.device.type != "cpu":
                raise ValueError(f"the native copy needs caches on the CPU, not {self.device}")
            # Imported here: compiling (or loading) the native copy takes a second or
            # two, which only processes that copy on CPU should pay.
            from hybridkv.transfer import runs

            runs.warm_up()
            self._native = runs
            self._runs = [self._group_runs(g) for g in range(num_groups)]

    @property
    def device_bytes(self) -> int:
        """Device memory this copier holds (its chunk); 0 on the native path."""
        return 0 if self._chunks is None else self._chunks.chunk_bytes

    @property
    def is_asynchronous(self) -> bool:
        """Whether ``gather_at``/``scatter_at`` return before their copies are done."""
        return self._stream is not None

    def block_bytes(self, group_id: int) -> int:
        return self.caches.model_groups.groups[group_id].block_bytes

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

    # ---- streams (CUDA; None and no-ops elsewhere) ------------------------------------

    def compute_mark(self) -> CopyMark:
        """A mark after the work queued so far on the calling thread's current stream."""
        if self._stream is None:
            return None
        mark = torch.cuda.Event()  # type: ignore[no-untyped-call]
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def copies_mark(self) -> CopyMark:
        """A mark after every copy enqueued so far: done when it is. A thread waiting
        for it sleeps (a default event would spin a core for the whole copy)."""
        if self._stream is None:
            return None
        mark = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        mark.record(self._stream)
        return mark

    @staticmethod
    def wait_done(mark: CopyMark) -> None:
        """Block the calling thread until ``mark`` is done (the GIL is released)."""
        if mark is not None:
            mark.synchronize()

    def hold_compute(self, mark: CopyMark) -> None:
        """Make the calling thread's current stream wait for ``mark`` (no host wait)."""
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    # ---- copies -------------------------------------------------------------------------

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
        Returns once the bytes are in place.

        ``hashed``: also return each row's xxh3-64 (``tiers.codec.checksum``), taken
        on CPU right after the row is written, while it is in cache."""
        stride = self._check_buffer(group_id, len(block_ids), out, row_stride)
        rows = rows_of(out, len(block_ids), stride)
        hashes = self.gather_at(group_id, block_ids, rows, hashed=hashed)
        self.wait_done(self.copies_mark())
        return hashes

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
        ``only_rows`` picks a subset. Returns once the blocks hold them."""
        stride = self._check_buffer(group_id, len(block_ids), src, row_stride)
        rows = rows_of(src, len(block_ids), stride)
        if only_rows is not None:
            picked = _index(only_rows, len(block_ids), "only_rows")
            block_ids = [block_ids[i] for i in picked.tolist()]
            rows = rows._replace(offsets=rows.offsets[picked])
        self.scatter_at(group_id, block_ids, rows)
        self.wait_done(self.copies_mark())

    def gather_at(
        self,
        group_id: int,
        block_ids: Sequence[int],
        rows: HostRows,
        *,
        after: CopyMark = None,
        hashed: bool = False,
    ) -> Hashes | None:
        """Copy block ``block_ids[i]`` to row ``i``. Asynchronous on CUDA (see module doc),
        after ``after`` (default: the calling thread's current stream), unless ``hashed``:
        then it waits for the bytes to hash them."""
        ids = self._check_rows(group_id, block_ids, rows)
        if self._chunks is None:
            return self._copy(group_id, ids, rows, to_rows=True, hashed=hashed)
        with self._on_stream(after):
            self._chunks.gather(
                group_id, ids, rows.memory, rows.offsets, scratch_gaps=rows.scratch_gaps
            )
        if not hashed:
            return None
        self.wait_done(self.copies_mark())
        return self._hash_rows(group_id, rows)

    def scatter_at(
        self, group_id: int, block_ids: Sequence[int], rows: HostRows, *, after: CopyMark = None
    ) -> None:
        """Copy row ``i`` into block ``block_ids[i]``. Asynchronous on CUDA (see module doc)."""
        ids = self._check_rows(group_id, block_ids, rows)
        if self._chunks is None:
            self._copy(group_id, ids, rows, to_rows=False)
            return
        with self._on_stream(after):
            self._chunks.scatter(
                group_id, ids, rows.memory, rows.offsets, scratch_gaps=rows.scratch_gaps
            )

    def _on_stream(self, after: CopyMark) -> Any:
        """The context the chunked path enqueues in: the copy stream, after ``after``."""
        stream = self._stream
        if stream is None:
            return _NO_STREAM
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            stream.wait_event(after)
        return torch.cuda.stream(stream)

    def _check_rows(
        self, group_id: int, block_ids: Sequence[int], rows: HostRows
    ) -> npt.NDArray[np.int64]:
        """Block ids as int64, after checking every row lies inside ``rows.memory``."""
        ids = self._block_index(block_ids)
        memory, offsets = rows.memory, rows.offsets
        if memory.device.type != "cpu" or memory.dtype != torch.uint8 or memory.dim() != 1:
            raise ValueError(
                f"rows.memory must be a 1-D uint8 CPU tensor, got {memory.dtype} "
                f"{tuple(memory.shape)} on {memory.device}"
            )
        if not memory.is_contiguous():
            raise ValueError("rows.memory must be contiguous")
        if offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) != len(ids):
            raise ValueError(
                f"rows.offsets must be 1-D int64 with one offset per block ({len(ids)}), got "
                f"{offsets.dtype} {offsets.shape}"
            )
        end = len(memory) - self.block_bytes(group_id)
        if len(offsets) and (offsets.min() < 0 or offsets.max() > end):
            raise IndexError(f"rows at offsets outside [0, {end}] of their memory")
        return ids

    def _copy(
        self,
        group_id: int,
        ids: npt.NDArray[np.int64],
        rows: HostRows,
        *,
        to_rows: bool,
        hashed: bool = False,
    ) -> Hashes | None:
        """Move block ``ids[i]`` to or from row ``i``, in one native call to form the runs
        and one to copy them (and hash the rows, when ``hashed``)."""
        assert self._native is not None
        plan = self._runs[group_id]
        addresses = rows.memory.data_ptr() + rows.offsets
        runs = self._native.block_runs(ids, addresses, plan.spans, plan.block_order, to_rows)
        if not hashed:
            self._native.copy_runs(runs)
            return None
        if not plan.block_order:  # span by span: each row is done only at the end
            self._native.copy_runs(runs)
            return self._hash_rows(group_id, rows)
        spans = plan.spans.shape[1]
        block_bytes = self.block_bytes(group_id)
        hashes: Hashes = self._native.copy_runs_hashed(runs, spans, addresses, block_bytes)
        return hashes

    def _hash_rows(self, group_id: int, rows: HostRows) -> Hashes:
        from hybridkv.transfer import runs

        addresses = rows.memory.data_ptr() + rows.offsets
        return runs.hash_rows(addresses, self.block_bytes(group_id))

    def _group_runs(self, group_id: int) -> _Runs:
        spans = self.caches.group_block_spans(group_id)
        tensors = [self.caches.tensors[s.tensor_idx] for s in spans]
        spans_at = [
            (t.data_ptr() + s.offset_bytes, t.stride(0), s.object_offset_bytes, s.num_bytes)
            for t, s in zip(tensors, spans, strict=True)
        ]
        return _Runs(
            spans=np.array(spans_at, dtype=np.int64).T.copy(),
            block_order=not self.caches.spans_may_share_bytes(group_id),
        )

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

    def _block_index(self, block_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        """Block ids as int64; IndexError when one is outside the cache (numpy would
        otherwise wrap a negative id around)."""
        return _index(block_ids, self.caches.num_blocks, "block ids")


class _NoStream:
    """The enqueue context of a path without streams."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_STREAM = _NoStream()
