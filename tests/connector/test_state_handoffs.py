"""States an engine hands over (``StateHandoff``): stored from the very block it names,
under the key of the tokens it names, and only while the request still holds them."""

from __future__ import annotations

from pathlib import Path

from hybridkv.connector.metadata import BlockTransfer, StorePlan
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.setup import build_store, lookup_for_store
from hybridkv.connector.steps import ScheduledRequest, StateHandoff, StepInput
from hybridkv.groups import GroupKind
from hybridkv.tools.sim.build import make_config
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups

GROUPS = make_groups([GroupKind.MAMBA, GroupKind.FULL], block_size=4)
TOKENS = prompt(16)


def scheduler(tmp_path: Path) -> ConnectorScheduler:
    config = make_config(tmp_path)
    store = build_store(config.tier_configs, config)
    return ConnectorScheduler(GROUPS, lookup_for_store(store), handoff_group_ids=frozenset({0}))


def first_step(req_id: str) -> ScheduledRequest:
    """The whole prompt in one step; the Mamba table is nulls but its last two blocks."""
    return ScheduledRequest(
        req_id=req_id,
        num_computed_tokens=0,
        num_scheduled_tokens=len(TOKENS),
        token_ids=TOKENS,
        new_block_ids=[[0, 0, 21, 22], [31, 32, 33, 34]],
        replaces_block_ids=True,
    )


def transfers(plan: StorePlan, group_id: int) -> list[BlockTransfer]:
    return [t for t in plan.transfers if t.group_id == group_id]


def test_a_state_is_stored_from_the_block_named_under_the_key_of_its_tokens(
    tmp_path: Path,
) -> None:
    sched = scheduler(tmp_path)
    sched.add_request("r")
    # A checkpoint: the state after 12 tokens, exported into block 21 (column 2).
    step = StepInput(scheduled=[first_step("r")], state_handoffs={"r": [StateHandoff(0, 21, 12)]})
    (plan,) = sched.build_metadata(step).stores
    (state,) = transfers(plan, 0)
    assert (state.block_ids, state.block_indices) == ((21,), (2,))
    expected_hash = sched.builders[0].block_hashes(0, sched._requests["r"].hasher.block_hashes, [2])
    assert state.block_hashes == tuple(expected_hash)
    # Full attention keeps its KV at its positions: stored from the table as before.
    (full,) = transfers(plan, 1)
    assert full.block_ids == (31, 32, 33, 34)
    # The state at the step's end (block 22) was not handed over: not stored.
    assert sched.stats.state_handoffs == 1 and sched.stats.state_handoffs_not_stored == 0


def test_states_of_requests_finished_or_preempted_in_the_step_are_dropped(
    tmp_path: Path,
) -> None:
    sched = scheduler(tmp_path)
    for req_id in ("live", "finished", "preempted", "idle"):
        sched.add_request(req_id)
        sched.build_metadata(StepInput(scheduled=[first_step(req_id)]))
    step = StepInput(
        finished_req_ids=frozenset({"finished"}),
        preempted_req_ids=frozenset({"preempted"}),
        state_handoffs={
            "finished": [StateHandoff(0, 41, 8)],
            "preempted": [StateHandoff(0, 42, 8)],
            "idle": [StateHandoff(0, 43, 8)],  # not scheduled this step, still running
            "live": [
                StateHandoff(0, 44, 12),
                StateHandoff(0, 45, 6),  # inside a block: no hit reads it
                StateHandoff(1, 46, 8),  # a group whose blocks keep their KV
                StateHandoff(0, 0, 4),  # the null block
            ],
        },
    )
    stores = {plan.req_id: plan for plan in sched.build_metadata(step).stores}
    assert sorted(stores) == ["idle", "live"]
    assert [t.block_ids for t in stores["idle"].transfers] == [(43,)]
    assert [t.block_ids for t in stores["live"].transfers] == [(44,)]
    assert sched.stats.state_handoffs == 7
    assert sched.stats.state_handoffs_not_stored == 5


def test_a_state_sent_recently_is_not_sent_again(tmp_path: Path) -> None:
    sched = scheduler(tmp_path)
    for req_id in ("a", "b"):  # the same tokens: the same keys
        sched.add_request(req_id)
        step = StepInput(
            scheduled=[first_step(req_id)], state_handoffs={req_id: [StateHandoff(0, 21, 16)]}
        )
        plans = sched.build_metadata(step).stores
        sent = sorted(t.group_id for p in plans for t in p.transfers)
        assert sent == ([0, 1] if req_id == "a" else [])
