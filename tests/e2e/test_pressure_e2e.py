"""Tiers too small for every conversation (real vLLM): the second turns' tokens, and
whether the tiers keep some conversations whole.

A Qwen3-Next-shaped tiny model (a Mamba group and a full-attention group): a hit
reads every full-attention block up to its end and the Mamba state at its end, and
vLLM keeps that state only where a step ended. Seven two-turn conversations go
through a CPU tier and a disk tier that together hold about three of their first
turns, sized in the engine's pages, with ``admission: reused`` and
``admission_keep_slower``. Whatever the tiers
keep, every second turn gives the engine alone's greedy tokens. The second turns come
in the order of the first: under recency alone each conversation is evicted just
before it comes back. The first second turn finds its prefix lost, so the slower
tiers keep what they hold (``connector.returns.KeptReturns``), and at least three
second turns hit, right after the first turns and after a restart (where the disk's
blocks hit before are noted reused).
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind, default_prompt_token_ids
from tests.e2e.expect import assert_same_outputs, counter, describe, engine_facts
from tests.e2e.harness import Harness
from tests.e2e.scenarios import RESET, SETTLE, engine, generate
from tests.support.disk import segment_bytes

pytestmark = pytest.mark.slow

NUM_CONVERSATIONS = 7
FIRST_TURN_TOKENS = tuple(250 + 33 * i for i in range(NUM_CONVERSATIONS))
"""250 to 448 tokens: none a multiple of the block size."""
QUESTION_TOKENS = 24
MAX_TOKENS = 16
CONVERSATIONS_HELD = 3
"""The tiers' room, in conversations' first turns (every group's blocks)."""
MIN_SECOND_TURN_HITS = 3
OBJECTS_PER_SEGMENT = 3


def _first_turns(vocab: int) -> list[list[int]]:
    return [
        default_prompt_token_ids(n, vocab_size=vocab, seed=700 + i)
        for i, n in enumerate(FIRST_TURN_TOKENS)
    ]


def _questions(vocab: int) -> list[list[int]]:
    return [
        default_prompt_token_ids(QUESTION_TOKENS, vocab_size=vocab, seed=800 + i)
        for i in range(NUM_CONVERSATIONS)
    ]


def _tier_sizes(facts: dict[str, Any]) -> tuple[int, int, int]:
    """CPU capacity, disk capacity and disk segment, in bytes, from the engine's pages and
    blocks: the disk holds about ``CONVERSATIONS_HELD`` first turns' objects (each full
    block and up to two states), three to a segment; the CPU tier a quarter of that. (With
    256 KiB pages and 128-token blocks: about 1 MiB and 5 MiB.)"""
    page_bytes = max(int(g["page_size_bytes"]) for g in facts["groups"])
    block_size = min(int(g["block_size"]) for g in facts["groups"] if g["kind"] != "mamba")
    objects = [(n + MAX_TOKENS) // block_size + 2 for n in FIRST_TURN_TOKENS]
    held = -(-CONVERSATIONS_HELD * sum(objects) // len(objects))
    num_segments = -(-held // OBJECTS_PER_SEGMENT)
    segment = segment_bytes(OBJECTS_PER_SEGMENT, page_bytes)
    return max(2, held // 4) * page_bytes, num_segments * segment, segment


def _second_turns(harness: Harness) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The second turns' records served by the tiers (right after the first turns, then
    after a restart) and those of the engine alone. Both plans run once per session."""
    model = harness.model(TinyModelKind.QWEN3_NEXT)
    vocab = model.vocab_size
    first_turns = _first_turns(vocab)
    questions = _questions(vocab)

    def first(label: str) -> list[dict[str, Any]]:
        return [generate(f"{label}-{i}", [p]) for i, p in enumerate(first_turns)]

    def second(label: str) -> list[dict[str, Any]]:
        return [
            {
                "op": "next_turn",
                "label": f"{label}-{i}",
                "after": f"first-{i}",
                "questions": [q],
                "max_tokens": MAX_TOKENS,
            }
            for i, q in enumerate(questions)
        ]

    alone = harness.run(
        "pressure-alone", [engine("alone", model, [*first("first"), *second("second")])]
    )
    assert alone.returncode == 0, alone.describe_failure()
    cpu_bytes, disk_bytes, segment_bytes = _tier_sizes(engine_facts(alone, "alone"))
    connector: dict[str, Any] = {
        "admission": "reused",
        "admission_keep_slower": True,
        "tiers": [
            {"kind": "cpu", "capacity_bytes": cpu_bytes},
            {
                "kind": "disk",
                "path": str(harness.cache_dir("pressure-e2e") / "disk"),
                "capacity_bytes": disk_bytes,
                "segment_bytes": segment_bytes,
            },
        ],
    }
    plan = [
        engine(
            "served", model, [*first("first"), SETTLE, RESET, *second("second"), SETTLE], connector
        ),
        engine("restarted", model, second("again"), connector),
    ]
    run = harness.run("pressure-e2e", plan)
    assert run.returncode == 0, run.describe_failure()
    served = [
        run.step(name, f"{label}-{i}")
        for name, label in (("served", "second"), ("restarted", "again"))
        for i in range(NUM_CONVERSATIONS)
    ]
    reference = [alone.step("alone", f"second-{i}") for i in range(NUM_CONVERSATIONS)]
    return served, reference + reference


def test_second_turns_under_pressure_give_the_engine_alones_tokens(harness: Harness) -> None:
    served, reference = _second_turns(harness)
    model = harness.model(TinyModelKind.QWEN3_NEXT)
    for i, (step, alone) in enumerate(zip(served, reference, strict=True)):
        assert_same_outputs(step, alone, model, f"second turn {i % NUM_CONVERSATIONS}")
        assert counter(step["connector"], "loads", outcome="failed") == 0, describe(step)


def test_tiers_under_pressure_keep_some_conversations_whole(harness: Harness) -> None:
    served, _ = _second_turns(harness)
    hits = [step["num_cached_tokens"][0] for step in served]
    right_after, restarted = hits[:NUM_CONVERSATIONS], hits[NUM_CONVERSATIONS:]
    for half in (right_after, restarted):
        assert sum(h > 0 for h in half) >= MIN_SECOND_TURN_HITS, f"{right_after} {restarted}"
