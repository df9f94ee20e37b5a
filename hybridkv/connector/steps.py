"""What an engine tells the scheduler side about each step, and the lookup answer.

Plain data, scheduler process; an engine adapter (``hybridkv.integrations``)
fills these from its own request and scheduler-output types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hybridkv.groups import ModelGroups
from hybridkv.groups.kinds import rules_for


class LookupResult(NamedTuple):
    num_tokens: int
    """Tokens to load beyond what the engine already computed (0: nothing)."""
    is_async: bool
    """Always True when ``num_tokens`` > 0: loads finish between steps."""


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


class StateHandoff(NamedTuple):
    """A recurrent state the engine hands over to store: the one after ``num_tokens``
    tokens of a request, held in its block ``block_id`` of group ``group_id``.

    Engines whose state blocks move (speculative columns, prefill checkpoints)
    name each committed state this way instead of leaving it at its position.
    """

    group_id: int
    block_id: int
    num_tokens: int


@dataclass(frozen=True, kw_only=True)
class StepInput:
    scheduled: Sequence[ScheduledRequest] = ()
    preempted_req_ids: frozenset[str] = frozenset()
    finished_req_ids: frozenset[str] = frozenset()
    """Requests the engine finished since the last step (their blocks are free)."""
    state_handoffs: Mapping[str, Sequence[StateHandoff]] = field(default_factory=dict)
    """Per request, the states this step hands over (groups the engine hands over)."""
    other_block_ids: Sequence[int] = ()
    """Blocks handed this step to groups the connector does not serve, from the pool
    its groups share: the forward pass may write them, so they are fenced too."""

    def written_block_ids(self, model_groups: ModelGroups) -> tuple[int, ...]:
        """The blocks this step's forward pass may write, in any group: those handed to
        a request this step, less the blocks of a new or resumed request's table that
        lie wholly before its computed tokens (prefix-cache hits, only read). A Mamba
        group's state block at that boundary counts as written (the step may update
        it). The null block 0 is never written."""
        written = {b for b in self.other_block_ids if b}
        for req in self.scheduled:
            if req.new_block_ids is None:
                continue
            for group_id, ids in enumerate(req.new_block_ids):
                group = model_groups.groups[group_id]
                first = 0
                if req.replaces_block_ids:
                    first = req.num_computed_tokens // group.block_size
                    # A state block at the boundary: the step may advance it.
                    first -= not rules_for(group.kind).blocks_stay_computed and first > 0
                written.update(b for b in ids[first:] if b)
        return tuple(sorted(written))
