"""Which tier serves a load (per block or whole request), and metadata that pickles."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hybridkv.connector.metadata import (
    BlockRef,
    BlockTransfer,
    ConnectorMetadata,
    LoadOutcome,
    LoadPlan,
    LoadResult,
    RankReport,
    StorePlan,
    WorkerReport,
)
from hybridkv.connector.setup import build_store
from hybridkv.groups import GroupKind
from hybridkv.keys import BlockHash
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.check import assert_kv_matches_cold
from hybridkv.tools.sim.drive import run_to_end, wait_loaded
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import block_keys


@pytest.mark.parametrize(
    ("selection", "hit", "tier_index"), [("per_block", 36, None), ("whole_request", 12, 0)]
)
def test_selection_picks_blocks_or_one_tier(
    tmp_path: Path, selection: str, hit: int, tier_index: int | None
) -> None:
    model_groups = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL))
    config = make_config(tmp_path, selection=selection)
    store = build_store(config.tier_configs, config)
    engine = make_engine(model_groups, config, store=store)
    tokens = prompt(37)
    engine.add("a", tokens)
    run_to_end(engine, "a", chunk=12)
    engine.settle()
    assert store.flush(10)  # every block is in the CPU tier and on disk
    engine.finish("a")
    cpu, disk = store.tiers
    # The CPU tier loses full-attention block 3: it now holds 12 tokens, the disk 36.
    assert cpu.delete_many(block_keys(model_groups, tokens, 1, [3])) == 1
    disk_gets = disk.stats().gets
    # whole_request: CPU scores 12 tokens / weight 1 > disk's 36 / 4 = 9.
    assert engine.add("b", tokens) == hit
    # Where the hit comes from, for vLLM's per-source metrics: per block, the CPU tier
    # serves most blocks and the disk the lost one; one chosen tier serves everything.
    sources = engine.scheduler.hit_sources("b")
    assert sum(sources.values()) == hit
    if tier_index is None:
        assert set(sources) == {0, 1} and 0 < sources[1] < sources[0]
    else:
        assert sources == {tier_index: hit}
    engine.step({})
    assert engine.last_meta is not None
    (load,) = engine.last_meta.loads
    assert load.tier_index == tier_index
    req = wait_loaded(engine, "b")
    assert req.outcomes[-1].ok
    assert_kv_matches_cold(engine, req, hit)
    assert (disk.stats().gets > disk_gets) == (tier_index is None)  # block 3 came from disk
    credited = store.stats_by_tier()["cpu"].hit_tokens
    assert credited == (hit if tier_index == 0 else 0)  # only a one-tier load credits a tier
    run_to_end(engine, "b", chunk=12)
    assert_kv_matches_cold(engine, req, 37)
    close_engine(engine)


def test_metadata_and_reports_pickle() -> None:
    hashes = (BlockHash(b"\x01" * 16), BlockHash(b"\x02" * 16))
    transfer = BlockTransfer(
        group_id=1, block_hashes=hashes, block_ids=(5, 9), block_indices=(0, 1)
    )
    meta = ConnectorMetadata(
        loads=(LoadPlan(req_id="a", num_tokens=8, base_tokens=0, transfers=(transfer,)),),
        stores=(StorePlan(req_id="b", transfers=(transfer,)),),
        cancelled_req_ids=frozenset({"c"}),
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    failed = LoadResult(req_id="a", outcome=LoadOutcome.FAILED, failed_block_ids=((), (9,)))
    report = WorkerReport(
        ranks=(RankReport(rank=0, finished_loads=(failed,), stored=(BlockRef(1, hashes[0]),)),)
    )
    merged = report.merge(
        WorkerReport(ranks=(RankReport(rank=1, missing=(BlockRef(1, hashes[1]),)),))
    )
    assert pickle.loads(pickle.dumps(merged)) == merged
    assert [r.rank for r in merged.ranks] == [0, 1] and not merged.ranks[0].finished_loads[0].ok
    assert WorkerReport().is_empty and WorkerReport(ranks=(RankReport(rank=0),)).is_empty
    assert not merged.is_empty
