"""A client's progress through its requests: prompts with history, think times."""

from __future__ import annotations

import pytest

from hybridkv.cli.bench.replay import ClientRun, make_record
from hybridkv.cli.bench.workloads import Client, Request


def test_a_conversation_sends_history_and_waits_its_think_time() -> None:
    client = Client(requests=(
        Request(prefix=(1, 2, 3), question=(4,), max_tokens=2),
        Request(prefix=(), question=(9,), max_tokens=2, with_history=True, think_s=0.5),
        Request(prefix=(7,), question=(8,), max_tokens=2, think_s=0.25),
    ))  # fmt: skip
    run = ClientRun(3, client, start=100.0)
    assert run.ready(100.0) and not run.ready(99.9)
    index, request, prompt = run.next_request()
    assert (index, prompt) == (0, [1, 2, 3, 4]) and not run.ready(200.0)  # busy
    record = make_record(
        run, index, request, prompt, phase="p", replay_start=100.0, sent=100.0,
        first_token=100.2, done=101.0, output=[5, 6], top_logprobs=[], num_cached_tokens=0,
    )  # fmt: skip
    assert record.client == 3 and record.ttft_s == pytest.approx(0.2)
    assert record.latency_s == 1.0 and record.sent_s == 0.0 and record.sent_at == 100.0
    run.finish(prompt, [5, 6], now=101.0)
    assert not run.ready(101.4) and run.ready(101.5)
    _, _, prompt = run.next_request()
    assert prompt == [1, 2, 3, 4, 5, 6, 9]
    run.finish(prompt, [6], now=102.0)
    _, _, prompt = run.next_request()
    assert prompt == [7, 8]  # no history: a new document
    run.finish(prompt, [1], now=103.0)
    assert run.done and not run.ready(1e9)


def test_a_request_without_a_first_token_counts_its_latency_as_ttft() -> None:
    run = ClientRun(0, Client(requests=(Request(prefix=(1,), question=(), max_tokens=0),)), 0.0)
    index, request, prompt = run.next_request()
    record = make_record(
        run, index, request, prompt, phase="p", replay_start=0.0, sent=1.0, first_token=None,
        done=3.0, output=[], top_logprobs=[], num_cached_tokens=0,
    )  # fmt: skip
    assert record.ttft_s == record.latency_s == 2.0
