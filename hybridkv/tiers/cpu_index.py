"""The CPU tier's bookkeeping: which extent of its arena holds which object, and in what state.

Worker process; not thread-safe (``CpuTier`` calls it under its lock) and moves no
bytes. An object is *reserved* (room handed out, being written, invisible), then
*stored* (visible, in LRU order); a stored object may be *borrowed* (pinned) any
number of times. One deleted or dropped while borrowed becomes a *zombie*: gone
from lookups, its extent freed by its last release. Reserved, borrowed and zombie
extents are never evicted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hybridkv.tiers.base import PutStatus, StoreKey, TierChanges
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
    """Objects of one arena by key; least recently used (put, hit or borrow) evicted first."""

    def __init__(self, capacity_bytes: int) -> None:
        self._allocator = ExtentAllocator(capacity_bytes)
        self.stored: OrderedDict[StoreKey, Slot] = OrderedDict()
        """Visible objects, least recently used first."""
        self._reserved: dict[StoreKey, Slot] = {}
        self._zombies: dict[StoreKey, Slot] = {}
        self._pinned_bytes = 0
        """Rounded bytes of every extent eviction may not take."""
        self.used_bytes = 0
        """Bytes of the stored objects."""
        self.num_evictions = 0
        self.changes: TierChanges | None = None
        """Told of every object stored and removed (``Tier.log_changes``)."""

    def find(self, key: StoreKey) -> Slot | None:
        """The stored object under ``key`` (reserved and deleted ones are absent)."""
        return self.stored.get(key)

    def knows(self, key: StoreKey) -> bool:
        """Whether ``key`` is stored, reserved or still borrowed after its deletion."""
        return key in self.stored or key in self._reserved or key in self._zombies

    def touch(self, key: StoreKey) -> None:
        self.stored.move_to_end(key)

    # Reserve and commit ---------------------------------------------------------

    def reserve(self, key: StoreKey, num_bytes: int) -> int | PutStatus:
        """The offset of new room for ``key``; EXISTS (a stored key becomes most recent)
        or FULL. A key whose deleted object is still borrowed is FULL: releases go by
        key, so one key never names two extents."""
        if key in self.stored:
            self.touch(key)
            return PutStatus.EXISTS
        if key in self._reserved:
            return PutStatus.EXISTS
        if key in self._zombies:
            return PutStatus.FULL
        offset = self._make_room(num_bytes)
        if offset is None:
            return PutStatus.FULL
        self._reserved[key] = Slot(offset, num_bytes)
        self._pinned_bytes += self._allocator.rounded(num_bytes)
        return offset

    def reserve_run(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int] | None:
        """Adjacent room for new objects ``keys`` (none stored, reserved or borrowed), in
        order, so a device copies them in one piece; None (nothing reserved) when there
        is none. It evicts only when the free room is short of the run anyway (what
        reserving them one by one would evict too), and then least recently used
        objects of at most the run's size."""
        allocator = self._allocator
        total = sum(allocator.rounded(size) for size in sizes)
        if total > allocator.total_bytes - self._pinned_bytes:
            return None
        offset = allocator.allocate(total)
        short = allocator.total_bytes - allocator.allocated_bytes < total
        evicted = 0
        while offset is None and short and evicted < total:
            victim = next((k for k, slot in self.stored.items() if not slot.num_borrows), None)
            if victim is None:
                return None
            evicted += allocator.rounded(self.stored[victim].num_bytes)
            self.drop(victim)
            self.num_evictions += 1
            offset = allocator.allocate(total)
        if offset is None:
            return None
        offsets = allocator.split(offset, sizes)
        for key, start, size in zip(keys, offsets, sizes, strict=True):
            self._reserved[key] = Slot(start, size)
        self._pinned_bytes += total
        return offsets

    def _make_room(self, num_bytes: int) -> int | None:
        """Allocate, evicting unpinned objects least recently used first; None if even
        evicting all of them could not make room (then nothing is evicted)."""
        rounded = self._allocator.rounded(num_bytes)
        if rounded > self._allocator.total_bytes - self._pinned_bytes:
            return None
        offset = self._allocator.allocate(num_bytes)
        while offset is None:
            victim = next((k for k, slot in self.stored.items() if not slot.num_borrows), None)
            if victim is None:
                return None  # pinned extents split the free room
            self.drop(victim)
            self.num_evictions += 1
            offset = self._allocator.allocate(num_bytes)
        return offset

    def check_commits(self, keys: Sequence[StoreKey], written: Sequence[bool]) -> None:
        """Raise for a commit batch that does not end open reservations, before any change."""
        if len(keys) != len(written):
            raise ValueError(f"{len(keys)} keys but {len(written)} written flags; need one each")
        unknown = [key for key in keys if key not in self._reserved]
        repeated = [key for key, count in Counter(keys).items() if count > 1]
        if unknown or repeated:
            raise ValueError(
                f"commit_many ends reservations once each: not reserved {unknown}, "
                f"repeated {repeated}; commit only keys that reserve_many gave an offset"
            )

    def commit(self, key: StoreKey, written: bool, num_borrows: int) -> Slot | None:
        """The stored object (most recently used, borrowed ``num_borrows`` times), or None
        when it was not written (its room is freed)."""
        slot = self._reserved.pop(key)
        self._pinned_bytes -= self._allocator.rounded(slot.num_bytes)
        if not written:
            self._allocator.free(slot.offset)
            return None
        self.stored[key] = slot
        self.used_bytes += slot.num_bytes
        if self.changes is not None:
            self.changes.stored((key,))
        for _ in range(num_borrows):
            self.borrow(key)
        return slot

    # Borrow and release ---------------------------------------------------------

    def borrow(self, key: StoreKey) -> Slot:
        slot = self.stored[key]
        self.touch(key)
        if slot.num_borrows == 0:
            self._pinned_bytes += self._allocator.rounded(slot.num_bytes)
        slot.num_borrows += 1
        return slot

    def check_releases(self, keys: Sequence[StoreKey]) -> None:
        """Raise for a release batch that ends more borrows than are open, before any change."""
        wrong = {
            key: count for key, count in Counter(keys).items() if count > self._num_borrows(key)
        }
        if wrong:
            held = {key: self._num_borrows(key) for key in wrong}
            raise ValueError(
                f"release_many ends borrows {wrong} but only {held} are open; "
                "release each key once per borrow_many that answered it an offset"
            )

    def _num_borrows(self, key: StoreKey) -> int:
        slot = self._zombies.get(key) or self.stored.get(key)
        return 0 if slot is None else slot.num_borrows

    def release(self, key: StoreKey) -> None:
        zombie = self._zombies.get(key)
        slot = zombie or self.stored[key]
        slot.num_borrows -= 1
        if slot.num_borrows:
            return
        self._pinned_bytes -= self._allocator.rounded(slot.num_bytes)
        if zombie is not None:
            del self._zombies[key]
            self._allocator.free(slot.offset)

    # Removal --------------------------------------------------------------------

    def drop(self, key: StoreKey) -> None:
        """Remove a stored object from lookups; a borrowed one keeps its extent until
        its last release."""
        slot = self.stored.pop(key)
        self.used_bytes -= slot.num_bytes
        if self.changes is not None:
            self.changes.removed((key,))
        if slot.num_borrows:
            self._zombies[key] = slot
        else:
            self._allocator.free(slot.offset)

    def outstanding(self) -> Outstanding:
        slots = [*self.stored.values(), *self._zombies.values()]
        return Outstanding(len(self._reserved), sum(slot.num_borrows for slot in slots))

    def check_integrity(self) -> None:
        allocator = self._allocator
        allocator.check_integrity()
        groups = (self.stored, self._reserved, self._zombies)
        assert sum(map(len, groups)) == len({k for g in groups for k in g}), "a key in two states"
        slots = [slot for group in groups for slot in group.values()]
        by_offset = {slot.offset: slot for slot in slots}
        assert len(by_offset) == len(slots), "two objects share an extent"
        allocated = allocator.allocated()
        assert allocated.keys() == by_offset.keys(), "allocator and index disagree"
        assert all(allocator.rounded(s.num_bytes) == allocated[o] for o, s in by_offset.items())
        assert all(slot.num_borrows == 0 for slot in self._reserved.values()), "reserved borrow"
        assert all(slot.num_borrows > 0 for slot in self._zombies.values()), "zombie kept"
        assert all(slot.num_borrows >= 0 for slot in self.stored.values())
        pinned = [
            *self._reserved.values(),
            *self._zombies.values(),
            *(slot for slot in self.stored.values() if slot.num_borrows),
        ]
        assert self._pinned_bytes == sum(allocator.rounded(s.num_bytes) for s in pinned)
        assert self.used_bytes == sum(slot.num_bytes for slot in self.stored.values())
        assert self.used_bytes <= allocator.allocated_bytes <= allocator.total_bytes
