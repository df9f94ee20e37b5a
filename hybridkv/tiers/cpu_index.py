"""The CPU tier's bookkeeping: which extent of its arena holds which object, and in what state.

Worker process; not thread-safe (``CpuTier`` calls it under its lock) and moves no
bytes. An object is *reserved* (room handed out, being written, invisible), then
*stored* (visible, in LRU order); a stored object may be *borrowed* (pinned) any
number of times. One deleted or dropped while borrowed becomes a *zombie*: gone
from lookups, its extent freed by its last release. Reserved, borrowed and zombie
extents are never evicted.

Objects go by key digest (``codec.key_digest``). Stored ones are rows of numpy
arrays (``LruObjects``); reserved and zombie ones, few and short-lived, stay in
dicts. The arena's allocator keeps nothing per extent: a row knows its size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridkv.tiers.base import PutStatus, StoreKey, TierChanges
from hybridkv.tiers.cpu_lru import LruObjects
from hybridkv.tiers.digest_table import NONE, Rows, digest_words
from hybridkv.tiers.memory import ExtentAllocator


@dataclass(slots=True)
class Slot:
    """One object's extent of the arena."""

    offset: int
    num_bytes: int
    num_borrows: int = 0


class Outstanding(NamedTuple):
    """What callers hold right now."""

    num_reserved: int
    num_borrows: int
    """Borrows not yet released, of stored and of deleted objects."""


class ArenaIndex:
    """Objects of one arena by key digest; least recently used (put, hit or borrow)
    evicted first."""

    def __init__(self, capacity_bytes: int, *, second_chance: bool = False) -> None:
        self._allocator = ExtentAllocator(capacity_bytes, tracked=False)
        self.stored = LruObjects(second_chance=second_chance)
        """Visible objects, least recently used first (``LruObjects.second_chance``)."""
        self._reserved: dict[bytes, Slot] = {}
        self._zombies: dict[bytes, Slot] = {}
        self._pinned_bytes = 0
        """Rounded bytes of every extent eviction may not take."""
        self.used_bytes = 0
        """Bytes of the stored objects."""
        self.num_evicted = 0
        self.changes: TierChanges | None = None
        """Told of every object stored (by key) and removed (by digest): ``Tier.log_changes``."""

    @property
    def num_objects(self) -> int:
        return len(self.stored)

    def find(self, digests: bytes) -> Rows:
        """The row of each stored object (concatenated digests), NONE where absent
        (reserved and deleted ones are absent)."""
        self.settle()
        return self.stored.find(digest_words(digests))

    def slot(self, row: int) -> Slot:
        stored = self.stored
        return Slot(int(stored.offsets[row]), int(stored.sizes[row]), int(stored.borrows[row]))

    def knows_unstored(self, digest: bytes) -> bool:
        """Whether ``digest`` is reserved or still borrowed after its deletion."""
        return digest in self._reserved or digest in self._zombies

    def touch(self, rows: Rows) -> None:
        self.stored.touch(rows)

    # Reserve and commit ---------------------------------------------------------

    def reserve(
        self, digest: bytes, num_bytes: int, *, maybe_stored: bool = True
    ) -> int | PutStatus:
        """The offset of new room for ``digest``; EXISTS (a stored object becomes most
        recent, at the next ``settle``) or FULL. A key whose deleted object is still
        borrowed is FULL: releases go by key, so one key never names two extents.
        ``maybe_stored=False``: the caller knows it is not stored (a batch looked)."""
        stored = self.stored
        if stored.added_later(digest):
            stored.touch_later(None, digest)
            return PutStatus.EXISTS
        row = stored.find_one(digest) if maybe_stored else NONE
        if row >= 0:
            stored.touch_later(row)
            return PutStatus.EXISTS
        if digest in self._reserved:
            return PutStatus.EXISTS
        if digest in self._zombies:
            return PutStatus.FULL
        offset = self._make_room(num_bytes)
        if offset is None:
            return PutStatus.FULL
        self._reserved[digest] = Slot(offset, num_bytes)
        self._pinned_bytes += self._allocator.rounded(num_bytes)
        return offset

    def reserve_run(self, digests: Sequence[bytes], sizes: Sequence[int]) -> list[int] | None:
        """Adjacent room for new objects (none stored, reserved or borrowed), in order, so
        a device copies them in one piece; None (nothing reserved) when there is none. It
        evicts only when the free room is short of the run anyway (what reserving them
        one by one would evict too), and then least recently used objects of at most
        the run's size."""
        self.settle()
        allocator = self._allocator
        total = sum(allocator.rounded(size) for size in sizes)
        if total > allocator.total_bytes - self._pinned_bytes:
            return None
        offset = allocator.allocate(total)
        short = allocator.total_bytes - allocator.allocated_bytes < total
        evicted = 0
        while offset is None and short and evicted < total:
            victim = self.stored.oldest_unborrowed()
            if victim == NONE:
                return None
            evicted += allocator.rounded(int(self.stored.sizes[victim]))
            self.drop(victim)
            self.num_evicted += 1
            offset = allocator.allocate(total)
        if offset is None:
            return None
        offsets = allocator.split(offset, sizes)
        for digest, start, size in zip(digests, offsets, sizes, strict=True):
            self._reserved[digest] = Slot(start, size)
        self._pinned_bytes += total
        return offsets

    def _make_room(self, num_bytes: int) -> int | None:
        """Allocate, evicting unpinned objects least recently used first; None if even
        evicting all of them could not make room (then nothing is evicted)."""
        rounded = self._allocator.rounded(num_bytes)
        if rounded > self._allocator.total_bytes - self._pinned_bytes:
            return None
        offset = self._allocator.allocate(num_bytes)
        if offset is None:
            self.settle()  # deferred changes decide the order of eviction
        while offset is None:
            victim = self.stored.oldest_unborrowed()
            if victim == NONE:
                return None  # pinned extents split the free room
            self.drop(victim)
            self.num_evicted += 1
            offset = self._allocator.allocate(num_bytes)
        return offset

    def check_commits(
        self, keys: Sequence[StoreKey], digests: Sequence[bytes], written: Sequence[bool]
    ) -> None:
        """Raise for a commit batch that does not end open reservations, before any change."""
        if len(keys) != len(written):
            raise ValueError(f"{len(keys)} keys but {len(written)} written flags; need one each")
        unknown = [k for k, d in zip(keys, digests, strict=True) if d not in self._reserved]
        repeated = [key for key, count in Counter(keys).items() if count > 1]
        if unknown or repeated:
            raise ValueError(
                f"commit_many ends reservations once each: not reserved {unknown}, "
                f"repeated {repeated}; commit only keys that reserve_many gave an offset"
            )

    def commit_one(self, key: StoreKey, digest: bytes) -> Slot:
        """A put's written reservation, stored (at the next ``settle``; lookups through
        ``reserve`` see it at once)."""
        slot = self._reserved.pop(digest)
        self._pinned_bytes -= self._allocator.rounded(slot.num_bytes)
        self.stored.add_later(digest, slot.offset, slot.num_bytes)
        self.used_bytes += slot.num_bytes
        if self.changes is not None:
            self.changes.stored([key])
        return slot

    def settle(self) -> None:
        """Apply what ``reserve`` and ``commit_one`` deferred: one native call for a
        batch's stores. Callers settle before the lock is let go."""
        self.stored.settle()

    def commit(
        self,
        keys: Sequence[StoreKey],
        digests: Sequence[bytes],
        written: Sequence[bool],
        num_borrows: int,
    ) -> list[Slot]:
        """Store the written reservations (most recently used, in order, each borrowed
        ``num_borrows`` times) and free the room of the others; returns the stored."""
        slots = [self._reserved.pop(digest) for digest in digests]
        for slot in slots:
            self._pinned_bytes -= self._allocator.rounded(slot.num_bytes)
        kept = [(d, s) for d, s, w in zip(digests, slots, written, strict=True) if w]
        for slot, was_written in zip(slots, written, strict=True):
            if not was_written:
                self._allocator.free(slot.offset, slot.num_bytes)
        if not kept:
            return []
        rows = self.stored.add(
            digest_words(b"".join(d for d, _ in kept)),
            np.array([s.offset for _, s in kept], np.int64),
            np.array([s.num_bytes for _, s in kept], np.int64),
        ).tolist()
        assert min(rows) >= 0, "a reserved key was stored already"
        self.used_bytes += sum(s.num_bytes for _, s in kept)
        if self.changes is not None:
            self.changes.stored([k for k, w in zip(keys, written, strict=True) if w])
        for _ in range(num_borrows):  # already the most recent, in order
            self.pin(rows)
        return [s for _, s in kept]

    # Borrow and release ---------------------------------------------------------

    def pin(self, rows: Sequence[int]) -> None:
        """Borrow each row once (a row may come more than once); the caller makes them
        most recent (``touch``)."""
        stored = self.stored
        for row in rows:
            if stored.borrows[row] == 0:
                self._pinned_bytes += self._allocator.rounded(int(stored.sizes[row]))
            stored.borrows[row] += 1

    def check_releases(self, keys: Sequence[StoreKey], digests: Sequence[bytes]) -> None:
        """Raise for a release batch that ends more borrows than are open, before any change."""
        digest_of = dict(zip(keys, digests, strict=True))
        counts = Counter(keys)
        wrong = {k: n for k, n in counts.items() if n > self._num_borrows(digest_of[k])}
        if wrong:
            held = {key: self._num_borrows(digest_of[key]) for key in wrong}
            raise ValueError(
                f"release_many ends borrows {wrong} but only {held} are open; "
                "release each key once per borrow_many that answered it an offset"
            )

    def _num_borrows(self, digest: bytes) -> int:
        zombie = self._zombies.get(digest)
        if zombie is not None:
            return zombie.num_borrows
        row = self.stored.find_one(digest)
        return 0 if row == NONE else int(self.stored.borrows[row])

    def release(self, digest: bytes) -> None:
        zombie = self._zombies.get(digest)
        if zombie is not None:
            zombie.num_borrows -= 1
            if not zombie.num_borrows:
                self._pinned_bytes -= self._allocator.rounded(zombie.num_bytes)
                del self._zombies[digest]
                self._allocator.free(zombie.offset, zombie.num_bytes)
            return
        row = self.stored.find_one(digest)
        stored = self.stored
        stored.borrows[row] -= 1
        if not stored.borrows[row]:
            self._pinned_bytes -= self._allocator.rounded(int(stored.sizes[row]))

    # Removal --------------------------------------------------------------------

    def drop(self, row: int) -> None:
        """Remove a stored object from lookups; a borrowed one keeps its extent until
        its last release."""
        slot = self.slot(row)
        digest = self.stored.digest(row)
        self.stored.remove(np.array([row], np.int64))
        self.used_bytes -= slot.num_bytes
        if self.changes is not None:
            self.changes.removed_digests(digest)
        if slot.num_borrows:
            self._zombies[digest] = slot
        else:
            self._allocator.free(slot.offset, slot.num_bytes)

    def lru_digests(self) -> list[bytes]:
        """Key digests of the stored objects, least recently used first."""
        self.settle()
        return [bytes(d.tobytes()) for d in self.stored.digests(self.stored.order())]

    def outstanding(self) -> Outstanding:
        self.settle()
        stored = self.stored
        num_borrows = int(stored.borrows[stored.sizes >= 0].sum())
        num_borrows += sum(slot.num_borrows for slot in self._zombies.values())
        return Outstanding(len(self._reserved), num_borrows)

    def check_integrity(self) -> None:
        self.settle()
        stored = self.stored
        stored.check()
        in_use = [self.slot(row) for row in stored.order().tolist()]
        digests = self.lru_digests()
        groups = (digests, list(self._reserved), list(self._zombies))
        assert sum(map(len, groups)) == len({d for g in groups for d in g}), "a key in two states"
        slots = [*in_use, *self._reserved.values(), *self._zombies.values()]
        allocator = self._allocator
        extents = {slot.offset: allocator.rounded(slot.num_bytes) for slot in slots}
        assert len(extents) == len(slots), "two objects share an extent"
        allocator.check_integrity(extents)
        assert all(slot.num_borrows == 0 for slot in self._reserved.values()), "reserved borrow"
        assert all(slot.num_borrows > 0 for slot in self._zombies.values()), "zombie kept"
        pinned = [
            *self._reserved.values(),
            *self._zombies.values(),
            *(slot for slot in in_use if slot.num_borrows),
        ]
        assert self._pinned_bytes == sum(allocator.rounded(s.num_bytes) for s in pinned)
        assert self.used_bytes == sum(slot.num_bytes for slot in in_use)
        assert self.used_bytes <= allocator.allocated_bytes <= allocator.total_bytes
