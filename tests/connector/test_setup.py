"""Building both sides: the scheduler reads the worker's store only when handed it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hybridkv.connector.setup import EngineFacts, build_scheduler, build_worker
from hybridkv.groups import GroupKind
from hybridkv.tiers.base import PutStatus
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tools.sim.build import make_config
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.connector import block_keys

GROUPS = make_groups((GroupKind.FULL,))
FACTS = EngineFacts(model_groups=GROUPS, alignment_tokens=GROUPS.scheduler_block_size)


@pytest.fixture(autouse=True)
def switch_interval() -> Iterator[None]:
    """``build_worker`` lowers the interpreter's switch interval: put it back."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("shared", [True, False])
def test_a_scheduler_handed_the_worker_store_finds_its_cpu_blocks(
    tmp_path: Path, shared: bool
) -> None:
    """Blocks only in the worker's CPU tier, never reported: a scheduler built with the
    worker's store hits them; one without it answers that tier from reports (none yet)."""
    config = make_config(tmp_path)
    worker = build_worker(config, FACTS, rank=WorkerRank())
    tokens = prompt(17)
    keys = block_keys(GROUPS, tokens, 0, range(4))
    block_bytes = GROUPS.groups[0].block_bytes
    cpu = worker.store.tiers[0]
    assert cpu.put_many(keys, [np.zeros(block_bytes, np.uint8)] * 4) == [PutStatus.OK] * 4
    scheduler, opened = build_scheduler(
        config, FACTS, worker_store=worker.store if shared else None
    )
    assert len(opened) == (0 if shared else 1)  # else a lookup-only view of the disk tier
    scheduler.add_request("a")
    assert scheduler.lookup("a", tokens, 0).num_tokens == (16 if shared else 0)
    for tier in opened:
        tier.close()
    worker.close()


def test_a_worker_store_is_refused_with_several_ranks(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    facts = EngineFacts(
        model_groups=GROUPS, alignment_tokens=GROUPS.scheduler_block_size, tp_size=2
    )
    worker = build_worker(config, facts, rank=WorkerRank(tp_rank=1, tp_size=2))
    with pytest.raises(ValueError, match="worker_store with 2 ranks"):
        build_scheduler(config, facts, worker_store=worker.store)
    with pytest.raises(ValueError, match=r"tp_size=4.*is not a rank of tensor_parallel_size=2"):
        build_worker(config, facts, rank=WorkerRank(tp_rank=2, tp_size=4))
    with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
        WorkerRank(tp_rank=2, tp_size=2)
    worker.close()
