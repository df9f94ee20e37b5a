"""A Valkey Cluster on loopback: N primary shards, slots split evenly, no replicas.

Runs in the CLI process and in tests, for ``LocalPool``. Each shard is one
``valkey-server --cluster-enabled yes`` with its own client and cluster-bus
ports on 127.0.0.1; the nodes meet and each takes an even range of the 16384
hash slots (``CLUSTER MEET``, ``CLUSTER ADDSLOTSRANGE``), so no ``valkey-cli``
is needed.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hybridkv.tools.servers import HOST, Server, valkey_call, valkey_ping, wait_until

NUM_SLOTS = 16384


def slot_ranges(num_shards: int) -> list[tuple[int, int]]:
    """Even, contiguous, inclusive slot ranges covering all slots."""
    bounds = [NUM_SLOTS * i // num_shards for i in range(num_shards + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(num_shards)]


def shard_argv(
    binary: Path, run_dir: Path, index: int, ports: tuple[int, int], *, password: str | None
) -> list[str]:
    """``valkey-server`` flags of shard ``index`` (client port, cluster-bus port)."""
    port, bus_port = ports
    argv = [str(binary), "--bind", HOST, "--port", str(port), "--cluster-enabled", "yes"]
    argv += ["--cluster-port", str(bus_port), "--cluster-config-file", f"nodes-{index}.conf"]
    argv += ["--cluster-node-timeout", "5000", "--dir", str(run_dir), "--save", ""]
    argv += ["--appendonly", "no"]
    if password:
        argv += ["--requirepass", password, "--masterauth", password]
    return argv


def start_cluster(
    shards: list[Server], ports: list[tuple[int, int]], *, password: str | None, timeout_s: float
) -> None:
    """Spawn the shards, wait until each answers, then form the cluster."""
    for (port, _), shard in zip(ports, shards, strict=True):
        shard.spawn()
        if not wait_until(functools.partial(valkey_ping, port, password), timeout_s):
            raise RuntimeError(f"valkey shard on port {port} not ready; log:\n{shard.log_tail()}")
    form_cluster(ports, password=password, timeout_s=timeout_s)


def form_cluster(ports: list[tuple[int, int]], *, password: str | None, timeout_s: float) -> None:
    """Introduce every node to the first, give each its slots, wait for ``cluster_state:ok``
    on every node; RuntimeError naming the node and its answer when that fails."""
    (first, first_bus), *others = ports
    for port, _ in others:
        _expect_ok(port, password, "CLUSTER", "MEET", HOST, str(first), str(first_bus))
    for (port, _), (start, end) in zip(ports, slot_ranges(len(ports)), strict=True):
        _expect_ok(port, password, "CLUSTER", "ADDSLOTSRANGE", str(start), str(end))

    def all_ok() -> bool:
        return all(cluster_state(port, password) == "ok" for port, _ in ports)

    if not wait_until(all_ok, timeout_s):
        states = {port: cluster_state(port, password) for port, _ in ports}
        raise RuntimeError(
            f"valkey cluster not ok in {timeout_s} s: cluster_state by port {states}"
        )


def cluster_state(port: int, password: str | None) -> str | None:
    text = (valkey_call(port, "CLUSTER", "INFO", password=password) or b"").decode()
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    return None


def _expect_ok(port: int, password: str | None, *command: str) -> None:
    answer = valkey_call(port, *command, password=password)
    if answer != b"OK":
        raise RuntimeError(f"valkey node on port {port}: {' '.join(command)} answered {answer!r}")
