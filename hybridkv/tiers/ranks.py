"""Which worker of an engine a process is: its pipeline stage and tensor-parallel rank.

Any process; pure data. A rank's keys and its disk directory are named by its
``label``; the scheduler counts ranks by their ``index``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WorkerRank:
    """One worker: tensor-parallel rank ``tp_rank`` of pipeline stage ``pp_rank``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        problems = [
            f"{name}={rank} must be in [0, {size_name}={size})"
            for name, rank, size_name, size in (
                ("tp_rank", self.tp_rank, "tp_size", self.tp_size),
                ("pp_rank", self.pp_rank, "pp_size", self.pp_size),
            )
            if not 0 <= rank < size
        ]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def index(self) -> int:
        """Its place among the engine's ranks, stage by stage (as vLLM numbers them)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def label(self) -> str:
        """``tp<rank>of<size>``, after ``pp<stage>of<stages>-`` with pipeline parallel
        (without it, the names ranks had before pipeline parallel was served)."""
        tp = f"tp{self.tp_rank}of{self.tp_size}"
        return tp if self.pp_size == 1 else f"pp{self.pp_rank}of{self.pp_size}-{tp}"


def every_rank(tp_size: int = 1, pp_size: int = 1) -> tuple[WorkerRank, ...]:
    """An engine's ranks in ``index`` order."""
    return tuple(
        WorkerRank(tp_rank=t, tp_size=tp_size, pp_rank=p, pp_size=pp_size)
        for p in range(pp_size)
        for t in range(tp_size)
    )
