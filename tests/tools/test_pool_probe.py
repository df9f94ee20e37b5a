"""The pool probe against a real Mooncake pool on 127.0.0.1 (no namespaces needed)."""

from __future__ import annotations

import pytest

from hybridkv.tools.pool_probe import time_reads
from hybridkv.tools.servers import free_port
from tests.support.servers import MIB, MooncakePool


def test_reads_are_timed_and_checked_against_a_running_pool() -> None:
    with MooncakePool(segment_bytes=64 * MIB) as pool:
        times = time_reads(pool.master_address, object_bytes=64 << 10, num_reads=12)
        key_count = pool.status()["pool"]["key_count"]
    assert len(times.read_ms) == 12 and all(ms > 0 for ms in times.read_ms)
    assert min(times.read_ms) <= times.median_ms <= max(times.read_ms)
    assert key_count == 0, "the probe leaves its objects in the pool"


def test_an_unreachable_pool_is_an_error_naming_it() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="storing the probe's objects") as failed:
        time_reads(address, num_reads=2, timeout_s=30)
    assert address in str(failed.value)
