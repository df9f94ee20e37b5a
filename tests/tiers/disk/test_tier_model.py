"""DiskTier against a first-value-wins dict (hypothesis): random puts, deletes, gets,
evictions, restarts and read-only followers; what the tier holds reads back exactly
what the dict says, survives a restart unchanged, and is what a follower sees."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.disk.segments import PAGE, Geometry
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier

KEYS = [StoreKey(f"model/{i}") for i in range(12)]
SIZES = [0, 1, 3000, 5000, 9000, 40_000]
"""40 kB: more than a segment holds, so a segment of its own."""
SEGMENT_BYTES = 2 * PAGE + 3 * 8192

items = st.tuples(st.integers(0, len(KEYS) - 1), st.sampled_from(SIZES))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(items, min_size=1, max_size=6)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, len(KEYS) - 1), max_size=3)),
        st.tuples(st.just("restart"), st.none()),
        st.tuples(st.just("follower"), st.none()),
    ),
    max_size=25,
)


def value(version: int, num_bytes: int) -> np.ndarray:
    return np.random.default_rng(version).integers(0, 256, num_bytes, dtype=np.uint8)


class Model:
    """What the tier must answer: the value of each key's first put since it was last
    absent. Evictions are the tier's choice; the model only learns of them as misses."""

    def __init__(self, path: Path, *, roomy: bool) -> None:
        capacity = 64 << 20 if roomy else 4 * SEGMENT_BYTES
        self.config = DiskConfig(path=path, capacity_bytes=capacity, segment_bytes=SEGMENT_BYTES)
        self.roomy = roomy
        self.tier = DiskTier(self.config)
        self.values: dict[StoreKey, np.ndarray] = {}
        self.num_puts = 0

    def put(self, batch: list[tuple[int, int]]) -> None:
        keys = [KEYS[i] for i, _ in batch]
        values = [value(self.num_puts + j, n) for j, (_, n) in enumerate(batch)]
        self.num_puts += len(batch)
        held = self.held()
        statuses = self.tier.put_many(keys, values)
        for key, put, status in zip(keys, values, statuses, strict=True):
            # A batch's own segments are busy until it ends: too many new ones fill a
            # small tier.
            assert status in (PutStatus.OK, PutStatus.EXISTS, PutStatus.FULL), status
            assert status is not PutStatus.FULL or not self.roomy
            if status is PutStatus.OK:
                assert key not in held or not self.roomy, f"{key} was stored already"
                held.add(key)  # a second put of it in this batch: EXISTS
                self.values[key] = put

    def held(self) -> set[StoreKey]:
        return {k for k, found in zip(KEYS, self.tier.contains_many(KEYS), strict=True) if found}

    def check(self, tier: DiskTier | None = None) -> set[StoreKey]:
        """Every key the tier holds reads back its value; returns them."""
        tier = tier or self.tier
        held = {k for k, found in zip(KEYS, tier.contains_many(KEYS), strict=True) if found}
        assert held <= set(self.values)
        if self.roomy:
            assert held == set(self.values)
        sizes = [len(self.values[k]) if k in self.values else 1 for k in KEYS]
        outs = [np.zeros(n, np.uint8) for n in sizes]
        statuses = tier.get_many_into(KEYS, outs)
        for key, status, out in zip(KEYS, statuses, outs, strict=True):
            assert status is (GetStatus.OK if key in held else GetStatus.MISS), (key, status)
            if key in held:
                assert np.array_equal(out, self.values[key]), key
        assert tier.usage().num_objects == len(held)
        tier.check_integrity()
        return held


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=ops, roomy=st.booleans())
def test_the_tier_answers_like_a_first_value_wins_dict(
    steps: list[tuple[str, object]], roomy: bool
) -> None:
    assert Geometry.standard(SEGMENT_BYTES).num_slots == 3
    with tempfile.TemporaryDirectory() as directory:
        model = Model(Path(directory), roomy=roomy)
        held = model.check()
        for op, arg in steps:
            if op == "put":
                assert isinstance(arg, list)
                model.put(arg)
            elif op == "delete":
                assert isinstance(arg, list)
                keys = [KEYS[i] for i in dict.fromkeys(arg)]
                assert model.tier.delete_many(keys) == len(set(keys) & held)
                for key in keys:
                    model.values.pop(key, None)
            elif op == "restart":
                model.tier.close()
                model.tier = DiskTier(model.config)
                assert model.check() == held, "a restart lost or found objects"
            else:
                follower = DiskTier(model.config.lookup_only())
                assert model.check(follower) == held
                follower.close()
            now = model.check()
            vanished = held - now - {KEYS[i] for i in (arg if op == "delete" else [])}  # type: ignore[union-attr]
            assert model.tier.stats().evictions >= len(vanished) or op == "restart"
            held = now
        model.tier.close()
