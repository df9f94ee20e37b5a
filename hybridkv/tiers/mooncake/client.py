"""Calls into Mooncake Store, bounded in time and gated by the pool's health.

Runs wherever a ``MooncakeTier`` runs. Each call runs in a helper thread and
is abandoned after ``op_timeout_s`` (calls to a killed master take ~4.3 s
each, to a hung one 30 s). A timeout or an unreachable master marks the
client unhealthy (``HealthGate``): callers get "not now" at once, without
calling Mooncake, until a background probe (run whether or not calls come)
reaches the master again.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from hybridkv.tiers.base import Buffer
from hybridkv.tiers.health import HealthGate, tcp_reachable
from hybridkv.tiers.log_once import LogOnce
from hybridkv.tiers.mooncake.config import MooncakeConfig

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 15.0
_PROBE_KEY = "hybridkv/health-probe"


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


ABSENT = frozenset({McCode.OBJECT_NOT_FOUND, McCode.REPLICA_IS_NOT_READY, McCode.REPLICA_IS_GONE})
UNREACHABLE = frozenset({McCode.RPC_FAIL, McCode.RPC_TIMEOUT})


class MooncakeClient:
    """``mooncake.store.MooncakeDistributedStore`` with bounded calls. Thread-safe.

    ``arena`` (and every ``add_buffer``) is registered with Mooncake at
    setup, so calls that name addresses inside it move bytes zero-copy.
    """

    def __init__(self, config: MooncakeConfig, arena: Buffer, *, name: str, log: LogOnce) -> None:
        # Peers must be told the address we reach them at, never another interface's.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel, or libibverbs1 it links against, is missing
            raise ImportError(
                f"the mooncake tier needs pip install 'hybridkv[mooncake]' and libibverbs1: {exc}"
            ) from exc
        self.config = config
        self.store: Any = MooncakeDistributedStore()
        self._buffers = [arena]
        """Registered at setup: the tier's arena, then staging lent by transfer engines."""
        self._log = log
        self.ready = self.closed = False
        # Two rounds per direction plus a lookup, and spares for calls abandoned in Mooncake.
        self._executor = cf.ThreadPoolExecutor(8, f"hybridkv-{name}")
        self._client_lock = threading.Lock()
        """Held by setup and probes; ``close`` takes it for good."""
        self._pending: set[cf.Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self.gate = HealthGate(name, self.probe, retry_interval_s=config.retry_interval_s)
        setup = self._executor.submit(self.connect)
        try:
            connected = setup.result(timeout=max(SETUP_TIMEOUT_S, config.op_timeout_s))
        except cf.TimeoutError:
            connected = False
        if not connected:
            self.gate.mark_failed(f"no setup against master {config.master_address}")

    @property
    def healthy(self) -> bool:
        """As last seen; only an unhealthy client probes (in the background)."""
        return self.ready and self.gate.healthy

    def allow(self) -> bool:
        """Whether to call Mooncake now."""
        return not self.closed and self.gate.allow() and self.ready

    def close(self) -> None:
        """Stop the helper threads and close the client, unless a call is stuck in it."""
        if self.closed:
            return
        self.closed = True
        self.gate.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._pending_lock:
            pending = list(self._pending)
        _, still_running = cf.wait(pending, timeout=self.config.op_timeout_s)
        if still_running or not self._client_lock.acquire(timeout=self.config.op_timeout_s):
            # Closing under a call still inside Mooncake would crash the process.
            self._log.warning("close", "calls still in flight; the client is left open")
            return
        if self.ready:
            self.ready = False
            self.store.close()

    def round_trip(self, call: Callable[..., list[int]], *args: Any, what: str) -> list[int] | None:
        """``call(*args)`` in a helper thread; None when it failed to answer in time."""
        future = self.submit(call, *args)
        return None if future is None else self.wait(future, what)

    def submit(self, call: Callable[..., list[int]], *args: Any) -> cf.Future[Any] | None:
        try:
            future = self._executor.submit(call, *args)
        except RuntimeError:  # the executor was shut down by close()
            return None
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self.forget)
        return future

    def wait(self, future: cf.Future[Any], what: str) -> list[int] | None:
        try:
            codes = [int(code) for code in future.result(timeout=self.config.op_timeout_s)]
        except cf.TimeoutError:
            self.gate.mark_failed(f"{what} got no answer in {self.config.op_timeout_s} s")
            return None
        except Exception as exc:  # the binding raises on arguments it rejects
            self._log.warning(f"raised-{what}", "%s raised %r", what, exc)
            return None
        if any(code in UNREACHABLE for code in codes):
            self.gate.mark_failed(f"{what}: master {self.config.master_address} unreachable")
        return codes

    def forget(self, future: cf.Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def connect(self) -> bool:
        """Set up the client and register the arena, once; False while the master is away."""
        with self._client_lock:
            return self.connect_locked()

    def connect_locked(self) -> bool:
        if self.ready or self.closed:
            return self.ready
        config = self.config
        if not self.master_reachable():
            return False  # setup itself would retry for ~90 s
        rc = self.store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_bytes,
            0,  # Mooncake's own copy buffer: unused, every call is zero-copy
            config.protocol.value,
            config.rdma_devices,
            config.master_address,
        )
        for buffer in self._buffers:
            rc = rc or self.store.register_buffer(int(buffer.ctypes.data), len(buffer))
        if rc != 0:
            self._log.warning("setup", "setup against %s returned %s", config.master_address, rc)
            return False
        self.ready = True
        return True

    def add_buffer(self, buffer: Buffer) -> bool:
        """Register ``buffer`` now if set up, else at setup; False when Mooncake refused it."""
        if self.closed or not self._client_lock.acquire(timeout=SETUP_TIMEOUT_S):
            return False
        try:
            if self.ready:
                rc = self.store.register_buffer(int(buffer.ctypes.data), len(buffer))
                if rc != 0:
                    self._log.warning("register", "registering staging returned %s", rc)
                    return False
            self._buffers.append(buffer)
            return True
        finally:
            self._client_lock.release()

    def master_reachable(self) -> bool:
        host, port = self.config.master_address.rsplit(":", 1)
        return tcp_reachable(host, int(port), timeout_s=min(1.0, self.config.op_timeout_s))

    def probe(self) -> bool:
        """Runs in the gate's probe thread: set up if needed, then ask the master once."""
        with self._client_lock:
            if not self.connect_locked() or not self.master_reachable():
                return False
            codes = self.store.batch_is_exist([_PROBE_KEY])
        return len(codes) == 1 and codes[0] in (0, 1)
