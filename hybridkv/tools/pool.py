"""A local shared pool on loopback: ``LocalPool`` starts, finds and stops it.

Runs in the CLI process (``hybridkv pool``) and in tests. Starts a Mooncake
master and one storage daemon (``mooncake_client``, which lends the pool its
memory, so objects outlive every engine), optionally a ``valkey-server``, as
background processes with free ports, bound to 127.0.0.1 unless ``host``
names another address. Their pids, ports and logs
go to ``<run_dir>/pool.json`` so another process can find and stop them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from hybridkv.tools.servers import (
    HOST,
    Server,
    ServerRole,
    connect_host,
    default_run_dir,
    free_port,
    is_loopback,
    mooncake_binary,
    read_metrics,
    valkey_binary,
    valkey_info,
    valkey_ping,
    wait_until,
)
from hybridkv.tools.valkey_cluster import shard_argv, start_cluster

STATE_FILE = "pool.json"
DEFAULT_SEGMENT_BYTES = 1 << 30
MIN_SEGMENT_BYTES = 16 << 20
DEFAULT_VALKEY_MAXMEMORY_BYTES = 1 << 30
DEFAULT_EVICTION_HIGH_WATERMARK = 0.8
"""The master evicts once this share of the pool is used: the headroom above it
absorbs a burst of stores between two eviction passes (Mooncake's default 0.9)."""
DEFAULT_EVICTION_RATIO = 0.2
"""Share of the objects one eviction pass removes, least recently used first
(Mooncake's default 0.05 frees too little to keep up with a burst)."""
VALKEY_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "noeviction")

_MOONCAKE_FIGURES = (
    ("total_capacity_bytes", "master_total_capacity_bytes"),
    ("allocated_bytes", "master_allocated_bytes"),
    ("key_count", "master_key_count"),
    ("evicted_keys", "master_evicted_key_count"),
    ("refused_puts", "master_put_start_alloc_failures_total"),
)
"""``status()``'s pool figures: name -> the master's metric."""
_VALKEY_FIGURES = (
    ("used_memory_bytes", "used_memory"),
    ("maxmemory_bytes", "maxmemory"),
    ("evicted_keys", "evicted_keys"),
    ("refused_puts", "errorstat_OOM"),
)
"""``status()``'s Valkey figures, summed over shards: name -> its ``INFO`` field."""


def _valkey_figures(ports: list[int], password: str | None) -> dict[str, int | None]:
    infos = [valkey_info(port, password) for port in ports]
    figures: dict[str, int | None] = {}
    for name, field_name in _VALKEY_FIGURES:
        # errorstat_OOM is "count=N,..." (absent until a write is refused).
        default = "count=0" if field_name.startswith("errorstat") else ""
        texts = [
            info.get(field_name, default).removeprefix("count=").split(",")[0] for info in infos
        ]
        usable = all(infos) and all(text.isdigit() for text in texts)
        figures[name] = sum(int(text) for text in texts) if usable else None
    return figures


@dataclass(kw_only=True)
class LocalPool:
    """A Mooncake master + one storage daemon (+ valkey-server) on ``host``."""

    run_dir: Path
    segment_bytes: int
    ports: dict[str, int]
    servers: dict[ServerRole, Server]
    shards: list[Server] = field(default_factory=list)
    """The primaries of a Valkey Cluster (``valkey_shards`` > 1), in slot order."""
    valkey_password: str | None = None
    host: str = HOST
    """The address every server binds: loopback unless asked otherwise."""

    @classmethod
    def start(
        cls,
        run_dir: Path | None = None,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        mooncake: bool = True,
        valkey: bool = False,
        valkey_maxmemory_bytes: int = DEFAULT_VALKEY_MAXMEMORY_BYTES,
        valkey_policy: str = "allkeys-lru",
        valkey_password: str | None = None,
        valkey_shards: int = 1,
        eviction_high_watermark: float = DEFAULT_EVICTION_HIGH_WATERMARK,
        eviction_ratio: float = DEFAULT_EVICTION_RATIO,
        client_ttl_s: int = 10,
        ready_timeout_s: float = 30.0,
        host: str = HOST,
    ) -> Self:
        """Start the servers, wait until they serve, write the state file.

        ``eviction_high_watermark`` and ``eviction_ratio`` are the master's
        eviction settings (see the constants); ``valkey_policy`` is Valkey's
        ``maxmemory-policy``, for each of ``valkey_shards`` primaries (more than
        one: a Valkey Cluster, slots split evenly). ``client_ttl_s`` is how long the master keeps a
        silent daemon's memory listed (Mooncake's default 10 s; tests shorten it).
        """
        run_dir = (run_dir or default_run_dir()).expanduser().resolve()
        problems = [] if mooncake or valkey else ["nothing to start: mooncake and valkey are off"]
        if segment_bytes < MIN_SEGMENT_BYTES:
            problems.append(
                f"segment_bytes={segment_bytes}: must be >= 16 MiB (the storage daemon's minimum)"
            )
        for name, ratio in (
            ("eviction_high_watermark", eviction_high_watermark),
            ("eviction_ratio", eviction_ratio),
        ):
            if not 0 < ratio <= 1:
                problems.append(f"{name}={ratio}: must be in (0, 1], e.g. 0.8")
        if valkey_policy not in VALKEY_POLICIES:
            problems.append(
                f"valkey_policy={valkey_policy!r}: must be one of {', '.join(VALKEY_POLICIES)}"
            )
        if valkey_shards < 1:
            problems.append(f"valkey_shards={valkey_shards}: must be >= 1 (1: no cluster)")
        if valkey and not valkey_password and not is_loopback(host):
            problems.append(
                f"valkey on {host} needs valkey_password: without one, valkey-server's "
                "protected mode refuses every client not on loopback"
            )
        if problems:
            raise ValueError("; ".join(problems))
        with contextlib.suppress(FileNotFoundError):
            running = cls.load(run_dir)
            if any(server.alive() for server in running.servers.values()):
                raise ValueError(
                    f"a pool already runs in {run_dir}; stop it first: "
                    f"hybridkv pool down --run-dir {run_dir}"
                )
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        pool = cls(run_dir=run_dir, segment_bytes=segment_bytes, ports={}, servers={}, host=host)
        pool.valkey_password = valkey_password
        if mooncake:
            pool.ports.update(master=free_port(), metrics=free_port(), daemon=free_port())
            eviction = (eviction_high_watermark, eviction_ratio)
            pool._add(ServerRole.MASTER, pool._master_argv(client_ttl_s, eviction))
            pool._add(ServerRole.DAEMON, pool._daemon_argv())
        memory = ["--maxmemory", str(valkey_maxmemory_bytes), "--maxmemory-policy", valkey_policy]
        if valkey and valkey_shards == 1:
            pool.ports["valkey"] = free_port()
            pool._add(ServerRole.VALKEY, pool._valkey_argv(memory, valkey_password))
        elif valkey:
            pool._add_shards(valkey_shards, memory)
        try:
            for role in pool.servers:
                pool._start_and_wait(role, ready_timeout_s)
            if pool.shards:
                pool._start_shards(ready_timeout_s)
        except BaseException:
            pool.stop()
            raise
        pool.write_state()
        return pool

    @classmethod
    def load(cls, run_dir: Path | None = None) -> Self:
        """The pool recorded in ``run_dir`` (FileNotFoundError when none)."""
        run_dir = (run_dir or default_run_dir()).expanduser().resolve()
        path = run_dir / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no pool state in {run_dir} (start one: hybridkv pool up)")
        state = json.loads(path.read_text())
        servers = {
            ServerRole(role): Server.from_json(info, ServerRole(role))
            for role, info in state["servers"].items()
        }
        return cls(
            run_dir=run_dir,
            segment_bytes=state["segment_bytes"],
            ports=state["ports"],
            servers=servers,
            shards=[
                Server.from_json(info, ServerRole.VALKEY_SHARD) for info in state.get("shards", [])
            ],
            valkey_password=state.get("valkey_password"),
            host=state.get("host", HOST),
        )

    # -- addresses and configs --------------------------------------------------------

    @property
    def client_host(self) -> str:
        """Where clients on this machine reach the servers."""
        return connect_host(self.host)

    @property
    def master_address(self) -> str:
        return f"{self.client_host}:{self.ports['master']}"

    @property
    def valkey_port(self) -> int:
        """The Valkey server's port; with a cluster, the first shard's."""
        return self.ports["valkey"] if "valkey" in self.ports else self.shard_ports[0]

    @property
    def shard_ports(self) -> list[int]:
        return [self.ports[f"valkey_shard_{i}"] for i in range(len(self.shards))]

    def tier_configs(self) -> list[dict[str, Any]]:
        """The ``tiers`` entries an engine uses to reach this pool."""
        tiers: list[dict[str, Any]] = []
        if ServerRole.MASTER in self.servers:
            tiers.append({"kind": "mooncake", "master_address": self.master_address})
        if ServerRole.VALKEY in self.servers or self.shards:
            entry = {"kind": "valkey", "host": self.client_host, "port": self.valkey_port}
            entry |= {"cluster": True} if self.shards else {}
            tiers.append(
                entry | ({"password": self.valkey_password} if self.valkey_password else {})
            )
        return tiers

    def kv_transfer_config(self) -> dict[str, Any]:
        """A full ``--kv-transfer-config`` for vLLM: CPU memory in front of this pool."""
        tiers = [{"kind": "cpu", "capacity_bytes": "2GiB"}, *self.tier_configs()]
        return {
            "kv_connector": "HybridKVConnector",
            "kv_connector_module_path": "hybridkv.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": tiers},
        }

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every server (daemon before master) and remove the state file."""
        for role in (ServerRole.DAEMON, ServerRole.VALKEY, ServerRole.MASTER):
            if role in self.servers:
                self.servers[role].stop()
        for shard in self.shards:
            shard.stop()
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)

    def kill(self, role: ServerRole) -> None:
        """SIGKILL one server, as a crash would."""
        self.servers[role].stop(sig=signal.SIGKILL)

    def restart(self, role: ServerRole, *, ready_timeout_s: float = 30.0) -> None:
        """Start a stopped server again on the same ports and wait until it serves."""
        self.servers[role].stop()
        self._start_and_wait(role, ready_timeout_s)
        self.write_state()

    def pause(self, role: ServerRole) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung host)."""
        self.servers[role].send(signal.SIGSTOP)

    def resume(self, role: ServerRole) -> None:
        self.servers[role].send(signal.SIGCONT)

    def kill_daemon(self) -> None:
        self.kill(ServerRole.DAEMON)

    def restart_daemon(self) -> None:
        self.restart(ServerRole.DAEMON)

    def kill_master(self) -> None:
        self.kill(ServerRole.MASTER)

    def restart_master(self) -> None:
        self.restart(ServerRole.MASTER)

    def status(self) -> dict[str, Any]:
        """Per server: pid and whether it runs; plus the master's pool metrics."""
        report: dict[str, Any] = {
            role.value: {"pid": server.pid, "alive": server.alive(), "log": str(server.log_path)}
            for role, server in self.servers.items()
        }
        for i, shard in enumerate(self.shards):
            report[f"valkey-shard-{i}"] = {
                "pid": shard.pid,
                "alive": shard.alive(),
                "log": str(shard.log_path),
            }
        if "metrics" in self.ports:
            metrics = read_metrics(self.ports["metrics"], self.client_host) or {}
            report["pool"] = {name: metrics.get(metric) for name, metric in _MOONCAKE_FIGURES}
        if "valkey" in self.ports or self.shards:
            ports = self.shard_ports or [self.valkey_port]
            report["valkey_pool"] = _valkey_figures(ports, self.valkey_password)
        return report

    def write_state(self) -> None:
        state = {
            "segment_bytes": self.segment_bytes,
            "host": self.host,
            "ports": self.ports,
            "servers": {role.value: server.to_json() for role, server in self.servers.items()},
            "shards": [shard.to_json() for shard in self.shards],
            "valkey_password": self.valkey_password,
        }
        path = self.run_dir / STATE_FILE
        temporary = path.with_suffix(".tmp")
        # Owner-only: the state may hold the valkey password.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(state, indent=2))
        temporary.replace(path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------

    def _add(self, role: ServerRole, argv: list[str]) -> None:
        log_path = self.run_dir / "logs" / f"{role.value}.log"
        self.servers[role] = Server(role=role, argv=argv, log_path=log_path, bind_host=self.host)

    def _master_argv(self, client_ttl_s: int, eviction: tuple[float, float]) -> list[str]:
        high_watermark, ratio = eviction
        return [
            str(mooncake_binary("mooncake_master")),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.ports['master']}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.ports['metrics']}",
            f"--client_ttl={client_ttl_s}",
            f"--eviction_high_watermark_ratio={high_watermark}",
            f"--eviction_ratio={ratio}",
        ]

    def _daemon_argv(self) -> list[str]:
        return [
            str(mooncake_binary("mooncake_client")),
            f"--host={self.host}",
            f"--port={self.ports['daemon']}",
            f"--global_segment_size={self.segment_bytes}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--master_server_address={self.master_address}",
        ]

    def _valkey_argv(self, memory: list[str], password: str | None) -> list[str]:
        argv = [str(valkey_binary()), "--bind", self.host, "--port", str(self.valkey_port)]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.run_dir), *memory]
        return argv + (["--requirepass", password] if password else [])

    def _add_shards(self, num_shards: int, memory: list[str]) -> None:
        for i in range(num_shards):
            ports = (free_port(), free_port())
            self.ports |= {f"valkey_shard_{i}": ports[0], f"valkey_bus_{i}": ports[1]}
            argv = shard_argv(
                valkey_binary(), self.run_dir, i, ports, password=self.valkey_password
            )
            log_path = self.run_dir / "logs" / f"valkey-shard-{i}.log"
            server = Server(role=ServerRole.VALKEY_SHARD, argv=argv + memory, log_path=log_path)
            self.shards.append(server)

    def _start_shards(self, timeout_s: float) -> None:
        bus_ports = [self.ports[f"valkey_bus_{i}"] for i in range(len(self.shards))]
        ports = list(zip(self.shard_ports, bus_ports, strict=True))
        start_cluster(self.shards, ports, password=self.valkey_password, timeout_s=timeout_s)

    def _start_and_wait(self, role: ServerRole, timeout_s: float) -> None:
        server = self.servers[role]
        mounts_before = self._metric("master_mount_segment_requests_total")
        server.spawn()
        checks: dict[ServerRole, Callable[[], bool]] = {
            ServerRole.MASTER: self._master_ready,
            ServerRole.DAEMON: lambda: (
                self._metric("master_mount_segment_requests_total") > mounts_before
            ),
            ServerRole.VALKEY: lambda: valkey_ping(
                self.valkey_port, self.valkey_password, self.client_host
            ),
        }
        if not wait_until(lambda: not server.alive() or checks[role](), timeout_s):
            raise RuntimeError(
                f"{role.value} not ready in {timeout_s} s; log:\n{server.log_tail()}"
            )
        if not server.alive():
            raise RuntimeError(f"{role.value} exited at start; log:\n{server.log_tail()}")
        if role is ServerRole.MASTER and ServerRole.DAEMON in self.servers:
            # After a master restart the running daemon mounts its memory again.
            daemon = self.servers[ServerRole.DAEMON]
            if daemon.alive() and not wait_until(self._capacity_mounted, timeout_s):
                raise RuntimeError(f"daemon memory not mounted again in {timeout_s} s")

    def _metric(self, name: str) -> float:
        if "metrics" not in self.ports:
            return 0.0
        return (read_metrics(self.ports["metrics"], self.client_host) or {}).get(name, 0.0)

    def _master_ready(self) -> bool:
        try:
            url = f"http://{self.client_host}:{self.ports['metrics']}/health"
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(json.loads(response.read()).get("service_ready"))
        except (OSError, ValueError):
            return False

    def _capacity_mounted(self) -> bool:
        return self._metric("master_total_capacity_bytes") >= self.segment_bytes
