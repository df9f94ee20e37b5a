"""A tiered store's in-place access: its first tier's memory, whose commits go on down.

Worker process. Reservations, borrows and releases are the first tier's own;
a commit is too, and then hands each stored object, as a view of that memory,
to the store (which counts it and sends it to the other tiers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey, TierMemory

if TYPE_CHECKING:
    import torch

Stored = Callable[[list[StoreKey], list[Buffer]], None]
"""Called with the keys and views of the objects a commit stored."""


class StoreMemory(TierMemory):
    """``TieredStore.memory()``: ``first``'s memory; ``stored`` sees every commit.

    With ``send_on``, each stored object comes to ``stored`` borrowed once more
    (taken by the commit itself, so nothing can evict it first); ``stored`` owns
    that borrow and must release it.
    """

    def __init__(self, first: TierMemory, stored: Stored, *, send_on: bool) -> None:
        self._first = first
        self._stored = stored
        self._send_on = send_on
        self._extents: dict[StoreKey, tuple[int, int]] = {}
        """(offset, size) of each reservation made through this store, until committed."""
        self._array: Buffer | None = None
        self._lock = threading.Lock()

    @property
    def memory(self) -> torch.Tensor:
        return self._first.memory

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        answers = self._first.reserve_many(keys, sizes)
        with self._lock:
            for key, size, answer in zip(keys, sizes, answers, strict=True):
                if not isinstance(answer, PutStatus):
                    self._extents[key] = (answer, int(size))
        return answers

    def commit_many(
        self, keys: Sequence[StoreKey], written: Sequence[bool], *, num_borrows: int = 0
    ) -> None:
        with self._lock:
            unknown = [key for key in keys if key not in self._extents]
        if unknown:
            raise ValueError(
                f"commit_many: {unknown} were not reserved through this store's memory(); "
                "commit where you reserved"
            )
        extra = 1 if self._send_on else 0
        self._first.commit_many(keys, written, num_borrows=num_borrows + extra)
        with self._lock:
            extents = [self._extents.pop(key) for key in keys]
        stored = [j for j, was_written in enumerate(written) if was_written]
        if stored:
            array = self.array()
            views = [array[extents[j][0] : extents[j][0] + extents[j][1]] for j in stored]
            self._stored([keys[j] for j in stored], views)

    def borrow_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | GetStatus]:
        return self._first.borrow_many(keys, sizes)

    def release_many(self, keys: Sequence[StoreKey]) -> None:
        self._first.release_many(keys)

    def array(self) -> Buffer:
        """The first tier's memory as one uint8 array (views of objects are slices)."""
        if self._array is None:
            self._array = cast(Buffer, self._first.memory.numpy())
        return self._array
