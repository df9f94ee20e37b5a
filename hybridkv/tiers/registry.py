"""Tier kinds: their configs (parsed from user dicts) and the tiers built from them.

Any process. ``TierConfig`` is the union of every kind's config, told apart
by its ``kind`` key; ``build_tier`` makes the tier a config describes.
Importing this module imports no client library (Mooncake and redis are
imported when such a tier is built).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import Field

from hybridkv.schema import parse
from hybridkv.tiers.base import Tier
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.mooncake.tier import MooncakeTier
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier

TierConfig = Annotated[
    CpuConfig | DiskConfig | MooncakeConfig | ValkeyConfig, Field(discriminator="kind")
]
"""Any tier kind's config; ``kind`` says which."""

TIER_CONFIGS: tuple[type[Any], ...] = (CpuConfig, DiskConfig, MooncakeConfig, ValkeyConfig)

_TIERS: dict[type[Any], Callable[[Any], Tier]] = {
    CpuConfig: CpuTier,
    DiskConfig: DiskTier,
    MooncakeConfig: MooncakeTier,
    ValkeyConfig: ValkeyTier,
}


def parse_tier_config(raw: object, *, where: str = "tier") -> TierConfig:
    """One tier dict ``{"kind": ..., <that kind's keys>}`` as its typed config."""
    config: TierConfig = parse(TierConfig, raw, where=where)
    return config


def parse_tier_configs(raw: object, *, where: str = "tiers") -> tuple[TierConfig, ...]:
    """A list of tier dicts; every problem of every entry goes into one ConfigError."""
    configs: tuple[TierConfig, ...] = parse(tuple[TierConfig, ...], raw, where=where)
    return configs


def build_tier(config: TierConfig) -> Tier:
    return _TIERS[type(config)](config)


def build_tiers(configs: Sequence[TierConfig]) -> list[Tier]:
    """Every tier of ``configs``; closes those it built if one fails."""
    tiers: list[Tier] = []
    try:
        for config in configs:
            tiers.append(build_tier(config))
    except Exception:
        for tier in tiers:
            tier.close()
        raise
    return tiers
