"""Packing a request's parts into transfer jobs, against the rules it must keep: every
part once, in order; at most one part per group and ``limit`` bytes per job (a part
alone may reach it); and a job ends only where the next part could not join it."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.connector.metadata import BlockRef
from hybridkv.connector.worker_parts import Part, pack, refs_of
from hybridkv.keys import BlockHash
from hybridkv.tiers.base import StoreKey
from hybridkv.transfer import TransferPart

BLOCK_BYTES = {0: 3, 1: 5, 2: 7}


def part(group_id: int, num_blocks: int, first: int = 0) -> Part:
    ids = list(range(first, first + num_blocks))
    keys = [StoreKey(f"{group_id}/{b}") for b in ids]
    refs = tuple(BlockRef(group_id, BlockHash(bytes([group_id, b]))) for b in ids)
    return Part(TransferPart(group_id, ids, keys), refs, "r")


def size(p: Part) -> int:
    return len(p.part.block_ids) * BLOCK_BYTES[p.part.group_id]


@given(
    st.lists(st.tuples(st.sampled_from(list(BLOCK_BYTES)), st.integers(0, 6)), max_size=12),
    st.integers(1, 40),
)
def test_jobs_keep_the_rules_and_end_only_where_they_must(
    shapes: list[tuple[int, int]], limit: int
) -> None:
    parts = [part(g, n) for g, n in shapes]
    jobs = pack(parts, BLOCK_BYTES.__getitem__, limit)
    assert [p for job in jobs for p in job] == parts
    assert all(jobs), "no empty job"
    for job in jobs:
        groups = [p.part.group_id for p in job]
        assert len(groups) == len(set(groups))
        assert len(job) == 1 or sum(size(p) for p in job) <= limit
    for job, after in itertools.pairwise(jobs):
        first = after[0]
        joins = first.part.group_id not in {p.part.group_id for p in job}
        assert not (joins and sum(size(p) for p in job) + size(first) <= limit)


def test_a_whole_request_of_every_group_is_one_job() -> None:
    parts = [part(0, 4), part(1, 2), part(2, 1)]
    assert pack(parts, BLOCK_BYTES.__getitem__, 100) == [parts]
    assert pack(parts, BLOCK_BYTES.__getitem__, 20) == [parts[:1], parts[1:]]


def test_refs_of_names_only_the_blocks_asked_for() -> None:
    a, b = part(0, 3), part(1, 2, first=1)
    refs = refs_of((a, b), {0: (0, 2), 1: (2,), 2: (0,)})
    assert refs == [a.refs[0], a.refs[2], b.refs[1]]
