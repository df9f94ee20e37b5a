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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from hybridkv.tools.servers import (
    HOST,
    Server,
    ServerRole,
    connect_host,
    default_run_dir,
    free_port,
    mooncake_binary,
    read_metrics,
    valkey_binary,
    valkey_ping,
    wait_until,
)

STATE_FILE = "pool.json"
DEFAULT_SEGMENT_BYTES = 1 << 30
DEFAULT_VALKEY_MAXMEMORY_BYTES = 1 << 30


@dataclass(kw_only=True)
class LocalPool:
    """A Mooncake master + one storage daemon (+ valkey-server) on ``host``."""

    run_dir: Path
    segment_bytes: int
    ports: dict[str, int]
    servers: dict[ServerRole, Server]
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
        client_ttl_s: int = 10,
        ready_timeout_s: float = 30.0,
        host: str = HOST,
    ) -> Self:
        """Start the servers, wait until they serve, write the state file.

        ``client_ttl_s`` is how long the master keeps a silent daemon's memory
        listed (Mooncake's default 10 s; tests shorten it).
        """
        run_dir = (run_dir or default_run_dir()).expanduser().resolve()
        problems = [] if mooncake or valkey else ["nothing to start: mooncake and valkey are off"]
        if segment_bytes < 1 << 20:
            problems.append(f"segment_bytes={segment_bytes}: must be >= 1 MiB")
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
            pool._add(ServerRole.MASTER, pool._master_argv(client_ttl_s))
            pool._add(ServerRole.DAEMON, pool._daemon_argv())
        if valkey:
            pool.ports["valkey"] = free_port()
            argv = pool._valkey_argv(valkey_maxmemory_bytes, valkey_policy, valkey_password)
            pool._add(ServerRole.VALKEY, argv)
        try:
            for role in pool.servers:
                pool._start_and_wait(role, ready_timeout_s)
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
            ServerRole(role): Server(
                role=ServerRole(role),
                argv=info["argv"],
                log_path=Path(info["log"]),
                pid=info["pid"],
                start_ticks=info.get("start_ticks", 0),
                bind_host=info.get("bind_host", HOST),
            )
            for role, info in state["servers"].items()
        }
        return cls(
            run_dir=run_dir,
            segment_bytes=state["segment_bytes"],
            ports=state["ports"],
            servers=servers,
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
        return self.ports["valkey"]

    def tier_configs(self) -> list[dict[str, Any]]:
        """The ``tiers`` entries an engine uses to reach this pool."""
        tiers: list[dict[str, Any]] = []
        if ServerRole.MASTER in self.servers:
            tiers.append({"kind": "mooncake", "master_address": self.master_address})
        if ServerRole.VALKEY in self.servers:
            entry = {"kind": "valkey", "host": self.client_host, "port": self.valkey_port}
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
        if "metrics" in self.ports:
            metrics = read_metrics(self.ports["metrics"], self.client_host) or {}
            names = ("master_total_capacity_bytes", "master_allocated_bytes", "master_key_count")
            report["pool"] = {name.removeprefix("master_"): metrics.get(name) for name in names}
        return report

    def write_state(self) -> None:
        state = {
            "segment_bytes": self.segment_bytes,
            "host": self.host,
            "ports": self.ports,
            "servers": {role.value: server.to_json() for role, server in self.servers.items()},
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

    def _master_argv(self, client_ttl_s: int) -> list[str]:
        return [
            str(mooncake_binary("mooncake_master")),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.ports['master']}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.ports['metrics']}",
            f"--client_ttl={client_ttl_s}",
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

    def _valkey_argv(self, maxmemory_bytes: int, policy: str, password: str | None) -> list[str]:
        argv = [str(valkey_binary()), "--bind", self.host, "--port", str(self.valkey_port)]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.run_dir)]
        argv += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", policy]
        return argv + (["--requirepass", password] if password else [])

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
