"""Host memory for tiers and staging: touched arenas and an extent allocator over them.

Any process; no I/O. Arenas are allocated and touched once (first-touch page
faults are slow on small hosts) and pinned when CUDA is present; extents of
an arena are handed out by ``ExtentAllocator``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.tiers.base import Buffer

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 64
"""Extents start on cache-line boundaries."""
PAGE_BYTES = 4096
"""Arenas start on a page boundary, so extent offsets are absolute alignments."""


class ExtentAllocator:
    """Hands out aligned extents of ``[0, total_bytes)``; not thread-safe.

    ``allocate`` reuses a free extent of exactly the rounded size when one
    exists, else splits the smallest free extent that fits (best fit). Freed
    extents merge with free neighbours, so a fully freed arena is one extent.

    ``tracked=False``: the caller keeps each extent's size and hands it to
    ``free``; the allocator then keeps nothing per allocated extent (a dict entry
    per stored object, in a CPU tier of millions of them).
    """

    def __init__(self, total_bytes: int, *, align: int = ALIGN_BYTES, tracked: bool = True) -> None:
        self.align = align
        self.total_bytes = total_bytes - total_bytes % align
        self.tracked = tracked
        self._free_by_offset: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._free_by_size: dict[int, set[int]] = {}
        self._allocated: dict[int, int] = {}
        """offset -> size of each allocated extent, when ``tracked``."""
        self.allocated_bytes = 0
        if self.total_bytes > 0:
            self._add_free(0, self.total_bytes)

    def rounded(self, num_bytes: int) -> int:
        return max(self.align, -(-num_bytes // self.align) * self.align)

    def allocate(self, num_bytes: int) -> int | None:
        """Offset of a new extent of at least ``num_bytes``, or None if none fits."""
        size = self.rounded(num_bytes)
        exact = self._free_by_size.get(size)
        if exact:
            offset = next(iter(exact))
            self._remove_free(offset)
        else:
            fits = [free_size for free_size in self._free_by_size if free_size > size]
            if not fits:
                return None
            offset = next(iter(self._free_by_size[min(fits)]))
            free_size = self._remove_free(offset)
            self._add_free(offset + size, free_size - size)
        if self.tracked:
            self._allocated[offset] = size
        self.allocated_bytes += size
        return offset

    def free(self, offset: int, num_bytes: int = 0) -> None:
        """Free the extent at ``offset``; untracked, ``num_bytes`` is the size it was
        allocated for."""
        size = self._allocated.pop(offset) if self.tracked else self.rounded(num_bytes)
        self.allocated_bytes -= size
        end = offset + size
        if end in self._free_by_offset:
            size += self._remove_free(end)
        left = self._free_by_end.get(offset)
        if left is not None:
            size += self._remove_free(left)
            offset = left
        self._add_free(offset, size)

    def split(self, offset: int, sizes: Sequence[int]) -> list[int]:
        """Cut the allocated extent at ``offset`` into adjacent extents of ``sizes`` (each
        rounded; together exactly the extent's size); returns their offsets."""
        rounded = [self.rounded(size) for size in sizes]
        if self.tracked and self._allocated.get(offset) != sum(rounded):
            raise ValueError(f"extent at {offset} is not {sum(rounded)} allocated bytes")
        offsets = list(itertools.accumulate(rounded[:-1], initial=offset))
        if self.tracked:
            for start, size in zip(offsets, rounded, strict=True):
                self._allocated[start] = size
        return offsets

    def allocated(self) -> dict[int, int]:
        """offset -> size of every allocated extent (a copy; tracked only)."""
        assert self.tracked, "an untracked allocator keeps no extents"
        return dict(self._allocated)

    def _add_free(self, offset: int, size: int) -> None:
        self._free_by_offset[offset] = size
        self._free_by_end[offset + size] = offset
        self._free_by_size.setdefault(size, set()).add(offset)

    def _remove_free(self, offset: int) -> int:
        size = self._free_by_offset.pop(offset)
        del self._free_by_end[offset + size]
        same_size = self._free_by_size[size]
        same_size.discard(offset)
        if not same_size:
            del self._free_by_size[size]
        return size

    def check_integrity(self, allocated: dict[int, int] | None = None) -> None:
        """``allocated``: offset -> size of each allocated extent, for an untracked one."""
        if allocated is None:
            assert self.tracked, "an untracked allocator checks the extents it is given"
            allocated = self._allocated
        extents = sorted([*allocated.items(), *self._free_by_offset.items()])
        position = 0
        for offset, size in extents:
            assert offset == position, f"gap or overlap at {position}: next extent at {offset}"
            assert size > 0 and offset % self.align == 0 and size % self.align == 0
            position = offset + size
        assert position == self.total_bytes, f"extents cover {position} of {self.total_bytes}"
        assert self.allocated_bytes == sum(allocated.values())
        for offset, size in self._free_by_offset.items():
            assert self._free_by_end[offset + size] == offset
            assert offset in self._free_by_size[size]
            assert offset + size not in self._free_by_offset, "adjacent free extents not merged"
        assert len(self._free_by_end) == len(self._free_by_offset)
        assert sum(map(len, self._free_by_size.values())) == len(self._free_by_offset)


def allocate_arena(num_bytes: int, *, pin_memory: bool | None) -> tuple[Buffer, object | None]:
    """A touched uint8 arena; pinned (page-locked) when asked or, for None, when CUDA is up.

    Returns the array and the object that owns its memory (a torch tensor when
    pinned) which must stay referenced as long as the array is used.
    """
    if pin_memory is not False:
        import torch

        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise ValueError("pin_memory=True needs CUDA, which is not available; use null (auto)")
        if cuda:
            tensor = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
            arena: Buffer = tensor.numpy()
            arena.fill(0)
            return arena, tensor
    # numpy aligns to 16 bytes only; copies into destinations off a page
    # boundary run slower (bench_tiers), so start the arena on one.
    raw = np.empty(num_bytes + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    arena = raw[start : start + num_bytes]
    arena.fill(0)  # first touch now, not on the data path
    return arena, None


def arena_tensor(arena: Buffer, owner: object | None) -> torch.Tensor:
    """``allocate_arena``'s pinned owner, else a tensor over the same memory (the same
    page-aligned start)."""
    import torch

    return owner if isinstance(owner, torch.Tensor) else torch.from_numpy(arena)
