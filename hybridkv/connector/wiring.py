"""Building the worker's store and the scheduler's lookup view from the config.

Any process. The worker builds the tiers (``build_store``) and registers the
store in this process (``register_local_store``); the scheduler side then
uses that very store for lookups when it runs in the same process, or else
builds lookup-only instances of the tiers other processes can see and
answers for the worker-private ones (CPU memory) from the worker's reports
(``build_lookup``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.views import KeyLookup, LookupView, TierSlice
from hybridkv.tiers.base import Tier
from hybridkv.tiers.cpu import CpuConfig
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.registry import build_tier
from hybridkv.tiers.tiered.store import TieredStore

logger = logging.getLogger(__name__)

_LOCAL_STORES: weakref.WeakValueDictionary[str, TieredStore] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def build_store(config: ConnectorConfig) -> TieredStore:
    """The worker's tiers behind one store (closes what it built if one tier fails)."""
    tiers: list[Tier] = []
    try:
        for tier_config in config.tiers:
            tiers.append(build_tier(tier_config))
    except Exception:
        for tier in tiers:
            tier.close()
        raise
    return TieredStore(tiers, selection=config.selection)


def register_local_store(engine_key: str, store: TieredStore) -> None:
    with _LOCK:
        _LOCAL_STORES[engine_key] = store


def unregister_local_store(engine_key: str, store: TieredStore) -> None:
    with _LOCK:
        if _LOCAL_STORES.get(engine_key) is store:
            del _LOCAL_STORES[engine_key]


def find_local_store(engine_key: str) -> TieredStore | None:
    with _LOCK:
        return _LOCAL_STORES.get(engine_key)


def is_private(tier_config: object) -> bool:
    """Tiers no other process can see (their keys reach the scheduler by report)."""
    return isinstance(tier_config, CpuConfig)


def lookup_for_store(store: TieredStore) -> KeyLookup:
    """Lookups straight against the worker's own store (same process)."""
    views: list[LookupView | None] = [TierSlice(store, i) for i in range(len(store.tiers))]
    weights = [tier.load_weight for tier in store.tiers]
    return KeyLookup(views, weights, union_view=store)


def build_lookup(config: ConnectorConfig, engine_key: str) -> tuple[KeyLookup, list[Tier]]:
    """The scheduler's lookup view and the lookup-only tiers it opened (close them)."""
    local = find_local_store(engine_key)
    if local is not None:
        logger.info("hybridkv lookups use the worker's store in this process (every tier)")
        return lookup_for_store(local), []
    views: list[LookupView | None] = []
    opened: list[Tier] = []
    try:
        for tier_config in config.tiers:
            if is_private(tier_config):
                views.append(None)
                continue
            if isinstance(tier_config, DiskConfig):  # the worker is the directory's writer
                tier_config = dataclasses.replace(tier_config, read_only=True)
            tier = build_tier(tier_config)
            opened.append(tier)
            views.append(tier)
    except Exception:
        for tier in opened:
            tier.close()
        raise
    weights = [c.load_weight for c in config.tiers]
    kinds = ["private (reported)" if v is None else "lookup-only" for v in views]
    logger.info("hybridkv lookups from another process than the worker: tiers %s", kinds)
    return KeyLookup(views, weights), opened
