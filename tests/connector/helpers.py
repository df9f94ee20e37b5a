"""Building scheduler/worker pairs on real tiers in a temporary directory (test helper)."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.connector import (
    ConnectorConfig,
    ConnectorScheduler,
    ConnectorWorker,
    KeyLookup,
    build_lookup,
    build_store,
    lookup_for_store,
)
from hybridkv.keys import KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.spec import KVLayoutSpec
from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, Tier, TierStats, TierUsage
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.transfer import TransferConfig
from tests.connector.sim import SimEngine

STAGING_BYTES = 4 << 20


def make_config(cache_dir: Path, **extra: Any) -> ConnectorConfig:
    raw: dict[str, Any] = {"cache_dir": str(cache_dir)}
    if "tiers" not in extra:
        raw.update(cpu_capacity_bytes="8MiB", disk_capacity_bytes="64MiB")
    raw.update(extra)
    return ConnectorConfig.from_dict(raw)


def make_engine(
    layout: KVLayoutSpec,
    config: ConnectorConfig,
    *,
    store: Tier | None = None,
    lookup: KeyLookup | None = None,
    load_timeout_s: float | None = 30.0,
    **engine_kwargs: Any,
) -> SimEngine:
    """A fresh engine: new KV tensors, new tiers (the disk directory persists)."""
    store = store if store is not None else build_store(config)
    worker = ConnectorWorker(
        layout,
        store,
        transfer_config=TransferConfig(staging_bytes=STAGING_BYTES, load_timeout_s=load_timeout_s),
    )
    if lookup is None:
        assert isinstance(store, TieredStore)
        lookup = lookup_for_store(store)
    scheduler = ConnectorScheduler(layout, lookup, selection=config.selection)
    return SimEngine(layout, scheduler, worker, **engine_kwargs)


def make_remote_lookup(config: ConnectorConfig) -> tuple[KeyLookup, list[Tier]]:
    """The lookup a scheduler in another process than the worker builds."""
    return build_lookup(config, engine_key="no-worker-in-this-process")


def close_engine(engine: SimEngine) -> None:
    engine.worker.check_integrity()
    engine.worker.close()


def disk_tier(config: ConnectorConfig) -> DiskTier:
    """A second, read-only instance of the config's disk tier (another process's view)."""
    disk = next(c for c in config.tiers if isinstance(c, DiskConfig))
    return DiskTier(dataclasses.replace(disk, read_only=True))


def remove_from_disk(config: ConnectorConfig, keys: Sequence[StoreKey]) -> int:
    """Mark the keys' slots dead behind the writer's back (as damage from outside would)."""
    disk = next(c for c in config.tiers if isinstance(c, DiskConfig))
    digests = {key_digest(key).hex() for key in keys}
    removed = 0
    for record in segments.iter_records(disk.path):
        if record.digest in digests and record.state is segments.SlotState.LIVE:
            fd = os.open(record.path, os.O_WRONLY)
            try:
                segments.write_slot_state(fd, record.slot, segments.SlotState.DEAD)
            finally:
                os.close(fd)
            removed += 1
    return removed


def block_keys(
    layout: KVLayoutSpec, tokens: Sequence[int], group_id: int, indices: Sequence[int]
) -> list[StoreKey]:
    hasher = RequestBlockHasher(layout.hash_block_size)
    hasher.extend(tokens)
    builder = KeyBuilder(layout, KeyNamespace.for_layout(layout))
    return builder.keys(group_id, hasher.block_hashes, indices)


class GatedTier(Tier):
    """A real tier whose reads wait until ``release()`` (a slow or hung tier)."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = f"gated-{inner.name}"
        self.load_weight = inner.load_weight
        self.gate = threading.Event()
        self.num_waiting = 0

    def release(self) -> None:
        self.gate.set()

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return self.inner.contains_many(keys)

    def put_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[PutStatus]:
        return self.inner.put_many(keys, buffers)

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        self.num_waiting += 1
        self.gate.wait(timeout=30)
        return self.inner.get_many_into(keys, buffers)

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        return self.inner.delete_many(keys)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def stats(self) -> TierStats:
        return self.inner.stats()

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self.gate.set()
        self.inner.close()
