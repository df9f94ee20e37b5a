"""An engine's card: written by its scheduler, read back as the same facts and tiers."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from hybridkv.connector.card import EngineCard, card_for, read_card, write_card
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.setup import EngineFacts, build_scheduler
from hybridkv.groups import GroupKind
from hybridkv.keys import HashAlgo
from hybridkv.schema import ConfigError
from hybridkv.tiers.selection import Selection
from hybridkv.tools.presets import gemma3_27b, qwen3_next_80b_a3b
from hybridkv.tools.sim.build import make_config
from hybridkv.tools.sim.shapes import make_groups

TIERS = [
    {"kind": "cpu", "capacity_bytes": "1GiB"},
    {"kind": "disk", "path": "/tmp/hybridkv-card-test/kv", "capacity_bytes": "4GiB"},
    {"kind": "valkey", "host": "10.0.0.5", "password": "secret", "load_weight": 9},
    {"kind": "mooncake", "master_address": "10.0.0.5:50051", "local_hostname": "10.0.0.7"},
]


@pytest.mark.parametrize("preset", [gemma3_27b, qwen3_next_80b_a3b])
def test_a_card_reads_back_as_the_card_written(tmp_path: Path, preset: object) -> None:
    model_groups = preset()  # type: ignore[operator]
    config = ConnectorConfig.from_dict(
        {"tiers": TIERS, "selection": "whole_request", "hash_algo": "sha256"}
    )
    facts = EngineFacts(
        model_groups=model_groups,
        alignment_tokens=2 * model_groups.scheduler_block_size,
        tp_size=2,
        use_eagle=True,
        eagle_group_ids=frozenset({0}),
        engine_key="engine-7",
    )
    card = card_for(config, facts, facts.alignment_tokens)
    path = tmp_path / "cards" / "a.json"
    write_card(path, card)
    back = read_card(path)
    assert back == card
    assert back.model_groups.fingerprint == model_groups.fingerprint
    assert back.tiers == config.tier_configs
    assert (back.selection, back.hash_algo) == (Selection.WHOLE_REQUEST, HashAlgo.SHA256)
    assert (back.tp_size, back.use_eagle, back.eagle_group_ids) == (2, True, (0,))
    assert back.alignment_tokens == 2 * model_groups.scheduler_block_size
    # It holds the pool's password: only its owner may read it.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(path.parent.glob(".*.tmp"))


def test_a_rank_s_disk_config_is_written_as_the_user_gave_it(tmp_path: Path) -> None:
    """``for_rank`` sets a field users never write; a card holds the configs as given."""
    config = make_config(tmp_path)
    facts = EngineFacts(model_groups=make_groups((GroupKind.FULL,)), alignment_tokens=4, tp_size=2)
    data = card_for(config, facts, 4).to_dict()
    assert "rank" not in data["tiers"][1]
    assert EngineCard.from_dict(data).tiers == config.tier_configs


def test_a_bad_card_is_refused_naming_the_file_and_every_problem(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    facts = EngineFacts(model_groups=make_groups((GroupKind.FULL,)), alignment_tokens=4)
    data = card_for(config, facts, 4).to_dict()
    data.update(alignment_tokens=0, selection="fastest")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        read_card(path)
    assert str(path) in str(caught.value)
    assert "alignment_tokens" in str(caught.value) and "selection" in str(caught.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_card(path)


def test_the_scheduler_writes_the_card_its_config_names(tmp_path: Path) -> None:
    model_groups = make_groups((GroupKind.FULL, GroupKind.SLIDING_WINDOW))
    path = tmp_path / "engines" / "a.json"
    config = make_config(tmp_path, engine_card=str(path), hit_alignment_tokens=8)
    facts = EngineFacts(model_groups=model_groups, alignment_tokens=4, engine_key="e1")
    scheduler, opened = build_scheduler(config, facts)
    card = read_card(path)
    assert card.engine_id == "e1"
    assert card.alignment_tokens == scheduler.alignment_tokens == 8
    assert card.tiers == config.tier_configs
    for tier in opened:
        tier.close()


def test_no_card_unless_asked_and_an_unwritable_one_only_costs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    facts = EngineFacts(model_groups=make_groups((GroupKind.FULL,)), alignment_tokens=4)
    _, opened = build_scheduler(make_config(tmp_path / "plain"), facts)
    assert not list((tmp_path / "plain").rglob("*.json"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = make_config(tmp_path / "c", engine_card=str(blocker / "a.json"))
    with caplog.at_level(logging.WARNING, logger="hybridkv.connector.card"):
        _, more = build_scheduler(config, facts)
    assert "could not write the engine card" in caplog.text
    for tier in opened + more:
        tier.close()
