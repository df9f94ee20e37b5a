"""``admission: reused`` goes plain LRU while most first sightings come back
(``connector.returns``): every store reaches the slower tiers, nothing is admitted,
and no tier keeps marked or read blocks over others; back once most do not. The
share on its own, then on the simulated engine over a real CPU tier and a real disk
tier full of marked objects."""

from __future__ import annotations

from pathlib import Path

from hybridkv.connector import returns
from hybridkv.connector.returns import ReturnShare
from hybridkv.groups import GroupKind
from hybridkv.tiers.cpu import CpuTier
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.retention import StackMode
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import every_key, fill_disk, on_disk, run_request, stored_keys

BLOCK_SIZE = 4
CHUNK = 32
HASH_TOKENS = 16


def test_the_share_decides_only_past_enough_first_sightings() -> None:
    share = ReturnShare(HASH_TOKENS)
    needed = returns.MIN_FIRST_TOKENS // HASH_TOKENS
    share.noted(needed - 1, 0)
    share.noted(0, 4 * needed)  # every first sighting came back, but too few yet
    assert share.share > returns.ENTER and not share.plain_lru
    share.noted(1, 0)
    assert share.plain_lru


def test_documents_asked_again_go_plain_lru_and_one_off_prompts_go_back() -> None:
    share = ReturnShare(HASH_TOKENS)
    doc = 16  # hashes of a 256-token document
    for _ in range(16):  # first questions, then the second of each
        share.noted(doc + 2, 0)
    assert not share.plain_lru, "nothing came back yet"
    for _ in range(16):
        share.noted(2, doc)
    assert share.share >= returns.ENTER and share.plain_lru
    while share.share > returns.LEAVE + 0.05:  # one-off prompts: between the two, it stays
        share.noted(doc, 0)
        assert share.plain_lru
    while share.plain_lru:
        share.noted(doc, 0)
    assert share.share <= returns.LEAVE


def test_a_full_disk_takes_first_sightings_while_most_come_back(tmp_path: Path) -> None:
    model_groups = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL), block_size=BLOCK_SIZE)
    config = make_config(tmp_path, admission="reused", disk_capacity_bytes="4MiB")
    engine = make_engine(model_groups, config)
    fill_disk(engine.worker.store.tiers[1])  # with objects noted reused
    cpu, disk = engine.worker.store.tiers
    assert isinstance(cpu, CpuTier) and isinstance(disk, DiskTier)
    docs = [prompt(256, seed=1000 + d) for d in range(12)]  # 12 x 64 hashes: enough
    for n, doc in enumerate(docs * 2):  # each asked twice
        run_request(engine, f"doc {n}", doc + prompt(8, seed=n), CHUNK)
        if n < len(docs):
            assert engine.last_meta.mode is not StackMode.PLAIN_LRU, "nothing came back yet"
    assert engine.last_meta.mode is StackMode.PLAIN_LRU
    assert cpu._index.stored.plain_lru and disk._table.plain_lru
    tokens = prompt(256, seed=5000)
    run_request(engine, "first sighting, plain LRU", tokens, CHUNK)
    stored = stored_keys(model_groups, engine, tokens)
    assert stored and all(on_disk(config, stored)), "the full, marked disk took it"
    sent = [*(doc + prompt(8, seed=n) for n, doc in enumerate(docs * 2)), tokens]
    while engine.last_meta.mode is StackMode.PLAIN_LRU:
        sent.append(prompt(256, seed=6000 + len(sent)))
        run_request(engine, f"one-off {len(sent)}", sent[-1], CHUNK)
        assert len(sent) < 200, "one-off prompts never took the tiers back"
    assert not (cpu._index.stored.plain_lru or disk._table.plain_lru)
    disk.retention.note_reused([k for t in sent for k in every_key(model_groups, t)])
    assert disk.retention.evicts_reused(1) is True, "every segment on disk is marked now"
    tokens = prompt(256, seed=9000)
    run_request(engine, "first sighting, reused", tokens, CHUNK)
    stored = stored_keys(model_groups, engine, tokens)
    assert stored and not any(on_disk(config, stored)), "held back again"
    close_engine(engine)
