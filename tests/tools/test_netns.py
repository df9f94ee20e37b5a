"""Namespaces joined by a bridge: hosts reach each other, a cut link drops their
packets, and nothing is left behind (real namespaces; skipped where not allowed)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hybridkv.tools.netns import Network
from tests.support.netns import needs_netns

pytestmark = needs_netns

PORT = 7411
ECHO = (
    "import socket\n"
    "s = socket.create_server((sys.argv[1], 7411))\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(c.recv(64)); c.close()\n"
)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.fixture
def network() -> Iterator[Network]:
    with Network.create(["pool", "a"], subnet="10.213.41.0/24") as made:
        yield made


def _echo(network: Network, host: str, address: str, timeout_s: float) -> bytes:
    with network.entered(host):
        conn = socket.create_connection((address, PORT), timeout=timeout_s)
    with conn:
        conn.sendall(b"ping")
        return conn.recv(64)


def test_hosts_reach_each_other_only_inside_their_namespaces(network: Network) -> None:
    pool, a = network.hosts["pool"], network.hosts["a"]
    assert (pool.address, a.address) == ("10.213.41.1", "10.213.41.2")
    argv = pool.argv([sys.executable, "-c", "import sys\n" + ECHO, pool.address])
    server = subprocess.Popen(argv)
    try:
        reply = None
        for _ in range(100):  # until the server listens
            try:
                reply = _echo(network, "a", pool.address, timeout_s=2.0)
                break
            except ConnectionRefusedError:
                subprocess.run(["sleep", "0.05"], check=True)
        assert reply == b"ping"
        # a's loopback is its own: the pool's server is not behind it.
        with pytest.raises(ConnectionRefusedError):
            _echo(network, "a", "127.0.0.1", timeout_s=1.0)
        network.set_link("a", up=False)
        with pytest.raises(TimeoutError):  # dropped silently, not refused
            _echo(network, "a", pool.address, timeout_s=1.0)
        network.set_link("a", up=True)
        assert _echo(network, "a", pool.address, timeout_s=5.0) == b"ping"
    finally:
        server.kill()
        server.wait()


def test_remove_deletes_every_namespace() -> None:
    before = _namespaces()
    network = Network.create(["x", "y"], subnet="10.213.42.0/29")
    made = {network.hub, *(h.namespace for h in network.hosts.values())}
    assert len(made) == 3 and made <= _namespaces()
    network.remove()
    network.remove()  # idempotent
    assert _namespaces() == before


@pytest.mark.parametrize(
    ("subnet", "num_hosts", "message"),
    [
        ("8.8.8.0/24", 2, "must be a private range"),
        ("10.213.0.0/30", 3, "no room for 3 hosts"),
        ("10.213.0.1/24", 2, "host bits set"),
    ],
)
def test_bad_subnet_is_refused_before_anything_is_made(
    subnet: str, num_hosts: int, message: str
) -> None:
    before = _namespaces()
    with pytest.raises(ValueError, match=message) as raised:
        Network.create([f"h{i}" for i in range(num_hosts)], subnet=subnet)
    assert f"subnet={subnet!r}" in str(raised.value)
    assert _namespaces() == before
