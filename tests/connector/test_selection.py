"""Which tier serves a load (per block or whole request), and metadata that pickles."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hybridkv.connector import (
    BlockTransfer,
    ConnectorMetadata,
    LoadResult,
    LoadSpec,
    StoreSpec,
    WorkerReport,
    build_store,
)
from hybridkv.spec import GroupKind
from hybridkv.tiers.base import StoreKey
from tests.connector.helpers import block_keys, close_engine, make_config, make_engine
from tests.connector.sim import make_layout
from tests.connector.test_scenarios import assert_kv_matches_cold, prompt, run_to_end, wait_loaded


@pytest.mark.parametrize(
    ("selection", "hit", "tier_index"), [("per_block", 36, None), ("whole_request", 12, 0)]
)
def test_selection_picks_blocks_or_one_tier(
    tmp_path: Path, selection: str, hit: int, tier_index: int | None
) -> None:
    layout = make_layout((GroupKind.SLIDING_WINDOW, GroupKind.FULL))
    config = make_config(tmp_path, selection=selection)
    store = build_store(config)
    engine = make_engine(layout, config, store=store)
    tokens = prompt(37)
    engine.add("a", tokens)
    run_to_end(engine, "a", chunk=12)
    engine.settle()
    assert store.flush(10)  # every block is in the CPU tier and on disk
    engine.finish("a")
    cpu, disk = store.tiers
    # The CPU tier loses full-attention block 3: it now holds 12 tokens, the disk 36.
    assert cpu.delete_many(block_keys(layout, tokens, 1, [3])) == 1
    disk_gets = disk.stats().gets
    # whole_request: CPU scores 12 tokens / weight 1 > disk's 36 / 4 = 9.
    assert engine.add("b", tokens) == hit
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
    transfer = BlockTransfer(
        group_id=1, keys=(StoreKey("k1"), StoreKey("k2")), block_ids=(5, 9), block_indices=(0, 1)
    )
    meta = ConnectorMetadata(
        loads=(LoadSpec(req_id="a", num_tokens=8, fallback_tokens=0, transfers=(transfer,)),),
        stores=(StoreSpec(req_id="b", transfers=(transfer,)),),
        cancelled_req_ids=frozenset({"c"}),
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    report = WorkerReport(
        finished_loads=(LoadResult(req_id="a", failed_block_ids=((), (9,))),),
        stored_keys=(StoreKey("k1"),),
    )
    merged = report.merge(WorkerReport(missing_keys=(StoreKey("k2"),)))
    assert pickle.loads(pickle.dumps(merged)) == merged
    assert merged.missing_keys == ("k2",) and not merged.finished_loads[0].ok
    assert WorkerReport().is_empty and not merged.is_empty
