"""Several hosts on one machine: network namespaces joined by a bridge.

Runs in tests and in the CLI (``hybridkv bench hosts``), as root. ``Network.create``
makes one namespace per host, each with its loopback up and one address of a
private subnet the caller picks, and a hub namespace whose bridge joins them
through veth pairs. Nothing is added to the caller's own namespace. Names carry
a random suffix, so parallel runs do not clash; ``remove`` (also on leaving the
``with`` block, and after a failed create) deletes every namespace, which
deletes their links. A process joins a host through ``Host.argv`` (``ip netns
exec``) or, spawned by this thread, inside ``Network.entered``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from hybridkv.tools.pool import LocalPool

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
BRIDGE = "br0"
HOST_LINK = "eth0"
"""The host's end of its veth pair, inside its namespace."""


class NetnsUnavailable(RuntimeError):
    """This machine does not let us make network namespaces (not root, no ``ip``)."""


@dataclass(frozen=True, kw_only=True)
class Host:
    name: str
    namespace: str
    address: str
    hub_link: str
    """Its veth end in the hub namespace: taking it down cuts the host off."""

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(kw_only=True)
class Network:
    hub: str
    prefix_len: int
    """The subnet's prefix length, for the hosts' addresses."""
    hosts: dict[str, Host] = field(default_factory=dict)

    @classmethod
    def create(cls, host_names: Sequence[str], *, subnet: str = "10.213.0.0/24") -> Self:
        """One namespace per name in ``host_names``, addresses from ``subnet`` in order."""
        addresses = _addresses(subnet, len(host_names))
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        tag = secrets.token_hex(3)
        network = cls(hub=f"hkv-{tag}-hub", prefix_len=ipaddress.IPv4Network(subnet).prefixlen)
        try:
            _ip("netns", "add", network.hub)
            _ip("-n", network.hub, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", network.hub, "link", "set", BRIDGE, "up")
            for i, (name, address) in enumerate(zip(host_names, addresses, strict=True)):
                network._add_host(name, f"hkv-{tag}-{name}", address, f"h{i}-{tag}")
        except BaseException:
            network.remove()
            raise
        return network

    def _add_host(self, name: str, namespace: str, address: str, hub_link: str) -> None:
        _ip("netns", "add", namespace)
        self.hosts[name] = Host(name=name, namespace=namespace, address=address, hub_link=hub_link)
        _ip(
            "link",
            "add",
            HOST_LINK,
            "netns",
            namespace,
            "type",
            "veth",
            "peer",
            "name",
            hub_link,
            "netns",
            self.hub,
        )
        _ip("-n", self.hub, "link", "set", hub_link, "master", BRIDGE, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{self.prefix_len}", "dev", HOST_LINK)
        _ip("-n", namespace, "link", "set", HOST_LINK, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")

    def set_link(self, host: str, *, up: bool) -> None:
        """Connect ``host`` to the others again, or cut it off (packets are dropped
        silently, as in a partition: its own link stays up, without carrier)."""
        _ip("-n", self.hub, "link", "set", self.hosts[host].hub_link, "up" if up else "down")

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[Host]:
        """This thread in ``host``'s namespace: sockets it opens and processes it
        spawns belong there (the other threads stay where they are)."""
        target = os.open(f"{NETNS_DIR}/{self.hosts[host].namespace}", os.O_RDONLY)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield self.hosts[host]
            finally:
                _setns(home)
        finally:
            os.close(target)
            os.close(home)

    def start_pool(self, host: str, run_dir: Path, **options: Any) -> LocalPool:
        """A ``LocalPool`` in ``host``'s namespace, bound to its address (``options``:
        ``LocalPool.start``'s). Read its ``status()`` inside ``entered(host)``."""
        with self.entered(host) as inside:
            return LocalPool.start(run_dir, host=inside.address, **options)

    def tier_configs(self, pool: LocalPool, host: str) -> list[dict[str, Any]]:
        """The pool's ``tiers`` entries for an engine on ``host``: Mooncake is told the
        address its peers reach this host at."""
        address = self.hosts[host].address
        return [
            t | {"local_hostname": address} if t["kind"] == "mooncake" else t
            for t in pool.tier_configs()
        ]

    def remove(self) -> None:
        """Delete every namespace made (their links go with them); idempotent."""
        for namespace in [*(h.namespace for h in self.hosts.values()), self.hub]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self.hosts.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can (checked by making one)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "the ip command is missing: install iproute2"
    probe = f"hkv-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _addresses(subnet: str, num_hosts: int) -> list[str]:
    try:
        network = ipaddress.IPv4Network(subnet)
    except ValueError as exc:
        raise ValueError(
            f"subnet={subnet!r}: {exc}; use a private IPv4 subnet such as '10.213.7.0/24'"
        ) from exc
    problems = [] if network.is_private else [f"subnet={subnet!r}: must be a private range"]
    if num_hosts < 1 or network.num_addresses - 2 < num_hosts:
        problems.append(f"subnet={subnet!r} has no room for {num_hosts} hosts: use a larger one")
    if problems:
        raise ValueError("; ".join(problems))
    return [str(address) for address in list(network.hosts())[:num_hosts]]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise NetnsUnavailable(f"setns failed: {os.strerror(errno)}")
