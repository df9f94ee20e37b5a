"""The Mooncake Store tier: the KV pool shared by many engines and machines.

Runs in the worker process (bytes) and in the scheduler process
(``contains_many``). Every object is a codec header followed by its payload,
in one Mooncake slice (over TCP an extra slice costs more than the copy it
would spare). Objects travel through one staging arena registered with
Mooncake at setup, so Mooncake moves bytes zero-copy. The arena has two slots
for loads and two for stores; a batch larger than a slot goes in rounds
(``mooncake.rounds``), one round in Mooncake while the next is staged
(stores) or the last is checked and copied out (loads), on two threads.
Buffers in a transfer engine's registered staging skip the arena and every
copy (``mooncake.direct``).

Failures are values; calls are bounded and health-gated by
``mooncake.client``. Return codes: -200 (pool full) -> FULL; -704/-703/-712
-> MISS; a stored object of another size (-600 on a get, or a short read) ->
CORRUPT; -706 (read lease) on delete -> removed with ``force``.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierStats,
    TierUsage,
    check_batch,
)
from hybridkv.tiers.codec import HEADER_BYTES
from hybridkv.tiers.log_once import LogOnce
from hybridkv.tiers.memory import allocate_arena
from hybridkv.tiers.mooncake.accounting import MooncakeAccounting
from hybridkv.tiers.mooncake.client import ABSENT, McCode, MooncakeClient
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.mooncake.direct import StagedPath
from hybridkv.tiers.mooncake.rounds import (
    ALIGN_BYTES,
    Item,
    Round,
    check_object,
    plan_rounds,
    release_when_done,
    share_work,
    stage_object,
)

logger = logging.getLogger(__name__)

_SHARED_MIN_BYTES = 1 << 20
"""Rounds at least this large are staged or checked with the copy thread's help."""

_R = TypeVar("_R")


class _Side(enum.Enum):
    LOAD = 0
    STORE = 1


@dataclass
class _Job:
    """One ``put_many``/``get_many_into`` call: its keys, buffers and answers so far."""

    keys: Sequence[StoreKey]
    buffers: Sequence[Buffer]
    statuses: list[Any]
    num_answered: int = 0
    lookup: tuple[list[int], cf.Future[Any]] | None = None
    """Stores: the indices asked about and the pending existence lookup."""
    present: frozenset[int] = frozenset()
    """Stores: indices the lookup found in the pool (answered EXISTS)."""
    planned: frozenset[int] = frozenset()
    """Stores: indices in some round (the others are too large to stage)."""


class MooncakeTier(Tier):
    """A ``Tier`` over ``mooncake.store.MooncakeDistributedStore``. Thread-safe.

    ``usage()`` counts what this process stored less what it deleted (deleted
    bytes estimated at the mean object size): the pool evicts on its own and
    holds other engines' objects too (see ``hybridkv pool status``).
    """

    def __init__(self, config: MooncakeConfig, *, name: str = "mooncake") -> None:
        self.name = name
        self.load_weight = config.load_weight
        self.config = config
        self.region_bytes = config.local_buffer_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self.slot_bytes = self.region_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self._arena, _ = allocate_arena(2 * self.region_bytes, pin_memory=False)
        self._region_base = {_Side.LOAD: 0, _Side.STORE: self.region_bytes}
        self._region_locks = {side: threading.Lock() for side in _Side}
        self._copier = (
            cf.ThreadPoolExecutor(1, f"hybridkv-{name}-copy") if (os.cpu_count() or 1) > 1 else None
        )
        """Copies and checksums items of large rounds alongside the caller; never calls Mooncake."""
        self._log = LogOnce(logger, name)
        self._counts = MooncakeAccounting(self._log)
        self._client = MooncakeClient(config, self._arena, name=name, log=self._log)
        self._staged = StagedPath(self._client, self._counts, self._shared)

    @property
    def healthy(self) -> bool:
        """As last seen; only an unhealthy tier probes (in the background)."""
        return self._client.healthy

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        found = [False] * len(keys)
        if keys and self._usable(len(keys)):
            codes = self._client.round_trip(
                self._client.store.batch_is_exist, list(keys), what="lookup"
            )
            if codes is None:
                self._counts.count(errors=len(keys))
            else:
                found = [code == 1 for code in codes]
                self._counts.note_codes("lookup", [c for c in codes if c not in (0, 1)], count=True)
        self._counts.looked_up(found)
        return found

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Store objects absent from the pool; those present (or repeated) are EXISTS.

        Mooncake answers 0 for a key it already holds (and keeps the first
        value), so an existence lookup tells EXISTS apart. It runs while the
        first round is staged; later rounds skip what it found.
        """
        check_batch(keys, buffers, checksums)
        statuses = [PutStatus.ERROR] * len(keys)
        if not keys or not self._usable(len(keys)):
            return statuses
        todo: list[int] = []
        repeated: list[int] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            (repeated if key in seen else todo).append(i)
            seen.add(key)
        # Asked first: the client's thread sends it once this one waits or hashes.
        lookup = self._client.submit(self._client.store.batch_is_exist, [keys[i] for i in todo])
        if lookup is None:
            self._counts.count(errors=len(keys))
            return statuses
        framed = self._staged.framed(buffers)
        if framed is not None:
            answers, answered = self._staged.put(keys, framed, todo, lookup, checksums)
            for i in todo:
                statuses[i] = answers[i] or PutStatus.ERROR
            for i in repeated if answered else []:
                statuses[i] = PutStatus.EXISTS
            unanswered = sum(answers[i] is None for i in todo)
            self._counts.count(errors=unanswered + (0 if answered else len(repeated)))
            return statuses
        rounds, too_large = self._rounds(todo, buffers)
        planned = frozenset(i for round_ in rounds for i in round_.indices)
        job = _Job(keys, buffers, statuses, lookup=(todo, lookup), planned=planned)
        if rounds:
            self._run_rounds(_Side.STORE, rounds, job)
        else:
            self._take_lookup(job)
        if job.lookup is not None:  # never answered
            self._counts.count(errors=len(too_large) + len(repeated))
        else:
            for i in repeated:
                statuses[i] = PutStatus.EXISTS
            self._counts.count(errors=sum(i not in job.present for i in too_large))
        return statuses

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        statuses = [GetStatus.ERROR] * len(keys)
        if not keys or not self._usable(len(keys)):
            return statuses
        framed = self._staged.framed(buffers)
        if framed is not None:
            answers = self._staged.get(keys, framed)
            self._counts.count(errors=answers.count(None))
            return [GetStatus.ERROR if a is None else a for a in answers]
        rounds, too_large = self._rounds(list(range(len(keys))), buffers)
        self._counts.count(errors=len(too_large))
        self._run_rounds(_Side.LOAD, rounds, _Job(keys, buffers, statuses))
        return statuses

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        """Remove keys; returns how many were present.

        A key read in the last ~10 s holds a lease (-706) and is removed again
        with ``force``, which skips the lease check: a reader racing with that
        removal may read torn bytes, which its checksum reports as CORRUPT.
        """
        if not keys or not self._usable(len(keys)):
            return 0
        codes = self._client.round_trip(
            self._client.store.batch_remove, list(keys), False, what="delete"
        )
        if codes is None:
            self._counts.count(errors=len(keys))
            return 0
        removed = sum(code == 0 for code in codes)
        leased = [k for k, c in zip(keys, codes, strict=True) if c == McCode.OBJECT_HAS_LEASE]
        if leased:
            forced = self._client.round_trip(
                self._client.store.batch_remove, leased, True, what="delete"
            )
            removed += 0 if forced is None else sum(code == 0 for code in forced)
        expected = {0, McCode.OBJECT_HAS_LEASE, *ABSENT}
        self._counts.note_codes("delete", [c for c in codes if c not in expected], count=True)
        self._counts.deleted(removed)
        return removed

    def register_staging(self, staging: Buffer) -> int:
        return self._staged.register(staging)

    def staging_busy(self) -> bool:
        return self._staged.busy

    def usage(self) -> TierUsage:
        return self._counts.usage()

    def stats(self) -> TierStats:
        return self._counts.snapshot()

    def check_integrity(self) -> None:
        load, store = self._region_base[_Side.LOAD], self._region_base[_Side.STORE]
        assert load + self.region_bytes <= store, "staging regions overlap"
        assert store + self.region_bytes <= len(self._arena), "staging region past the arena"
        assert (load | store | self.slot_bytes) % ALIGN_BYTES == 0, "unaligned regions"
        assert 2 * self.slot_bytes <= self.region_bytes, "slots overlap"
        self._counts.check()

    def close(self) -> None:
        """Stop the helper threads and close the client. Idempotent."""
        if self._copier is not None:
            self._copier.shutdown(wait=False)
        self._client.close()

    # -- rounds ------------------------------------------------------------------------

    def _rounds(self, todo: list[int], buffers: Sequence[Buffer]) -> tuple[list[Round], list[int]]:
        """Split a batch into as few rounds as the slots allow; also returns the
        indices too large for a slot (logged, left ERROR, counted by the caller).

        Few large rounds beat many small pipelined ones on a small host
        (per-call costs, no idle core to overlap on; ``benchmarks/bench_pool.py``);
        batches larger than a slot still overlap.
        """
        sizes = [HEADER_BYTES + len(buffers[i]) for i in todo]
        rounds, too_large = plan_rounds(sizes, self.slot_bytes)
        for j in too_large:
            self._log.warning(
                "too-large",
                "objects of %d bytes exceed the %d-byte staging slot and are skipped "
                "(fix: local_buffer_bytes above four times the object size)",
                sizes[j],
                self.slot_bytes,
            )
        indexed = [Round([todo[j] for j in r.indices], r.offsets, r.num_bytes) for r in rounds]
        return indexed, [todo[j] for j in too_large]

    def _run_rounds(self, side: _Side, rounds: list[Round], job: _Job) -> None:
        """Run rounds through the side's two slots, one in Mooncake while the other is
        staged (stores) or checked (loads). After a failed round the rest stay ERROR."""
        lock = self._region_locks[side]
        if not lock.acquire(timeout=self.config.op_timeout_s):
            self._counts.count(errors=sum(len(r.indices) for r in rounds))
            return
        call = (
            self._client.store.batch_put_from
            if side is _Side.STORE
            else self._client.store.batch_get_into
        )
        in_flight: deque[tuple[Round, int, cf.Future[Any]]] = deque()
        ok = True
        num_submitted = 0
        try:
            for round_ in rounds:
                if len(in_flight) == 2 and not (ok := self._finish(side, in_flight, job)):
                    break
                # Slots alternate by submission (a store round may turn out empty): the
                # one not in flight.
                base = self._region_base[side] + num_submitted % 2 * self.slot_bytes
                if side is _Side.STORE:
                    answered = job.lookup is None
                    round_ = self._absent(round_, job)
                    self._stage(round_, base, job)
                    if not answered:
                        if not (ok := self._take_lookup(job)):
                            break
                        round_ = self._absent(round_, job)
                    if not round_.indices:
                        continue
                keys = [job.keys[i] for i in round_.indices]
                pointers = self._pointers(base, round_.offsets)
                future = self._client.submit(call, keys, pointers, round_.num_bytes)
                if future is None:
                    ok = False
                    break
                in_flight.append((round_, base, future))
                num_submitted += 1
            while ok and in_flight:
                ok = self._finish(side, in_flight, job)
        finally:
            unfinished = [future for _, _, future in in_flight]
            self._counts.count(errors=sum(len(r.indices) for r in rounds) - job.num_answered)
            release_when_done(lock, unfinished)  # Mooncake may still use the slots

    def _finish(
        self, side: _Side, in_flight: deque[tuple[Round, int, cf.Future[Any]]], job: _Job
    ) -> bool:
        """Wait for the oldest round and record its answers; False when it failed."""
        round_, base, future = in_flight[0]
        codes = self._client.wait(future, "store" if side is _Side.STORE else "load")
        if codes is None:
            return False
        in_flight.popleft()
        unexpected: list[int] = []
        if side is _Side.STORE:
            for i, size, code in zip(round_.indices, round_.num_bytes, codes, strict=True):
                job.statuses[i] = self._counts.put_status(code, size - HEADER_BYTES, unexpected)
        else:
            # Only objects read back whole are checked (and copied out, when they pass).
            whole = [k for k, code in enumerate(codes) if code == round_.num_bytes[k]]
            items = [
                (
                    job.keys[round_.indices[k]],
                    self._stored(base, round_, k),
                    job.buffers[round_.indices[k]],
                )
                for k in whole
            ]
            problems = dict(zip(whole, self._shared(check_object, items), strict=True))
            for k, (i, code) in enumerate(zip(round_.indices, codes, strict=True)):
                job.statuses[i] = self._counts.get_status(
                    job.keys[i], code, round_.num_bytes[k], problems.get(k), unexpected
                )
        job.num_answered += len(round_.indices)
        self._counts.note_codes(side.name.lower(), unexpected, count=False)
        return True

    def _stored(self, base: int, round_: Round, k: int) -> Buffer:
        """The slot bytes of the round's ``k``-th object (header, then payload)."""
        start = base + round_.offsets[k]
        return self._arena[start : start + round_.num_bytes[k]]

    def _stage(self, round_: Round, base: int, job: _Job) -> None:
        items = [
            (job.keys[i], self._stored(base, round_, k), job.buffers[i])
            for k, i in enumerate(round_.indices)
        ]
        self._shared(stage_object, items)

    def _shared(self, work: Callable[[Item], _R], items: Sequence[Item]) -> list[_R]:
        """``work`` over a round's items, with the copy thread's help for large rounds."""
        large = sum(len(item[1]) for item in items) >= _SHARED_MIN_BYTES
        return share_work(self._copier if large else None, work, items)

    def _take_lookup(self, job: _Job) -> bool:
        """Wait for the store's existence lookup; answer EXISTS for what it found."""
        assert job.lookup is not None
        asked, future = job.lookup
        codes = self._client.wait(future, "lookup")
        if codes is None:
            return False
        job.lookup = None
        job.present = frozenset(i for i, code in zip(asked, codes, strict=True) if code == 1)
        for i in job.present:
            job.statuses[i] = PutStatus.EXISTS
        job.num_answered += len(job.present & job.planned)
        self._counts.note_codes("lookup", [c for c in codes if c not in (0, 1)], count=False)
        return True

    def _absent(self, round_: Round, job: _Job) -> Round:
        """``round_`` without the objects the lookup found in the pool."""
        if not job.present.intersection(round_.indices):
            return round_
        kept = [k for k, i in enumerate(round_.indices) if i not in job.present]
        return Round(
            [round_.indices[k] for k in kept],
            [round_.offsets[k] for k in kept],
            [round_.num_bytes[k] for k in kept],
        )

    def _pointers(self, base: int, offsets: Sequence[int]) -> list[int]:
        address = int(self._arena.ctypes.data) + base
        return [address + offset for offset in offsets]

    def _usable(self, num_keys: int) -> bool:
        """Whether to call Mooncake now; when not, the keys count as errors."""
        if self._client.allow():
            return True
        self._counts.count(errors=num_keys)
        return False
