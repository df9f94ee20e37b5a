"""A process that stores a request and ends without closing its worker (test helper).

Run as ``python -m tests.connector.exit_script DIR HOW``: a scheduler/worker pair
on a real CPU tier in front of a real disk tier in ``DIR``, whose writes wait
at a gate for a second, stores one request; the worker is handed to
``flush_at_exit``; then the process ends ``HOW`` (``return``: the interpreter
exits; ``sigterm``: the process sends itself SIGTERM) with the write-back
still held at the gate. Prints the keys it stored, one per line, first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from hybridkv.connector.exit_flush import flush_at_exit
from hybridkv.groups import GroupKind
from hybridkv.tiers.base import Buffer, PutStatus, StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.sim.build import make_config, make_engine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import disk_config, stored_keys

GATE_S = 1.0


class SlowDiskTier(DiskTier):
    """A real disk tier whose writes start ``GATE_S`` after it was built."""

    opens_at = 0.0

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        time.sleep(max(0.0, self.opens_at - time.monotonic()))
        return super().put_many(keys, buffers, checksums)


def main(directory: Path, how: str) -> None:
    model_groups = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL))
    config = make_config(directory)
    disk = SlowDiskTier(disk_config(config))
    disk.opens_at = time.monotonic() + GATE_S
    cpu = CpuTier(CpuConfig(capacity_bytes=8 << 20, pin_memory=False))
    engine = make_engine(model_groups, config, store=TieredStore([cpu, disk]))
    flush_at_exit(engine.worker)
    tokens = prompt(70)
    engine.add("a", tokens)
    engine.step()
    assert engine.worker.store.write_back_stats().num_pending > 0, "nothing left to flush"
    for key in stored_keys(model_groups, engine, tokens):
        print(key, flush=True)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(60)  # the signal ends the process first


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
