"""vLLM 0.32's scheduler output and requests as the connector's step input."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from hybridkv.integrations.vllm.plumbing import step_input, tensor_parallel_rank


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
    step = step_input(output, requests)
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
    assert tensor_parallel_rank(1) == 0
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2 but this worker cannot read"):
        tensor_parallel_rank(2)  # no distributed state in this process: never rank 0
