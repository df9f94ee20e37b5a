"""The CPU tier: a bounded, LRU-evicted object store in one preallocated arena.

Runs in the worker process. Objects live in extents of one arena
(``tiers.memory``; free extents indexed by exact size, so the few object
sizes of a model's groups reuse each other's slots), never in fresh memory; which
extent holds what is ``tiers.cpu_index``'s. Blocks are copied in and out
through buffers (``put_many``, ``get_many_into``) or, by the transfer engine,
in place (``memory()``).

No checksums here: the arena is process memory, trusted like the KV cache
itself, and a transfer writing in place leaves no moment to take one. Blocks
are checksummed where they leave the process (disk and pool tiers); a stored
object of another size is still CORRUPT.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, StrictBool
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, ByteSize
from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierChanges,
    TierMedium,
    TierMemory,
    TierReach,
    TierStats,
    TierUsage,
    check_batch,
    check_sizes,
)
from hybridkv.tiers.config import LoadWeight, TierConfigBase
from hybridkv.tiers.cpu_index import ArenaIndex, Outstanding, Slot
from hybridkv.tiers.memory import ALIGN_BYTES, allocate_arena

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class CpuConfig(TierConfigBase):
    """``kind: cpu``: CPU memory of the worker process."""

    kind: Literal["cpu"] = "cpu"
    capacity_bytes: Annotated[
        ByteSize, Field(ge=ALIGN_BYTES, description="size of the memory arena")
    ]
    load_weight: LoadWeight = 1.0
    pin_memory: Annotated[
        StrictBool | None, Field(description="page-lock the arena; null: when CUDA is available")
    ] = None

    reach: ClassVar[TierReach] = TierReach.PROCESS
    medium: ClassVar[TierMedium] = TierMedium.MEMORY

    def build(self) -> CpuTier:
        return CpuTier(self)


class CpuTier(Tier):
    """Objects in one arena; least recently used (put, hit or borrow) evicted first.

    Thread-safe: one lock guards the index and the copies (a copy of a block is
    microseconds; holding the lock keeps an evicted extent from being overwritten
    while it is read). In-place access (``memory()``, the ``TierMemory`` calls
    below) copies outside the lock: a reserved or borrowed extent is never reused.
    """

    accepts_promotions = True

    def __init__(self, config: CpuConfig, *, name: str = "cpu") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.capacity_bytes = config.capacity_bytes
        self._arena, self._arena_owner = allocate_arena(
            config.capacity_bytes, pin_memory=config.pin_memory
        )
        self._tensor: torch.Tensor | None = None
        self._index = ArenaIndex(config.capacity_bytes)
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._closed = False
        self._memory = _CpuMemory(self)

    @property
    def is_pinned(self) -> bool:
        return self._arena_owner is not None

    def memory(self) -> TierMemory:
        return self._memory

    @property
    def arena(self) -> torch.Tensor:
        """The arena as a 1-D uint8 tensor: the pinned owner, or a view made on first use
        (so a tier that is never read in place never imports torch)."""
        with self._lock:
            self._check_open()
            if self._tensor is None:
                self._tensor = _as_tensor(self._arena, self._arena_owner)
            return self._tensor

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            found = [self._index.find(key) is not None for key in keys]
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
        return found

    # Through buffers ---------------------------------------------------------------

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Copy each buffer in; ``checksums`` are not kept (see the module docstring)."""
        check_batch(keys, buffers, checksums)
        with self._lock:
            self._check_open()
            return [self._put(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def _put(self, key: StoreKey, buf: Buffer) -> PutStatus:
        offset = self._reserve(key, len(buf))
        if isinstance(offset, PutStatus):
            return offset
        np.copyto(self._arena[offset : offset + len(buf)], buf)
        self._commit(key, True, num_borrows=0)
        return PutStatus.OK

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        with self._lock:
            self._check_open()
            return [self._get(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def _get(self, key: StoreKey, buf: Buffer) -> GetStatus:
        slot = self._find(key, len(buf))
        if isinstance(slot, GetStatus):
            return slot
        np.copyto(buf, self._arena[slot.offset : slot.offset + slot.num_bytes])
        self._index.touch(key)
        self._count_get(slot)
        return GetStatus.OK

    # In place (TierMemory) -----------------------------------------------------------

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        """See ``TierMemory.reserve_many``."""
        check_sizes(keys, sizes)
        with self._lock:
            self._check_open()
            answers: list[int | PutStatus | None] = [None] * len(keys)
            new: dict[StoreKey, int] = {}  # keys no one holds, at their first sight
            for j, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if key in new:
                    answers[j] = PutStatus.EXISTS  # reserved below, for its first sight
                elif self._index.knows(key):
                    answers[j] = self._reserve(key, int(size))  # EXISTS or FULL
                else:
                    new[key] = int(size)
            # One run for the new objects when the arena has it: a device copies it at once.
            run = self._index.reserve_run(list(new), list(new.values())) if len(new) > 1 else None
            offsets = dict(zip(new, run, strict=True)) if run is not None else {}
            for j, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if answers[j] is None:
                    answers[j] = offsets[key] if key in offsets else self._reserve(key, int(size))
            return [answer for answer in answers if answer is not None]

    def commit_many(
        self, keys: Sequence[StoreKey], written: Sequence[bool], *, num_borrows: int = 0
    ) -> None:
        """See ``TierMemory.commit_many``."""
        if num_borrows < 0:
            raise ValueError(f"num_borrows={num_borrows}: must be >= 0")
        with self._lock:
            self._check_open()
            self._index.check_commits(keys, written)
            for key, was_written in zip(keys, written, strict=True):
                self._commit(key, bool(was_written), num_borrows)

    def borrow_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | GetStatus]:
        """See ``TierMemory.borrow_many``."""
        check_sizes(keys, sizes)
        with self._lock:
            self._check_open()
            return [self._borrow(key, int(size)) for key, size in zip(keys, sizes, strict=True)]

    def release_many(self, keys: Sequence[StoreKey]) -> None:
        """See ``TierMemory.release_many``."""
        with self._lock:
            self._check_open()
            self._index.check_releases(keys)
            for key in keys:
                self._index.release(key)

    def _reserve(self, key: StoreKey, num_bytes: int) -> int | PutStatus:
        answer = self._index.reserve(key, num_bytes)
        if answer is PutStatus.FULL:
            self._stats.put_skipped_full += 1
        return answer

    def _commit(self, key: StoreKey, written: bool, num_borrows: int) -> None:
        slot = self._index.commit(key, written, num_borrows)
        if slot is not None:
            self._stats.puts += 1
            self._stats.put_bytes += slot.num_bytes

    def _borrow(self, key: StoreKey, num_bytes: int) -> int | GetStatus:
        slot = self._find(key, num_bytes)
        if isinstance(slot, GetStatus):
            return slot
        self._index.borrow(key)
        self._count_get(slot)
        return slot.offset

    def _find(self, key: StoreKey, num_bytes: int) -> Slot | GetStatus:
        """The stored object, if it has ``num_bytes``; one of another size is dropped."""
        slot = self._index.find(key)
        if slot is None:
            return GetStatus.MISS
        if slot.num_bytes != num_bytes:
            logger.warning(
                "cpu tier %s: object %s is corrupt (stored %d bytes, asked %d); dropped",
                self.name,
                key,
                slot.num_bytes,
                num_bytes,
            )
            self._stats.corrupt += 1
            self._index.drop(key)
            return GetStatus.CORRUPT
        return slot

    def _count_get(self, slot: Slot) -> None:
        self._stats.gets += 1
        self._stats.get_bytes += slot.num_bytes

    # Bookkeeping ---------------------------------------------------------------------

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        """Remove stored keys (a borrowed one keeps its bytes until released); reservations
        are left alone."""
        with self._lock:
            self._check_open()
            present = [key for key in dict.fromkeys(keys) if self._index.find(key) is not None]
            for key in present:
                self._index.drop(key)
        return len(present)

    def log_changes(self, changes: TierChanges) -> bool:
        """Commits, evictions, deletes and corrupt drops, recorded under this tier's lock."""
        with self._lock:
            self._check_open()
            self._index.changes = changes
        return True

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                num_objects=len(self._index.stored),
                used_bytes=self._index.used_bytes,
                capacity_bytes=self.capacity_bytes,
            )

    def stats(self) -> TierStats:
        with self._lock:
            stats = TierStats(**self._stats.as_dict())
            stats.evictions = self._index.num_evictions
        return stats

    def keys_lru_order(self) -> list[StoreKey]:
        """Stored keys, least recently used first (evicted first unless borrowed)."""
        with self._lock:
            return list(self._index.stored)

    def outstanding(self) -> Outstanding:
        """Reservations and borrows not yet ended."""
        with self._lock:
            return self._index.outstanding()

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            assert self._index.used_bytes <= self.capacity_bytes

    def close(self) -> None:
        """Drop every object, reservation and borrow (callers stopped first)."""
        with self._lock:
            self._closed = True
            self._index = ArenaIndex(0)
            self._arena = np.empty(0, dtype=np.uint8)
            self._arena_owner = None
            self._tensor = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"cpu tier {self.name} is closed")


def _as_tensor(arena: Buffer, owner: object | None) -> torch.Tensor:
    """The arena's pinned owner, else a tensor over the same memory (same page-aligned start)."""
    import torch

    return owner if isinstance(owner, torch.Tensor) else torch.from_numpy(arena)


class _CpuMemory(TierMemory):
    """``CpuTier.memory()``: its arena and its in-place calls (a ``Tier`` cannot itself be
    a ``TierMemory``: both name a ``memory``)."""

    def __init__(self, tier: CpuTier) -> None:
        self._tier = tier

    @property
    def memory(self) -> torch.Tensor:
        return self._tier.arena

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        return self._tier.reserve_many(keys, sizes)

    def commit_many(
        self, keys: Sequence[StoreKey], written: Sequence[bool], *, num_borrows: int = 0
    ) -> None:
        self._tier.commit_many(keys, written, num_borrows=num_borrows)

    def borrow_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | GetStatus]:
        return self._tier.borrow_many(keys, sizes)

    def release_many(self, keys: Sequence[StoreKey]) -> None:
        self._tier.release_many(keys)
