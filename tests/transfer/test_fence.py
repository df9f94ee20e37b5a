"""The fence of an asynchronous store that is given up on before its copies start.

A real transfer engine in CUDA's mode (stores copied on its own thread, here
through the chunked path on CPU tensors) over a real CPU tier whose
reservations (where a store's copies start) wait at a gate: store A holds the
copy thread there, so store B stays queued, its copies not enqueued. A fence
on B's blocks waits for B; B is then given up on (its deadline passes, or it
is cancelled, or the engine closes). Its copies never run, so the fence must
return, and B must never land in the tier. With nobody polling, the fence
itself gives up on B at its deadline: the host never waits for a copy thread
that is stuck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tiers.base import PutStatus, StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import JobId, JobOutcome, TransferConfig, TransferEngine, TransferPart
from hybridkv.transfer.jobs import JobState

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 16
PAGE = 1024
WAIT_S = 10.0
"""Longer than any step of these scenarios takes, shorter than the test's timeout."""


class GatedCpuTier(CpuTier):
    """A real CPU tier whose reservations wait at ``gate`` (``calling`` says one began)."""

    def __init__(self) -> None:
        super().__init__(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
        self.gate = threading.Event()
        self.calling = threading.Event()

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        self.calling.set()
        assert self.gate.wait(WAIT_S), "the gate was never opened"
        return super().reserve_many(keys, sizes)


class WatchedEvent(threading.Event):
    """A job's ``enqueued`` event that says when someone starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


@dataclass
class Rig:
    engine: TransferEngine
    tier: GatedCpuTier
    first: JobId
    """Store A: its copies hold the copy thread at the gate."""
    second: JobId
    """Store B: queued behind A, its copies not enqueued."""
    watched: WatchedEvent
    """B's ``enqueued``."""


def keys(tag: str, ids: list[int]) -> list[StoreKey]:
    return [StoreKey(f"fence/{tag}/{b}") for b in ids]


@pytest.fixture
def rig() -> Iterator[Rig]:
    group = KVGroup(kind=GroupKind.FULL, block_size=16, page_size_bytes=PAGE, layer_names=("f",))
    alloc = allocate_kv_caches(
        ModelGroups(groups=(group,)), NUM_BLOCKS, kind=KVLayoutKind.LAYER_MAJOR
    )
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    tier = GatedCpuTier()
    config = TransferConfig(staging_bytes=1 << 20, asynchronous=True, chunked_copies=True)
    engine = TransferEngine(alloc.canonical, TieredStore([tier]), config)
    first = engine.submit_store([TransferPart(0, [1, 2], keys("a", [1, 2]))])
    assert first is not None and tier.calling.wait(WAIT_S), "A's copies never started"
    second = engine.submit_store([TransferPart(0, [3, 4], keys("b", [3, 4]))], timeout_s=0.3)
    assert second is not None
    job = engine._ledger.jobs[second]
    assert job.state is JobState.QUEUED and not job.enqueued.is_set()
    watched = WatchedEvent()
    job.enqueued = watched
    try:
        yield Rig(engine, tier, first, second, watched)
    finally:
        tier.gate.set()
        engine.close()


def fence_in_thread(engine: TransferEngine, block_ids: list[int]) -> threading.Thread:
    fencing = threading.Thread(target=engine.fence, args=(block_ids,), daemon=True)
    fencing.start()
    return fencing


def finish(rig: Rig) -> dict[JobId, JobOutcome]:
    """Open the gate, wait for every job; each job's outcome. B never reached the tier."""
    rig.tier.gate.set()
    assert rig.engine.wait(None, WAIT_S)
    outcomes = {r.job_id: r.outcome for r in rig.engine.poll_finished()}
    assert rig.tier.contains_many(keys("b", [3, 4])) == [False, False]
    assert rig.tier.contains_many(keys("a", [1, 2])) == [True, True]
    rig.engine.check_integrity()
    return outcomes


def test_a_fence_returns_when_the_store_it_waits_for_expires(rig: Rig) -> None:
    fencing = fence_in_thread(rig.engine, [4])
    assert rig.watched.waited.wait(WAIT_S), "the fence never waited for B"
    time.sleep(0.4)  # past B's deadline
    outcomes = {r.job_id: r.outcome for r in rig.engine.poll_finished()}
    assert outcomes == {rig.second: JobOutcome.TIMED_OUT}
    fencing.join(WAIT_S)
    assert not fencing.is_alive(), "the fence waits for copies that will never run"
    assert finish(rig) == {rig.first: JobOutcome.OK}


def test_a_fence_returns_when_the_store_it_waits_for_is_cancelled(rig: Rig) -> None:
    fencing = fence_in_thread(rig.engine, [3])
    assert rig.watched.waited.wait(WAIT_S), "the fence never waited for B"
    assert rig.engine.cancel(rig.second)
    fencing.join(WAIT_S)
    assert not fencing.is_alive(), "the fence waits for copies that will never run"
    assert finish(rig) == {rig.first: JobOutcome.OK, rig.second: JobOutcome.CANCELLED}


def test_a_fence_returns_when_the_engine_closes_under_it(rig: Rig) -> None:
    fencing = fence_in_thread(rig.engine, [3])
    assert rig.watched.waited.wait(WAIT_S), "the fence never waited for B"
    rig.engine.close(timeout_s=0.1)  # A's copies still hold the copy thread
    fencing.join(WAIT_S)
    assert not fencing.is_alive(), "the fence waits for copies that will never run"
    assert finish(rig) == {rig.first: JobOutcome.OK, rig.second: JobOutcome.CLOSED}


def test_a_fence_never_waits_past_the_deadline_of_a_store_not_started(rig: Rig) -> None:
    """Nobody polls and the copy thread stays stuck: the fence gives B up itself."""
    start = time.monotonic()
    rig.engine.fence([3, 4])
    waited = time.monotonic() - start
    assert rig.watched.waited.is_set()
    assert not rig.tier.gate.is_set() and waited < WAIT_S / 2, waited
    assert rig.engine.stats().timeouts == 1
    assert finish(rig) == {rig.first: JobOutcome.OK, rig.second: JobOutcome.TIMED_OUT}


def test_a_fence_on_a_store_being_copied_waits_for_its_copies(rig: Rig) -> None:
    """A's copies have started (the copy thread holds it): the fence waits until they
    are enqueued, however long that takes."""
    fencing = fence_in_thread(rig.engine, [1])
    fencing.join(0.5)
    assert fencing.is_alive(), "the fence returned before A's copies were enqueued"
    rig.tier.gate.set()
    fencing.join(WAIT_S)
    assert not fencing.is_alive()
    assert rig.engine.stats().fences == 1
