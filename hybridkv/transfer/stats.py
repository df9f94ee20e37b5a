"""Counters of the transfer engine (worker process); monotonic per process."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field


def _per_kind() -> dict[str, int]:
    return {"store": 0, "load": 0}


@dataclass(kw_only=True)
class TransferStats:
    jobs: dict[str, int] = field(default_factory=_per_kind)
    """Jobs accepted, per kind ("store", "load")."""
    blocks: dict[str, int] = field(default_factory=_per_kind)
    """Blocks submitted, per kind."""
    ok_blocks: dict[str, int] = field(default_factory=_per_kind)
    failed_blocks: dict[str, int] = field(default_factory=_per_kind)
    bytes: dict[str, int] = field(default_factory=_per_kind)
    """Bytes of blocks stored / loaded OK."""
    statuses: dict[str, int] = field(default_factory=dict)
    """Failed blocks per tier status ("miss", "corrupt", "error", "full")."""
    backpressured: int = 0
    """Submits refused (None) because staging was full."""
    timeouts: int = 0
    cancels: int = 0
    fences: int = 0
    """Store jobs the engine had to wait for before writing their blocks again."""

    def count_submit(self, kind: str, num_blocks: int) -> None:
        self.jobs[kind] += 1
        self.blocks[kind] += num_blocks

    def count_result(
        self,
        kind: str,
        ok_block_ids: Mapping[int, tuple[int, ...]],
        num_failed: int,
        statuses: Mapping[str, int],
    ) -> None:
        self.ok_blocks[kind] += sum(len(ids) for ids in ok_block_ids.values())
        self.failed_blocks[kind] += num_failed
        for status, n in statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + n

    def copy(self) -> TransferStats:
        return copy.deepcopy(self)
