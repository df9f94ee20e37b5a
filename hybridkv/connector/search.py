"""One engine's hit search over every rank's tiers: the scheduler's lookups and a router's.

Scheduler process, and any process that answers lookups for an engine (``hybridkv
route``). ``HitSearch`` holds what fixes an engine's answer (its groups, every rank's
keys, its alignment and drafting) and asks a ``RankedLookup`` for the blocks
``find_longest_hit`` needs: a block counts as stored only when every rank holds it
(every rank with layers of its group, ``EngineRanks.holders``).
It only asks; what a caller does about missing blocks it does after.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.connector.ranks import EngineRanks
from hybridkv.groups import ModelGroups
from hybridkv.hits import Contains, Hit, find_longest_hit
from hybridkv.keys import BlockHash, KeyBuilder
from hybridkv.tiers.base import StoreKey

IsStoring = Callable[[int, BlockHash], bool]
"""``is_storing(group_id, block_hash)``: a store of that block is under way."""


class RankedLookup(Protocol):
    """Answers "does rank ``rank`` hold each key", in any tier or in one (``KeyLookup``)."""

    def contains_many(
        self, keys: Sequence[StoreKey], *, rank: int = 0, tier_index: int | None = None
    ) -> list[bool]: ...


@dataclass(frozen=True, kw_only=True)
class HitSearch:
    """The longest hit an engine can resume from, with its rules (see ``find_longest_hit``)."""

    model_groups: ModelGroups
    ranks: EngineRanks
    alignment_tokens: int
    use_eagle: bool = False
    eagle_group_ids: Collection[int] | None = None
    """The groups whose hits drop a block for drafting; None: every group."""
    builders: tuple[KeyBuilder, ...] = field(default=(), init=False, repr=False, compare=False)
    """Every rank's store keys, built from the fields above."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "builders", self.ranks.builders())

    def search(
        self,
        lookup: RankedLookup,
        chain: Sequence[BlockHash],
        max_hit_tokens: int,
        *,
        tier_index: int | None = None,
        is_storing: IsStoring | None = None,
        held_elsewhere: Contains | None = None,
    ) -> Hit:
        """The hit of a request whose chained hashes are ``chain``, over every tier
        (``tier_index`` None) or one; blocks ``is_storing`` names count as stored, and
        so do those ``held_elsewhere`` answers for (tiers the lookup cannot reach,
        known otherwise)."""

        def contains(group_id: int, indices: Sequence[int]) -> Sequence[bool]:
            hashes = self.builders[0].block_hashes(group_id, chain, indices)
            found = [True] * len(hashes)
            known = (
                [False] * len(hashes)
                if held_elsewhere is None
                else held_elsewhere(group_id, indices)
            )
            todo = [
                i
                for i, h in enumerate(hashes)
                if not known[i] and (is_storing is None or not is_storing(group_id, h))
            ]
            for rank in self.ranks.holders[group_id]:  # stored: held by every rank
                if not todo:
                    break
                keys = self.builders[rank].keys_of(group_id, (hashes[i] for i in todo))
                answers = lookup.contains_many(keys, rank=rank, tier_index=tier_index)
                for i, hit in zip(todo, answers, strict=True):
                    found[i] = hit
                todo = [i for i in todo if found[i]]
            return found

        return self.search_in(contains, max_hit_tokens)

    def search_in(self, contains: Contains, max_hit_tokens: int) -> Hit:
        """The hit over blocks ``contains`` answers for (by group and block index)."""
        return find_longest_hit(
            self.model_groups.groups,
            max_hit_tokens,
            contains,
            alignment_tokens=self.alignment_tokens,
            use_eagle=self.use_eagle,
            eagle_group_ids=self.eagle_group_ids,
        )

    def load_bytes(self, hit: Hit) -> int:
        """Bytes one tensor-parallel rank (of every pipeline stage) reads to load ``hit``
        from nothing: every block it names, each group's ``block_bytes``."""
        return sum(
            len(ids) * self.ranks.block_bytes((g,)) for g, ids in enumerate(hit.blocks_to_load)
        )
