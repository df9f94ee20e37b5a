"""``admission: reused`` with ``admission_keep_slower`` keeps what the slower tiers
hold while most returning prefixes were lost there (``connector.returns.KeptReturns``):
a cycle of prompts longer than the tiers evicts each just before it comes back, and
keeping what is held makes some of them hit. Prefixes lost because they were held back while
keeping count against it, so a workload that keeps coming back to new prefixes
brings the tiers back to their rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.connector import returns
from hybridkv.connector.returns import KeptReturns
from hybridkv.groups import GroupKind
from hybridkv.tiers.retention import StackMode
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import run_request

BLOCK_SIZE = 4
CHUNK = 32


def test_most_returns_lost_keep_the_slower_tiers_until_most_are_found() -> None:
    kept = KeptReturns()
    kept.judged(lost=False, held_back=False)
    assert not kept.keep_slower
    for _ in range(3):
        kept.judged(lost=True, held_back=False)
    assert kept.share >= returns.KEEP_ENTER and kept.keep_slower
    while kept.share > returns.KEEP_LEAVE + 0.05:  # between the two, it stays
        kept.judged(lost=False, held_back=False)
        assert kept.keep_slower
    while kept.keep_slower:
        kept.judged(lost=False, held_back=False)
    assert kept.share <= returns.KEEP_LEAVE


def test_returns_lost_because_they_were_held_back_lead_out_of_keeping() -> None:
    kept = KeptReturns()
    kept.judged(lost=True, held_back=False)
    assert kept.keep_slower
    for _ in range(8):
        kept.judged(lost=True, held_back=True)
    assert not kept.keep_slower, "keeping is what lost them"


@pytest.mark.parametrize("keep", [True, False], ids=["keeping", "not keeping"])
def test_a_cycle_longer_than_the_tiers_hits_what_they_keep(tmp_path: Path, keep: bool) -> None:
    """Twelve prompts sent twice in the same order through tiers with room for about five
    (a 256 B block takes a 4 KiB page on the disk): with ``admission_keep_slower`` the
    second pass hits some of them and the engine's last metadata keeps; without it
    (recency alone) each is evicted just before it comes back, and none hits."""
    model_groups = make_groups((GroupKind.MAMBA, GroupKind.FULL), block_size=BLOCK_SIZE)
    config = make_config(
        tmp_path,
        admission="reused",
        admission_keep_slower=keep,
        cpu_capacity_bytes="64KiB",
        disk_capacity_bytes="3MiB",
    )
    engine = make_engine(model_groups, config)
    try:
        prompts = [prompt(192, seed=100 + i) for i in range(12)]
        for i, tokens in enumerate(prompts):
            run_request(engine, f"first {i}", tokens, CHUNK)
            assert engine.last_meta.mode is not StackMode.KEEP_SLOWER, "nothing came back yet"
        hits = []
        for i, tokens in enumerate(prompts):
            hits.append(run_request(engine, f"again {i}", tokens + prompt(8, seed=i), CHUNK))
        if keep:
            assert engine.last_meta.mode is StackMode.KEEP_SLOWER
            assert sum(h > 0 for h in hits) >= 3, hits  # 5 here
        else:
            assert engine.last_meta.mode is StackMode.OWN_RULES
            assert sum(h > 0 for h in hits) == 0, hits
    finally:
        close_engine(engine)
