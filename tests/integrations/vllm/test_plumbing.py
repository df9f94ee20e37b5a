"""vLLM 0.32's scheduler output and requests as the connector's step input."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.integrations.vllm.plumbing import StageGroups, stage_groups, step_input, worker_rank
from hybridkv.integrations.vllm.served import ServedGroups
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tools.sim.shapes import make_groups


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
    )


def test_scheduler_output_becomes_step_input() -> None:
    new_req, old_req, resumed = (
        _request("new", list(range(3, 70))),
        _request("old", list(range(5, 40))),
        _request("back", list(range(7, 50))),
    )
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [
        NewRequestData.from_request(new_req, ([1, 2, 3], [4, 5, 6]))  # type: ignore[arg-type]
    ]
    output.scheduled_cached_reqs = CachedRequestData(
        req_ids=["old", "back", "gone"],
        resumed_req_ids={"back"},
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None, ([7], [8]), ([9], [10])],
        num_computed_tokens=[32, 0, 5],
        num_output_tokens=[0, 0, 0],
    )
    output.num_scheduled_tokens = {"new": 64, "old": 3, "back": 43, "gone": 1}
    output.preempted_req_ids = {"x"}
    requests = {"new": new_req, "old": old_req, "back": resumed}
    served = ServedGroups(engine_group_ids=(0, 1), num_engine_groups=2, device_group_ids=(0, 1))
    step = step_input(output, requests, served)
    by_id = {r.req_id: r for r in step.scheduled}
    assert set(by_id) == {"new", "old", "back"}  # unknown requests are skipped
    assert by_id["new"].replaces_block_ids and by_id["new"].new_block_ids == ((1, 2, 3), (4, 5, 6))
    assert by_id["new"].num_scheduled_tokens == 64 and list(by_id["new"].token_ids) == list(
        range(3, 70)
    )
    assert by_id["old"].new_block_ids is None and not by_id["old"].replaces_block_ids
    assert by_id["old"].num_computed_tokens == 32
    assert by_id["back"].replaces_block_ids and by_id["back"].new_block_ids == ((7,), (8,))
    assert step.preempted_req_ids == frozenset({"x"})


def test_one_rank_needs_no_distributed_state_but_several_do() -> None:
    assert worker_rank(1, 1) == WorkerRank()
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2, pipeline_parallel_size=1 but"):
        worker_rank(2, 1)  # no distributed state in this process: never rank 0
    with pytest.raises(RuntimeError, match="pipeline_parallel_size=2 but this worker cannot"):
        worker_rank(1, 2)


def test_each_stages_groups_reach_the_scheduler_through_the_handshake() -> None:
    full = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL))
    stage0 = ModelGroups(groups=(full.groups[0], replace(full.groups[1], layer_names=())))
    stage1 = ModelGroups(groups=(replace(full.groups[0], layer_names=("s.1",)), full.groups[1]))
    # As vLLM's engine core gathers them: pickled by each worker, keyed (stage, tp rank).
    sent = {
        (p, t): pickle.loads(pickle.dumps(StageGroups(g)))
        for p, g in enumerate((stage0, stage1))
        for t in range(2)
    }
    assert stage_groups(sent, tp_size=2, pp_size=2) == (stage0, stage1)
    with pytest.raises(RuntimeError, match="stage 1, tensor-parallel rank 1"):
        stage_groups({k: v for k, v in sent.items() if k != (1, 1)}, tp_size=2, pp_size=2)
    with pytest.raises(RuntimeError, match="ranks of pipeline stage 0 hold other layers"):
        stage_groups({**sent, (0, 1): StageGroups(stage1)}, tp_size=2, pp_size=2)
