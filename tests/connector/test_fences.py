"""Asynchronous stores: the engine must not write a block a store still copies out.

Scheduler + worker on a real CPU tier, stores copied on the transfer engine's
own thread (as on CUDA, where they run on the copier's stream after the
step). The tier's reservations wait at a gate, so a store's copies have not
started when the engine frees the request's blocks and hands them to the
next request. With the fence (what vLLM's connector does before each forward
pass) the stored bytes are the first request's; an engine that writes the
blocks at once stores the second request's KV under the first one's keys,
and the test sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridkv.groups import GroupKind
from hybridkv.tiers.base import PutStatus, StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.sim.build import make_config, make_engine
from hybridkv.tools.sim.drive import wait_loaded
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


class GatedCpuTier(CpuTier):
    """A real CPU tier whose reservations (where a store's copies start) wait at ``gate``."""

    def __init__(self) -> None:
        super().__init__(CpuConfig(capacity_bytes=8 << 20, pin_memory=False))
        self.gate = threading.Event()

    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        assert self.gate.wait(10), "the gate was never opened"
        return super().reserve_many(keys, sizes)


def stored_blocks_match(tmp_path: Path, kinds: tuple[GroupKind, ...], *, fence: bool) -> bool:
    """Store a's blocks asynchronously, finish a, run b on a's freed blocks, open the gate
    after a moment; then load a's prompt and compare every block with a cold run."""
    model_groups = make_groups(kinds)
    tier = GatedCpuTier()
    engine = make_engine(
        model_groups,
        make_config(tmp_path),
        store=TieredStore([tier]),
        transfer={"asynchronous": True},
        reuse_freed_first=True,
        fence=fence,
    )
    a, b = prompt(41), prompt(41, seed=7)
    engine.add("a", a)
    engine.step()  # a computed; its stores wait at the gate
    assert engine.finish("a") is False  # its blocks are free at once
    engine.add("b", b)
    opener = threading.Timer(0.3, tier.gate.set)
    opener.start()
    engine.step()  # b is written into a's blocks: after a's copies only with the fence
    opener.join()
    engine.settle()
    reused = {bid for rid, _, bid in engine.handed_out if rid == "a"} & {
        bid for rid, _, bid in engine.handed_out if rid == "b"
    }
    assert reused, "b must be handed a's blocks for the scenario to mean anything"
    assert engine.worker.engine is not None
    fences = engine.worker.engine.stats().fences
    assert (fences > 0) == fence
    assert engine.finish("b") is False
    assert engine.add("again", a) == 40
    req = wait_loaded(engine, "again")
    assert req.outcomes[-1].ok
    matches = all(
        engine.block_bytes(g, req.block_ids[g][i]) == engine.expected_block(a, g, i)
        for g, group in enumerate(model_groups.groups)
        for i in range(40 // group.block_size)
        if group.kind is GroupKind.FULL
    )
    engine.worker.check_integrity()
    engine.worker.close()
    return matches


@pytest.mark.parametrize("kinds", [(FULL,), (SW, FULL)], ids=["full", "gemma-like"])
def test_the_fence_keeps_a_stored_block_from_being_overwritten(
    tmp_path: Path, kinds: tuple[GroupKind, ...]
) -> None:
    assert stored_blocks_match(tmp_path / "fenced", kinds, fence=True)


def test_an_engine_that_writes_freed_blocks_at_once_stores_wrong_kv(tmp_path: Path) -> None:
    """The hazard is real: without the fence the first request's keys name the second
    request's KV (a check that cannot fail would pass here too)."""
    assert not stored_blocks_match(tmp_path, (FULL,), fence=False)
