"""SeenHashes against a brute-force reference: levels, oldest forgotten first, bounded
memory."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.connector.seen import NOT_SEEN, SeenHashes
from hybridkv.keys import BlockHash, HashAlgo


def block_hash(i: int, algo: HashAlgo = HashAlgo.XXH3_128) -> BlockHash:
    return algo.digest(i.to_bytes(8, "little"))


class Reference:
    """Hashes by first sighting, each with its level: a dict, forgetting the first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.levels: OrderedDict[BlockHash, int] = OrderedDict()

    def sight(self, hashes: list[BlockHash], first: int, again: int) -> list[int]:
        """Levels before the batch; then one at ``first`` goes to ``again``, each at
        least to ``first`` (a repeat within the batch is one sighting)."""
        before = [self.levels.get(h, NOT_SEEN) for h in hashes]
        for h, was in dict(zip(hashes, before, strict=True)).items():
            self.levels[h] = again if was == first else max(was, first)  # a new one goes last
        while len(self.levels) > self.capacity:
            self.levels.popitem(last=False)
        return before


batches = st.lists(
    st.tuples(st.lists(st.integers(0, 40), max_size=12), st.integers(1, 3), st.integers(0, 2)),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 16), calls=batches)
def test_matches_the_reference(capacity: int, calls: list[tuple[list[int], int, int]]) -> None:
    """``raise_to`` (a level, nothing promoted) and ``sight`` (the first level, promoted
    to a higher one when seen again), interleaved."""
    seen, reference = SeenHashes(capacity), Reference(capacity)
    for numbers, first, up in calls:
        hashes = [block_hash(n) for n in numbers]
        got = seen.sight(hashes, first, first + up) if up else seen.raise_to(hashes, first)
        assert got.tolist() == reference.sight(hashes, first, first + up)
        assert len(seen) == len(reference.levels)
        seen.check_integrity()


def test_the_oldest_sighting_is_forgotten_first_whatever_its_level() -> None:
    seen = SeenHashes(3)
    a, b, c, d = (block_hash(i) for i in range(4))
    seen.raise_to([a, b, c], 1)
    seen.raise_to([a], 2)  # raising a level is no new sighting
    seen.raise_to([d], 1)
    assert seen.raise_to([b, c, d], 1).tolist() == [1, 1, 1]
    assert seen.raise_to([a], 1).tolist() == [NOT_SEEN]  # a went first, then b
    assert seen.raise_to([b], 1).tolist() == [NOT_SEEN]


def test_memory_stays_what_it_was_at_the_start() -> None:
    seen = SeenHashes(1000)
    start = seen.nbytes
    assert 29 * 1000 <= start <= 37 * 1000 + 4096  # the module docstring's bytes per hash
    for first in range(0, 20_000, 500):
        seen.raise_to([block_hash(i) for i in range(first, first + 500)], 1)
        assert len(seen) <= 1000
    assert seen.nbytes == start
    seen.check_integrity()
    recent = [block_hash(i) for i in range(19_000, 20_000)]
    assert (seen.raise_to(recent, 1) == 1).all()


def test_sha256_hashes_are_told_apart_by_their_first_16_bytes() -> None:
    seen = SeenHashes(8)
    hashes = [block_hash(i, HashAlgo.SHA256) for i in range(4)]
    assert seen.raise_to(hashes, 1).tolist() == [NOT_SEEN] * 4
    assert seen.raise_to(hashes, 1).tolist() == [1] * 4


def test_a_batch_larger_than_the_capacity_keeps_its_last_hashes() -> None:
    seen = SeenHashes(4)
    hashes = [block_hash(i) for i in range(10)]
    seen.raise_to(hashes, 1)
    assert seen.raise_to(hashes, 1).tolist() == [NOT_SEEN] * 6 + [1] * 4
    seen.check_integrity()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        SeenHashes(0)
    with pytest.raises(ValueError, match="levels 0, 0"):
        SeenHashes(4).raise_to([block_hash(0)], 0)
    with pytest.raises(ValueError, match="levels 2, 1"):
        SeenHashes(4).sight([block_hash(0)], 2, 1)
