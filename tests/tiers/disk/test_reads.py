"""Gets read runs of consecutive slots in one call each: objects of any size (with
padding to the next page between them), in any order of the batch, and each
verified on its own."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from tests.support.corrupt import flip_payload_byte


def test_a_batch_read_in_runs_returns_every_object_and_flags_only_the_damaged(
    tmp_path: Path,
) -> None:
    rng = random.Random(3)
    tier = DiskTier(DiskConfig(path=tmp_path / "d", capacity_bytes=64 << 20, num_io_threads=2))
    sizes = [rng.choice([1, 1000, 4096, 4097, 9000, 300_000]) for _ in range(40)]
    keys = [StoreKey(f"k/{i}") for i in range(len(sizes))]
    objects = [np.frombuffer(rng.randbytes(n), np.uint8).copy() for n in sizes]
    assert tier.put_many(keys, objects) == [PutStatus.OK] * len(keys)

    def get(order: list[int]) -> dict[int, GetStatus]:
        buffers = {i: np.zeros(sizes[i], np.uint8) for i in order}
        statuses = tier.get_many_into([keys[i] for i in order], [buffers[i] for i in order])
        result = dict(zip(order, statuses, strict=True))
        for i in order:
            if result[i] is GetStatus.OK:
                assert buffers[i].tobytes() == objects[i].tobytes(), i
        return result

    order = list(range(len(keys)))
    rng.shuffle(order)
    assert set(get(order).values()) == {GetStatus.OK}

    digest_of = {key_digest(k).hex(): i for i, k in enumerate(keys)}
    records = {digest_of[r.digest]: r for r in segments.iter_records(tmp_path / "d")}
    damaged = {7, 8, 30}  # neighbours within a run, and one alone
    for i in damaged:
        flip_payload_byte(records[i])
    statuses = get(order)
    assert {i for i, s in statuses.items() if s is not GetStatus.OK} == damaged
    assert {statuses[i] for i in damaged} == {GetStatus.CORRUPT}
    tier.check_integrity()
    tier.close()
