"""What the scheduler side can see of the worker's store, for hit lookups only.

Scheduler process. The worker owns the tiers and writes every block; the
scheduler only asks "is this key stored?" (in any tier, or in one tier for
whole-request selection). ``KeyLookup`` answers from, per tier:

* a view of that tier: the worker's own store when both run in one process,
  else a lookup-only instance of a tier other processes can see (disk,
  shared pools);
* or, for a tier private to the worker process (CPU memory) that this
  process cannot see, the record of keys the worker reported stored;

and never offers a key a load found missing or corrupt until the worker
reports it stored again. A stale "yes" only costs a failed load, which the
engine recomputes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from hybridkv.tiers.base import StoreKey

DEFAULT_RECORD_KEYS = 1 << 20
DEFAULT_BAD_KEYS = 1 << 16


class LookupView(Protocol):
    """Anything that answers ``contains_many`` (every ``Tier`` does)."""

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]: ...


class TieredLookupView(Protocol):
    """A store that answers for one of its tiers (``TieredStore`` does)."""

    def contains_many(
        self, keys: Sequence[StoreKey], *, tier_index: int | None = None
    ) -> list[bool]: ...


class TierSlice:
    """One tier of a tiered store, as a ``LookupView``."""

    def __init__(self, store: TieredLookupView, tier_index: int) -> None:
        self.store = store
        self.tier_index = tier_index

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return self.store.contains_many(keys, tier_index=self.tier_index)


class BoundedKeySet:
    """Insertion-ordered set that forgets its oldest keys beyond ``max_keys``."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[StoreKey, None] = OrderedDict()

    def add_many(self, keys: Iterable[StoreKey]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def discard_many(self, keys: Iterable[StoreKey]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class KeyLookup:
    """The scheduler's answer to "is this key stored".

    ``tier_views[i]`` answers for tier ``i``; None marks a tier this process
    cannot see (answered from the worker's reports). ``union_view``, when
    given, answers "any tier" in one call (the worker's own store).
    """

    def __init__(
        self,
        tier_views: Sequence[LookupView | None],
        load_weights: Sequence[float],
        *,
        union_view: LookupView | None = None,
        max_record_keys: int = DEFAULT_RECORD_KEYS,
        max_bad_keys: int = DEFAULT_BAD_KEYS,
    ) -> None:
        if len(tier_views) != len(load_weights) or not tier_views:
            raise ValueError(
                f"{len(tier_views)} tier views and {len(load_weights)} load weights; "
                "give one of each per tier (at least one)"
            )
        self.tier_views = tuple(tier_views)
        self.load_weights = tuple(load_weights)
        self.union_view = union_view
        self.record = BoundedKeySet(max_record_keys)
        """Keys the worker reported stored, for the tiers marked None."""
        self.bad = BoundedKeySet(max_bad_keys)
        self._lock = threading.Lock()

    @property
    def num_tiers(self) -> int:
        return len(self.tier_views)

    @property
    def complete(self) -> bool:
        """True when every tier is visible here: the record is not needed."""
        return all(view is not None for view in self.tier_views)

    def contains_many(
        self, keys: Sequence[StoreKey], *, tier_index: int | None = None
    ) -> list[bool]:
        with self._lock:
            usable = [key not in self.bad for key in keys]
        views = self.tier_views if tier_index is None else (self.tier_views[tier_index],)
        found = [False] * len(keys)
        if any(view is None for view in views):
            with self._lock:
                found = [ok and key in self.record for key, ok in zip(keys, usable, strict=True)]
        if tier_index is None and self.union_view is not None:
            views = (self.union_view,)
        for view in views:
            if view is None:
                continue
            todo = [
                i for i, (hit, ok) in enumerate(zip(found, usable, strict=True)) if ok and not hit
            ]
            if not todo:
                break
            answers = view.contains_many([keys[i] for i in todo])
            for i, hit in zip(todo, answers, strict=True):
                found[i] = bool(hit)
        return found

    def on_stored(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            self.bad.discard_many(keys)
            if not self.complete:
                self.record.add_many(keys)

    def on_missing(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            self.record.discard_many(keys)
            self.bad.add_many(keys)
