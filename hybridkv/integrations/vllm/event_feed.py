"""One engine's KV events, received as vLLM publishes them, handed to whoever indexes them.

The lookup's process (a router, ``hybridkv route serve``, ``hybridkv bench
route``). ``EventFeed`` binds a SUB socket (loopback by default; vLLM's ZMQ
publisher connects to an endpoint without ``*``) and decodes every batch with
vLLM's own ``KVEventBatch`` on a thread: a message is ``(topic, sequence,
payload)``. A batch it cannot decode is counted (``errors``) and skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

logger = logging.getLogger(__name__)


class EventFeed:
    """One engine's events, received on a loopback SUB socket; each batch's events go to
    ``apply`` (``route.events.EventIndex.apply``), on the feed's thread.

    ``endpoint`` is what the engine's ``kv_events_config.endpoint`` must be (vLLM's
    publisher connects to an address without ``*``). ``close`` stops the thread.
    """

    def __init__(
        self, apply: Callable[[list[Any]], None], *, endpoint: str = "tcp://127.0.0.1:*"
    ) -> None:
        self._apply = apply
        self.batches = 0
        self.last_batch_at = 0.0
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket: Any = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridkv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._socket.poll(100):
                    continue
                frames = self._socket.recv_multipart()
                try:
                    batch = self._decoder.decode(frames[-1])
                except Exception as exc:  # a message we cannot read costs it, not the feed
                    self.errors += 1
                    logger.warning("KV events from %s: undecodable batch (%s)", self.endpoint, exc)
                    continue
                self._apply(batch.events)
                self.batches += 1
                self.last_batch_at = time.monotonic()
        finally:
            self._socket.close(linger=0)

    def settle(self, quiet_s: float = 0.2, timeout_s: float = 5.0) -> None:
        """Wait until no batch came for ``quiet_s`` (at most ``timeout_s``): the engine's
        events of what it just did are in."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if time.monotonic() - self.last_batch_at >= quiet_s:
                return
            time.sleep(quiet_s / 4)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
