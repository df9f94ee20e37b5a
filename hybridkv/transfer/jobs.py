"""Job vocabulary of the transfer engine: ids, kinds, parts, results, config.

Pure data and pure functions; used in the worker process by ``engine``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

from pydantic import StrictBool

from hybridkv.schema import PositiveInt, Seconds, check_fields
from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey
from hybridkv.transfer.chunked import DEVICE_CHUNK_BYTES

JobId = NewType("JobId", int)


class JobKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


class JobOutcome(enum.Enum):
    """How a job ended."""

    OK = "ok"
    FAILED = "failed"
    """The tier answered; some blocks were not OK (miss, corrupt, full, error)."""
    ERROR = "error"
    """The tier call or a copy raised: every block failed."""
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    CLOSED = "closed"
    """The engine closed before the job ran."""


class TransferPart(NamedTuple):
    """Blocks of one group in a job, with one key per block."""

    group_id: int
    block_ids: Sequence[int]
    keys: Sequence[StoreKey]
    tier_index: int | None = None
    """A load's one source, ``tiers[tier_index]`` of a ``TieredStore`` (whole-request
    selection; a single tier is index 0); None: the cheapest tier holding each block."""


@dataclass(frozen=True, kw_only=True)
class JobResult:
    job_id: JobId
    kind: JobKind
    outcome: JobOutcome
    ok_block_ids: dict[int, tuple[int, ...]]
    """group_id -> block ids stored (OK or already there) / loaded, in submit order."""
    failed_block_ids: dict[int, tuple[int, ...]]
    """group_id -> block ids not stored / not loaded (their KV is untouched)."""
    detail: str | None = None
    """Why blocks failed, for logs (status counts, the exception, the timeout)."""
    finished_at: float = 0.0
    """``time.monotonic()`` when the engine reported the job (its last block landed)."""

    @property
    def ok(self) -> bool:
        return self.outcome is JobOutcome.OK

    @property
    def num_failed(self) -> int:
        return sum(len(ids) for ids in self.failed_block_ids.values())


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    staging_bytes: PositiveInt = 256 << 20
    """Staging arena size: the bound on bytes in flight (backpressure beyond)."""
    num_workers: PositiveInt = 1
    """Threads calling the tier; > 1 needs a thread-safe tier."""
    load_timeout_s: Seconds | None = 30.0
    """None: no timeout."""
    store_timeout_s: Seconds | None = 60.0
    pin_memory: StrictBool | None = None
    """Pin the staging arena; None: pin when the KV caches are on CUDA."""
    asynchronous: StrictBool | None = None
    """A store returns before its copies are done (the engine keeps its blocks
    until then: ``TransferEngine.fence``); None: when the copies can be (CUDA)."""
    chunked_copies: StrictBool | None = None
    """Copy through a bounded device chunk (``transfer.chunked``); None: for caches
    off the CPU. True on CPU runs that path's logic without a GPU."""
    device_chunk_bytes: PositiveInt = DEVICE_CHUNK_BYTES
    """Device memory the chunked copies take (more only for a larger block)."""

    def __post_init__(self) -> None:
        check_fields(self).raise_if_any()


class JobState(enum.Enum):
    QUEUED = "queued"
    COPYING = "copying"
    """An asynchronous store copying its blocks out (it cannot be given up on)."""
    RUNNING = "running"
    SCATTERING = "scattering"
    ABANDONED = "abandoned"
    """Reported failed (timeout, cancel, close) while the tier call still runs."""


@dataclass(eq=False)
class Job:
    """Engine bookkeeping of one submitted job (internal)."""

    job_id: JobId
    kind: JobKind
    parts: tuple[TransferPart, ...]
    part_offsets: tuple[int, ...]
    """Staging offset of each part's first block."""
    staging_offset: int | None
    timeout_s: float | None
    deadline: float | None = None
    state: JobState = JobState.QUEUED
    buffers: list[Buffer] = field(default_factory=list)
    checksums: list[int] | None = None
    """A store's per-block xxh3-64, taken while gathering (header room only)."""
    in_place: bool = False
    """Copies go straight into (store) or may come out of (load) the tier's memory."""
    compute_mark: object = None
    """The compute its copies must follow (CUDA: an event taken at submit)."""
    copies_mark: object = None
    """Done when its copies are (CUDA: an event); None once they are done."""
    enqueued: threading.Event = field(default_factory=threading.Event)
    """Set once ``copies_mark`` is valid: the copies are enqueued (CUDA) or done, or
    the job was given up on before they started (they never run; the mark stays None)."""
    staged_statuses: list[GetStatus] | None = None
    """A load's answers for the blocks read into staging (the others came in place)."""

    @property
    def block_ids(self) -> frozenset[int]:
        """Every block the job copies, whatever its group."""
        return frozenset(b for part in self.parts for b in part.block_ids)


def check_parts(
    parts: Sequence[TransferPart],
    num_groups: int,
    check_block_ids: Callable[[int, Sequence[int]], str | None],
    *,
    num_tiers: int | None,
) -> tuple[TransferPart, ...]:
    """Validate a job's parts at the API boundary; ValueError names every problem.

    ``num_tiers``: the tiers a load part may name (None: a store, which names none).
    """
    problems: list[str] = []
    checked: list[TransferPart] = []
    seen: set[int] = set()
    for i, raw in enumerate(parts):
        group_id, block_ids, keys, tier_index = TransferPart(*raw)
        problem = _tier_index_problem(tier_index, num_tiers)
        if problem:
            problems.append(f"parts[{i}].{problem}")
        if not isinstance(group_id, int) or not 0 <= group_id < num_groups:
            problems.append(f"parts[{i}].group_id={group_id!r} not in [0, {num_groups})")
            continue
        if group_id in seen:
            problems.append(f"parts[{i}]: group {group_id} appears twice; merge the parts")
        seen.add(group_id)
        if len(keys) != len(block_ids):
            problems.append(
                f"parts[{i}]: {len(keys)} keys for {len(block_ids)} block ids; need one each"
            )
        problem = check_block_ids(group_id, block_ids)
        if problem:
            problems.append(f"parts[{i}]: {problem}")
        else:
            block_ids = tuple(int(b) for b in block_ids)
            checked.append(TransferPart(group_id, block_ids, tuple(keys), tier_index))
    if problems:
        raise ValueError("invalid transfer parts: " + "; ".join(problems))
    return tuple(checked)


def _tier_index_problem(tier_index: object, num_tiers: int | None) -> str | None:
    if tier_index is None:
        return None
    if num_tiers is None:
        return f"tier_index={tier_index!r}: a store goes to every tier; leave it None"
    if isinstance(tier_index, bool) or not isinstance(tier_index, int):
        return f"tier_index={tier_index!r} must be an int or None"
    if not 0 <= tier_index < num_tiers:
        return f"tier_index={tier_index} not in [0, {num_tiers}): the store's tiers"
    return None


_OK = frozenset((GetStatus.OK, PutStatus.OK, PutStatus.EXISTS))
"""The answers that count a block stored (or already there) or loaded."""


def build_result(
    job: Job,
    statuses: Sequence[GetStatus | PutStatus],
    outcome: JobOutcome,
    detail: str | None,
) -> tuple[JobResult, dict[str, int]]:
    """The job's result from per-key statuses, and the failed blocks per status.

    Without statuses every block failed with ``outcome``; with them the
    outcome is OK or FAILED by what the tier answered.
    """
    ok: dict[int, tuple[int, ...]] = {}
    failed: dict[int, tuple[int, ...]] = {}
    counts: dict[str, int] = {}
    start = 0
    for part in job.parts:
        n = len(part.block_ids)
        part_statuses = statuses[start : start + n] if statuses else [None] * n
        start += n
        good = [s in _OK for s in part_statuses]
        ok[part.group_id] = tuple(b for b, g in zip(part.block_ids, good, strict=True) if g)
        failed[part.group_id] = tuple(b for b, g in zip(part.block_ids, good, strict=True) if not g)
        for s, g in zip(part_statuses, good, strict=True):
            if s is not None and not g:
                counts[s.value] = counts.get(s.value, 0) + 1
    if statuses:
        outcome = JobOutcome.FAILED if counts else JobOutcome.OK
    if counts and detail is None:
        detail = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    result = JobResult(
        job_id=job.job_id,
        kind=job.kind,
        outcome=outcome,
        ok_block_ids=ok,
        failed_block_ids=failed,
        detail=detail,
        finished_at=time.monotonic(),
    )
    return result, counts
