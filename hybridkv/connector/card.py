"""An engine's card: what a router needs to answer lookups for it, as one small JSON file.

Written by the scheduler process when it starts (``engine_card`` in the connector's
config); read by ``hybridkv route`` in any process that can open the card. It holds
the engine's groups, hit alignment, hash settings, drafting, tensor and pipeline
parallelism (each stage's groups), tier selection and tier configs: with them
another process names the engine's blocks exactly as its scheduler does and
opens lookup-only instances of the tiers it can see. Tier configs are written as
given, secrets included (a Valkey password), so the file is created readable by
its owner only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, StrictBool
from pydantic import TypeAdapter as _TypeAdapter
from pydantic.dataclasses import dataclass

from hybridkv.connector.config import ConnectorConfig
from hybridkv.groups import ModelGroups
from hybridkv.keys import HashAlgo
from hybridkv.schema import CONFIG, NonEmptyStr, NonNegativeInt, PositiveInt, parse
from hybridkv.tiers.registry import TierConfig
from hybridkv.tiers.selection import Selection

if TYPE_CHECKING:
    from hybridkv.connector.setup import EngineFacts  # it imports this module

logger = logging.getLogger(__name__)

CARD_VERSION: Literal[1] = 1


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class EngineCard:
    """One engine's facts and tiers, as its scheduler uses them for lookups."""

    version: Annotated[Literal[1], Field(description="format of the card")] = CARD_VERSION
    engine_id: Annotated[NonEmptyStr, Field(description="the engine's own id")]
    model_groups: Annotated[ModelGroups, Field(description="groups, block sizes, model id")]
    alignment_tokens: Annotated[PositiveInt, Field(description="hits land on multiples of this")]
    hash_algo: Annotated[HashAlgo, Field(description="block hash")]
    tp_size: Annotated[PositiveInt, Field(description="tensor-parallel ranks")] = 1
    engine_group_ids: Annotated[
        tuple[NonNegativeInt, ...],
        Field(description="the engine's id of each group (in its events); empty: its place"),
    ] = ()
    stage_groups: Annotated[
        tuple[ModelGroups, ...],
        Field(description="each pipeline stage's groups (its layers); empty: no stages"),
    ] = ()
    use_eagle: Annotated[StrictBool, Field(description="hits drop a block for drafting")] = False
    eagle_group_ids: Annotated[
        tuple[NonNegativeInt, ...], Field(description="groups that drop it; empty: every group")
    ] = ()
    selection: Annotated[Selection, Field(description="which tiers serve a load")] = (
        Selection.PER_BLOCK
    )
    tiers: Annotated[tuple[TierConfig, ...], Field(min_length=1, description="lookup order")]
    hostname: Annotated[str, Field(description="where the engine runs")] = ""
    pid: Annotated[NonNegativeInt, Field(description="its scheduler process")] = 0

    def connector_config(self) -> ConnectorConfig:
        """The part of the engine's connector config that lookups depend on."""
        return ConnectorConfig(tiers=self.tiers, selection=self.selection, hash_algo=self.hash_algo)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "engine_id": self.engine_id,
            "model_groups": self.model_groups.to_dict(),
            "alignment_tokens": self.alignment_tokens,
            "hash_algo": self.hash_algo.value,
            "tp_size": self.tp_size,
            "engine_group_ids": list(self.engine_group_ids),
            "stage_groups": [groups.to_dict() for groups in self.stage_groups],
            "use_eagle": self.use_eagle,
            "eagle_group_ids": sorted(self.eagle_group_ids),
            "selection": self.selection.value,
            "tiers": [tier_dict(tier) for tier in self.tiers],
            "hostname": self.hostname,
            "pid": self.pid,
        }

    @classmethod
    def from_dict(cls, raw: object, *, where: str = "engine card") -> EngineCard:
        card: EngineCard = parse(cls, raw, where=where)
        return card


def tier_dict(config: TierConfig) -> dict[str, Any]:
    """A tier config as the JSON its kind parses (fields set by code, such as a disk
    tier's rank, left out)."""
    data: dict[str, Any] = _TypeAdapter(type(config)).dump_python(config, mode="json")
    derived = {f.name for f in dataclasses.fields(type(config)) if not f.init}
    return {k: v for k, v in data.items() if k not in derived}


def card_for(config: ConnectorConfig, facts: EngineFacts, alignment_tokens: int) -> EngineCard:
    """The card of an engine whose scheduler runs here, with this config and these facts."""
    return EngineCard(
        engine_id=facts.engine_key,
        model_groups=facts.model_groups,
        alignment_tokens=alignment_tokens,
        hash_algo=config.hash_algo,
        tp_size=facts.tp_size,
        engine_group_ids=facts.engine_group_ids,
        stage_groups=facts.stage_groups,
        use_eagle=facts.use_eagle,
        eagle_group_ids=tuple(sorted(facts.eagle_group_ids)),
        selection=config.selection,
        tiers=config.tier_configs,
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )


def write_card(path: Path, card: EngineCard) -> None:
    """Write ``card`` to ``path`` at once (a reader sees the old card or the new one),
    readable by its owner only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(card.to_dict(), file, indent=1)
    os.replace(temporary, path)


def read_card(path: Path) -> EngineCard:
    """The card in ``path``; FileNotFoundError, or ValueError naming the file and problem."""
    text = path.read_text()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); an engine writes it (engine_card)") from None
    return EngineCard.from_dict(raw, where=str(path))


def publish_card(config: ConnectorConfig, facts: EngineFacts, alignment_tokens: int) -> None:
    """Write this engine's card where its config says (nowhere when ``engine_card`` is
    null). A card that cannot be written costs routing, never the engine: logged."""
    if config.engine_card is None:
        return
    try:
        write_card(config.engine_card, card_for(config, facts, alignment_tokens))
    except OSError as exc:
        logger.warning("hybridkv could not write the engine card %s: %s", config.engine_card, exc)
        return
    logger.info("hybridkv wrote the engine card %s (for hybridkv route)", config.engine_card)
