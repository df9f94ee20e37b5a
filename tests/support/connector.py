"""Scenario steps and checks shared by the connector tests, on the simulated engine
(``hybridkv.tools.sim``): keys of a prompt's blocks, a tier that hangs, damage to the
disk tier from outside, a request run start to end (test helper)."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.lookup import KeyLookup
from hybridkv.connector.metadata import BlockRef
from hybridkv.connector.setup import EngineFacts, build_lookup
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, Tier, TierStats, TierUsage
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.retention import TierRetention
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.check import assert_kv_matches_cold
from hybridkv.tools.sim.drive import run_to_end, wait_loaded
from hybridkv.tools.sim.engine import SimEngine


def make_remote_lookup(
    config: ConnectorConfig, model_groups: ModelGroups
) -> tuple[KeyLookup, list[Tier]]:
    """The lookup a scheduler in another process than the worker builds."""
    facts = EngineFacts(
        model_groups=model_groups, alignment_tokens=model_groups.scheduler_block_size
    )
    return build_lookup(config, facts)


def disk_tier(config: ConnectorConfig) -> DiskTier:
    """A second, read-only instance of the config's disk tier (another process's view)."""
    return DiskTier(disk_config(config).lookup_only())


def disk_config(config: ConnectorConfig) -> DiskConfig:
    return next(c for c in config.tier_configs if isinstance(c, DiskConfig))


def fill_disk(disk: Tier) -> None:
    """Write filler objects into a live disk tier until it has no free room left, noted
    reused, so ``admission: reused`` holds back what is not reused
    (``tiers.tiered.room``; the marks are kept in the segment headers)."""
    filler = np.zeros(4096, np.uint8)
    keys: list[StoreKey] = []
    for i in range(1 << 16):
        usage = disk.usage()
        if usage.capacity_bytes is not None and usage.used_bytes >= usage.capacity_bytes:
            disk.retention.note_reused(keys)
            assert disk.retention.evicts_reused(1) is True
            return
        keys.append(StoreKey(f"test/filler/{i}"))
        assert disk.put_many(keys[-1:], [filler]) == [PutStatus.OK]
    raise AssertionError("the disk tier never filled")


def remove_from_disk(config: ConnectorConfig, keys: Sequence[StoreKey]) -> int:
    """Mark the keys' slots dead behind the writer's back (as damage from outside would)."""
    disk = disk_config(config)
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


def block_refs(
    model_groups: ModelGroups, tokens: Sequence[int], group_id: int, indices: Sequence[int]
) -> list[BlockRef]:
    """The rank-free names of a request's group blocks."""
    hasher = RequestBlockHasher(model_groups.hash_block_size)
    hasher.extend(tokens)
    builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups))
    hashes = builder.block_hashes(group_id, hasher.block_hashes, indices)
    return [BlockRef(group_id, h) for h in hashes]


def block_keys(
    model_groups: ModelGroups,
    tokens: Sequence[int],
    group_id: int,
    indices: Sequence[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[StoreKey]:
    """The store keys of a request's group blocks in one rank's namespace."""
    namespace = KeyNamespace.for_groups(model_groups, tp_rank=tp_rank, tp_size=tp_size)
    builder = KeyBuilder(model_groups, namespace)
    return [builder.key(*ref) for ref in block_refs(model_groups, tokens, group_id, indices)]


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

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        return self.inner.put_many(keys, buffers, checksums)

    @functools.cached_property
    def retention(self) -> TierRetention:
        return self.inner.retention

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


def store_prompt(
    model_groups: ModelGroups, cache_dir: Path, tokens: Sequence[int], chunk: int
) -> None:
    first = make_engine(model_groups, make_config(cache_dir))
    assert first.add("cold", tokens) == 0
    run_to_end(first, "cold", chunk)
    first.settle()
    assert first.finish("cold") is False
    close_engine(first)  # flushes the write-back: the disk tier holds every block


def run_request(
    engine: SimEngine, req_id: str, tokens: list[int], chunk: int, *, cached: int = 0
) -> int:
    """The request from lookup to its last token (its load checked against a cold run),
    its stores written through to every tier; returns its hit. The engine's own cache
    serves its first ``cached`` tokens."""
    hit = engine.add(req_id, tokens, cached=cached)
    if hit:
        req = wait_loaded(engine, req_id)
        assert req.outcomes[-1].ok
        assert assert_kv_matches_cold(engine, req, hit) > 0
    run_to_end(engine, req_id, chunk)
    engine.settle()
    assert engine.finish(req_id) is False
    assert engine.worker.store.flush(30)
    return hit


def every_key(model_groups: ModelGroups, tokens: Sequence[int]) -> list[StoreKey]:
    """Every group's store keys of ``tokens``' whole blocks."""
    return [
        key
        for g, group in enumerate(model_groups.groups)
        for key in block_keys(model_groups, tokens, g, range(len(tokens) // group.block_size))
    ]


def stored_keys(
    model_groups: ModelGroups, engine: SimEngine, tokens: Sequence[int]
) -> list[StoreKey]:
    """Every group's keys of ``tokens`` that the first tier holds (what was stored)."""
    keys = every_key(model_groups, tokens)
    held = engine.worker.store.tiers[0].contains_many(keys)
    return [k for k, h in zip(keys, held, strict=True) if h]


def on_disk(config: ConnectorConfig, keys: Sequence[StoreKey]) -> list[bool]:
    """Which keys the config's disk tier holds, as another process sees it."""
    reader = disk_tier(config)
    try:
        return reader.contains_many(keys)
    finally:
        reader.close()
