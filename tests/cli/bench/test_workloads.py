"""Workloads: who sends what, deterministic per seed, parameters checked."""

from __future__ import annotations

import pytest

from hybridkv.cli.bench.workloads import (
    PRESETS,
    WorkloadKind,
    WorkloadParams,
    build_workload,
)

VOCAB = 32768


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    params = PRESETS[WorkloadKind.LONG_DOC_QA]
    one = build_workload(WorkloadKind.LONG_DOC_QA, params, VOCAB)
    two = build_workload(WorkloadKind.LONG_DOC_QA, params, VOCAB)
    other = build_workload(WorkloadKind.LONG_DOC_QA, params.replace({"seed": "1"}), VOCAB)
    assert one == two
    assert one.clients[0].requests[0].prefix != other.clients[0].requests[0].prefix


def test_long_doc_qa_asks_every_document_q_times_over_c_clients() -> None:
    params = WorkloadParams(documents=3, document_tokens=100, questions=4, clients=2)
    workload = build_workload(WorkloadKind.LONG_DOC_QA, params, VOCAB)
    requests = [r for c in workload.clients for r in c.requests]
    assert len(workload.clients) == 2 and workload.num_requests == 12
    documents = {r.prefix for r in requests}
    assert len(documents) == 3 and all(len(d) == 100 for d in documents)
    assert all(sum(r.prefix == d for r in requests) == 4 for d in documents)
    assert len({r.question for r in requests}) == 12  # every question is new
    assert workload.unique_prompt_tokens == 300
    assert workload.longest_sequence == 100 + params.question_tokens + params.answer_tokens


def test_interleaved_order_cycles_through_the_documents() -> None:
    params = WorkloadParams(documents=3, document_tokens=50, questions=2, clients=1,
                            order="interleaved")  # fmt: skip
    (client,) = build_workload(WorkloadKind.LONG_DOC_QA, params, VOCAB).clients
    prefixes = [r.prefix for r in client.requests]
    assert prefixes[:3] == prefixes[3:] and len(set(prefixes[:3])) == 3


def test_multi_turn_rounds_carry_the_history() -> None:
    params = WorkloadParams(clients=3, rounds=4, document_tokens=200, question_tokens=10,
                            answer_tokens=5, think_s=0.25)  # fmt: skip
    workload = build_workload(WorkloadKind.MULTI_TURN, params, VOCAB)
    assert len(workload.clients) == 3 and workload.num_requests == 12
    for client in workload.clients:
        first, *later = client.requests
        assert len(first.prefix) == 200 and not first.with_history and first.think_s == 0
        assert all(r.with_history and not r.prefix and r.think_s == 0.25 for r in later)
    # A conversation ends at document + 4 questions + 4 answers.
    assert workload.longest_sequence == 200 + 4 * 10 + 4 * 5
    assert workload.unique_prompt_tokens == 3 * (200 + 4 * 10 + 4 * 5)


def test_shared_asks_each_document_on_engine_0_then_on_engine_1() -> None:
    params = WorkloadParams(documents=2, document_tokens=64, questions=2)
    workload = build_workload(WorkloadKind.SHARED, params, VOCAB)
    (client,) = workload.clients
    assert workload.engines == 2
    assert [r.engine for r in client.requests] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert client.requests[0].prefix == client.requests[3].prefix
    assert client.requests[3].prefix != client.requests[4].prefix


def test_restart_asks_each_document_once() -> None:
    params = WorkloadParams(documents=3, document_tokens=64)
    (client,) = build_workload(WorkloadKind.RESTART, params, VOCAB).clients
    assert len({r.prefix for r in client.requests}) == len(client.requests) == 3


def test_params_are_checked_and_overrides_typed() -> None:
    params = PRESETS[WorkloadKind.MULTI_TURN].replace({"rounds": "2", "think_s": "0"})
    assert params.rounds == 2 and params.think_s == 0.0
    with pytest.raises(ValueError, match="unknown"):
        params.replace({"round": "2"})
    with pytest.raises(ValueError, match="not a int"):
        params.replace({"rounds": "two"})
    with pytest.raises(ValueError, match="rounds=0 must be >= 1"):
        params.replace({"rounds": "0"})
    with pytest.raises(ValueError, match="order"):
        params.replace({"order": "sorted"})


def test_mixed_sends_every_class_in_a_seeded_order_one_client_turn_at_a_time() -> None:
    params = PRESETS[WorkloadKind.MIXED].replace({"document_tokens": "64", "rounds": "3"})
    workload = build_workload(WorkloadKind.MIXED, params, VOCAB)
    assert workload == build_workload(WorkloadKind.MIXED, params, VOCAB)
    *conversations, system0, system1, docs, one_offs = workload.clients
    assert len(conversations) == params.clients
    for conversation in conversations:  # the history resent from the second turn on
        assert [r.with_history for r in conversation.requests] == [False, True, True]
    for system in (system0, system1):  # one prefix, a new question each round
        assert len({r.prefix for r in system.requests}) == 1 and len(system.requests) == 3
        assert len({r.question for r in system.requests}) == 3
    asked = [r.prefix for r in docs.requests]
    assert len(set(asked)) == params.documents
    assert all(asked.count(d) == params.questions for d in set(asked))
    assert len({r.prefix for r in one_offs.requests}) == 3 * params.one_offs
    # The schedule names each client once per request it sends.
    assert sorted(workload.schedule) == sorted(
        c for c, client in enumerate(workload.clients) for _ in client.requests
    )
    first_round = workload.schedule[: len(workload.schedule) // 3]
    assert set(range(len(conversations) + 2)) <= set(first_round)
