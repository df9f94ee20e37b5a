"""A tiered store's guard: a tier that raises never breaks the store.

Worker process, any thread. Every call a ``TieredStore`` makes into one of its
tiers goes through ``TierGuard``: an exception is logged (the first per tier as a
warning, later ones at debug level), counted for that tier, and answered with the
caller's failure value, which the store treats as a miss.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from hybridkv.tiers.base import StoreKey

T = TypeVar("T")


class TierGuard:
    """Runs calls into the tiers of the store ``store_name``, counting their exceptions."""

    def __init__(self, store_name: str, tier_names: Sequence[str], log: logging.Logger) -> None:
        self.store_name = store_name
        self.tier_names = tuple(tier_names)
        self._log = log
        """The store's logger: its warnings name the store's module."""
        self._errors = [0] * len(self.tier_names)
        self._lock = threading.Lock()

    def call(self, index: int, what: str, failed: T, call: Callable[..., T], *args: object) -> T:
        """Run ``call(*args)`` on tier ``index``; an exception is logged once, counted, and
        answered with ``failed``."""
        try:
            return call(*args)
        except Exception as exc:
            with self._lock:
                first = self._errors[index] == 0
                self._errors[index] += 1
            self._log.log(
                logging.WARNING if first else logging.DEBUG,
                "tiered store %s: %s on tier %s failed: %r",
                self.store_name,
                what,
                self.tier_names[index],
                exc,
            )
            return failed

    def batch(
        self,
        index: int,
        what: str,
        failed: T,
        call: Callable[..., list[T]],
        keys: Sequence[StoreKey],
        *args: object,
    ) -> list[T]:
        """One batched tier call; a wrong-length answer counts as an error."""

        def checked() -> list[T]:
            answers = call(keys, *args)
            if len(answers) != len(keys):
                raise RuntimeError(f"answered {len(answers)} results for {len(keys)} keys")
            return answers

        return self.call(index, what, [failed] * len(keys), checked)

    def num_errors(self, index: int | None = None) -> int:
        """Exceptions caught from tier ``index`` (None: from every tier)."""
        with self._lock:
            return sum(self._errors) if index is None else self._errors[index]
