"""A simulated engine over a fresh scheduler/worker pair on real tiers: the config, the
pair, and closing it.

Runs in the process of the test or benchmark: both sides of the connector
and their tiers live there (a disk tier's directory outlives the engine, so
a second engine on the same config finds what the first stored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.lookup import KeyLookup
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.setup import build_store, lookup_for_store, sighting_tier
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import ModelGroups
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.transfer import TransferConfig

STAGING_BYTES = 4 << 20


def make_config(cache_dir: Path, **extra: Any) -> ConnectorConfig:
    """A connector config under ``cache_dir``: a CPU and a disk tier unless ``tiers`` is
    given; ``extra`` are more of the config's keys, as a user writes them."""
    raw: dict[str, Any] = {"cache_dir": str(cache_dir)}
    if "tiers" not in extra:
        raw.update(cpu_capacity_bytes="8MiB", disk_capacity_bytes="64MiB")
    raw.update(extra)
    return ConnectorConfig.from_dict(raw)


def make_engine(
    model_groups: ModelGroups,
    config: ConnectorConfig,
    *,
    store: TieredStore | None = None,
    lookup: KeyLookup | None = None,
    load_timeout_s: float | None = 30.0,
    transfer: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> SimEngine:
    """A fresh engine: new KV tensors, new tiers (the disk directory persists).
    ``transfer``: more ``TransferConfig`` fields; ``engine_kwargs``: ``SimEngine``'s."""
    store = store if store is not None else build_store(config.tier_configs, config)
    transfer_config = TransferConfig(
        staging_bytes=STAGING_BYTES, load_timeout_s=load_timeout_s, **(transfer or {})
    )
    worker = ConnectorWorker(
        model_groups, store, transfer_config=transfer_config, eviction_order=config.eviction_order
    )
    if lookup is None:
        lookup = lookup_for_store(store)
    scheduler = ConnectorScheduler(
        model_groups,
        lookup,
        selection=config.selection,
        admission=config.admission,
        admission_seen_hashes=config.admission_seen_hashes,
        admission_keep_slower=config.admission_keep_slower,
        sighting_tier=sighting_tier(config, store.tiers),
        sighting_ttl_s=config.admission_sighting_ttl_s,
    )
    return SimEngine(model_groups, scheduler, worker, **engine_kwargs)


def close_engine(engine: SimEngine) -> None:
    """Check the worker's bookkeeping, then close it (its write-back flushed)."""
    engine.worker.check_integrity()
    engine.worker.close()
