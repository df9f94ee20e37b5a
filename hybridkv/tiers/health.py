"""Health of remote tiers (Mooncake, Valkey): gate calls while a server is unreachable.

Runs wherever a remote tier runs (worker and scheduler processes). A remote
server that dies or hangs must cost one bounded wait, then answer misses at
once until a background probe sees it back.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class HealthGate:
    """Whether a remote tier is worth calling; probes it in the background when not.

    ``mark_failed`` flips the gate closed (logged once per outage). While
    closed, ``allow()`` answers False at once and starts ``probe`` in a
    daemon thread at most every ``retry_interval_s``; a probe returning True
    opens the gate again. Thread-safe.
    """

    def __init__(
        self,
        name: str,
        probe: Callable[[], bool],
        *,
        retry_interval_s: float,
        log: logging.Logger = logger,
    ) -> None:
        self.name = name
        self._log = log
        self.num_outages = 0
        self._probe = probe
        self._retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self._healthy = True
        self._probing = False
        self._closed = False
        self._next_probe_at = 0.0

    @property
    def healthy(self) -> bool:
        return self._healthy

    def allow(self) -> bool:
        with self._lock:
            if self._healthy:
                return True
            if self._probing or self._closed or time.monotonic() < self._next_probe_at:
                return False
            self._probing = True
        threading.Thread(
            target=self._run_probe, name=f"hybridkv-{self.name}-probe", daemon=True
        ).start()
        return False

    def mark_failed(self, reason: str) -> None:
        with self._lock:
            if not self._healthy:
                return
            self._healthy = False
            self.num_outages += 1
            self._next_probe_at = time.monotonic() + self._retry_interval_s
        self._log.warning(
            "tier %s: unreachable (%s); answering misses until a probe (every %.1f s) succeeds",
            self.name,
            reason,
            self._retry_interval_s,
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def _run_probe(self) -> None:
        try:
            ok = self._probe()
        except Exception as exc:  # a probe failure is an answer, not a crash
            self._log.debug("tier %s: probe raised %r", self.name, exc)
            ok = False
        with self._lock:
            self._probing = False
            self._next_probe_at = time.monotonic() + self._retry_interval_s
            recovered = ok and not self._healthy
            self._healthy = self._healthy or ok
        if recovered:
            self._log.warning("tier %s: reachable again", self.name)


def tcp_reachable(host: str, port: int, *, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True
