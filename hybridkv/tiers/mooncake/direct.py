"""The Mooncake tier's zero-copy path: objects framed in place in registered staging.

Runs in the worker process, on the transfer engine's threads. The engine
registers its staging arena with the tier (``Tier.register_staging``) and
leaves ``HEADER_BYTES`` of room in front of every block it stages there. A
put writes the header (the checksum) into that room and hands Mooncake the
header and payload as one slice; a get reads the object into the same place
and verifies it there, and the engine scatters only what passed. No payload
is copied by the tier.

A call given up on (``op_timeout_s``) may still be in Mooncake reading or
writing staging: it is held until it finishes, and ``busy`` says so, so the
engine reuses no staging until then.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, buffer_address
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError, verify_object, write_header_into
from hybridkv.tiers.mooncake.accounting import MooncakeAccounting
from hybridkv.tiers.mooncake.client import MooncakeClient

ROOM_BYTES = 64
"""Room asked for in front of each buffer: the header, kept cache-line aligned."""

CHUNK_BYTES = 64 << 20
"""Batches larger than this go in calls of about this size, two in flight, so one chunk's
checksums run while Mooncake moves another. Each extra call costs more than it hides at
smaller sizes (``benchmarks/bench_pool.py``; figures in docs/DECISIONS.md)."""
MAX_CHUNKS = 4


class Framed(NamedTuple):
    """Objects in registered staging (header room, then payload) and their addresses."""

    views: list[Buffer]
    addresses: list[int]


Share = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
"""Runs a function over items with a spare thread's help (``rounds.share_work``)."""


def seal(item: tuple[StoreKey, Buffer]) -> None:
    """Checksum the payload and write the header in front of it."""
    key, framed = item
    write_header_into(framed, key, framed[HEADER_BYTES:])


def check(item: tuple[StoreKey, Buffer]) -> HeaderError | None:
    key, framed = item
    return verify_object(framed[:HEADER_BYTES], key, framed[HEADER_BYTES:])


def split(indices: list[int], framed: Sequence[Buffer]) -> list[list[int]]:
    """``indices`` in order, in chunks of about ``CHUNK_BYTES`` (at most ``MAX_CHUNKS``)."""
    total = sum(len(framed[i]) for i in indices)
    num_chunks = max(1, min(MAX_CHUNKS, total // CHUNK_BYTES))
    chunks: list[list[int]] = [[] for _ in range(num_chunks)]
    done = 0
    for i in indices:
        chunks[min(num_chunks - 1, done * num_chunks // max(1, total))].append(i)
        done += len(framed[i])
    return [chunk for chunk in chunks if chunk] or [[]]


class StagedPath:
    """Puts and gets of buffers in registered staging. Thread-safe."""

    def __init__(self, client: MooncakeClient, counts: MooncakeAccounting, share: Share) -> None:
        self._client = client
        self._counts = counts
        self._share = share
        self._regions: list[tuple[int, int, Buffer]] = []
        """Registered staging: first and past-the-end address, and the array."""
        self._held: set[cf.Future[Any]] = set()
        self._lock = threading.Lock()

    def register(self, staging: Buffer) -> int:
        """Register ``staging`` with Mooncake; the room wanted (0 when refused)."""
        if not self._client.add_buffer(staging):
            return 0
        low = int(staging.ctypes.data)
        with self._lock:
            self._regions.append((low, low + staging.nbytes, staging))
        return ROOM_BYTES

    def framed(self, buffers: Sequence[Buffer]) -> Framed | None:
        """Each buffer with its header room in front, as one slice of registered
        staging, and the slices' addresses; None unless every buffer lies in it.
        Each buffer's address is read once, through ``buffer_address``."""
        with self._lock:
            regions = list(self._regions)
        if not regions:
            return None
        framed: list[Buffer] = []
        addresses: list[int] = []
        low, high, staging = regions[0]
        for buffer in buffers:
            start = buffer_address(buffer) - HEADER_BYTES
            end = start + HEADER_BYTES + buffer.nbytes
            if not low <= start < end <= high:  # blocks of one batch mostly share a region
                found = [r for r in regions if r[0] <= start < end <= r[1]]
                if not found:
                    return None
                low, high, staging = found[0]
            framed.append(staging[start - low : end - low])
            addresses.append(start)
        return Framed(framed, addresses)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._held)

    def put(
        self,
        keys: Sequence[StoreKey],
        objects: Framed,
        todo: list[int],
        lookup: cf.Future[Any],
        checksums: Sequence[int] | None = None,
    ) -> tuple[list[PutStatus | None], bool]:
        """Store ``todo`` (distinct keys); per index a status (None: unanswered), and
        whether ``lookup`` (``batch_is_exist`` of ``todo``'s keys, submitted) answered.
        The first chunk is hashed while the lookup runs, each later chunk while the
        one before is in Mooncake (xxh3 lets go of the GIL). With ``checksums`` (the
        payloads', see ``Tier.put_many``) every header is written at once on this
        thread, a few microseconds each, before the lookup is waited for: no payload
        is read."""
        statuses: list[PutStatus | None] = [None] * len(keys)
        framed = objects.views
        chunks = split(todo, framed)
        if checksums is not None:
            for i in todo:
                write_header_into(framed[i], keys[i], framed[i][HEADER_BYTES:], checksums[i])
        else:
            self._share(seal, [(keys[i], framed[i]) for i in chunks[0]])
        codes = self._client.wait(lookup, "lookup")
        if codes is None:
            return statuses, False
        self._counts.note_codes("lookup", [c for c in codes if c not in (0, 1)], count=False)
        present = {i for i, code in zip(todo, codes, strict=True) if code == 1}
        for i in present:
            statuses[i] = PutStatus.EXISTS

        def before(n: int, chunk: list[int]) -> list[int]:
            if n and checksums is None:
                self._share(seal, [(keys[i], framed[i]) for i in chunk if i not in present])
            return [i for i in chunk if i not in present]

        def after(chunk: list[int], answer: list[int]) -> None:
            if not any(answer):  # all stored: count them at once
                for i in chunk:
                    statuses[i] = PutStatus.OK
                payload_bytes = sum(len(framed[i]) for i in chunk) - HEADER_BYTES * len(chunk)
                self._counts.stored(len(chunk), payload_bytes)
                return
            unexpected: list[int] = []
            for i, code in zip(chunk, answer, strict=True):
                payload_bytes = len(framed[i]) - HEADER_BYTES
                statuses[i] = self._counts.put_status(code, payload_bytes, unexpected)
            self._counts.note_codes("store", unexpected, count=False)

        store = self._client.store.batch_put_from
        self._pipeline(store, "store", keys, objects, chunks, before, after)
        return statuses, True

    def get(self, keys: Sequence[StoreKey], objects: Framed) -> list[GetStatus | None]:
        """Read every key into its framed buffer and verify it there (None: unanswered).
        Each chunk is verified while the next is in Mooncake."""
        statuses: list[GetStatus | None] = [None] * len(keys)
        framed = objects.views

        def after(chunk: list[int], codes: list[int]) -> None:
            whole = [i for i, code in zip(chunk, codes, strict=True) if code == len(framed[i])]
            checked = self._share(check, [(keys[i], framed[i]) for i in whole])
            if len(whole) == len(chunk) and all(c is None for c in checked):  # all sound
                for i in chunk:
                    statuses[i] = GetStatus.OK
                payload_bytes = sum(codes) - HEADER_BYTES * len(chunk)
                self._counts.loaded(len(chunk), payload_bytes)
                return
            problems = dict(zip(whole, checked, strict=True))
            unexpected: list[int] = []
            for i, code in zip(chunk, codes, strict=True):
                stored = len(framed[i])
                statuses[i] = self._counts.get_status(
                    keys[i], code, stored, problems.get(i), unexpected
                )
            self._counts.note_codes("load", unexpected, count=False)

        chunks = split(list(range(len(keys))), framed)
        load = self._client.store.batch_get_into
        self._pipeline(load, "load", keys, objects, chunks, lambda _, c: c, after)
        return statuses

    def _pipeline(
        self,
        call: Callable[..., list[int]],
        what: str,
        keys: Sequence[StoreKey],
        objects: Framed,
        chunks: list[list[int]],
        before: Callable[[int, list[int]], list[int]],
        after: Callable[[list[int], list[int]], None],
    ) -> None:
        """One call per chunk, two in flight: ``before`` gives a chunk's indices to send
        (after its own work), ``after`` takes their answers. After a failed call the rest
        stay unanswered; calls still in Mooncake are held."""
        in_flight: deque[tuple[list[int], cf.Future[Any]]] = deque()
        try:
            for n, chunk in enumerate(chunks):
                if len(in_flight) == 2 and not self._finish(in_flight, what, after):
                    return
                indices = before(n, chunk)
                if not indices:
                    continue
                pointers = [objects.addresses[i] for i in indices]
                sizes = [len(objects.views[i]) for i in indices]
                future = self._client.submit(call, [keys[i] for i in indices], pointers, sizes)
                if future is None:
                    return
                in_flight.append((indices, future))
            while in_flight:
                if not self._finish(in_flight, what, after):
                    return
        finally:
            for _, future in in_flight:
                if not future.done():
                    self._hold(future)  # still in Mooncake: it may read or write staging

    def _finish(
        self,
        in_flight: deque[tuple[list[int], cf.Future[Any]]],
        what: str,
        after: Callable[[list[int], list[int]], None],
    ) -> bool:
        indices, future = in_flight[0]
        codes = self._client.wait(future, what)
        if codes is None:
            return False
        in_flight.popleft()
        after(indices, codes)
        return True

    def _hold(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._held.add(future)

        def release(done: cf.Future[Any]) -> None:
            with self._lock:
                self._held.discard(done)

        future.add_done_callback(release)
