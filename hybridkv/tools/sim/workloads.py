"""Seeded request sequences the replay benchmarks share, and what each request could hit.

Pure functions, run in the benchmark's process: ``mixed_workload`` interleaves
four classes of request, round by round; ``docs_workload`` is the served
``long-doc-qa``; ``reusable_prefixes`` is the upper bound a policy's hits are
read against.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.groups import GroupKind
from hybridkv.tools.sim.model import prompt

BLOCK_SIZE = 4
"""Tokens per block of ``SHAPES``."""
SHAPES: dict[str, tuple[GroupKind, ...]] = {
    "sliding+full (Gemma 3-like)": (GroupKind.SLIDING_WINDOW, GroupKind.FULL),
    "mamba+full (Qwen3-Next-like)": (GroupKind.MAMBA, GroupKind.FULL),
}
"""The two model shapes the workloads are replayed on."""
MIXED_CLASSES = ("shared", "docs", "chat", "one-off")
"""The classes of request of ``mixed_workload``."""
DOCS, QUESTIONS = 16, 3
"""long-doc-qa: documents of 320 tokens, each asked this many times."""


@dataclass(frozen=True)
class Ask:
    """One request of a workload: its class and its prompt."""

    kind: str
    tokens: tuple[int, ...]


def mixed_workload(rounds: int, seed: int) -> list[Ask]:
    """The requests in order: each round, every class's requests, shuffled: ``shared``
    (two system prompts, each with a new user tail), ``docs`` (two of four documents,
    each with a new question), ``chat`` (two conversations, each turn resending the
    history) and ``one-off`` (six prompts never seen again)."""
    rng = random.Random(seed)
    fresh = iter(range(10_000, 1_000_000))
    systems = [prompt(96, seed=next(fresh)) for _ in range(2)]
    docs = [prompt(192, seed=next(fresh)) for _ in range(4)]
    chats: list[list[int]] = [[] for _ in range(2)]
    asks: list[Ask] = []
    for r in range(rounds):
        batch = [Ask("shared", tuple(s + prompt(32, seed=next(fresh)))) for s in systems]
        for d in (r % len(docs), (r + 1) % len(docs)):
            batch.append(Ask("docs", tuple(docs[d] + prompt(16, seed=next(fresh)))))
        for chat in chats:
            chat += prompt(48, seed=next(fresh))
            batch.append(Ask("chat", tuple(chat)))
        batch += [Ask("one-off", tuple(prompt(192, seed=next(fresh)))) for _ in range(6)]
        rng.shuffle(batch)
        asks += batch
    return asks


def docs_workload(seed: int) -> list[Ask]:
    """Long documents, each asked several questions, all in a seeded random order (the
    served ``long-doc-qa``): a document's first question stores it, and what admission
    holds back then is lost to its later ones."""
    rng = random.Random(seed)
    fresh = iter(range(2_000_000, 3_000_000))
    docs = [prompt(320, seed=next(fresh)) for _ in range(DOCS)]
    asks = [d for d in range(DOCS) for _ in range(QUESTIONS)]
    rng.shuffle(asks)
    return [Ask("docs", tuple(docs[d] + prompt(16, seed=next(fresh)))) for d in asks]


def reusable_prefixes(asks: Sequence[Ask], block_size: int = BLOCK_SIZE) -> list[int]:
    """Per request: the longest block-aligned prefix an earlier request computed."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ask in asks:
        blocks = len(ask.tokens) // block_size
        k = 0
        while k < blocks and ask.tokens[: (k + 1) * block_size] in seen:
            k += 1
        out.append(k * block_size)
        seen.update(ask.tokens[: (j + 1) * block_size] for j in range(blocks))
    return out
