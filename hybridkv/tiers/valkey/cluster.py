"""Where a key lives in a Valkey Cluster: hash slots and the map of slots to shards.

Runs wherever a ``ValkeyTier`` in cluster mode runs. A key's slot is CRC16
(XMODEM) of the key, or of its ``{hash tag}``, modulo 16384, as the servers
compute it; the map comes from ``CLUSTER SLOTS`` of any node.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from typing import Any, NamedTuple

NUM_SLOTS = 16384
REDIRECTS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
"""Error replies that mean the slot map changed (or is changing)."""


class Node(NamedTuple):
    host: str
    port: int


def key_slot(key: str) -> int:
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:  # an empty tag "{}" hashes the whole key
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % NUM_SLOTS


class SlotMap:
    """Slot -> the primary serving it. Immutable; a new map replaces a stale one."""

    def __init__(self, ranges: Sequence[tuple[int, int, Node]]) -> None:
        self.nodes = sorted({node for _, _, node in ranges})
        index = {node: i for i, node in enumerate(self.nodes)}
        self._owner = [-1] * NUM_SLOTS
        for start, end, node in ranges:
            self._owner[start : end + 1] = [index[node]] * (end - start + 1)

    @classmethod
    def from_reply(cls, reply: Any, seed_host: str) -> SlotMap:
        """From a ``CLUSTER SLOTS`` reply: ``[[start, end, [host, port, id, ...], ...]]``
        (the primary first; a node that announces no address is reached at ``seed_host``)."""
        ranges = []
        for start, end, primary, *_replicas in reply:
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            node = Node(host if host not in ("", "?") else seed_host, int(primary[1]))
            ranges.append((int(start), int(end), node))
        return cls(ranges)

    def node_of(self, key: str) -> Node | None:
        """The shard serving ``key``'s slot; None while no shard does."""
        owner = self._owner[key_slot(key)]
        return None if owner < 0 else self.nodes[owner]
