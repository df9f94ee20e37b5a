"""Engine cards and prompts stored through a real connector, for the route tests (test
helper)."""

from __future__ import annotations

from pathlib import Path

from hybridkv.connector.card import EngineCard, card_for, read_card, write_card
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.setup import EngineFacts
from hybridkv.groups import ModelGroups
from hybridkv.tools.sim.build import close_engine, make_engine
from hybridkv.tools.sim.drive import run_to_end


def write_engine_card(path: Path, config: ConnectorConfig, model_groups: ModelGroups) -> EngineCard:
    """The card an engine with these groups and this config writes (its own alignment)."""
    align = model_groups.scheduler_block_size
    facts = EngineFacts(model_groups=model_groups, alignment_tokens=align)
    write_card(path, card_for(config, facts, align))
    return read_card(path)


def store_through_engine(
    model_groups: ModelGroups, config: ConnectorConfig, tokens: list[int], salt: str | None
) -> None:
    """One engine computes ``tokens`` and stores them (CPU, then disk); then it stops."""
    engine = make_engine(model_groups, config)
    assert engine.add("cold", tokens, cache_salt=salt) == 0
    run_to_end(engine, "cold", chunk=12)
    engine.settle()
    assert engine.finish("cold") is False
    close_engine(engine)  # flushes the write-back: the disk tier holds every block
