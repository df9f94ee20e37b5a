"""Serving workloads for ``hybridkv bench``: who sends which prompt, in which order.

CLI process; pure data. A workload is a set of clients running at once; each
client sends its requests one after another, each after a think time, and a
request is a prefix (a document) and a question, or (in a conversation) the
client's history followed by a question. Prompts are token ids drawn from a
seeded generator, so every run of a preset sends the same tokens.

* ``long-doc-qa``: D documents of L tokens, each asked Q questions, in random
  or interleaved order, spread over C clients.
* ``multi-turn``: C clients x R rounds; each round sends the whole
  conversation (earlier prompts and the engine's answers) and a new question.
* ``restart``: D documents asked once each, four times: cold, on the engine's
  own prefix cache, on hybridkv's tiers after the engine's cache is reset,
  and on a restarted engine.
* ``shared``: two engines; each document is asked Q times on engine 0, then Q
  times on engine 1, which can only hit it through a shared pool.
* ``route``: C conversations of R rounds (each opens with a document of its
  own) and D documents asked Q times each, their requests one at a time in a
  seeded random order (``schedule``), for a router to send to one of two
  engines.
* ``mixed``: one engine; R rounds, each of every system prompt with a new
  question, questions on D documents in turn, a turn of each of C
  conversations and a few one-off prompts, one at a time in a seeded order
  (``schedule``): what eviction and admission policies are compared on.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridkv.tools.models import default_prompt_token_ids

Tokens = Callable[[int], tuple[int, ...]]
"""Draws ``n`` token ids from the workload's seeded generator."""


class WorkloadKind(enum.Enum):
    LONG_DOC_QA = "long-doc-qa"
    MULTI_TURN = "multi-turn"
    RESTART = "restart"
    SHARED = "shared"
    ROUTE = "route"
    MIXED = "mixed"


@dataclass(frozen=True, kw_only=True)
class Request:
    prefix: tuple[int, ...]
    """A document; empty in a conversation's later rounds (the history comes first)."""
    question: tuple[int, ...]
    max_tokens: int
    with_history: bool = False
    """Send the client's earlier prompts and answers first (a conversation)."""
    engine: int = 0
    """Which engine serves it (the shared workload has two)."""
    think_s: float = 0.0
    """Pause before sending it, after the client's previous answer."""


@dataclass(frozen=True, kw_only=True)
class Client:
    requests: tuple[Request, ...]


@dataclass(frozen=True, kw_only=True)
class WorkloadParams:
    """Every knob of every workload (each uses those its docstring names), and the
    engine's KV cache memory, which sets how much of the workload it can keep."""

    documents: int = 4
    document_tokens: int = 2048
    questions: int = 3
    question_tokens: int = 32
    answer_tokens: int = 16
    clients: int = 2
    rounds: int = 4
    think_s: float = 0.2
    order: str = "random"
    """long-doc-qa: 'random' or 'interleaved' (doc 0 q0, doc 1 q0, ..., doc 0 q1, ...)."""
    seed: int = 0
    kv_cache_mib: int = 256
    """The engine's KV cache memory (``kv_cache_memory_bytes``), MiB."""
    max_num_batched_tokens: int = 512
    """Prefill chunk; small enough that a sliding-window group needs few blocks."""
    cpu_tier_mib: int = 4096
    """Each engine's CPU tier, MiB (every setup with one)."""
    pool_mib: int = 2048
    """route: the shared pool's memory (valkey-server ``maxmemory``), MiB."""
    disk_tier_mib: int = 16384
    """Each engine's disk tier, MiB (the setups that compare eviction policies)."""
    system_prompts: int = 2
    """mixed: system prompts, each sent with a new user question every round."""
    one_offs: int = 2
    """mixed: prompts of ``document_tokens`` sent once, per round."""

    def replace(self, overrides: dict[str, str]) -> WorkloadParams:
        """These params with ``name=value`` strings applied (ValueError names bad ones)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for name, text in overrides.items():
            if name not in fields:
                raise ValueError(f"--param {name}: unknown; known: {sorted(fields)}")
            kind = type(getattr(self, name))
            try:
                changes[name] = kind(text)
            except ValueError:
                raise ValueError(f"--param {name}={text!r}: not a {kind.__name__}") from None
        params = dataclasses.replace(self, **changes)
        params.check()
        return params

    def check(self) -> None:
        problems = [
            f"{name}={getattr(self, name)} must be >= 1"
            for name in (
                "documents",
                "document_tokens",
                "questions",
                "question_tokens",
                "answer_tokens",
                "clients",
                "rounds",
                "kv_cache_mib",
                "max_num_batched_tokens",
                "cpu_tier_mib",
                "pool_mib",
                "disk_tier_mib",
                "system_prompts",
            )
            if getattr(self, name) < 1
        ]
        if self.think_s < 0:
            problems.append(f"think_s={self.think_s} must be >= 0")
        if self.order not in ("random", "interleaved"):
            problems.append(f"order={self.order!r} must be 'random' or 'interleaved'")
        if problems:
            raise ValueError("; ".join(problems))


PRESETS: dict[WorkloadKind, WorkloadParams] = {
    # 4 x 2048 tokens of documents: 3.6 times a 40 MiB KV cache on Gemma 3 270M.
    WorkloadKind.LONG_DOC_QA: WorkloadParams(
        documents=4, document_tokens=2048, questions=3, clients=2, kv_cache_mib=40
    ),
    # 6 conversations of up to 1408 tokens: 4.1 times a 36 MiB KV cache on Gemma 3 270M.
    WorkloadKind.MULTI_TURN: WorkloadParams(
        clients=6,
        rounds=4,
        document_tokens=1024,
        question_tokens=64,
        answer_tokens=32,
        think_s=2.0,
        kv_cache_mib=36,
    ),
    WorkloadKind.RESTART: WorkloadParams(documents=4, document_tokens=4096, questions=1),
    WorkloadKind.SHARED: WorkloadParams(documents=3, document_tokens=2048, questions=2),
    WorkloadKind.ROUTE: WorkloadParams(
        clients=4,
        rounds=3,
        documents=6,
        document_tokens=1024,
        questions=3,
        question_tokens=64,
        answer_tokens=16,
        kv_cache_mib=24,
        cpu_tier_mib=64,
        pool_mib=32,
    ),
    # Shared prompts, documents asked again, conversations and one-off prompts: about
    # 15000 distinct tokens, 4.2 times the 16 MiB CPU and 48 MiB disk tiers on Gemma 3
    # 270M (18 KiB a token, all layers); what comes back (about 2900 tokens) fits them.
    WorkloadKind.MIXED: WorkloadParams(
        clients=2,
        rounds=4,
        documents=3,
        document_tokens=512,
        questions=2,
        question_tokens=32,
        answer_tokens=8,
        think_s=0.0,
        system_prompts=2,
        one_offs=6,
        kv_cache_mib=16,
        cpu_tier_mib=16,
        disk_tier_mib=48,
    ),
}
"""Presets that finish in a few minutes per setup on 2 cores with Gemma 3 270M's shape."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    kind: WorkloadKind
    params: WorkloadParams
    clients: tuple[Client, ...]
    engines: int = 1
    schedule: tuple[int, ...] = ()
    """route: the order of requests, as client indices (each names that client's next)."""

    @property
    def num_requests(self) -> int:
        return sum(len(c.requests) for c in self.clients)

    @property
    def longest_sequence(self) -> int:
        """Tokens of the longest prompt plus its answer (the engine's ``max_model_len``
        must hold it)."""
        longest = 0
        for client in self.clients:
            history = 0
            for r in client.requests:
                prompt = (history if r.with_history else 0) + len(r.prefix) + len(r.question)
                history = prompt + r.max_tokens
                longest = max(longest, history)
        return longest

    @property
    def unique_prompt_tokens(self) -> int:
        """Tokens whose KV the workload can reuse: every distinct document once, and
        each conversation at its longest."""
        documents = {r.prefix for c in self.clients for r in c.requests if r.prefix}
        total = sum(len(d) for d in documents)
        for client in self.clients:
            if any(r.with_history for r in client.requests):
                total += self._conversation_tokens(client) - len(client.requests[0].prefix)
        return total

    @staticmethod
    def _conversation_tokens(client: Client) -> int:
        history = 0
        for r in client.requests:
            history = (history if r.with_history else 0) + len(r.prefix) + len(r.question)
            history += r.max_tokens
        return history

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "params": dataclasses.asdict(self.params),
            "clients": len(self.clients),
            "requests": self.num_requests,
            "engines": self.engines,
        }


def build_workload(kind: WorkloadKind, params: WorkloadParams, vocab_size: int) -> Workload:
    params.check()
    rng = random.Random(params.seed)

    def tokens(n: int) -> tuple[int, ...]:
        seed = rng.randrange(1 << 30)
        return tuple(default_prompt_token_ids(n, vocab_size=vocab_size, seed=seed))

    if kind is WorkloadKind.ROUTE:
        return _route_workload(params, tokens, rng)
    if kind is WorkloadKind.MIXED:
        return _mixed_workload(params, tokens, rng)
    if kind is WorkloadKind.MULTI_TURN:
        clients = tuple(
            _conversation(params, tokens, params.document_tokens, think_s=params.think_s)
            for _ in range(params.clients)
        )
        return Workload(kind=kind, params=params, clients=clients)
    docs = [tokens(params.document_tokens) for _ in range(params.documents)]

    def ask(d: int, engine: int = 0, think_s: float = 0.0) -> Request:
        return _request(params, tokens, docs[d], engine=engine, think_s=think_s)

    if kind is WorkloadKind.RESTART:
        requests = tuple(ask(d) for d in range(len(docs)))
        return Workload(kind=kind, params=params, clients=(Client(requests=requests),))
    if kind is WorkloadKind.SHARED:
        shared = tuple(
            ask(d, engine)
            for d in range(len(docs))
            for engine in (0, 1)
            for _ in range(params.questions)
        )
        return Workload(kind=kind, params=params, clients=(Client(requests=shared),), engines=2)
    asks = [d for _ in range(params.questions) for d in range(len(docs))]
    if params.order == "random":
        rng.shuffle(asks)
    asked = [ask(d, think_s=params.think_s) for d in asks]
    clients = tuple(
        Client(requests=tuple(asked[c :: params.clients])) for c in range(params.clients)
    )
    return Workload(kind=kind, params=params, clients=tuple(c for c in clients if c.requests))


def _request(
    params: WorkloadParams,
    tokens: Tokens,
    prefix: tuple[int, ...],
    *,
    with_history: bool = False,
    engine: int = 0,
    think_s: float = 0.0,
) -> Request:
    """A request of ``prefix`` and a new question."""
    return Request(
        prefix=prefix,
        question=tokens(params.question_tokens),
        max_tokens=params.answer_tokens,
        with_history=with_history,
        engine=engine,
        think_s=think_s,
    )


def _conversation(
    params: WorkloadParams, tokens: Tokens, opening_tokens: int, *, think_s: float = 0.0
) -> Client:
    """``rounds`` requests: an opening prompt of ``opening_tokens``, then questions sent
    after the history, each ``think_s`` after the answer before it."""
    return Client(
        requests=tuple(
            _request(
                params,
                tokens,
                tokens(opening_tokens) if r == 0 else (),
                with_history=r > 0,
                think_s=think_s if r > 0 else 0.0,
            )
            for r in range(params.rounds)
        )
    )


def _route_workload(params: WorkloadParams, tokens: Tokens, rng: random.Random) -> Workload:
    conversations = [
        _conversation(params, tokens, params.document_tokens) for _ in range(params.clients)
    ]
    documents = [tokens(params.document_tokens) for _ in range(params.documents)]
    asked = [
        Client(requests=tuple(_request(params, tokens, doc) for _ in range(params.questions)))
        for doc in documents
    ]
    clients = (*conversations, *asked)
    schedule = [c for c, client in enumerate(clients) for _ in client.requests]
    rng.shuffle(schedule)
    return Workload(
        kind=WorkloadKind.ROUTE,
        params=params,
        clients=clients,
        engines=2,
        schedule=tuple(schedule),
    )


def _mixed_workload(params: WorkloadParams, tokens: Tokens, rng: random.Random) -> Workload:
    """One engine; in each of ``rounds`` rounds, in a seeded order: every system prompt
    with a new question, a question on ``documents`` in turn (each asked ``questions``
    times over the run), a turn of each of ``clients`` conversations (the history
    resent) and ``one_offs`` prompts never seen again."""

    def request(prefix: tuple[int, ...]) -> Request:
        return _request(params, tokens, prefix)

    half = max(1, params.document_tokens // 2)
    systems = [tokens(half) for _ in range(params.system_prompts)]
    documents = [tokens(params.document_tokens) for _ in range(params.documents)]
    asked = [d for d in range(params.documents) for _ in range(params.questions)]
    conversations = [_conversation(params, tokens, half) for _ in range(params.clients)]
    shared = [
        Client(requests=tuple(request(system) for _ in range(params.rounds))) for system in systems
    ]
    docs = Client(requests=tuple(request(documents[d]) for d in asked))
    one_offs = Client(
        requests=tuple(
            request(tokens(params.document_tokens)) for _ in range(params.rounds * params.one_offs)
        )
    )
    clients = (*conversations, *shared, docs, one_offs)
    schedule: list[int] = []
    per_round = -(-len(asked) // params.rounds)
    for r in range(params.rounds):
        batch = list(range(len(conversations) + len(shared)))
        batch += [len(clients) - 2] * len(asked[r * per_round : (r + 1) * per_round])
        batch += [len(clients) - 1] * params.one_offs
        rng.shuffle(batch)
        schedule += batch
    return Workload(
        kind=WorkloadKind.MIXED, params=params, clients=clients, schedule=tuple(schedule)
    )
