"""Pipeline parallel: each stage's workers store their own layers under their own keys.

A real scheduler and one real worker per stage over real tiers (a CPU tier each, a
disk directory each), driven by hand as vLLM drives them. Stage 0 holds the
sliding-window layer 0 only (no full-attention layer), stage 1 the rest: stage 0
stores and loads nothing of the full group, yet reports its loads; a load is done
only when both stages reported; a restarted engine hits from both stages' disk
directories, and the stages' blocks never serve each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridkv.connector.metadata import WorkerReport
from hybridkv.connector.ranks import EngineRanks
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.setup import EngineFacts, build_scheduler, build_worker
from hybridkv.connector.steps import ScheduledRequest, StepInput
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import GroupKind, KVGroup, ModelGroups, merge_stages
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tools.sim.build import make_config
from hybridkv.tools.sim.shapes import make_groups, make_kv_caches

NUM_BLOCKS = 64
TOKENS = list(range(100, 141))  # 41 tokens: 10 blocks of 4, one token left to compute
WHOLE = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL), layers_per_group=2)


def stage(group_layers: tuple[tuple[str, ...], tuple[str, ...]]) -> ModelGroups:
    groups = tuple(
        KVGroup(**{**g.__dict__, "layer_names": names})
        for g, names in zip(WHOLE.groups, group_layers, strict=True)
    )
    return ModelGroups(groups=groups, model_id=WHOLE.model_id)


STAGES = (
    stage((("layers.0.0",), ())),  # no full-attention layer on stage 0
    stage((("layers.0.1",), ("layers.1.0", "layers.1.1"))),
)
RANKS = tuple(WorkerRank(pp_rank=p, pp_size=2) for p in range(2))


class Engine:
    """A scheduler and both stages' workers, with their KV caches."""

    def __init__(self, cache_dir: Path) -> None:
        config = make_config(cache_dir)
        facts = EngineFacts(
            model_groups=merge_stages(STAGES),
            alignment_tokens=WHOLE.scheduler_block_size,
            pp_size=2,
            stage_groups=STAGES,
        )
        self.scheduler: ConnectorScheduler
        self.scheduler, self.opened = build_scheduler(config, facts)
        self.workers: list[ConnectorWorker] = []
        self.kv: list[dict[str, torch.Tensor]] = []
        for rank, groups in zip(RANKS, STAGES, strict=True):
            stage_facts = EngineFacts(
                model_groups=groups, alignment_tokens=facts.alignment_tokens, pp_size=2
            )
            worker = build_worker(config, stage_facts, rank=rank)
            self.kv.append(make_kv_caches(groups, NUM_BLOCKS))
            worker.register_kv_caches(self.kv[-1])
            self.workers.append(worker)

    def step(self, req_id: str, block_ids: list[list[int]], computed: int) -> None:
        """One step computing the prompt from ``computed`` on: stores of every stage."""
        req = ScheduledRequest(
            req_id=req_id,
            num_computed_tokens=computed,
            num_scheduled_tokens=len(TOKENS) - computed,
            token_ids=TOKENS,
            new_block_ids=tuple(tuple(ids) for ids in block_ids),
            replaces_block_ids=True,
        )
        meta = self.scheduler.build_metadata(StepInput(scheduled=(req,)))
        for worker in self.workers:
            worker.start_loads(meta.loads)
            worker.save(meta.stores)

    def report(self, stage: int) -> WorkerReport:
        worker = self.workers[stage]
        assert worker.wait_jobs(30) and worker.store.flush(30)
        return worker.poll()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        for tier in self.opened:
            tier.close()


def blocks(first: int) -> list[list[int]]:
    return [list(range(first, first + 11)), list(range(first + 20, first + 31))]


def test_engine_ranks_know_which_ranks_hold_each_group() -> None:
    ranks = EngineRanks(tp_size=2, stage_groups=STAGES)
    assert [r.label for r in ranks.ranks] == [
        "pp0of2-tp0of2",
        "pp0of2-tp1of2",
        "pp1of2-tp0of2",
        "pp1of2-tp1of2",
    ]
    assert ranks.holders == ((0, 1, 2, 3), (2, 3))
    prefixes = [b.namespace.prefix for b in ranks.builders()]
    assert len(set(prefixes)) == 4 and all(
        p.endswith(r.label) for p, r in zip(prefixes, ranks.ranks, strict=True)
    )
    assert ranks.builders()[0].namespace.groups_fingerprint == STAGES[0].fingerprint
    assert EngineRanks.uniform(WHOLE, 2).builders()[1].namespace.prefix.endswith("|tp1of2")
    with pytest.raises(ValueError, match="stages disagree"):
        EngineRanks(stage_groups=(STAGES[0], make_groups((GroupKind.FULL, GroupKind.FULL))))


def test_a_stage_without_a_groups_layers_stores_none_of_it_and_loads_wait_for_every_stage(
    tmp_path: Path,
) -> None:
    engine = Engine(tmp_path)
    scheduler = engine.scheduler
    for kv in engine.kv:
        for tensor in kv.values():
            tensor.view(torch.int8).random_(-128, 127)
    assert scheduler.lookup("a", TOKENS, 0).num_tokens == 0
    engine.step("a", blocks(1), 0)
    stage1 = engine.report(1)
    scheduler.process_report(stage1)
    assert scheduler.stores.num_blocks_storing > 0, "stage 0's sliding blocks are unconfirmed"
    scheduler.process_report(engine.report(0))
    assert scheduler.stores.num_blocks_storing == 0
    stored = [[w.stats.groups[g].stored_blocks for g in (0, 1)] for w in engine.workers]
    assert stored[0][1] == 0 and stored[0][0] > 0 and stored[1][0] == stored[0][0]
    assert stored[1][1] == 10  # every full block before the last token
    before = [{n: t.clone() for n, t in kv.items()} for kv in engine.kv]

    scheduler.request_finished("a")
    assert scheduler.lookup("b", TOKENS, 0).num_tokens == 40
    scheduler.allocated("b", blocks(32), 40)
    for kv in engine.kv:
        for tensor in kv.values():
            tensor.zero_()
    engine.step("b", blocks(32), 40)
    scheduler.process_report(engine.report(1))
    assert scheduler._requests["b"].load is not None, "stage 0 has not reported the load"
    report0 = engine.report(0)
    assert [r.ok for r in report0.ranks[0].finished_loads] == [True]
    scheduler.process_report(report0)
    assert scheduler._requests["b"].load is None
    assert [w.stats.groups[1].loaded_blocks for w in engine.workers] == [0, 10]
    for kv, old in zip(engine.kv, before, strict=True):
        for name in kv:
            if name.startswith("layers.1"):  # full attention: every block before the hit
                loaded, stored_kv = kv[name][52:62], old[name][21:31]  # bytes: NaNs may occur
                assert torch.equal(loaded.view(torch.int8), stored_kv.view(torch.int8)), name
    engine.close()


def test_a_restarted_engine_hits_every_stages_directory_and_stages_never_mix(
    tmp_path: Path,
) -> None:
    engine = Engine(tmp_path)
    engine.step("a", blocks(1), 0)
    for stage_index in (0, 1):
        engine.scheduler.process_report(engine.report(stage_index))
    engine.close()
    disk = tmp_path / "kv"
    assert sorted(p.name for p in disk.iterdir() if p.is_dir()) == [
        "pp0of2-tp0of1",
        "pp1of2-tp0of1",
    ]
    restarted = Engine(tmp_path)
    assert restarted.scheduler.lookup("b", TOKENS, 0).num_tokens == 40
    restarted.close()
    # Stage 1's objects under stage 0's directory name: its keys are not stage 0's.
    (disk / "pp0of2-tp0of1").rename(disk / "old")
    (disk / "pp1of2-tp0of1").rename(disk / "pp0of2-tp0of1")
    swapped = Engine(tmp_path)
    assert swapped.scheduler.lookup("c", TOKENS, 0).num_tokens == 0
    swapped.close()
