"""Quiet logs for tiers: each distinct problem of one tier logged once, repeats at debug."""

from __future__ import annotations

import logging


class LogOnce:
    """Logs each distinct problem of one tier once; repeats go to debug."""

    def __init__(self, log: logging.Logger, name: str) -> None:
        self._log, self._name, self._seen = log, name, set[str]()

    def warning(self, problem: str, message: str, *args: object) -> None:
        level = logging.DEBUG if problem in self._seen else logging.WARNING
        self._seen.add(problem)
        self._log.log(level, "tier %s: " + message, self._name, *args)
