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

import functools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, StrictBool
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, ByteSize
from hybridkv.tiers import cpu_lru
from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    TierMedium,
    TierMemory,
    TierReach,
    TierStats,
    check_batch,
    check_sizes,
)
from hybridkv.tiers.books import BookkeepingTier
from hybridkv.tiers.codec import key_digests
from hybridkv.tiers.config import LoadWeight, TierConfigBase
from hybridkv.tiers.cpu_index import ArenaIndex, Outstanding
from hybridkv.tiers.memory import ALIGN_BYTES, allocate_arena, arena_tensor
from hybridkv.tiers.retention import TierRetention

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
    second_chance: Annotated[
        StrictBool,
        Field(
            description=(
                "an object read since it was stored (a hit) is passed over once when it is "
                "the next to evict: it becomes the most recent, its mark cleared, so objects "
                "never read go first and a prefix every request reads outlives one-off "
                "prompts; while more than three quarters of the objects are marked, the "
                "least recent goes, read or not; false: plain recency"
            )
        ),
    ] = False

    reach: ClassVar[TierReach] = TierReach.PROCESS
    medium: ClassVar[TierMedium] = TierMedium.MEMORY

    def build(self) -> CpuTier:
        return CpuTier(self)


class CpuTier(BookkeepingTier):
    """Objects in one arena; least recently used (put, hit, borrow or touch) evicted first.

    Thread-safe: one lock guards the index and the copies (a copy of a block is
    microseconds; holding the lock keeps an evicted extent from being overwritten
    while it is read). In-place access (``memory()``, the ``TierMemory`` calls
    below) copies outside the lock: a reserved or borrowed extent is never reused.
    """

    accepts_promotions = True
    local_usage = True

    def __init__(self, config: CpuConfig, *, name: str = "cpu") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.capacity_bytes = config.capacity_bytes
        self._arena, self._arena_owner = allocate_arena(
            config.capacity_bytes, pin_memory=config.pin_memory
        )
        self._tensor: torch.Tensor | None = None
        self._index = ArenaIndex(config.capacity_bytes, second_chance=config.second_chance)
        cpu_lru.warm_up()  # compiled (or loaded) now, not on the first put
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._closed = False
        self._memory = _CpuMemory(self)

    @property
    def is_pinned(self) -> bool:
        return self._arena_owner is not None

    def memory(self) -> TierMemory:
        return self._memory

    @functools.cached_property
    def retention(self) -> CpuRetention:
        return CpuRetention(self)

    @property
    def arena(self) -> torch.Tensor:
        """The arena as a 1-D uint8 tensor: the pinned owner, or a view made on first use
        (so a tier that is never read in place never imports torch)."""
        with self._lock:
            self._check_open()
            if self._tensor is None:
                self._tensor = arena_tensor(self._arena, self._arena_owner)
            return self._tensor

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        digests = key_digests(keys)
        with self._lock:
            self._check_open()
            found = self._index.find(digests) >= 0
            self._stats.queries += len(keys)
            self._stats.hits += int(np.count_nonzero(found))
        answers: list[bool] = found.tolist()
        return answers

    # Through buffers ---------------------------------------------------------------

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Copy each buffer in; ``checksums`` are not kept (see the module docstring)."""
        check_batch(keys, buffers, checksums)
        digests = _split(key_digests(keys))
        with self._lock:
            self._check_open()
            # One lookup for the batch: only a key stored then, or by this batch, may
            # be stored when its turn comes (evictions only remove).
            found = (self._index.find(b"".join(digests)) >= 0).tolist()
            stored: set[bytes] = set()
            results: list[PutStatus] = []
            try:
                for key, digest, buf, was_found in zip(keys, digests, buffers, found, strict=True):
                    status = self._put(key, digest, buf, was_found or digest in stored)
                    if status is PutStatus.OK:
                        stored.add(digest)
                    results.append(status)
            finally:
                self._index.settle()
            return results

    def _put(self, key: StoreKey, digest: bytes, buf: Buffer, maybe_stored: bool) -> PutStatus:
        offset = self._reserve(digest, len(buf), maybe_stored=maybe_stored)
        if isinstance(offset, PutStatus):
            return offset
        np.copyto(self._arena[offset : offset + len(buf)], buf)
        slot = self._index.commit_one(key, digest)
        self._stats.puts += 1
        self._stats.put_bytes += slot.num_bytes
        return PutStatus.OK

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        digests = key_digests(keys)
        with self._lock:
            self._check_open()
            found = self._find(keys, digests, [len(buf) for buf in buffers], borrow=False)
            results: list[GetStatus] = []
            for answer, buf in zip(found, buffers, strict=True):
                if isinstance(answer, int):
                    np.copyto(buf, self._arena[answer : answer + len(buf)])
                    answer = GetStatus.OK
                results.append(answer)
            return results

    # In place (TierMemory) -----------------------------------------------------------

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        """See ``TierMemory.reserve_many``."""
        check_sizes(keys, sizes)
        digests = _split(key_digests(keys))
        with self._lock:
            self._check_open()
            index = self._index
            stored = (index.find(b"".join(digests)) >= 0).tolist()
            answers: list[int | PutStatus | None] = [None] * len(keys)
            new: dict[bytes, int] = {}  # keys no one holds, at their first sight
            for j, (digest, size) in enumerate(zip(digests, sizes, strict=True)):
                if digest in new:
                    answers[j] = PutStatus.EXISTS  # reserved below, for its first sight
                elif stored[j] or index.knows_unstored(digest):
                    answers[j] = self._reserve(digest, int(size))  # EXISTS or FULL
                else:
                    new[digest] = int(size)
            # One run for the new objects when the arena has it: a device copies it at once.
            run = index.reserve_run(list(new), list(new.values())) if len(new) > 1 else None
            offsets = dict(zip(new, run, strict=True)) if run is not None else {}
            for j, (digest, size) in enumerate(zip(digests, sizes, strict=True)):
                if answers[j] is None:
                    answers[j] = offsets.get(digest)
                    if answers[j] is None:
                        answers[j] = self._reserve(digest, int(size))
            index.settle()
            return [answer for answer in answers if answer is not None]

    def commit_many(
        self, keys: Sequence[StoreKey], written: Sequence[bool], *, num_borrows: int = 0
    ) -> None:
        """See ``TierMemory.commit_many``."""
        if num_borrows < 0:
            raise ValueError(f"num_borrows={num_borrows}: must be >= 0")
        digests = _split(key_digests(keys))
        with self._lock:
            self._check_open()
            self._index.check_commits(keys, digests, written)
            self._commit(keys, digests, [bool(w) for w in written], num_borrows)

    def borrow_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | GetStatus]:
        """See ``TierMemory.borrow_many``."""
        check_sizes(keys, sizes)
        digests = key_digests(keys)
        with self._lock:
            self._check_open()
            return self._find(keys, digests, [int(size) for size in sizes], borrow=True)

    def release_many(self, keys: Sequence[StoreKey]) -> None:
        """See ``TierMemory.release_many``."""
        digests = _split(key_digests(keys))
        with self._lock:
            self._check_open()
            self._index.check_releases(keys, digests)
            for digest in digests:
                self._index.release(digest)

    def _reserve(
        self, digest: bytes, num_bytes: int, *, maybe_stored: bool = True
    ) -> int | PutStatus:
        answer = self._index.reserve(digest, num_bytes, maybe_stored=maybe_stored)
        if answer is PutStatus.FULL:
            self._stats.put_skipped_full += 1
        return answer

    def _commit(
        self,
        keys: Sequence[StoreKey],
        digests: Sequence[bytes],
        written: Sequence[bool],
        num_borrows: int,
    ) -> None:
        for slot in self._index.commit(keys, digests, written, num_borrows):
            self._stats.puts += 1
            self._stats.put_bytes += slot.num_bytes

    def _find(
        self, keys: Sequence[StoreKey], digests: bytes, sizes: Sequence[int], *, borrow: bool
    ) -> list[int | GetStatus]:
        """Per key, the offset of its stored object if that has the size asked (then it
        is most recent, a get counted, and borrowed if ``borrow``); else MISS, or CORRUPT
        for an object of another size, which is dropped."""
        index = self._index
        rows: list[int] = index.find(digests).tolist()
        answers: list[int | GetStatus] = []
        used: list[int] = []
        for j, (row, num_bytes) in enumerate(zip(rows, sizes, strict=True)):
            slot = index.slot(row) if row >= 0 else None
            if slot is None:
                answers.append(GetStatus.MISS)
            elif slot.num_bytes != num_bytes:
                logger.warning(
                    "cpu tier %s: object %s is corrupt (stored %d bytes, asked %d); dropped",
                    self.name,
                    keys[j],
                    slot.num_bytes,
                    num_bytes,
                )
                self._stats.corrupt += 1
                index.drop(row)
                used = [r for r in used if r != row]
                rows[j + 1 :] = index.find(digests[16 * (j + 1) :]).tolist()  # its row is free
                answers.append(GetStatus.CORRUPT)
            else:
                if borrow:
                    index.pin([row])
                used.append(row)
                self._stats.gets += 1
                self._stats.get_bytes += slot.num_bytes
                answers.append(slot.offset)
        rows_used = np.array(used, np.int64)
        index.touch(rows_used)
        index.stored.mark_read(rows_used)
        return answers

    # Bookkeeping ---------------------------------------------------------------------

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        """Remove stored keys (a borrowed one keeps its bytes until released); reservations
        are left alone."""
        digests = b"".join(dict.fromkeys(_split(key_digests(keys))))
        with self._lock:
            self._check_open()
            present = [row for row in self._index.find(digests).tolist() if row >= 0]
            for row in present:
                self._index.drop(row)
        return len(present)

    def lru_digests(self) -> list[bytes]:
        """Key digests (``codec.key_digest``) of the stored objects, least recently used
        first (evicted first unless borrowed)."""
        with self._lock:
            return self._index.lru_digests()

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

    def _books(self) -> ArenaIndex:
        return self._index

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"cpu tier {self.name} is closed")


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


class CpuRetention(TierRetention):
    """``CpuTier.retention``: touches and passes in one native batch, plain recency by
    setting aside ``second_chance`` (``cpu_lru.LruObjects``)."""

    tier: CpuTier

    def __init__(self, tier: CpuTier) -> None:
        super().__init__(tier)

    def touch(self, keys: Sequence[StoreKey], passes: int | None = None) -> None:
        """Not counted as gets; passes given replace those the objects had
        (``LruObjects.grant``)."""
        tier = self.tier
        digests = key_digests(keys)
        with tier._lock:
            tier._check_open()
            rows = tier._index.find(digests)
            rows = rows[rows >= 0]
            tier._index.touch(rows)
            if passes is not None:
                tier._index.stored.grant(rows, passes)

    def use_plain_lru(self, on: bool) -> None:
        """While ``on``, no ``second_chance`` (``LruObjects.plain_lru``)."""
        with self.tier._lock:
            self.tier._index.stored.plain_lru = on


def _split(digests: bytes) -> list[bytes]:
    """Concatenated 16-byte key digests, one by one."""
    return [digests[i : i + 16] for i in range(0, len(digests), 16)]
