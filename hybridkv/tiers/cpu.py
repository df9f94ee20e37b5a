"""The CPU tier: a bounded, LRU-evicted object store in one preallocated arena.

Runs in the worker process. Objects are copied into extents of one arena
(``tiers.memory``; free extents indexed by exact size, so the few object
sizes of a KV layout reuse each other's slots), never into fresh memory.
Each entry keeps an xxh3-64 checksum that ``get_many_into`` verifies before
copying out.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import Field, StrictBool
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, ByteSize, Number
from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierConfigBase,
    TierMedium,
    TierReach,
    TierStats,
    TierUsage,
    check_batch,
)
from hybridkv.tiers.codec import checksum
from hybridkv.tiers.memory import ALIGN_BYTES, ExtentAllocator, allocate_arena

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class CpuConfig(TierConfigBase):
    """``kind: cpu``: CPU memory of the worker process."""

    kind: Literal["cpu"] = "cpu"
    capacity_bytes: Annotated[
        ByteSize, Field(ge=ALIGN_BYTES, description="size of the memory arena")
    ]
    load_weight: Annotated[
        Number, Field(gt=0, allow_inf_nan=False, description="relative cost of loading from it")
    ] = 1.0
    pin_memory: Annotated[
        StrictBool | None, Field(description="page-lock the arena; null: when CUDA is available")
    ] = None

    reach: ClassVar[TierReach] = TierReach.PROCESS
    medium: ClassVar[TierMedium] = TierMedium.MEMORY


class _Entry(NamedTuple):
    offset: int
    num_bytes: int
    checksum: int


class CpuTier(Tier):
    """Objects in one arena; least recently used (put or hit) evicted first.

    Thread-safe: one lock guards the index and the copies (a copy of a block
    is microseconds; holding the lock keeps an evicted extent from being
    overwritten while it is read).
    """

    accepts_promotions = True

    def __init__(self, config: CpuConfig, *, name: str = "cpu") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.capacity_bytes = config.capacity_bytes
        self._arena, self._arena_owner = allocate_arena(
            config.capacity_bytes, pin_memory=config.pin_memory
        )
        self._allocator = ExtentAllocator(config.capacity_bytes)
        self._entries: OrderedDict[StoreKey, _Entry] = OrderedDict()
        self._used_bytes = 0
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def is_pinned(self) -> bool:
        return self._arena_owner is not None

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            found = [key in self._entries for key in keys]
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
            self._stats.misses += len(keys) - sum(found)
        return found

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        check_batch(keys, buffers, checksums)
        with self._lock:
            self._check_open()
            values = [None] * len(keys) if checksums is None else checksums
            return [
                self._put(key, buf, value)
                for key, buf, value in zip(keys, buffers, values, strict=True)
            ]

    def _put(self, key: StoreKey, buf: Buffer, value: int | None) -> PutStatus:
        """Copy ``buf`` in; ``value`` is its checksum when the caller took it."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return PutStatus.EXISTS
        offset = self._make_room(len(buf))
        if offset is None:
            self._stats.put_skipped_full += 1
            return PutStatus.FULL
        stored = self._arena[offset : offset + len(buf)]
        np.copyto(stored, buf)
        self._entries[key] = _Entry(offset, len(buf), checksum(stored) if value is None else value)
        self._used_bytes += len(buf)
        self._stats.puts += 1
        self._stats.put_bytes += len(buf)
        return PutStatus.OK

    def _make_room(self, num_bytes: int) -> int | None:
        if self._allocator.rounded(num_bytes) > self._allocator.total_bytes:
            return None
        offset = self._allocator.allocate(num_bytes)
        while offset is None and self._entries:
            self._drop(next(iter(self._entries)))
            self._stats.evictions += 1
            offset = self._allocator.allocate(num_bytes)
        return offset

    def _drop(self, key: StoreKey) -> None:
        entry = self._entries.pop(key)
        self._allocator.free(entry.offset)
        self._used_bytes -= entry.num_bytes

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        with self._lock:
            self._check_open()
            return [self._get(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def _get(self, key: StoreKey, buf: Buffer) -> GetStatus:
        entry = self._entries.get(key)
        if entry is None:
            return GetStatus.MISS
        stored = self._arena[entry.offset : entry.offset + entry.num_bytes]
        if entry.num_bytes != len(buf) or checksum(stored) != entry.checksum:
            logger.warning(
                "cpu tier %s: object %s is corrupt (stored %d bytes, asked %d); dropped",
                self.name,
                key,
                entry.num_bytes,
                len(buf),
            )
            self._stats.corrupt += 1
            self._drop(key)
            return GetStatus.CORRUPT
        np.copyto(buf, stored)
        self._entries.move_to_end(key)
        self._stats.gets += 1
        self._stats.get_bytes += entry.num_bytes
        return GetStatus.OK

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        with self._lock:
            self._check_open()
            present = [key for key in keys if key in self._entries]
            for key in present:
                self._drop(key)
            self._stats.deletes += len(present)
        return len(present)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                num_objects=len(self._entries),
                used_bytes=self._used_bytes,
                capacity_bytes=self.capacity_bytes,
            )

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self._stats.as_dict())

    def keys_lru_order(self) -> list[StoreKey]:
        """Stored keys, least recently used first (the next to be evicted first)."""
        with self._lock:
            return list(self._entries)

    def check_integrity(self) -> None:
        with self._lock:
            self._allocator.check_integrity()
            by_offset = {entry.offset: entry for entry in self._entries.values()}
            assert len(by_offset) == len(self._entries), "two entries share an extent"
            allocated = self._allocator.allocated()
            assert allocated.keys() == by_offset.keys(), "allocator and index disagree"
            for offset, entry in by_offset.items():
                assert self._allocator.rounded(entry.num_bytes) == allocated[offset]
            assert self._used_bytes == sum(e.num_bytes for e in self._entries.values())
            assert self._used_bytes <= self._allocator.allocated_bytes <= self.capacity_bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._allocator = ExtentAllocator(0)
            self._used_bytes = 0
            self._arena = np.empty(0, dtype=np.uint8)
            self._arena_owner = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"cpu tier {self.name} is closed")
