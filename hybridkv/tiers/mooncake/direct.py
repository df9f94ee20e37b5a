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
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError, verify_object, write_header_into
from hybridkv.tiers.mooncake.accounting import MooncakeAccounting
from hybridkv.tiers.mooncake.client import MooncakeClient

ROOM_BYTES = 64
"""Room asked for in front of each buffer: the header, kept cache-line aligned."""

Share = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
"""Runs a function over items with a spare thread's help (``rounds.share_work``)."""


def seal(item: tuple[StoreKey, Buffer]) -> None:
    """Checksum the payload and write the header in front of it."""
    key, framed = item
    write_header_into(framed, key, framed[HEADER_BYTES:])


def check(item: tuple[StoreKey, Buffer]) -> HeaderError | None:
    key, framed = item
    return verify_object(framed[:HEADER_BYTES], key, framed[HEADER_BYTES:])


class StagedPath:
    """Puts and gets of buffers in registered staging. Thread-safe."""

    def __init__(self, client: MooncakeClient, counts: MooncakeAccounting, share: Share) -> None:
        self._client = client
        self._counts = counts
        self._share = share
        self._regions: list[tuple[int, Buffer]] = []
        self._held: set[cf.Future[Any]] = set()
        self._lock = threading.Lock()

    def register(self, staging: Buffer) -> int:
        """Register ``staging`` with Mooncake; the room wanted (0 when refused)."""
        if not self._client.add_buffer(staging):
            return 0
        with self._lock:
            self._regions.append((int(staging.ctypes.data), staging))
        return ROOM_BYTES

    def framed(self, buffers: Sequence[Buffer]) -> list[Buffer] | None:
        """Each buffer with its header room in front, as one slice of registered
        staging; None unless every buffer lies in it."""
        with self._lock:
            regions = list(self._regions)
        framed = []
        for buffer in buffers:
            start = int(buffer.ctypes.data) - HEADER_BYTES
            for low, staging in regions:
                offset = start - low
                if offset >= 0 and offset + HEADER_BYTES + buffer.nbytes <= staging.nbytes:
                    framed.append(staging[offset : offset + HEADER_BYTES + buffer.nbytes])
                    break
            else:
                return None
        return framed

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._held)

    def put(
        self, keys: Sequence[StoreKey], framed: Sequence[Buffer], todo: list[int]
    ) -> tuple[list[PutStatus | None], bool]:
        """Store ``todo`` (distinct keys); per index a status (None: not asked), and
        whether the pool answered. Headers are written while the existence lookup runs."""
        statuses: list[PutStatus | None] = [None] * len(keys)
        store = self._client.store
        lookup = self._client.submit(store.batch_is_exist, [keys[i] for i in todo])
        if lookup is None:
            return statuses, False
        self._share(seal, [(keys[i], framed[i]) for i in todo])
        codes = self._client.wait(lookup, "lookup")
        if codes is None:
            return statuses, False
        self._counts.note_codes("lookup", [c for c in codes if c not in (0, 1)], count=False)
        absent = [i for i, code in zip(todo, codes, strict=True) if code != 1]
        for i in set(todo) - set(absent):
            statuses[i] = PutStatus.EXISTS
        if not absent:
            return statuses, True
        answer = self._call(store.batch_put_from, "store", keys, framed, absent)
        if answer is None:
            return statuses, False
        unexpected: list[int] = []
        for i, code in zip(absent, answer, strict=True):
            statuses[i] = self._counts.put_status(code, len(framed[i]) - HEADER_BYTES, unexpected)
        self._counts.note_codes("store", unexpected, count=False)
        return statuses, True

    def get(self, keys: Sequence[StoreKey], framed: Sequence[Buffer]) -> list[GetStatus] | None:
        """Read every key into its framed buffer and verify it there; None: no answer."""
        everything = list(range(len(keys)))
        codes = self._call(self._client.store.batch_get_into, "load", keys, framed, everything)
        if codes is None:
            return None
        whole = [i for i in everything if codes[i] == len(framed[i])]
        checked = self._share(check, [(keys[i], framed[i]) for i in whole])
        problems = dict(zip(whole, checked, strict=True))
        unexpected: list[int] = []
        statuses = [
            self._counts.get_status(keys[i], codes[i], len(framed[i]), problems.get(i), unexpected)
            for i in everything
        ]
        self._counts.note_codes("load", unexpected, count=False)
        return statuses

    def _call(
        self,
        call: Callable[..., list[int]],
        what: str,
        keys: Sequence[StoreKey],
        framed: Sequence[Buffer],
        indices: list[int],
    ) -> list[int] | None:
        pointers = [int(framed[i].ctypes.data) for i in indices]
        sizes = [len(framed[i]) for i in indices]
        future = self._client.submit(call, [keys[i] for i in indices], pointers, sizes)
        if future is None:
            return None
        codes = self._client.wait(future, what)
        if codes is None and not future.done():
            self._hold(future)  # still in Mooncake: it may read or write staging
        return codes

    def _hold(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._held.add(future)

        def release(done: cf.Future[Any]) -> None:
            with self._lock:
                self._held.discard(done)

        future.add_done_callback(release)
