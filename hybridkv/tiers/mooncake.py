"""The Mooncake Store tier: the KV pool shared by many engines and machines.

Runs in the worker process (bytes) and in the scheduler process
(``contains_many``). Every object is a codec header followed by its payload.
Objects travel through one staging arena registered with Mooncake once at
setup, so Mooncake moves bytes zero-copy (``batch_put_from``/
``batch_get_into``; ``batch_is_exist`` for lookups). The arena has two slots
for loads and two for stores; a batch larger than a slot goes in rounds, one
round in Mooncake while the next is staged (stores) or the last is checked
and copied out (loads). Staging (copy in, checksum) and checking (checksum,
copy out) of a round run on two threads: numpy copies and xxh3 release the
GIL. Every object goes in one Mooncake slice: over TCP each extra slice costs
more than the copy it would spare, so objects are never split into a header
slice and a payload slice read from the caller's memory. Rounds are planned
and staged in ``mooncake_rounds``; settings live in ``mooncake_config``.

On a small host the Mooncake call itself uses the CPU: its caller polls for
completion without sleeping, and on loopback both TCP ends run here too.
Measured on 2 cores (64 x 256 KiB): splitting a batch into pipelined rounds,
two calls at once, or lowering the polling thread's priority all came out
slower than one round staged first, so batches up to a slot go as one round.

Failures are values. Each Mooncake call runs in a helper thread and is
abandoned after ``op_timeout_s`` (calls to a killed master take ~4.3 s each,
to a hung one 30 s). A timeout or an unreachable master marks the tier
unhealthy (``HealthGate``): lookups answer False and loads ERROR at once,
without calling Mooncake, until a background probe reaches the master again.
Return codes: -200 (pool full) -> FULL; -704/-703/-712 -> MISS; a stored
object of another size (-600 on a get, or a short read) -> CORRUPT; -706
(read lease) on delete -> removed with ``force``.

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
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError
from hybridkv.tiers.cpu import allocate_arena
from hybridkv.tiers.mooncake_config import MooncakeConfig
from hybridkv.tiers.mooncake_rounds import (
    ALIGN_BYTES,
    Item,
    Round,
    check_object,
    plan_rounds,
    release_when_done,
    share_work,
    stage_object,
)
from hybridkv.tiers.remote import HealthGate, LogOnce, tcp_reachable

logger = logging.getLogger(__name__)

_SETUP_TIMEOUT_S = 15.0
_PROBE_KEY = "hybridkv/health-probe"
_SHARED_MIN_BYTES = 1 << 20
"""Rounds at least this large are staged or checked with the copy thread's help."""

_R = TypeVar("_R")


class McCode(enum.IntEnum):
    """Mooncake Store return codes this tier acts on (mooncake-store ``ErrorCode``)."""

    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901


_ABSENT = frozenset({McCode.OBJECT_NOT_FOUND, McCode.REPLICA_IS_NOT_READY, McCode.REPLICA_IS_GONE})
_UNREACHABLE = frozenset({McCode.RPC_FAIL, McCode.RPC_TIMEOUT})


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
        # Peers must be told the address we reach them at, never another interface's.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel, or libibverbs1 it links against, is missing
            raise ImportError(
                f"the mooncake tier needs pip install 'hybridkv[mooncake]' and libibverbs1: {exc}"
            ) from exc

        self.name = name
        self.load_weight = config.load_weight
        self.config = config
        self.region_bytes = config.local_buffer_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self.slot_bytes = self.region_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self._store: Any = MooncakeDistributedStore()
        self._arena, _ = allocate_arena(2 * self.region_bytes, pin_memory=False)
        self._region_base = {_Side.LOAD: 0, _Side.STORE: self.region_bytes}
        self._region_locks = {side: threading.Lock() for side in _Side}
        # Two rounds per direction plus a lookup, and spares for calls abandoned in Mooncake.
        self._executor = cf.ThreadPoolExecutor(8, f"hybridkv-{name}")
        self._copier = (
            cf.ThreadPoolExecutor(1, f"hybridkv-{name}-copy") if (os.cpu_count() or 1) > 1 else None
        )
        """Copies and checksums items of large rounds alongside the caller; never calls Mooncake."""
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        self._num_objects = self._used_bytes = 0
        self._log = LogOnce(logger, name)
        self._ready = self._closed = False
        self._client_lock = threading.Lock()
        """Held by setup and probes; ``close`` takes it for good."""
        self._pending: set[cf.Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._gate = HealthGate(name, self._probe, retry_interval_s=config.retry_interval_s)
        setup = self._executor.submit(self._connect)
        try:
            connected = setup.result(timeout=max(_SETUP_TIMEOUT_S, config.op_timeout_s))
        except cf.TimeoutError:
            connected = False
        if not connected:
            self._gate.mark_failed(f"no setup against master {config.master_address}")

    @property
    def healthy(self) -> bool:
        """As last seen; probes run only when calls come (an idle tier never polls)."""
        return self._ready and self._gate.healthy

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        found = [False] * len(keys)
        if keys and self._usable(len(keys)):
            codes = self._round_trip(self._store.batch_is_exist, list(keys), what="lookup")
            if codes is None:
                self._count(errors=len(keys))
            else:
                found = [code == 1 for code in codes]
                self._note_codes("lookup", [c for c in codes if c not in (0, 1)], count=True)
        with self._stats_lock:
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
            self._stats.misses += len(keys) - sum(found)
        return found

    def put_many(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[PutStatus]:
        """Store objects absent from the pool; those present (or repeated) are EXISTS.

        Mooncake answers 0 for a key it already holds (and keeps the first
        value), so an existence lookup tells EXISTS apart. It runs while the
        first round is staged; later rounds skip what it found.
        """
        check_batch(keys, buffers)
        statuses = [PutStatus.ERROR] * len(keys)
        if not keys or not self._usable(len(keys)):
            return statuses
        todo: list[int] = []
        repeated: list[int] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            (repeated if key in seen else todo).append(i)
            seen.add(key)
        rounds, too_large = self._rounds(todo, buffers)
        lookup = self._submit(self._store.batch_is_exist, [keys[i] for i in todo])
        if lookup is None:
            self._count(errors=len(keys))
            return statuses
        planned = frozenset(i for round_ in rounds for i in round_.indices)
        job = _Job(keys, buffers, statuses, lookup=(todo, lookup), planned=planned)
        if rounds:
            self._run_rounds(_Side.STORE, rounds, job)
        else:
            self._take_lookup(job)
        if job.lookup is not None:  # never answered
            self._count(errors=len(too_large) + len(repeated))
        else:
            for i in repeated:
                statuses[i] = PutStatus.EXISTS
            self._count(errors=sum(i not in job.present for i in too_large))
        return statuses

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        check_batch(keys, buffers)
        statuses = [GetStatus.ERROR] * len(keys)
        if keys and self._usable(len(keys)):
            rounds, too_large = self._rounds(list(range(len(keys))), buffers)
            self._count(errors=len(too_large))
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
        codes = self._round_trip(self._store.batch_remove, list(keys), False, what="delete")
        if codes is None:
            self._count(errors=len(keys))
            return 0
        removed = sum(code == 0 for code in codes)
        leased = [k for k, c in zip(keys, codes, strict=True) if c == McCode.OBJECT_HAS_LEASE]
        if leased:
            forced = self._round_trip(self._store.batch_remove, leased, True, what="delete")
            removed += 0 if forced is None else sum(code == 0 for code in forced)
        expected = {0, McCode.OBJECT_HAS_LEASE, *_ABSENT}
        self._note_codes("delete", [c for c in codes if c not in expected], count=True)
        with self._stats_lock:
            self._stats.deletes += removed
            if removed and self._num_objects > 0:
                mean_bytes = self._used_bytes // self._num_objects
                self._num_objects = max(0, self._num_objects - removed)
                self._used_bytes = min(self._used_bytes, self._num_objects * mean_bytes)
        return removed

    def usage(self) -> TierUsage:
        with self._stats_lock:
            return TierUsage(
                num_objects=max(0, self._num_objects),
                used_bytes=self._used_bytes,
                capacity_bytes=None,
            )

    def stats(self) -> TierStats:
        with self._stats_lock:
            return TierStats(**self._stats.as_dict())

    def check_integrity(self) -> None:
        load, store = self._region_base[_Side.LOAD], self._region_base[_Side.STORE]
        assert load + self.region_bytes <= store, "staging regions overlap"
        assert store + self.region_bytes <= len(self._arena), "staging region past the arena"
        assert (load | store | self.slot_bytes) % ALIGN_BYTES == 0, "unaligned regions"
        assert 2 * self.slot_bytes <= self.region_bytes, "slots overlap"
        with self._stats_lock:
            stats = self._stats
            assert stats.hits + stats.misses == stats.queries, stats
            assert all(value >= 0 for value in stats.as_dict().values()), stats
            assert 0 <= self._num_objects <= stats.puts, (self._num_objects, stats.puts)
            assert 0 <= self._used_bytes <= stats.put_bytes, (self._used_bytes, stats.put_bytes)

    def close(self) -> None:
        """Stop the helper threads and close the client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gate.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._copier is not None:
            self._copier.shutdown(wait=False)
        with self._pending_lock:
            pending = list(self._pending)
        _, still_running = cf.wait(pending, timeout=self.config.op_timeout_s)
        if still_running or not self._client_lock.acquire(timeout=self.config.op_timeout_s):
            # Closing under a call still inside Mooncake would crash the process.
            self._log.warning("close", "calls still in flight; the client is left open")
            return
        if self._ready:
            self._ready = False
            self._store.close()

    # -- rounds ------------------------------------------------------------------------

    def _rounds(self, todo: list[int], buffers: Sequence[Buffer]) -> tuple[list[Round], list[int]]:
        """Split a batch into as few rounds as the slots allow; also returns the
        indices too large for a slot (logged, left ERROR, counted by the caller).

        Measured on a busy 2-core host: one 16 MiB round reached 0.91 of the
        raw client, four pipelined 4 MiB rounds only 0.6-0.7 (per-call costs,
        no idle core to overlap on); batches larger than a slot still overlap.
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
            self._count(errors=sum(len(r.indices) for r in rounds))
            return
        call = self._store.batch_put_from if side is _Side.STORE else self._store.batch_get_into
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
                future = self._submit(call, keys, pointers, round_.num_bytes)
                if future is None:
                    ok = False
                    break
                in_flight.append((round_, base, future))
                num_submitted += 1
            while ok and in_flight:
                ok = self._finish(side, in_flight, job)
        finally:
            unfinished = [future for _, _, future in in_flight]
            self._count(errors=sum(len(r.indices) for r in rounds) - job.num_answered)
            release_when_done(lock, unfinished)  # Mooncake may still use the slots

    def _finish(
        self, side: _Side, in_flight: deque[tuple[Round, int, cf.Future[Any]]], job: _Job
    ) -> bool:
        """Wait for the oldest round and record its answers; False when it failed."""
        round_, base, future = in_flight[0]
        codes = self._wait(future, "store" if side is _Side.STORE else "load")
        if codes is None:
            return False
        in_flight.popleft()
        unexpected: list[int] = []
        if side is _Side.STORE:
            for i, size, code in zip(round_.indices, round_.num_bytes, codes, strict=True):
                job.statuses[i] = self._put_status(code, size - HEADER_BYTES, unexpected)
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
                job.statuses[i] = self._get_status(
                    job.keys[i], code, round_.num_bytes[k], problems.get(k), unexpected
                )
        job.num_answered += len(round_.indices)
        self._note_codes(side.name.lower(), unexpected, count=False)
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
        codes = self._wait(future, "lookup")
        if codes is None:
            return False
        job.lookup = None
        job.present = frozenset(i for i, code in zip(asked, codes, strict=True) if code == 1)
        for i in job.present:
            job.statuses[i] = PutStatus.EXISTS
        job.num_answered += len(job.present & job.planned)
        self._note_codes("lookup", [c for c in codes if c not in (0, 1)], count=False)
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

    def _put_status(self, code: int, payload_bytes: int, unexpected: list[int]) -> PutStatus:
        with self._stats_lock:
            if code == 0:
                self._stats.puts += 1
                self._stats.put_bytes += payload_bytes
                self._num_objects += 1
                self._used_bytes += payload_bytes
                return PutStatus.OK
            if code == McCode.OBJECT_ALREADY_EXISTS:
                return PutStatus.EXISTS
            if code == McCode.NO_AVAILABLE_HANDLE:
                self._stats.put_skipped_full += 1
                return PutStatus.FULL
            self._stats.errors += 1
        if code == McCode.INVALID_PARAMS:
            self._log.warning(
                "put-invalid", "the pool refused an object of %d bytes as invalid (-600); "
                "objects like it are skipped", payload_bytes + HEADER_BYTES,
            )  # fmt: skip
        unexpected.append(code)
        return PutStatus.ERROR

    def _get_status(
        self,
        key: StoreKey,
        code: int,
        stored_bytes: int,
        problem: HeaderError | None,
        unexpected: list[int],
    ) -> GetStatus:
        """The answer for one object read with ``code``; ``problem`` is what checking it
        found (None: it passed), and means nothing unless it was read whole."""
        if code in _ABSENT:
            return GetStatus.MISS
        if code == stored_bytes:
            if problem is None:  # already copied out
                with self._stats_lock:
                    self._stats.gets += 1
                    self._stats.get_bytes += stored_bytes - HEADER_BYTES
                return GetStatus.OK
            reason = problem.value
        elif code >= 0 or code == McCode.INVALID_PARAMS:  # a shorter or a longer object
            reason = f"stored size differs from {stored_bytes} bytes (read {code})"
        else:
            unexpected.append(code)
            self._count(errors=1)
            return GetStatus.ERROR
        self._log.warning("corrupt", "object %s is corrupt: %s", key, reason)
        with self._stats_lock:
            self._stats.corrupt += 1
        return GetStatus.CORRUPT

    # -- calls -------------------------------------------------------------------------

    def _pointers(self, base: int, offsets: Sequence[int]) -> list[int]:
        address = int(self._arena.ctypes.data) + base
        return [address + offset for offset in offsets]

    def _usable(self, num_keys: int) -> bool:
        """Whether to call Mooncake now; when not, the keys count as errors."""
        if not self._closed and self._gate.allow() and self._ready:
            return True
        self._count(errors=num_keys)
        return False

    def _round_trip(
        self, call: Callable[..., list[int]], *args: Any, what: str
    ) -> list[int] | None:
        """``call(*args)`` in a helper thread; None when it failed to answer in time."""
        future = self._submit(call, *args)
        return None if future is None else self._wait(future, what)

    def _submit(self, call: Callable[..., list[int]], *args: Any) -> cf.Future[Any] | None:
        try:
            future = self._executor.submit(call, *args)
        except RuntimeError:  # the executor was shut down by close()
            return None
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _wait(self, future: cf.Future[Any], what: str) -> list[int] | None:
        try:
            codes = [int(code) for code in future.result(timeout=self.config.op_timeout_s)]
        except cf.TimeoutError:
            self._gate.mark_failed(f"{what} got no answer in {self.config.op_timeout_s} s")
            return None
        except Exception as exc:  # the binding raises on arguments it rejects
            self._log.warning(f"raised-{what}", "%s raised %r", what, exc)
            return None
        if any(code in _UNREACHABLE for code in codes):
            self._gate.mark_failed(f"{what}: master {self.config.master_address} unreachable")
        return codes

    def _forget(self, future: cf.Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def _note_codes(self, what: str, codes: Sequence[int], *, count: bool) -> None:
        if codes:
            distinct = sorted(set(codes))
            self._log.warning(f"{what}{distinct}", "%s answered Mooncake codes %s", what, distinct)
            if count:
                self._count(errors=len(codes))

    def _count(self, *, errors: int) -> None:
        if errors:
            with self._stats_lock:
                self._stats.errors += errors

    def _connect(self) -> bool:
        """Set up the client and register the arena, once; False while the master is away."""
        with self._client_lock:
            return self._connect_locked()

    def _connect_locked(self) -> bool:
        if self._ready or self._closed:
            return self._ready
        config = self.config
        if not self._master_reachable():
            return False  # setup itself would retry for ~90 s
        rc = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_bytes,
            0,  # Mooncake's own copy buffer: unused, every call is zero-copy
            config.protocol.value,
            config.rdma_devices,
            config.master_address,
        )
        if rc == 0:
            rc = self._store.register_buffer(int(self._arena.ctypes.data), len(self._arena))
        if rc != 0:
            self._log.warning("setup", "setup against %s returned %s", config.master_address, rc)
            return False
        self._ready = True
        return True

    def _master_reachable(self) -> bool:
        host, port = self.config.master_address.rsplit(":", 1)
        return tcp_reachable(host, int(port), timeout_s=min(1.0, self.config.op_timeout_s))

    def _probe(self) -> bool:
        """Runs in the gate's probe thread: set up if needed, then ask the master once."""
        with self._client_lock:
            if not self._connect_locked() or not self._master_reachable():
                return False
            codes = self._store.batch_is_exist([_PROBE_KEY])
        return len(codes) == 1 and codes[0] in (0, 1)
