"""Settings of the Mooncake Store tier (``kind: mooncake``), read without importing the client."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, StrictStr, field_validator
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, ByteSize
from hybridkv.tiers.config import LoadWeight, ServerTierConfig

if TYPE_CHECKING:
    from hybridkv.tiers.mooncake.tier import MooncakeTier


class Protocol(enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


def check_address(address: str) -> str:
    """``address`` if it is ``"host:port"`` with a port in 1..65535, else ValueError."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return address
    raise ValueError('must be "host:port" with a port in 1..65535')


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class MooncakeConfig(ServerTierConfig):
    """``kind: mooncake``: a Mooncake Store pool shared by engines and machines."""

    kind: Literal["mooncake"] = "mooncake"
    master_address: Annotated[StrictStr, Field(description='the master\'s "host:port"')]
    metadata_server: Annotated[
        StrictStr, Field(min_length=1, description="transfer metadata service; default: none")
    ] = "P2PHANDSHAKE"
    protocol: Annotated[Protocol, Field(description="transport")] = Protocol.TCP
    rdma_devices: Annotated[StrictStr, Field(description="RDMA device names for protocol rdma")] = (
        ""
    )
    local_hostname: Annotated[
        StrictStr, Field(min_length=1, description="address peers reach this process at")
    ] = "127.0.0.1"
    local_buffer_bytes: Annotated[
        ByteSize,
        Field(
            ge=64 << 10,
            description=(
                "registered staging memory, half for loads and half for stores; bounds "
                "one round trip and one object"
            ),
        ),
    ] = 128 << 20
    global_segment_bytes: Annotated[
        ByteSize,
        Field(
            ge=0, description="memory this process lends to the pool; 0: storage daemons hold it"
        ),
    ] = 0
    load_weight: LoadWeight = 8.0

    @field_validator("master_address")
    @classmethod
    def _master_address(cls, value: str) -> str:
        return check_address(value)

    def build(self) -> MooncakeTier:
        from hybridkv.tiers.mooncake.tier import MooncakeTier  # it imports this module

        return MooncakeTier(self)
