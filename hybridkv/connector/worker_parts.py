"""A worker's blocks in flight, and how a request's blocks are packed into transfer jobs.

Worker process (``ConnectorWorker``'s bookkeeping). A part is one group's
blocks of one request, at most a job's worth of bytes. A job takes a
request's parts in order, at most one per group and a job's worth of bytes in
all, so a whole load or store of a request is one job where it fits: each job
costs the tier one lookup batch, one copy call per group, one report and one
release, however few blocks it moves, and a hit waits for every job of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridkv.connector.metadata import BlockRef, LoadOutcome, LoadPlan
from hybridkv.transfer import JobId, TransferPart


@dataclass
class Part:
    """One group's blocks of a request, with the names the scheduler gave them."""

    part: TransferPart
    refs: tuple[BlockRef, ...]
    req_id: str
    waited_for_store: bool = False


@dataclass(kw_only=True)
class Load:
    plan: LoadPlan
    started: float
    parts: list[Part]
    """Parts not submitted yet (staging full, or a store of their blocks in flight)."""
    jobs: set[JobId] = field(default_factory=set)
    failed: dict[int, list[int]] = field(default_factory=dict)
    outcome: LoadOutcome = LoadOutcome.OK
    landed: float | None = None
    """When its last finished job was reported by the transfer engine."""


def pack(
    parts: Sequence[Part], block_bytes: Callable[[int], int], limit_bytes: int
) -> list[list[Part]]:
    """``parts`` in order, cut into jobs of at most one part per group and
    ``limit_bytes`` in all (a part alone may reach it)."""
    jobs: list[list[Part]] = []
    groups: set[int] = set()
    total = 0
    for p in parts:
        group_id = p.part.group_id
        size = len(p.part.block_ids) * block_bytes(group_id)
        if not jobs or group_id in groups or total + size > limit_bytes:
            jobs.append([])
            groups, total = set(), 0
        jobs[-1].append(p)
        groups.add(group_id)
        total += size
    return jobs


def refs_of(parts: Sequence[Part], block_ids: Mapping[int, Sequence[int]]) -> list[BlockRef]:
    """The names of the parts' blocks among ``block_ids`` (group id -> block ids)."""
    refs: list[BlockRef] = []
    for p in parts:
        wanted = set(block_ids.get(p.part.group_id, ()))
        refs += [ref for ref, b in zip(p.refs, p.part.block_ids, strict=True) if b in wanted]
    return refs
