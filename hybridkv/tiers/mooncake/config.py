"""Settings of the Mooncake Store tier, read without importing the client."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from hybridkv.tiers.health import check_address
from hybridkv.tiers.registry import ConfigReader, value_problems

if TYPE_CHECKING:
    from hybridkv.tiers.mooncake.tier import MooncakeTier


class Protocol(enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


_MOONCAKE_KEYS = {
    "master_address": 'the master\'s "host:port" (required)',
    "metadata_server": 'transfer metadata service (default "P2PHANDSHAKE": none needed)',
    "protocol": "'tcp' or 'rdma' (default 'tcp')",
    "rdma_devices": 'RDMA device names for protocol rdma (default "")',
    "local_hostname": 'address peers reach this process at (default "127.0.0.1")',
    "local_buffer_bytes": "registered staging arena, half for loads and half for stores; "
    'bounds one round trip and one object (default "128MiB")',
    "global_segment_bytes": "memory this process lends to the pool; 0: none, the pool lives in "
    "storage daemons (default 0)",
    "load_weight": "relative cost of loading from this tier, > 0 (default 8.0)",
    "op_timeout_s": "seconds before one round trip is abandoned as an error (default 2.0)",
    "retry_interval_s": "seconds between probes of an unreachable pool (default 1.0)",
}


@dataclass(frozen=True, kw_only=True)
class MooncakeConfig:
    master_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Protocol = Protocol.TCP
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    local_buffer_bytes: int = 128 << 20
    """The registered staging arena (not Mooncake's own copy buffer, which stays unused)."""
    global_segment_bytes: int = 0
    load_weight: float = 8.0
    op_timeout_s: float = 2.0
    retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        problems = value_problems(
            capacity_bytes=self.local_buffer_bytes, minimum=64 << 10, load_weight=self.load_weight
        )
        problems += check_address("master_address", self.master_address)
        if not self.global_segment_bytes >= 0:
            problems.append(f"global_segment_bytes={self.global_segment_bytes!r}: must be >= 0")
        for key in ("op_timeout_s", "retry_interval_s"):
            if not getattr(self, key) > 0:
                problems.append(f"{key}={getattr(self, key)!r}: must be > 0")
        if problems:
            raise ValueError("invalid MooncakeConfig: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str) -> Self:
        reader = ConfigReader(raw, where=where, allowed=_MOONCAKE_KEYS)
        master_address = reader.text("master_address")
        if master_address:
            reader.problems += check_address("master_address", master_address)
        rdma_devices = raw.get("rdma_devices", "")
        if not isinstance(rdma_devices, str):
            reader.problems.append(f"rdma_devices={rdma_devices!r}: must be a string")
        metadata_server = reader.text("metadata_server", default="P2PHANDSHAKE")
        protocol = reader.choice("protocol", Protocol, default=Protocol.TCP)
        local_hostname = reader.text("local_hostname", default="127.0.0.1")
        local_buffer_bytes = reader.byte_size(
            "local_buffer_bytes", minimum=64 << 10, default=128 << 20
        )
        global_segment_bytes = reader.byte_size("global_segment_bytes", minimum=0, default=0)
        load_weight = reader.positive_float("load_weight", default=8.0)
        op_timeout_s = reader.positive_float("op_timeout_s", default=2.0)
        retry_interval_s = reader.positive_float("retry_interval_s", default=1.0)
        reader.finish()
        return cls(
            master_address=master_address,
            metadata_server=metadata_server,
            protocol=protocol,
            rdma_devices=str(rdma_devices),
            local_hostname=local_hostname,
            local_buffer_bytes=local_buffer_bytes,
            global_segment_bytes=global_segment_bytes,
            load_weight=load_weight,
            op_timeout_s=op_timeout_s,
            retry_interval_s=retry_interval_s,
        )

    def build(self) -> MooncakeTier:
        from hybridkv.tiers.mooncake.tier import MooncakeTier

        return MooncakeTier(self)
