"""Settings of the Valkey tier (``kind: valkey``), read without importing the client."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from hybridkv.tiers.registry import ConfigReader, value_problems

if TYPE_CHECKING:
    from hybridkv.tiers.valkey.tier import ValkeyTier

_VALKEY_KEYS = {
    "host": 'server address (default "127.0.0.1")',
    "port": "server port, 1..65535 (default 6379)",
    "db": "database number, >= 0 (default 0)",
    "username": "ACL user name (default none)",
    "password": "password (default none)",
    "ssl": "connect with TLS, true or false (default false)",
    "ssl_ca_certs": "CA bundle file for TLS (default: the system's)",
    "ssl_certfile": "client certificate file for TLS (default none)",
    "ssl_keyfile": "client key file for TLS (default none)",
    "load_weight": "relative cost of loading from this tier, > 0 (default 10.0)",
    "op_timeout_s": "socket timeout of every call, > 0 (default 2.0)",
    "retry_interval_s": "seconds between probes of an unreachable server (default 1.0)",
}
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


@dataclass(frozen=True, kw_only=True)
class ValkeyConfig:
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    load_weight: float = 10.0
    op_timeout_s: float = 2.0
    retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        problems = value_problems(capacity_bytes=1, minimum=1, load_weight=self.load_weight)
        problems += _int_problems("port", self.port, 1, 65535)
        problems += _int_problems("db", self.db, 0, 1 << 31)
        for key in ("op_timeout_s", "retry_interval_s"):
            if not getattr(self, key) > 0:
                problems.append(f"{key}={getattr(self, key)!r}: must be > 0")
        if not self.ssl and any(getattr(self, key) for key in TLS_FILES):
            problems.append("ssl_* files given while ssl is false: set ssl to true")
        if problems:
            raise ValueError("invalid ValkeyConfig: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str) -> Self:
        reader = ConfigReader(raw, where=where, allowed=_VALKEY_KEYS)
        ints = {key: raw.get(key, default) for key, default in (("port", 6379), ("db", 0))}
        reader.problems += _int_problems("port", ints["port"], 1, 65535)
        reader.problems += _int_problems("db", ints["db"], 0, 1 << 31)
        texts: dict[str, str | None] = {}
        for key in ("username", "password", *TLS_FILES):
            value = raw.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                reader.problems.append(
                    f"{key}=<{type(value).__name__}>: must be a non-empty string"
                )
            texts[key] = value if isinstance(value, str) and value else None
        ssl = raw.get("ssl", False)
        if not isinstance(ssl, bool):
            reader.problems.append(f"ssl={ssl!r}: must be true or false")
        elif not ssl and any(texts[key] for key in TLS_FILES):
            reader.problems.append("ssl_* files given while ssl is false: set ssl to true")
        host = reader.text("host", default="127.0.0.1")
        load_weight = reader.positive_float("load_weight", default=10.0)
        op_timeout_s = reader.positive_float("op_timeout_s", default=2.0)
        retry_interval_s = reader.positive_float("retry_interval_s", default=1.0)
        reader.finish()
        return cls(
            host=host,
            port=int(ints["port"]),
            db=int(ints["db"]),
            username=texts["username"],
            password=texts["password"],
            ssl=bool(ssl),
            ssl_ca_certs=texts["ssl_ca_certs"],
            ssl_certfile=texts["ssl_certfile"],
            ssl_keyfile=texts["ssl_keyfile"],
            load_weight=load_weight,
            op_timeout_s=op_timeout_s,
            retry_interval_s=retry_interval_s,
        )

    def build(self) -> ValkeyTier:
        from hybridkv.tiers.valkey.tier import ValkeyTier

        return ValkeyTier(self)


def _int_problems(key: str, value: object, low: int, high: int) -> list[str]:
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return []
    return [f"{key}={value!r}: must be an integer in {low}..{high}"]
