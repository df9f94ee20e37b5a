"""What an engine tells the scheduler side each step, and what it gets back.

Plain data, scheduler process; the engine adapter (``hybridkv.vllm`` for
vLLM) fills these from its own request and scheduler-output types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class LookupResult(NamedTuple):
    num_tokens: int
    """Tokens to load beyond what the engine already computed (0: nothing)."""
    is_async: bool
    """Always True when ``num_tokens`` > 0: loads finish between steps."""


class LoadOutcome(NamedTuple):
    req_id: str
    num_tokens: int
    """Where the request resumes: the planned count, or less after failures."""
    ok: bool


@dataclass(frozen=True, kw_only=True)
class ScheduledRequest:
    """One request scheduled in a step, as the engine reports it."""

    req_id: str
    num_computed_tokens: int
    """Tokens computed before this step."""
    num_scheduled_tokens: int
    token_ids: Sequence[int]
    """Every token id known (prompt and output so far; no speculative tokens)."""
    new_block_ids: Sequence[Sequence[int]] | None
    """Per group, block ids allocated this step (None: none)."""
    replaces_block_ids: bool = False
    """True when ``new_block_ids`` is the request's whole table (new or resumed)."""


@dataclass(frozen=True, kw_only=True)
class StepInput:
    scheduled: Sequence[ScheduledRequest] = ()
    preempted_req_ids: frozenset[str] = frozenset()


@dataclass(kw_only=True)
class SchedulerStats:
    """Monotonic counters of the scheduler side."""

    lookups: int = 0
    lookup_tokens: int = 0
    """Tokens asked about (beyond what the engine had)."""
    hits: int = 0
    hit_tokens: int = 0
    misses: int = 0
    loads_planned: int = 0
    loads_unplanned: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    store_blocks_planned: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))
