"""The staging arena: host memory that block objects pass through on their way to a tier.

Runs in the worker process. Allocated once and touched at start (a first-touch
page fault would otherwise land on the data path), pinned when the KV cache is on CUDA,
and handed out in aligned regions, first fit; freed regions merge with free
neighbours, so a fully freed arena is one region again. Not thread-safe: the
transfer engine calls it under its lock.

The arena starts at the same address modulo a page as the KV caches
(``address_phase``): a copy whose source and destination sit at different
offsets within a cache line or page runs slower than one where they match
(docs/DECISIONS.md), so block rows that share the caches' phase copy at
memcpy speed.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt
import torch

STAGING_ALIGN_BYTES = 64
"""Regions are multiples of this apart (wide-dtype copies need 8)."""
PHASE_BYTES = 4096
"""The arena's start, modulo this, is the caller's ``address_phase``."""


class StagingArena:
    def __init__(
        self, total_bytes: int, *, pin_memory: bool = False, address_phase: int = 0
    ) -> None:
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
            raise ValueError(f"staging total_bytes={total_bytes!r} must be an int > 0")
        if address_phase % 8:
            raise ValueError(f"staging address_phase={address_phase} must be a multiple of 8")
        align = STAGING_ALIGN_BYTES
        self.total_bytes = total_bytes - total_bytes % align
        if self.total_bytes == 0:
            raise ValueError(f"staging total_bytes={total_bytes} must be at least {align}")
        if pin_memory:
            self._tensor = torch.empty(
                self.total_bytes + PHASE_BYTES, dtype=torch.uint8, pin_memory=True
            )
        else:  # numpy's allocator asks for transparent huge pages on big buffers
            self._tensor = torch.from_numpy(
                np.empty(self.total_bytes + PHASE_BYTES, dtype=np.uint8)
            )
        raw: npt.NDArray[np.uint8] = self._tensor.numpy()
        shift = (address_phase - raw.ctypes.data) % PHASE_BYTES
        self.array: npt.NDArray[np.uint8] = raw[shift : shift + self.total_bytes]
        self.array.fill(0)  # first touch now, never on the hot path
        self.tensor = self._tensor[shift : shift + self.total_bytes]
        self._free_offsets: list[int] = [0]  # sorted; parallel to _free_sizes
        self._free_sizes: list[int] = [self.total_bytes]
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    @property
    def num_regions(self) -> int:
        return len(self._used)

    def region_bytes(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` occupies (rounded up to the alignment)."""
        return -(-nbytes // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a region of at least ``nbytes``, or None when none is free."""
        assert nbytes > 0, nbytes
        size = self.region_bytes(nbytes)
        for i, free in enumerate(self._free_sizes):
            if free >= size:
                offset = self._free_offsets[i]
                if free == size:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += size
                    self._free_sizes[i] -= size
                self._used[offset] = size
                self.used_bytes += size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.used_bytes -= size
        i = bisect.bisect(self._free_offsets, offset)
        merge_next = i < len(self._free_offsets) and self._free_offsets[i] == offset + size
        merge_prev = i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset
        if merge_next:
            size += self._free_sizes[i]
            del self._free_offsets[i], self._free_sizes[i]
        if merge_prev:
            self._free_sizes[i - 1] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        return self.array[offset : offset + nbytes]

    def check_integrity(self) -> None:
        regions = sorted(
            [(o, s, "free") for o, s in zip(self._free_offsets, self._free_sizes, strict=True)]
            + [(o, s, "used") for o, s in self._used.items()]
        )
        assert self._free_offsets == sorted(self._free_offsets), "free list out of order"
        position = 0
        previous = ""
        for offset, size, kind in regions:
            assert offset == position, f"gap or overlap at {offset} (expected {position})"
            assert size > 0 and offset % STAGING_ALIGN_BYTES == 0, (offset, size)
            assert not (kind == previous == "free"), f"unmerged free regions at {offset}"
            position += size
            previous = kind
        assert position == self.total_bytes, (position, self.total_bytes)
        assert self.used_bytes == sum(self._used.values()), "used_bytes out of sync"
