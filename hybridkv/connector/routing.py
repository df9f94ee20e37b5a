"""Reads of chosen keys from one chosen tier (whole-request selection).

Worker process. ``RoutedStore`` wraps the worker's store for the transfer
engine: a key routed to tier ``i`` is read with ``tier_index=i``; every
other call passes straight through. Thread-safe (the transfer engine reads
on its own threads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, Tier, TierStats, TierUsage
from hybridkv.tiers.tiered.store import TieredStore


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
