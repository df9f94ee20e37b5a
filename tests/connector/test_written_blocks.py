"""Which blocks a step's forward pass writes (what a worker fences before it)."""

from __future__ import annotations

from hybridkv.connector.steps import ScheduledRequest, StepInput
from hybridkv.groups import GroupKind
from hybridkv.tools.sim.shapes import make_groups

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


def scheduled(
    req_id: str, computed: int, ids: list[list[int]] | None, *, whole: bool
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        num_computed_tokens=computed,
        num_scheduled_tokens=4,
        token_ids=list(range(64)),
        new_block_ids=ids,
        replaces_block_ids=whole,
    )


def test_new_blocks_of_running_requests_are_written() -> None:
    model_groups = make_groups((FULL, SW), block_size=4)
    step = StepInput(
        scheduled=(
            scheduled("a", 20, [[7], [8]], whole=False),
            scheduled("b", 20, None, whole=False),  # decoding inside a block it has
            scheduled("c", 0, [[0, 3], [9, 0]], whole=False),
        )
    )
    assert step.written_block_ids(model_groups) == (3, 7, 8, 9), "never the null block 0"


def test_prefix_cache_hits_of_a_new_request_are_only_read() -> None:
    model_groups = make_groups((FULL, SW, MAMBA), block_size=4)
    # 10 tokens computed (a prefix-cache hit): blocks 0 and 1 are whole and only read;
    # block 2 holds tokens 8..11, half computed, and is written. The Mamba group's
    # state block at that boundary (index 1) is written too.
    table = [[11, 12, 13, 14], [0, 22, 23, 24], [0, 32, 33, 0]]
    step = StepInput(scheduled=(scheduled("n", 10, table, whole=True),))
    assert step.written_block_ids(model_groups) == (13, 14, 23, 24, 32, 33)
    # With nothing computed every block of the table is written.
    fresh = StepInput(scheduled=(scheduled("f", 0, table, whole=True),))
    assert fresh.written_block_ids(model_groups) == tuple(
        sorted({b for g in table for b in g} - {0})
    )
