"""What one Mooncake read costs from a given host, without an engine around it.

Runs in the CLI process and in tests, which spawn ``python -m
hybridkv.tools.pool_probe`` (inside a host's network namespace where one is
given). The child, a fresh ``MooncakeTier`` client bound to the host's address,
stores a few objects under keys of its own, times ``num_reads`` single-object
``get_many_into`` calls, deletes the objects and prints the milliseconds as
JSON. Compare a host across a network with the pool's own host: the pool's
cost of a read, apart from what an engine adds (its steps, its busy threads).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.tools.netns import Host

OBJECT_BYTES = 16 << 10
"""One KV block of the tiny test models."""
NUM_OBJECTS = 4
NUM_READS = 40
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class ReadTimes:
    """The milliseconds of each timed single-object read, in order."""

    read_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.read_ms)


def time_reads(
    master_address: str,
    host: Host | None = None,
    *,
    object_bytes: int = OBJECT_BYTES,
    num_reads: int = NUM_READS,
    timeout_s: float = 60.0,
) -> ReadTimes:
    """Reads timed by a client on ``host`` (None: this namespace, over loopback)."""
    address = host.address if host else LOOPBACK
    argv = [sys.executable, "-m", __name__, master_address, address]
    argv += [str(object_bytes), str(num_reads)]
    done = subprocess.run(
        host.argv(argv) if host else argv,
        env=os.environ | {"MC_TCP_BIND_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        where = host.name if host else "loopback"
        raise RuntimeError(
            f"pool probe on {where} against {master_address} exited with {done.returncode}:\n"
            f"{done.stderr[-2000:]}"
        )
    return ReadTimes(read_ms=tuple(json.loads(lines[-1])["read_ms"]))


def measure(master_address: str, local_hostname: str, object_bytes: int, num_reads: int) -> str:
    """The child's work: the JSON line to print, or RuntimeError naming the failed step."""
    from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
    from hybridkv.tiers.mooncake.config import MooncakeConfig
    from hybridkv.tiers.mooncake.tier import MooncakeTier

    config = MooncakeConfig(master_address=master_address, local_hostname=local_hostname)
    rng = np.random.default_rng(0)
    objects = [rng.integers(0, 256, object_bytes, dtype=np.uint8) for _ in range(NUM_OBJECTS)]
    keys = [StoreKey(f"hybridkv/probe/{uuid.uuid4().hex}/{i}") for i in range(NUM_OBJECTS)]
    with MooncakeTier(config) as tier:
        stored = tier.put_many(keys, objects)
        if any(status is not PutStatus.OK for status in stored):
            raise RuntimeError(f"storing the probe's objects: {stored}")
        read_ms = []
        into = np.empty(object_bytes, np.uint8)
        for i in range(num_reads):
            k = i % NUM_OBJECTS
            start = time.perf_counter()
            status = tier.get_many_into([keys[k]], [into])[0]
            read_ms.append((time.perf_counter() - start) * 1000)
            if status is not GetStatus.OK or not np.array_equal(into, objects[k]):
                raise RuntimeError(f"read {i} of {keys[k]}: {status}")
        tier.delete_many(keys)
    return json.dumps({"read_ms": read_ms})


def main(argv: Sequence[str]) -> int:
    if len(argv) != 4:
        print(
            "usage: python -m hybridkv.tools.pool_probe MASTER_ADDRESS LOCAL_HOSTNAME "
            "OBJECT_BYTES NUM_READS",
            file=sys.stderr,
        )
        return 2
    master_address, local_hostname, object_bytes, num_reads = argv
    try:
        print(measure(master_address, local_hostname, int(object_bytes), int(num_reads)))
    except RuntimeError as exc:
        print(f"pool probe failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
