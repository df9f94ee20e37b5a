"""Health of remote tiers (Mooncake, Valkey): gate calls while a server is unreachable.

Runs wherever a remote tier runs (worker and scheduler processes). A remote
server that dies or hangs must cost one bounded wait, then answer misses at
once until a background probe sees it back. Probes run while the gate is
closed whether or not calls come, so an engine idle through a server's
restart finds the gate open again when its next requests arrive.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


CALL_PROBE_GAP_S = 0.1
"""A call finding the gate closed probes at once when no probe ended this recently."""
CALL_WAIT_S = 0.1
"""How long that call waits for the probe: a recovered server answers within it, an
unreachable one costs the call no more than this (the probe goes on in the background)."""


class HealthGate:
    """Whether a remote tier is worth calling; probes it in the background when not.

    ``mark_failed`` flips the gate closed (logged once per outage) and starts
    a daemon thread that calls ``probe`` every ``retry_interval_s`` until one
    returns True, which opens the gate again. A call finding the gate closed
    asks for a probe at once (unless one ran in the last ``CALL_PROBE_GAP_S``)
    and waits up to ``CALL_WAIT_S`` for its answer, so the first call after a
    recovery goes through; other calls answer False at once. Thread-safe.
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
        self._lock = threading.Condition()
        self._healthy = True
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._num_probes = 0
        self._asked = False
        self._last_probe_at = 0.0

    @property
    def healthy(self) -> bool:
        return self._healthy

    def allow(self) -> bool:
        if self._healthy or self._closed.is_set():
            return self._healthy and not self._closed.is_set()
        with self._lock:
            if self._asked or time.monotonic() - self._last_probe_at < CALL_PROBE_GAP_S:
                return False
            self._asked = True
            asked_at = self._num_probes
            self._wake.set()
            self._lock.wait_for(
                lambda: self._num_probes > asked_at or self._closed.is_set(), CALL_WAIT_S
            )
            return self._healthy and not self._closed.is_set()

    def mark_failed(self, reason: str) -> None:
        with self._lock:
            if not self._healthy or self._closed.is_set():
                return
            self._healthy = False
            self.num_outages += 1
            self._last_probe_at = time.monotonic()  # the failed call counts as a probe
        self._log.warning(
            "tier %s: unreachable (%s); answering misses until a probe (every %.1f s) succeeds",
            self.name,
            reason,
            self._retry_interval_s,
        )
        threading.Thread(
            target=self._probe_until_healthy, name=f"hybridkv-{self.name}-probe", daemon=True
        ).start()

    def close(self) -> None:
        """Stop probing; ``allow()`` answers False from now on."""
        self._closed.set()
        self._wake.set()

    def _probe_until_healthy(self) -> None:
        """One thread per outage: ``mark_failed`` starts it only on the healthy -> failed edge."""
        while not self._closed.is_set():
            self._wake.wait(self._retry_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                break
            try:
                ok = self._probe()
            except Exception as exc:  # a probe failure is an answer, not a crash
                self._log.debug("tier %s: probe raised %r", self.name, exc)
                ok = False
            with self._lock:
                self._healthy = ok and not self._closed.is_set()
                self._num_probes += 1
                self._asked = False
                self._last_probe_at = time.monotonic()
                self._lock.notify_all()
            if ok:
                self._log.warning("tier %s: reachable again", self.name)
                return
        with self._lock:
            self._lock.notify_all()


def tcp_reachable(host: str, port: int, *, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True
