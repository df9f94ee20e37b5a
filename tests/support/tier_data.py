"""Checks every remote tier must pass, shared by the Mooncake and Valkey tier tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier
from hybridkv.tiers.codec import HEADER_BYTES, pack_header
from tests.support.servers import timed


def new_keys(num_keys: int) -> list[StoreKey]:
    prefix = uuid.uuid4().hex
    return [StoreKey(f"test/{prefix}/{i}") for i in range(num_keys)]


def payloads(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def put_new(tier: Tier, sizes: list[int], seed: int = 0) -> tuple[list[StoreKey], list[np.ndarray]]:
    """Stores fresh keys holding ``payloads(sizes, seed)``; every put must succeed."""
    keys = new_keys(len(sizes))
    buffers = payloads(sizes, seed)
    assert tier.put_many(keys, buffers) == [PutStatus.OK] * len(sizes)
    return keys, buffers


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


def round_trip_test(max_object_bytes: int) -> Callable[..., None]:
    """A property test of ``check_round_trip_matches_a_dict`` on a module's ``tier``
    fixture, with objects of up to ``max_object_bytes``."""
    batch = st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, max_object_bytes)), min_size=1, max_size=8
    )

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(batches=st.lists(batch, min_size=1, max_size=4), wrong_size=st.booleans())
    def test(tier: Tier, batches: list[list[tuple[int, int]]], wrong_size: bool) -> None:
        check_round_trip_matches_a_dict(tier, batches, wrong_size)

    return test


def check_reads_back(tier: Tier, keys: list[StoreKey], buffers: list[np.ndarray]) -> None:
    """Every key reads back OK, the bytes of its buffer; the tier is consistent."""
    outs = [np.empty_like(buf) for buf in buffers]
    assert tier.get_many_into(keys, outs) == [GetStatus.OK] * len(keys)
    assert all(np.array_equal(o, b) for o, b in zip(outs, buffers, strict=True))
    tier.check_integrity()


def check_stored_value_is_header_then_payload(
    tier: Tier, read_raw: Callable[[StoreKey], Any]
) -> None:
    """What a put leaves on the server (``read_raw``: a plain client's read of a key) is
    the codec's header, then the payload."""
    key = new_keys(1)
    (payload,) = payloads([12345], seed=2)
    assert tier.put_many(key, [payload]) == [PutStatus.OK]
    assert read_raw(key[0]) == pack_header(key[0], payload) + payload.tobytes()


def check_hung_server_costs_one_timeout(
    tier: Tier, keys: list[StoreKey], op_timeout_s: float
) -> None:
    """With its server hung, a lookup waits out one timeout and misses; the next misses at
    once (the tier's gate closed)."""
    found, seconds = timed(lambda: tier.contains_many(keys))
    assert found == [False] * len(keys)
    assert op_timeout_s * 0.9 < seconds < op_timeout_s + 1.0
    found, seconds = timed(lambda: tier.contains_many(keys))
    assert found == [False] * len(keys) and seconds < 0.2


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
