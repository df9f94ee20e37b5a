"""Disk tiers for tests: deterministic keys and payloads, and segment sizes that hold an
exact number of objects."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from hybridkv.tiers.base import GetStatus, StoreKey
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.segments import PAGE, Geometry
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/disk/{i}")


def payload(k: str, num_bytes: int, version: int = 0) -> np.ndarray:
    """Deterministic bytes of a key (a random 4 KiB pattern repeated: cheap for big sizes)."""
    rng = np.random.default_rng(zlib.crc32(k.encode()) + 7919 * version)
    return np.resize(rng.integers(0, 256, min(num_bytes, 4096), dtype=np.uint8), num_bytes)


def disk_tier(path: Path, capacity_bytes: int = 64 << 20, **kwargs: object) -> DiskTier:
    return DiskTier(DiskConfig(path=path, capacity_bytes=capacity_bytes, **kwargs))  # type: ignore[arg-type]


def segment_bytes(num_objects: int, object_bytes: int) -> int:
    """A segment size whose data area holds exactly ``num_objects`` such objects."""
    size = 2 * PAGE + num_objects * segments.align_up(object_bytes)
    geometry = Geometry.standard(size)
    assert geometry.num_slots >= num_objects and geometry.data_offset == 2 * PAGE
    return size


def get_one(tier: DiskTier, k: StoreKey, num_bytes: int) -> tuple[GetStatus, np.ndarray]:
    out = np.zeros(num_bytes, dtype=np.uint8)
    return tier.get_many_into([k], [out])[0], out
