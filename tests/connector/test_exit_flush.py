"""Closing a worker lets its write-back finish, up to its bound, and counts what it left;
a process that ends without closing it (it returns, or gets SIGTERM) closes it first.

Scheduler + worker on a real CPU tier in front of a real disk tier whose writes
wait at a gate, so the write-back of a request's blocks is still queued when
the worker closes. Opened within the bound, every block reaches the disk and
nothing is counted; never opened, the worker stops at the bound and counts
every block it did not write.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import GroupKind
from hybridkv.tiers.base import Buffer, PutStatus, StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.sim.build import make_config, make_engine
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import disk_config, on_disk, stored_keys

GATE_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


class GatedDiskTier(DiskTier):
    """A real disk tier whose writes wait at ``gate``."""

    gate: threading.Event

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        assert self.gate.wait(GATE_S), "the gate was never opened"
        return super().put_many(keys, buffers, checksums)


def stored_request(tmp_path: Path) -> tuple[SimEngine, GatedDiskTier, list[StoreKey]]:
    """A request computed and stored: in the CPU tier, its write-back held at the gate."""
    model_groups = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL))
    config = make_config(tmp_path)
    disk = GatedDiskTier(disk_config(config))
    disk.gate = threading.Event()
    cpu = CpuTier(CpuConfig(capacity_bytes=8 << 20, pin_memory=False))
    engine = make_engine(model_groups, config, store=TieredStore([cpu, disk]))
    tokens = prompt(70)
    engine.add("a", tokens)
    engine.step()
    assert engine.worker.collect_results() == 0, "stores on CPU end before save returns"
    keys = stored_keys(model_groups, engine, tokens)
    pending = engine.worker.store.write_back_stats().num_pending
    assert keys and pending == len(keys), "every stored block waits for the disk"
    return engine, disk, keys


def test_closing_waits_for_the_write_back_and_counts_nothing(tmp_path: Path) -> None:
    engine, disk, keys = stored_request(tmp_path)
    worker: ConnectorWorker = engine.worker
    threading.Timer(0.3, disk.gate.set).start()
    worker.close()
    assert worker.stats.unflushed_blocks == 0
    assert on_disk(make_config(tmp_path), keys) == [True] * len(keys)


def test_closing_stops_at_its_bound_and_counts_every_block_left(tmp_path: Path) -> None:
    engine, disk, keys = stored_request(tmp_path)
    worker: ConnectorWorker = engine.worker
    worker.close_timeout_s = 0.3
    start = time.monotonic()
    worker.close()
    took = time.monotonic() - start
    disk.gate.set()
    assert took < GATE_S / 2, took
    assert worker.stats.unflushed_blocks == len(keys)
    worker.close()  # once closed, closing again does nothing
    assert worker.stats.unflushed_blocks == len(keys)
    assert not any(on_disk(make_config(tmp_path), keys))


@pytest.mark.parametrize("how", ["return", "sigterm"])
def test_a_process_ending_without_close_writes_back_first(tmp_path: Path, how: str) -> None:
    """At interpreter exit, or on a SIGTERM nothing else handles, the worker is closed
    first: its write-back, held back for a second, reaches the disk."""
    ended = subprocess.run(
        [sys.executable, "-m", "tests.connector.exit_script", str(tmp_path), how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = 0 if how == "return" else -signal.SIGTERM
    assert ended.returncode == expected, ended.stderr[-3000:]
    keys = [StoreKey(line) for line in ended.stdout.splitlines()]
    assert keys
    assert on_disk(make_config(tmp_path), keys) == [True] * len(keys)
