"""DigestIndex against a dict: random inserts, removals and lookups (hypothesis), with
keys crowded into a few buckets so probe runs wrap around the table and removals
shift them back."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.digest_table import NONE, digest_words
from hybridkv.tiers.disk.index import DigestIndex
from hybridkv.tiers.disk.segments import PAGE

# First words pick the bucket: a few values, some at the end of the smallest table
# (64 buckets), so that runs of equal homes wrap around to bucket 0.
FIRST_WORDS = [0, 1, 2, 62, 63, 64 + 63, 1 << 40, (1 << 64) - 1]
digests = st.tuples(st.sampled_from(FIRST_WORDS), st.integers(0, 5)).map(
    lambda t: t[0].to_bytes(8, "little") + t[1].to_bytes(8, "little")
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(digests, min_size=1, max_size=12)),
        st.tuples(st.just("remove"), st.lists(digests, min_size=1, max_size=12)),
        st.tuples(st.just("grow"), st.integers(0, 200)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_index_answers_like_a_dict(steps: list[tuple[str, object]]) -> None:
    index = DigestIndex()
    reference: dict[bytes, tuple[int, int, int, int]] = {}  # digest -> row, segment, slot, offset
    for step, (op, arg) in enumerate(steps):
        if op == "insert":
            assert isinstance(arg, list)
            slots = np.arange(len(arg), dtype=np.int64) + 10 * step
            offsets = (slots + 1) * PAGE
            rows = index.insert(digest_words(b"".join(arg)), step, slots, offsets)
            for digest, row, slot, offset in zip(arg, rows.tolist(), slots, offsets, strict=True):
                if digest in reference:  # present before, or earlier in this batch
                    assert row == NONE
                else:
                    assert row >= 0 and row not in {r for r, *_ in reference.values()}
                    reference[digest] = (row, step, int(slot), int(offset))
        elif op == "remove":
            assert isinstance(arg, list)
            gone = [d for d in dict.fromkeys(arg) if d in reference]
            index.remove(np.array([reference.pop(d)[0] for d in gone], np.int64))
        else:
            assert isinstance(arg, int)
            index.reserve(len(index) + arg)
        asked = sorted({*reference, *digests_of(steps)})
        rows = index.find(digest_words(b"".join(asked)))
        expected = [reference[d][0] if d in reference else NONE for d in asked]
        assert rows.tolist() == expected
        present = rows[rows >= 0]
        found = zip(index.segment(present), index.slot(present), index.offset(present), strict=True)
        assert [tuple(map(int, f)) for f in found] == [
            reference[d][1:] for d in asked if d in reference
        ]
        assert len(index) == len(reference)
        index.check()


def digests_of(steps: list[tuple[str, object]]) -> set[bytes]:
    return {d for _, arg in steps if isinstance(arg, list) for d in arg}


def test_a_million_keys_fit_in_under_40_bytes_each() -> None:
    index = DigestIndex()
    num_keys = 1 << 20
    keys = np.random.default_rng(0).integers(0, 1 << 63, (num_keys, 2))
    index.reserve(num_keys)
    rows = index.insert(keys, 1, np.zeros(num_keys, np.int64), np.zeros(num_keys, np.int64))
    assert (rows >= 0).all() and index.nbytes / num_keys <= 36.1  # 28 B a row + 8 B buckets
    assert np.array_equal(index.find(keys), rows)
    index.remove(rows[::2])
    assert len(index) == num_keys // 2
    again = index.insert(
        keys[::2], 2, np.ones(num_keys // 2, np.int64), np.zeros(num_keys // 2, np.int64)
    )
    assert set(again.tolist()) == set(rows[::2].tolist()), "freed rows are reused first"
    assert index.nbytes / num_keys <= 36.1
    index.check()
