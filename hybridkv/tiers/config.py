"""What every tier kind's configuration shares: the base classes and the shared fields.

Any process; no I/O, no client library. Each kind's config (``kind: cpu``,
``disk``, ``mooncake``, ``valkey``) is a frozen pydantic dataclass
(``hybridkv.schema``) deriving from ``TierConfigBase``, and builds its own
tier; ``hybridkv.tiers.registry`` lists the kinds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Self

from pydantic import Field
from pydantic.dataclasses import dataclass

from hybridkv.schema import CONFIG, Number, Seconds
from hybridkv.tiers.base import TierMedium, TierReach
from hybridkv.tiers.ranks import WorkerRank

if TYPE_CHECKING:
    from hybridkv.tiers.base import Tier

LoadWeight = Annotated[
    Number, Field(gt=0, allow_inf_nan=False, description="relative cost of loading from it")
]
"""Every kind's ``load_weight``; each kind sets its own default."""


class TierConfigBase:
    """What every tier kind's configuration offers besides its fields.

    Each kind's config has a ``kind`` tag and a ``load_weight``; it overrides
    these when its kind needs to.
    """

    reach: ClassVar[TierReach] = TierReach.CLUSTER
    medium: ClassVar[TierMedium] = TierMedium.REMOTE
    kind: str
    load_weight: float

    def build(self) -> Tier:
        """The tier this config describes (its client library is imported here, if any)."""
        raise NotImplementedError

    def lookup_only(self) -> Self:
        """The config of an instance that only answers lookups (for another process)."""
        return self

    def for_rank(self, rank: WorkerRank) -> Self:
        """The config of ``rank``'s own tier."""
        return self


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class ServerTierConfig(TierConfigBase):
    """A tier behind a server (a pool): calls time out, and an unreachable server is
    probed until it answers again (``hybridkv.tiers.health``)."""

    op_timeout_s: Annotated[
        Seconds, Field(description="seconds before one round trip is an error")
    ] = 2.0
    retry_interval_s: Annotated[
        Seconds, Field(description="seconds between probes of an unreachable server")
    ] = 1.0
