"""What one request of a replay measured, and a client's progress through its requests.

Any process (the offline engine's process replays with these; the CLI process
does for the server); pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.cli.bench.workloads import Client, Request

TOP_LOGPROBS = 5
"""Log-probabilities asked per generated token, to tell bfloat16 near-ties from errors."""


@dataclass(kw_only=True)
class Record:
    """One request: what was sent and what came back, with its timings."""

    setup: str
    client: int
    index: int
    """The request's position in its client's list."""
    engine: int
    phase: str
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens the engine did not compute (its own cache and hybridkv's)."""
    sent_s: float
    """When it was sent, from the start of the replay."""
    sent_at: float
    """When it was sent, ``time.perf_counter()`` (system-wide on Linux: the same clock
    in every process)."""
    ttft_s: float
    latency_s: float
    output_token_ids: list[int]
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    reusable_tokens: int = 0
    """Prompt tokens an earlier request of the run computed (filled in by the report)."""
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.phase, self.client, self.index)

    def to_json(self, *, with_tokens: bool = False) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("prompt_token_ids",)}
        if not with_tokens:
            out.pop("top_logprobs")
        return out


class ClientRun:
    """A client replaying its requests: what to send next, and when."""

    def __init__(self, client_id: int, client: Client, start: float) -> None:
        self.client_id = client_id
        self.requests = client.requests
        self.position = 0
        self.busy = False
        self.due = start + (client.requests[0].think_s if client.requests else 0.0)
        self.history: list[int] = []

    @property
    def done(self) -> bool:
        return self.position >= len(self.requests)

    def ready(self, now: float) -> bool:
        return not self.done and not self.busy and now >= self.due

    def next_request(self) -> tuple[int, Request, list[int]]:
        """The next request's index, itself and its prompt; the client is busy until
        ``finish``."""
        index, request = self.position, self.requests[self.position]
        prompt = [*(self.history if request.with_history else ()), *request.prefix]
        prompt += request.question
        self.busy = True
        return index, request, prompt

    def finish(self, prompt: Sequence[int], output: Sequence[int], now: float) -> None:
        self.history = [*prompt, *output]
        self.position += 1
        self.busy = False
        if not self.done:
            self.due = now + self.requests[self.position].think_s


def make_record(
    run: ClientRun,
    index: int,
    request: Request,
    prompt: list[int],
    *,
    phase: str,
    replay_start: float,
    sent: float,
    first_token: float | None,
    done: float,
    output: Sequence[int],
    top_logprobs: list[dict[str, float]],
    num_cached_tokens: int,
) -> Record:
    return Record(
        setup="",
        client=run.client_id,
        index=index,
        engine=request.engine,
        phase=phase,
        num_prompt_tokens=len(prompt),
        num_cached_tokens=num_cached_tokens,
        sent_s=sent - replay_start,
        sent_at=sent,
        ttft_s=(first_token if first_token is not None else done) - sent,
        latency_s=done - sent,
        output_token_ids=list(output),
        top_logprobs=top_logprobs,
        prompt_token_ids=prompt,
    )


def sleep_until(deadline: float, *, at_most_s: float = 0.05) -> None:
    time.sleep(max(0.0, min(deadline - time.perf_counter(), at_most_s)))
