"""Real shared-pool servers for tests, on 127.0.0.1 with free ports.

``MooncakePool`` (a Mooncake master + one storage daemon) and ``ValkeyServer``
are context managers over ``hybridkv.tools.pool.LocalPool`` that yield the running
pool and stop it (and remove its temporary run directory) on exit. Typical
use in a test module::

    @pytest.fixture(scope="module")
    def pool() -> Iterator[LocalPool]:
        with MooncakePool() as running:
            yield running
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from hybridkv.tools.pool import LocalPool

MIB = 1 << 20


class _PoolContext:
    def __init__(self, **start_options: Any) -> None:
        self._options = start_options
        self._run_dir: Path | None = None
        self._pool: LocalPool | None = None

    def __enter__(self) -> LocalPool:
        self._run_dir = Path(tempfile.mkdtemp(prefix="hybridkv-pool-"))
        try:
            self._pool = LocalPool.start(self._run_dir, **self._options)
        except BaseException:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            raise
        return self._pool

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.stop()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)


class MooncakePool(_PoolContext):
    """A master and one storage daemon lending ``segment_bytes``.

    ``client_ttl_s`` (default 2, Mooncake's own default is 10) is how long the
    master keeps a dead daemon's memory listed: short, so fault tests are quick.
    """

    def __init__(self, *, segment_bytes: int = 256 * MIB, client_ttl_s: int = 2) -> None:
        super().__init__(segment_bytes=segment_bytes, client_ttl_s=client_ttl_s)


class ValkeyServer(_PoolContext):
    """A valkey-server with ``maxmemory_bytes`` under ``policy`` (optionally a password);
    with ``shards`` > 1, a Valkey Cluster of that many primaries, each with that memory."""

    def __init__(
        self,
        *,
        maxmemory_bytes: int = 256 * MIB,
        policy: str = "allkeys-lru",
        password: str | None = None,
        shards: int = 1,
    ) -> None:
        super().__init__(
            mooncake=False,
            valkey=True,
            valkey_maxmemory_bytes=maxmemory_bytes,
            valkey_policy=policy,
            valkey_password=password,
            valkey_shards=shards,
        )


def wait_for(condition: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.1) -> float:
    """Seconds until ``condition()`` held; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - start


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s result and the seconds it took."""
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start
