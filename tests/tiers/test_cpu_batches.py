"""CpuTier's batches against an OrderedDict (hypothesis): puts, gets and deletes of
several keys at once, with repeats within a batch, evictions halfway through one and
gets of another size (CORRUPT: dropped), answer and order the objects exactly as the
same calls one key at a time would."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier

NUM_SLOTS = 5
SLOT = 1000
"""Rounds to 1024 bytes: a tier of ``NUM_SLOTS * 1024`` bytes holds exactly that many."""
KEYS = [StoreKey(f"test/cpu-batches/{i}") for i in range(9)]

batches = st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=7)
ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "delete"]), batches, st.integers(0, 3)), max_size=30
)
"""(op, keys, which key of a get asks for another size: none past the batch's end)."""


def value(version: int) -> np.ndarray:
    return np.full(SLOT, version % 251, np.uint8)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_batches_answer_like_one_key_at_a_time(steps: list[tuple[str, list[int], int]]) -> None:
    tier = CpuTier(CpuConfig(capacity_bytes=NUM_SLOTS * 1024, pin_memory=False))
    model: OrderedDict[StoreKey, np.ndarray] = OrderedDict()  # least recently used first
    num_evictions = 0
    for step, (op, batch, wrong) in enumerate(steps):
        keys = [KEYS[i] for i in batch]
        if op == "put":
            values = [value(100 * step + j) for j in range(len(keys))]
            expected = []
            for k, v in zip(keys, values, strict=True):
                if k in model:
                    model.move_to_end(k)
                    expected.append(PutStatus.EXISTS)
                    continue
                if len(model) == NUM_SLOTS:
                    model.popitem(last=False)
                    num_evictions += 1
                model[k] = v
                expected.append(PutStatus.OK)
            assert tier.put_many(keys, values) == expected
        elif op == "get":
            outs = [np.zeros(SLOT + (j == wrong), np.uint8) for j in range(len(keys))]
            statuses = tier.get_many_into(keys, outs)
            for k, status, out in zip(keys, statuses, outs, strict=True):
                if k not in model:
                    assert status is GetStatus.MISS
                elif len(out) != SLOT:
                    assert status is GetStatus.CORRUPT
                    del model[k]
                else:
                    assert status is GetStatus.OK and np.array_equal(out, model[k])
                    model.move_to_end(k)
        else:
            present = {k for k in keys if k in model}
            assert tier.delete_many(keys) == len(present)
            for k in present:
                del model[k]
        assert tier.lru_digests() == [key_digest(k) for k in model]
        assert tier.stats().evictions == num_evictions
        tier.check_integrity()
