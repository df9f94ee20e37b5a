"""An engine's ranks: each pipeline stage's tensor-parallel ranks, and the layers they hold.

Any process that names an engine's blocks (its scheduler, a router); pure data.
Every rank keeps its own blocks under its own keys. Without pipeline parallel
every rank holds every layer; with it each stage holds its own layers of each
group, and may hold none of a group: such a rank stores and loads nothing of
that group, and a block of the group is held once every rank that has its
layers holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder, KeyNamespace
from hybridkv.tiers.ranks import WorkerRank, every_rank


@dataclass(frozen=True, kw_only=True)
class EngineRanks:
    """Every rank of one engine and the groups, with its stage's layers, each holds."""

    tp_size: int = 1
    stage_groups: tuple[ModelGroups, ...]
    """Per pipeline stage, the model's groups with that stage's layers (one entry
    without pipeline parallel)."""
    ranks: tuple[WorkerRank, ...] = field(init=False, repr=False, compare=False)
    holders: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    """Per group, the indices of the ranks holding some of its layers."""

    def __post_init__(self) -> None:
        stages = self.stage_groups
        if not stages or self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} and {len(stages)} stages must be >= 1")
        shapes = {tuple((g.kind, g.block_size) for g in s.groups) for s in stages}
        if len(shapes) != 1 or len({s.hash_block_size for s in stages}) != 1:
            raise ValueError(
                "pipeline stages disagree on the model's groups (kinds, block sizes, hash "
                "block size); every stage must see the same groups"
            )
        ranks = every_rank(self.tp_size, len(stages))
        holders = tuple(
            tuple(r.index for r in ranks if stages[r.pp_rank].groups[g].layer_names)
            for g in range(stages[0].num_groups)
        )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "holders", holders)

    @classmethod
    def uniform(cls, model_groups: ModelGroups, tp_size: int = 1) -> EngineRanks:
        """An engine without pipeline parallel: every rank holds every layer."""
        return cls(tp_size=tp_size, stage_groups=(model_groups,))

    @property
    def pp_size(self) -> int:
        return len(self.stage_groups)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def groups_of(self, rank: WorkerRank) -> ModelGroups:
        return self.stage_groups[rank.pp_rank]

    def builders(self) -> tuple[KeyBuilder, ...]:
        """Every rank's store keys, in rank order."""
        return tuple(
            KeyBuilder(self.groups_of(r), KeyNamespace.for_rank(self.groups_of(r), r))
            for r in self.ranks
        )

    def num_holders(self) -> tuple[int, ...]:
        """Per group, how many ranks store (and confirm) each of its blocks."""
        return tuple(len(ranks) for ranks in self.holders)

    def block_bytes(self, group_ids: Sequence[int]) -> int:
        """Bytes one tensor-parallel rank of every stage holds of one block of each
        group named (a group once per block)."""
        return sum(s.groups[g].block_bytes for s in self.stage_groups for g in group_ids)
