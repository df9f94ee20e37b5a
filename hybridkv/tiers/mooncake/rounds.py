"""How the Mooncake tier packs a batch into rounds and stages or checks a round.

No Mooncake calls here: rounds are planned over staging slots, and objects
are staged (payload copied behind its header, then checksummed) or checked
(verified, then copied out) by the caller with one spare thread's help.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from hybridkv.tiers.base import Buffer, StoreKey
from hybridkv.tiers.codec import HEADER_BYTES, HeaderError, verify_object, write_header_into

ALIGN_BYTES = 64
"""Objects start at multiples of this within a slot."""

_T = TypeVar("_T")
_R = TypeVar("_R")


class Round(NamedTuple):
    """Objects that fit one staging region together: one Mooncake call."""

    indices: list[int]
    offsets: list[int]
    num_bytes: list[int]


def plan_rounds(num_bytes: Sequence[int], region_bytes: int) -> tuple[list[Round], list[int]]:
    """Pack objects in order into rounds of aligned offsets within ``region_bytes``.

    Returns the rounds and the indices of objects larger than a region.
    """
    rounds: list[Round] = []
    too_large: list[int] = []
    current = Round([], [], [])
    end = 0
    for i, size in enumerate(num_bytes):
        if size > region_bytes:
            too_large.append(i)
            continue
        if end + size > region_bytes:
            rounds.append(current)
            current, end = Round([], [], []), 0
        current.indices.append(i)
        current.offsets.append(end)
        current.num_bytes.append(size)
        end += -(-size // ALIGN_BYTES) * ALIGN_BYTES
    if current.indices:
        rounds.append(current)
    return rounds, too_large


Item = tuple[StoreKey, Buffer, Buffer]
"""A key, its object's bytes in a slot (header, then payload), and the caller's buffer."""


def stage_object(item: Item) -> None:
    """Copy the payload behind its header slot, then checksum the copy (still cached)."""
    key, stored, payload = item
    body = stored[HEADER_BYTES:]
    np.copyto(body, payload)
    write_header_into(stored, key, body)


def check_object(item: Item) -> HeaderError | None:
    """Verify a stored object; copy its payload out only when it passes."""
    key, stored, out = item
    problem = verify_object(stored[:HEADER_BYTES], key, stored[HEADER_BYTES:])
    if problem is None:
        np.copyto(out, stored[HEADER_BYTES:])
    return problem


def share_work(
    helper: cf.Executor | None, work: Callable[[_T], _R], items: Sequence[_T]
) -> list[_R]:
    """``[work(item) for item in items]``, with ``helper`` (one spare thread) taking items too.

    Numpy copies and xxh3 release the GIL, so two threads stage or check a
    round in less time than one, even on two cores. Both claim
    the next item from one counter: a helper kept off the CPU by other
    processes leaves the items to the caller instead of holding the round up.
    Returns only when no ``work`` call is running any more.
    """
    results: list[Any] = [None] * len(items)
    claims = itertools.count()

    def drain() -> None:
        while (k := next(claims)) < len(items):
            results[k] = work(items[k])

    help_wanted = None
    if helper is not None and len(items) > 1:
        with contextlib.suppress(RuntimeError):  # shut down: work alone
            help_wanted = helper.submit(drain)
    try:
        drain()
    finally:
        if help_wanted is not None and not help_wanted.cancel():
            help_wanted.result()  # its last item; no write may land after the return
    return results


def release_when_done(lock: threading.Lock, futures: list[cf.Future[Any]]) -> None:
    """Release ``lock`` once every future has finished (now, if none is running)."""
    remaining = [len(futures)]
    guard = threading.Lock()

    def one_done(_future: cf.Future[Any]) -> None:
        with guard:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            lock.release()

    if not futures:
        lock.release()
    for future in futures:
        future.add_done_callback(one_done)
