"""Tier kinds: their configs (parsed from user dicts) and the tiers built from them.

Any process. ``TierConfig`` is the one list of kinds: the union of every
kind's config, told apart by its ``kind`` key; each config builds its own
tier (``TierConfigBase.build``). Adding a kind is its modules plus one entry
in that union. Importing this module imports no tier and no client library
(a tier's module, and Mooncake or redis, are imported when such a tier is
built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, get_args

from pydantic import Field

from hybridkv.schema import parse
from hybridkv.tiers.base import Tier
from hybridkv.tiers.config import TierConfigBase
from hybridkv.tiers.cpu import CpuConfig
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.valkey.config import ValkeyConfig

TierConfig = Annotated[
    CpuConfig | DiskConfig | MooncakeConfig | ValkeyConfig, Field(discriminator="kind")
]
"""Any tier kind's config; ``kind`` says which."""

TIER_CONFIGS: tuple[type[TierConfigBase], ...] = get_args(get_args(TierConfig)[0])
"""Every kind's config class, in the order of ``TierConfig``."""


def parse_tier_config(raw: object, *, where: str = "tier") -> TierConfig:
    """One tier dict ``{"kind": ..., <that kind's keys>}`` as its typed config."""
    config: TierConfig = parse(TierConfig, raw, where=where)
    return config


def parse_tier_configs(raw: object, *, where: str = "tiers") -> tuple[TierConfig, ...]:
    """A list of tier dicts; every problem of every entry goes into one ConfigError."""
    configs: tuple[TierConfig, ...] = parse(tuple[TierConfig, ...], raw, where=where)
    return configs


def build_tier(config: TierConfig) -> Tier:
    return config.build()


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
