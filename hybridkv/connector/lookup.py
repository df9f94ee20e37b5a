"""What the scheduler side can see of the workers' stores, for hit lookups only.

Scheduler process. Each worker (one per tensor-parallel rank) owns its tiers
and writes every block; the scheduler only asks "is this key stored?" (in any
tier, or in one tier for whole-request selection). ``KeyLookup`` answers
from, per rank and tier:

* a view of that tier: a worker's own store when both run in one process,
  else a lookup-only instance of a tier other processes can see (disk,
  shared pools);
* or, for a tier private to a worker process (CPU memory) that this
  process cannot see, the record of keys the workers reported stored;

and never offers a key a load found missing or corrupt until a worker
reports it stored again. A stale "yes" only costs a failed load, which the
engine recomputes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

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


K = TypeVar("K", bound=Hashable)


class BoundedKeySet(Generic[K]):
    """Insertion-ordered set that forgets its oldest keys beyond ``max_keys``."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[K, None] = OrderedDict()

    def add_many(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def discard_many(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class KeyLookup:
    """The scheduler's answer to "does rank r hold this key".

    ``tier_views[rank][i]`` answers for tier ``i`` of that rank's store; None
    marks a tier this process cannot see (answered from the workers' reports).
    ``union_views[rank]``, when given, answers "any tier" in one call (a
    worker's own store in this process). Keys name their rank, so one record
    of reported keys serves every rank.
    """

    def __init__(
        self,
        tier_views: Sequence[Sequence[LookupView | None]],
        load_weights: Sequence[float],
        *,
        union_views: Sequence[LookupView] | None = None,
        max_record_keys: int = DEFAULT_RECORD_KEYS,
        max_bad_keys: int = DEFAULT_BAD_KEYS,
    ) -> None:
        if not tier_views or any(len(views) != len(load_weights) for views in tier_views):
            raise ValueError(
                f"tier views per rank {[len(v) for v in tier_views]} and {len(load_weights)} "
                "load weights; give one view per tier for every rank (at least one rank)"
            )
        if union_views is not None and len(union_views) != len(tier_views):
            raise ValueError(f"{len(union_views)} union views for {len(tier_views)} ranks")
        self.tier_views = tuple(tuple(views) for views in tier_views)
        self.load_weights = tuple(load_weights)
        self.union_views = None if union_views is None else tuple(union_views)
        self.record: BoundedKeySet[StoreKey] = BoundedKeySet(max_record_keys)
        """Keys the workers reported stored, for the tiers marked None."""
        self.bad: BoundedKeySet[StoreKey] = BoundedKeySet(max_bad_keys)
        self._lock = threading.Lock()

    @property
    def num_ranks(self) -> int:
        return len(self.tier_views)

    @property
    def num_tiers(self) -> int:
        return len(self.load_weights)

    @property
    def complete(self) -> bool:
        """True when every tier is visible here: the record is not needed."""
        return all(view is not None for views in self.tier_views for view in views)

    def contains_many(
        self, keys: Sequence[StoreKey], *, rank: int = 0, tier_index: int | None = None
    ) -> list[bool]:
        with self._lock:
            usable = [key not in self.bad for key in keys]
        rank_views = self.tier_views[rank]
        views = rank_views if tier_index is None else (rank_views[tier_index],)
        found = [False] * len(keys)
        if any(view is None for view in views):
            with self._lock:
                found = [ok and key in self.record for key, ok in zip(keys, usable, strict=True)]
        if tier_index is None and self.union_views is not None:
            views = (self.union_views[rank],)
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
