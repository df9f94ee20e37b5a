"""The scheduler side's record of one request: its hashes, block ids and load.

Scheduler process; plain data and bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.connector.metadata import LoadPlan, LoadResult
from hybridkv.hits import Hit
from hybridkv.keys import RequestBlockHasher


class GroupBlockTable:
    """Block ids of one request, one list per KV cache group, appended step by step."""

    def __init__(self, num_groups: int) -> None:
        self.block_ids: list[list[int]] = [[] for _ in range(num_groups)]

    def append(self, new_block_ids: Sequence[Sequence[int]] | None) -> None:
        """Add one step's new blocks (one sequence per group; None means no new blocks)."""
        if new_block_ids is None:
            return
        if len(new_block_ids) != len(self.block_ids):
            raise ValueError(
                f"new_block_ids has {len(new_block_ids)} groups; this table has "
                f"{len(self.block_ids)} (pass one sequence per group, empty for none)"
            )
        for ids, new in zip(self.block_ids, new_block_ids, strict=True):
            ids.extend(new)

    def clear(self) -> None:
        for ids in self.block_ids:
            ids.clear()


@dataclass(kw_only=True)
class RequestState:
    hasher: RequestBlockHasher
    table: GroupBlockTable
    hit: Hit | None = None
    """The last lookup's hit, until the engine allocates for it."""
    hit_base_tokens: int = 0
    hit_tier: int | None = None
    load: LoadPlan | None = None
    """The load sent to the workers and not yet reported by all of them."""
    load_results: dict[int, LoadResult] = field(default_factory=dict)
    """Results of ``load`` so far, by tensor-parallel rank."""
    num_failed_loads: int = 0
    finished: bool = False
    cacheable: bool = True
    num_noted: int = 0
    """Hashes of its chain noted for admission (``connector.admission``)."""
    shared_hashes: int = 0
    """Its chain's first hashes another request reached too (or it loaded)."""
    admitted_hashes: int = 0
    """Blocks ending within its first hashes were sent to be admitted."""
    return_judged: bool = False
    """Whether the tiers were found to keep its shared prefix or not
    (``connector.returns.KeptReturns``)."""
    engine_cached_tokens: int = 0
    """Tokens the engine's own cache held at its last lookup."""
    planned_tokens: int = 0
    """Where its last step's stores were planned up to (``StorePlanner.plan``)."""

    def hash_up_to(self, token_ids: Sequence[int], end: int) -> None:
        """Hash the request's tokens up to ``end`` (those not hashed yet)."""
        have = self.hasher.num_tokens
        if end > have:
            self.hasher.extend(token_ids[have:end])
