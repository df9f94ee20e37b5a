"""The connector's typed configuration, parsed once from the engine's extra config.

Any process (the scheduler and the worker each parse the same dict). Every
problem of the dict (unknown keys, wrong types, impossible values, bad tier
entries) goes into one ``ValueError`` that lists the allowed keys. An empty
dict is a complete configuration: a CPU tier plus a disk tier under the
default cache directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.keys import HashAlgo
from hybridkv.paths import CACHE_DIR_ENV, default_cache_dir
from hybridkv.tiers.registry import ConfigReader, TierConfig, parse_tier_configs
from hybridkv.tiers.selection import Selection

DEFAULT_CPU_CAPACITY_BYTES = 2 << 30
DEFAULT_DISK_CAPACITY_BYTES = 32 << 30
DEFAULT_LOAD_TIMEOUT_S = 30.0
DISK_SUBDIR = "kv"
"""The default disk tier lives in ``<cache_dir>/kv``."""


ALLOWED_KEYS: dict[str, str] = {
    "tiers": "list of tier dicts, each with 'kind' (cpu, disk, mooncake, valkey) and that "
    "kind's keys; default: a CPU tier plus a disk tier in <cache_dir>/kv",
    "cache_dir": f"directory of the default disk tier (default ${CACHE_DIR_ENV}, else "
    "~/.cache/hybridkv)",
    "cpu_capacity_bytes": 'size of the default CPU tier, int or "2GiB" (default 2GiB)',
    "disk_capacity_bytes": 'size of the default disk tier, int or "32GiB" (default 32GiB)',
    "selection": "'per_block' (each block from the cheapest tier holding it) or "
    "'whole_request' (one tier serves a whole load) (default 'per_block')",
    "load_timeout_s": f"seconds before a load is abandoned and recomputed, > 0 (default "
    f"{DEFAULT_LOAD_TIMEOUT_S})",
    "chunk_tokens": "tokens per stored chunk, a multiple of every group's block size "
    "(default: the scheduler block size)",
    "model_id": "name that keeps this model's keys apart (default: the engine's model)",
    "hash_algo": "'xxh3_128' or 'sha256' (default 'xxh3_128')",
}


def default_tier_dicts(
    cache_dir: Path, cpu_capacity_bytes: int, disk_capacity_bytes: int
) -> list[dict[str, Any]]:
    """The embedded default: CPU memory in front of a local disk directory."""
    return [
        {"kind": "cpu", "capacity_bytes": cpu_capacity_bytes},
        {
            "kind": "disk",
            "path": str(cache_dir / DISK_SUBDIR),
            "capacity_bytes": disk_capacity_bytes,
        },
    ]


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """Everything the connector reads from the user, validated."""

    tiers: tuple[TierConfig, ...]
    """Tiers in lookup order; the first is the one stores land in first."""
    cache_dir: Path
    selection: Selection = Selection.PER_BLOCK
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    chunk_tokens: int | None = None
    """None: the layout's scheduler block size."""
    model_id: str | None = None
    """None: the engine's model name."""
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    uses_default_tiers: bool = True

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any] | None, *, where: str = "kv_connector_extra_config"
    ) -> ConnectorConfig:
        """Parse the user's dict; one ValueError names every problem and the allowed keys."""
        raw = {} if raw is None else raw
        reader = ConfigReader(raw, where=where, allowed=ALLOWED_KEYS)
        cache_dir = _read_cache_dir(reader, raw)
        cpu_bytes = reader.byte_size("cpu_capacity_bytes", default=DEFAULT_CPU_CAPACITY_BYTES)
        disk_bytes = reader.byte_size("disk_capacity_bytes", default=DEFAULT_DISK_CAPACITY_BYTES)
        selection = reader.choice("selection", Selection, default=Selection.PER_BLOCK)
        timeout = reader.positive_float("load_timeout_s", default=DEFAULT_LOAD_TIMEOUT_S)
        chunk_tokens = _read_optional_positive_int(reader, raw, "chunk_tokens")
        model_id = reader.text("model_id", default="") or None
        hash_algo = _read_hash_algo(reader, raw)
        uses_default = "tiers" not in raw
        if not uses_default:
            for key in ("cpu_capacity_bytes", "disk_capacity_bytes"):
                if key in raw:
                    reader.problems.append(
                        f"{key} sizes the default tiers only and 'tiers' is given: set "
                        "capacity_bytes inside the 'tiers' entries instead"
                    )
        tier_dicts = (
            raw["tiers"]
            if not uses_default
            else default_tier_dicts(cache_dir, cpu_bytes, disk_bytes)
        )
        tiers: list[TierConfig] = []
        try:
            tiers = parse_tier_configs(tier_dicts, where=f"{where}.tiers")
        except (ValueError, TypeError) as exc:
            reader.problems.append(str(exc))
        reader.finish()
        return cls(
            tiers=tuple(tiers),
            cache_dir=cache_dir,
            selection=selection,
            load_timeout_s=timeout,
            chunk_tokens=chunk_tokens,
            model_id=model_id,
            hash_algo=hash_algo,
            uses_default_tiers=uses_default,
        )


def _read_cache_dir(reader: ConfigReader, raw: Mapping[str, Any]) -> Path:
    if "cache_dir" not in raw:
        return default_cache_dir()
    value = raw["cache_dir"]
    if not isinstance(value, str | os.PathLike) or not str(value):
        reader.problems.append(f"cache_dir={value!r}: must be a non-empty path string")
        return default_cache_dir()
    return Path(value).expanduser()


def _read_optional_positive_int(
    reader: ConfigReader, raw: Mapping[str, Any], key: str
) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        reader.problems.append(f"{key}={value!r}: must be an int > 0")
        return None
    return value


def _read_hash_algo(reader: ConfigReader, raw: Mapping[str, Any]) -> HashAlgo:
    value = raw.get("hash_algo", HashAlgo.XXH3_128.value)
    try:
        return HashAlgo.parse(value)
    except ValueError as exc:
        reader.problems.append(str(exc))
        return HashAlgo.XXH3_128
