"""Checks every remote tier must pass, shared by the Mooncake and Valkey tier tests."""

from __future__ import annotations

import uuid

import numpy as np

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier
from hybridkv.tiers.codec import HEADER_BYTES, pack_header


def new_keys(num_keys: int) -> list[StoreKey]:
    prefix = uuid.uuid4().hex
    return [StoreKey(f"test/{prefix}/{i}") for i in range(num_keys)]


def payloads(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def check_round_trip_matches_a_dict(
    tier: Tier, batches: list[list[tuple[int, int]]], wrong_size: bool
) -> None:
    """Puts (key number, size) batches; the tier must answer like a first-value-wins dict."""
    keys = new_keys(10)
    reference: dict[int, np.ndarray] = {}
    for number, items in enumerate(batches):
        buffers = payloads([size for _, size in items], seed=number)
        statuses = tier.put_many([keys[k] for k, _ in items], buffers)
        expected = []
        for (k, _), buf in zip(items, buffers, strict=True):
            expected.append(PutStatus.EXISTS if k in reference else PutStatus.OK)
            reference.setdefault(k, buf)
        assert statuses == expected
    assert tier.contains_many(keys) == [k in reference for k in range(10)]
    sizes = [len(reference[k]) + (wrong_size and k % 2) if k in reference else 7 for k in range(10)]
    outs = [np.zeros(size, dtype=np.uint8) for size in sizes]
    statuses = tier.get_many_into(keys, outs)
    for k in range(10):
        if k not in reference:
            assert statuses[k] is GetStatus.MISS
        elif len(outs[k]) != len(reference[k]):
            assert statuses[k] is GetStatus.CORRUPT and not outs[k].any()
        else:
            assert statuses[k] is GetStatus.OK
            assert np.array_equal(outs[k], reference[k])
    tier.check_integrity()


def bad_values(keys: list[StoreKey], payload: np.ndarray) -> list[bytes]:
    """Five values a client could write under ``keys``, each of which must read back CORRUPT."""
    good = pack_header(keys[0], payload) + payload.tobytes()
    flipped = bytearray(good)
    flipped[HEADER_BYTES + 100] ^= 0xFF
    return [
        bytes(flipped),  # checksum mismatch
        pack_header(StoreKey("someone/else"), payload) + payload.tobytes(),  # another key's
        good[:-1],  # shorter than asked
        good + b"x",  # longer than asked
        bytes(len(good)),  # no header at all
    ]
