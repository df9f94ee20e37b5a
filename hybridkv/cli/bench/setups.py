"""What ``hybridkv bench`` compares: the engine alone and hybridkv's tier set-ups.

CLI process. A setup is a list of tiers (none for the engine alone); pool
setups share a Mooncake or Valkey pool that the bench starts for the run on
127.0.0.1 (``LocalPool``) and stops afterwards.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridkv.tools.pool import LocalPool

CPU_TIER_BYTES = "4GiB"
DISK_TIER_BYTES = "16GiB"
POOL_BYTES = 2 << 30


class Setup(enum.Enum):
    ALONE = "alone"
    """The engine with its own prefix cache only."""
    DEFAULT = "default"
    """No tiers configured: hybridkv's embedded default, a CPU tier and a disk tier in
    ``<cache_dir>/kv``."""
    CPU = "cpu"
    CPU_LRU = "cpu-lru"
    """The CPU tier with plain recency (``eviction_order: lru``): what chain-aware
    eviction, every other setup's, is measured against."""
    CPU_DISK = "cpu+disk"
    CPU_DISK_LRU = "cpu+disk-lru"
    """CPU and disk tiers of ``cpu_tier_mib`` and ``disk_tier_mib``, LRU everything
    (``eviction_order: lru``, ``admission: all``): what the reuse policies are
    measured against."""
    CPU_DISK_REUSE = "cpu+disk-reuse"
    """The same tiers with chain-aware order, the CPU tier's ``second_chance`` and
    ``admission: reused``."""
    MOONCAKE = "mooncake"
    """CPU memory in front of a Mooncake pool."""
    VALKEY = "valkey"
    """CPU memory in front of a valkey-server."""

    @property
    def uses_pool(self) -> bool:
        return self in (Setup.MOONCAKE, Setup.VALKEY)


def parse_setups(text: str) -> list[Setup]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {s.value: s for s in Setup}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"--setups {text!r}: use a comma-separated list of {sorted(known)}")
    setups = [known[n] for n in dict.fromkeys(names)]
    if Setup.ALONE not in setups:
        setups.insert(0, Setup.ALONE)  # the reference every output is compared with
    return setups


def tiers_for(
    setup: Setup,
    disk_dir: Path,
    pool: LocalPool | None,
    cpu_bytes: int | str = CPU_TIER_BYTES,
    disk_bytes: int | str = DISK_TIER_BYTES,
) -> list[dict[str, Any]]:
    """The ``tiers`` of ``setup`` (empty for the engine alone and the default); the
    eviction setups' disk tier is ``disk_bytes``."""
    cpu: dict[str, Any] = {"kind": "cpu", "capacity_bytes": cpu_bytes}
    if setup in (Setup.ALONE, Setup.DEFAULT):
        return []
    if setup in (Setup.CPU, Setup.CPU_LRU):
        return [cpu]
    if setup is Setup.CPU_DISK:
        return [cpu, {"kind": "disk", "path": str(disk_dir), "capacity_bytes": DISK_TIER_BYTES}]
    if setup in (Setup.CPU_DISK_LRU, Setup.CPU_DISK_REUSE):
        cpu["second_chance"] = setup is Setup.CPU_DISK_REUSE
        return [cpu, {"kind": "disk", "path": str(disk_dir), "capacity_bytes": disk_bytes}]
    assert pool is not None, f"setup {setup.value} needs a pool"
    kind = "mooncake" if setup is Setup.MOONCAKE else "valkey"
    return [cpu, *(t for t in pool.tier_configs() if t["kind"] == kind)]


def transfer_config(
    setup: Setup, tiers: Sequence[dict[str, Any]], cache_dir: Path
) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of ``setup``; None for the engine alone."""
    if setup is Setup.ALONE:
        return None
    extra: dict[str, Any] = {"tiers": list(tiers)} if tiers else {"cache_dir": str(cache_dir)}
    if setup in (Setup.CPU_LRU, Setup.CPU_DISK_LRU):
        extra["eviction_order"] = "lru"
    if setup is Setup.CPU_DISK_REUSE:
        extra["admission"] = "reused"
    return {
        "kv_connector": "HybridKVConnector",
        "kv_connector_module_path": "hybridkv.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@contextlib.contextmanager
def pool_for(setup: Setup, run_dir: Path) -> Iterator[LocalPool | None]:
    """The pool ``setup`` needs, started on loopback for as long as it is used."""
    if not setup.uses_pool:
        yield None
        return
    pool = LocalPool.start(
        run_dir,
        segment_bytes=POOL_BYTES,
        mooncake=setup is Setup.MOONCAKE,
        valkey=setup is Setup.VALKEY,
        valkey_maxmemory_bytes=POOL_BYTES,
    )
    try:
        yield pool
    finally:
        pool.stop()
