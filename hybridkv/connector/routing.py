"""Reads of chosen keys from one chosen tier (whole-request selection).

Worker process. ``RoutedStore`` wraps the worker's store for the transfer
engine: a key routed to tier ``i`` is read with ``tier_index=i``, and read in
place from the first tier's memory only when ``i`` is that tier; every other
call passes straight through. Thread-safe (the transfer engine reads on its
own threads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierMemory,
    TierStats,
    TierUsage,
)
from hybridkv.tiers.tiered.store import TieredStore

if TYPE_CHECKING:
    import torch


class RoutedStore(Tier):
    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.name = store.name
        self.load_weight = store.load_weight
        self._routes: dict[StoreKey, int] = {}
        self._lock = threading.Lock()

    def route(self, keys: Sequence[StoreKey], tier_index: int) -> None:
        with self._lock:
            for key in keys:
                self._routes[key] = tier_index

    def unroute(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            for key in keys:
                self._routes.pop(key, None)

    @property
    def num_routes(self) -> int:
        with self._lock:
            return len(self._routes)

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return self.store.contains_many(keys)

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        return self.store.put_many(keys, buffers, checksums)

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        with self._lock:
            routes = [self._routes.get(key) for key in keys]
        if all(r is None for r in routes):
            return self.store.get_many_into(keys, buffers)
        statuses = [GetStatus.MISS] * len(keys)
        for tier_index in set(routes):
            picked = [j for j, r in enumerate(routes) if r == tier_index]
            answers = self.store.get_many_into(
                [keys[j] for j in picked], [buffers[j] for j in picked], tier_index=tier_index
            )
            for j, status in zip(picked, answers, strict=True):
                statuses[j] = status
        return statuses

    def memory(self) -> TierMemory | None:
        first = self.store.memory()
        return None if first is None else _RoutedMemory(first, self)

    def routes_of(self, keys: Sequence[StoreKey]) -> list[int | None]:
        with self._lock:
            return [self._routes.get(key) for key in keys]

    def register_staging(self, staging: Buffer) -> int:
        return self.store.register_staging(staging)

    def staging_busy(self) -> bool:
        return self.store.staging_busy()

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        return self.store.delete_many(keys)

    def usage(self) -> TierUsage:
        return self.store.usage()

    def stats(self) -> TierStats:
        return self.store.stats()

    def check_integrity(self) -> None:
        self.store.check_integrity()

    def close(self) -> None:
        self.store.close()


class _RoutedMemory(TierMemory):
    """The first tier's memory; a key routed to another tier is not borrowed from it."""

    def __init__(self, first: TierMemory, routed: RoutedStore) -> None:
        self._first = first
        self._routed = routed

    @property
    def memory(self) -> torch.Tensor:
        return self._first.memory

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        return self._first.reserve_many(keys, sizes)

    def commit_many(
        self, keys: Sequence[StoreKey], written: Sequence[bool], *, num_borrows: int = 0
    ) -> None:
        self._first.commit_many(keys, written, num_borrows=num_borrows)

    def borrow_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | GetStatus]:
        here = [j for j, r in enumerate(self._routed.routes_of(keys)) if r in (None, 0)]
        answers: list[int | GetStatus] = [GetStatus.MISS] * len(keys)
        borrowed = self._first.borrow_many([keys[j] for j in here], [sizes[j] for j in here])
        for j, answer in zip(here, borrowed, strict=True):
            answers[j] = answer
        return answers

    def release_many(self, keys: Sequence[StoreKey]) -> None:
        self._first.release_many(keys)
