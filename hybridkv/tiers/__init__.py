"""Where stored KV blocks live: one protocol, several tiers."""

from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierStats,
    TierUsage,
)

__all__ = ["Buffer", "GetStatus", "PutStatus", "StoreKey", "Tier", "TierStats", "TierUsage"]
