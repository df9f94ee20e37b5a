"""``admission``: with ``reused`` a full disk tier receives a prefix only once two
requests reached it (or one loaded it), every group's blocks together; with ``all``
every store. Real scheduler, worker, CPU and disk tiers; the disk is filled first
with objects noted reused (``fill_disk``), as while it has room, or can make it by
evicting what was not reused, ``reused`` sends every store on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hybridkv.connector.config import ConnectorConfig
from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.tiers.admission import Admission
from hybridkv.tiers.base import Buffer, GetStatus, PutStatus, StoreKey
from hybridkv.tiers.codec import key_digest
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.drive import run_to_end
from hybridkv.tools.sim.engine import SimEngine
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import attention_page_bytes, make_groups
from tests.support.connector import (
    GatedTier,
    block_keys,
    disk_config,
    fill_disk,
    on_disk,
    run_request,
    stored_keys,
)

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
BLOCK_SIZE = 4
CHUNK = 32
"""Tokens per step; a Mamba state is stored where a step ends."""
PREFIX = prompt(64, seed=100)
"""Shared by the requests that reuse it: 16 blocks, two steps."""
KINDS = [(FULL,), (SW, FULL), (MAMBA, FULL)]
KIND_IDS = ["full", "sliding+full", "mamba+full"]


def with_suffix(seed: int, num_tokens: int = CHUNK) -> list[int]:
    return PREFIX + prompt(num_tokens, seed=seed)


def full_disk_config(tmp_path: Path, **extra: Any) -> ConnectorConfig:
    """Tiers of ``make_config`` with a 1 MiB disk of one segment (``full_disk_engine``
    fills it)."""
    return make_config(tmp_path, disk_capacity_bytes="1MiB", **extra)


def full_disk_engine(model_groups: ModelGroups, config: ConnectorConfig) -> SimEngine:
    """An engine whose disk tier is full of objects noted reused."""
    engine = make_engine(model_groups, config)
    fill_disk(engine.worker.store.tiers[1])
    return engine


def run(engine: SimEngine, req_id: str, tokens: list[int]) -> int:
    return run_request(engine, req_id, tokens, CHUNK)


def full_keys(model_groups: ModelGroups, tokens: list[int], blocks: range) -> list[StoreKey]:
    return block_keys(model_groups, tokens, model_groups.num_groups - 1, blocks)


@pytest.mark.parametrize("admission", ["all", "reused"])
def test_a_prompt_seen_once_reaches_disk_only_with_all(tmp_path: Path, admission: str) -> None:
    model_groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    config = full_disk_config(tmp_path, admission=admission)
    engine = full_disk_engine(model_groups, config)
    tokens = with_suffix(seed=1)
    assert run(engine, "once", tokens) == 0
    stored = stored_keys(model_groups, engine, tokens)
    assert len(stored) == 2 * len(tokens) // BLOCK_SIZE
    assert on_disk(config, stored) == [admission == "all"] * len(stored)
    disk_stats = engine.worker.store.stats_by_tier()["disk"]
    expected = (len(stored), 0) if admission == "all" else (0, len(stored))
    assert (disk_stats.admitted, disk_stats.rejected) == expected
    assert engine.add("again", tokens) == len(tokens) - BLOCK_SIZE  # a hit from the cpu tier
    close_engine(engine)


@pytest.mark.parametrize("seen_hashes", [1 << 20, 1], ids=["seen-twice", "loaded-only"])
@pytest.mark.parametrize("kinds", KINDS, ids=KIND_IDS)
def test_a_loaded_prefix_is_admitted_with_every_group(
    tmp_path: Path, kinds: tuple[GroupKind, ...], seen_hashes: int
) -> None:
    """With one hash remembered, only the load tells that the prefix is reused."""
    model_groups = make_groups(kinds, block_size=BLOCK_SIZE)
    config = full_disk_config(tmp_path, admission="reused", admission_seen_hashes=seen_hashes)
    engine = full_disk_engine(model_groups, config)
    a, b = with_suffix(seed=1), with_suffix(seed=2)
    assert run(engine, "a", a) == 0
    prefix_keys = stored_keys(model_groups, engine, PREFIX)
    assert on_disk(config, prefix_keys) == [False] * len(prefix_keys)
    assert run(engine, "b", b) == len(PREFIX)  # from the cpu tier
    assert on_disk(config, prefix_keys) == [True] * len(prefix_keys)
    suffixes = [k for t in (a, b) for k in full_keys(model_groups, t, range(16, 24))]
    assert on_disk(config, suffixes) == [False] * len(suffixes)  # each seen once
    close_engine(engine)
    restarted = make_engine(model_groups, config)  # an empty cpu tier, the same disk
    assert run(restarted, "c", with_suffix(seed=3)) == len(PREFIX)  # every group's blocks
    close_engine(restarted)


@pytest.mark.parametrize("kinds", KINDS, ids=KIND_IDS)
def test_a_prefix_computed_twice_is_admitted_once_its_store_ends(
    tmp_path: Path, kinds: tuple[GroupKind, ...]
) -> None:
    """The second request recomputes the prefix (gone from the cpu tier): its own stores
    are admitted, after they end."""
    model_groups = make_groups(kinds, block_size=BLOCK_SIZE)
    config = full_disk_config(tmp_path, admission="reused")
    engine = full_disk_engine(model_groups, config)
    assert run(engine, "a", with_suffix(seed=1)) == 0
    prefix_keys = stored_keys(model_groups, engine, PREFIX)
    assert engine.worker.store.tiers[0].delete_many(prefix_keys) == len(prefix_keys)
    assert run(engine, "b", with_suffix(seed=2)) == 0
    assert stored_keys(model_groups, engine, PREFIX) == prefix_keys  # stored again
    assert on_disk(config, prefix_keys) == [True] * len(prefix_keys)
    close_engine(engine)
    restarted = make_engine(model_groups, config)
    assert run(restarted, "c", with_suffix(seed=3)) == len(PREFIX)
    close_engine(restarted)


@pytest.mark.parametrize("evicted", [True, False], ids=["evicted", "held"])
@pytest.mark.parametrize("kinds", KINDS, ids=KIND_IDS)
def test_a_prefix_the_engine_cache_serves_is_stored_again_if_the_cpu_tier_evicted_it(
    tmp_path: Path, kinds: tuple[GroupKind, ...], evicted: bool
) -> None:
    """The second request reads the prefix from the engine's own cache and computes none
    of it. Its admission sends the prefix on from the cpu tier, or, where that tier
    evicted it, from the engine's blocks (stored again): not for a Mamba state, which a
    step may advance, and so for no group of such a model (a hit needs every group)."""
    model_groups = make_groups(kinds, block_size=BLOCK_SIZE)
    config = full_disk_config(tmp_path, admission="reused")
    engine = full_disk_engine(model_groups, config)
    assert run(engine, "a", with_suffix(seed=1)) == 0
    prefix_keys = stored_keys(model_groups, engine, PREFIX)
    if evicted:
        assert engine.worker.store.tiers[0].delete_many(prefix_keys) == len(prefix_keys)
    assert run_request(engine, "b", with_suffix(seed=2), CHUNK, cached=len(PREFIX)) == 0
    refreshable = MAMBA not in kinds
    # The engine keeps a sliding window's last blocks only: the rest stays evicted.
    kept = full_keys(model_groups, PREFIX, range(16))
    if SW in kinds:
        kept += block_keys(model_groups, PREFIX, kinds.index(SW), range(14, 16))
    expect = {k: not evicted or (refreshable and k in kept) for k in prefix_keys}
    assert dict(zip(prefix_keys, on_disk(config, prefix_keys), strict=True)) == expect
    refreshed = sum(c.refreshed_blocks for c in engine.worker.stats.groups)
    assert refreshed == (evicted and refreshable) * sum(expect.values())
    # Each group's 16 blocks were admitted; those the cpu tier did not hold are lost.
    lost = engine.worker.store.stats_by_tier()["disk"].admission_lost
    assert lost == 16 * len(kinds) - sum(expect.values())
    close_engine(engine)
    restarted = make_engine(model_groups, config)  # an empty cpu tier, the same disk
    hit = run(restarted, "c", with_suffix(seed=3))
    assert hit == (len(PREFIX) if not evicted or refreshable else 0)
    close_engine(restarted)


@pytest.mark.parametrize("kinds", KINDS[:2], ids=KIND_IDS[:2])
def test_a_prefix_reaches_the_disk_last_block_first_so_its_tail_is_evicted_first(
    tmp_path: Path, kinds: tuple[GroupKind, ...]
) -> None:
    """The disk evicts the segment written first. Admitted blocks go there the chain's
    last position first, every group's blocks of a position together, so the oldest
    segment holds the prefix's tail: once it is evicted, a shorter prefix still hits."""
    model_groups = make_groups(kinds, block_size=BLOCK_SIZE)
    tiers = [
        {"kind": "cpu", "capacity_bytes": "8MiB", "pin_memory": False},
        {  # 12 segments of 40 KiB: four slots each
            "kind": "disk",
            "path": str(tmp_path / "disk"),
            "capacity_bytes": 12 * 40960,
            "segment_bytes": 40960,
        },
    ]
    config = make_config(tmp_path, tiers=tiers, admission="reused")
    engine = full_disk_engine(model_groups, config)
    assert run(engine, "a", with_suffix(seed=1)) == 0
    assert run(engine, "b", with_suffix(seed=2)) == len(PREFIX)  # loaded: admitted
    disk = engine.worker.store.tiers[1]
    assert isinstance(disk, DiskTier)
    keys = {
        (i, g): block_keys(model_groups, PREFIX, g, [i])[0]
        for i in range(16)
        for g in range(len(kinds))
    }
    entries = {at: disk._table.entry(key_digest(k)) for at, k in keys.items()}
    assert all(e is not None for e in entries.values()), "the prefix is not on disk"
    seqs = {at: e.segment.seq for at, e in entries.items() if e is not None}
    written = sorted(keys, key=lambda at: (-at[0], at[1]))  # last position first
    assert [seqs[at] for at in written] == sorted(seqs.values())
    oldest = [at for at in keys if seqs[at] == min(seqs.values())]
    assert disk.delete_many([keys[at] for at in oldest]) == len(oldest)  # as eviction does
    close_engine(engine)
    restarted = make_engine(model_groups, config)  # an empty cpu tier, the same disk
    hit = min(i for i, _ in oldest) * BLOCK_SIZE
    assert hit > 0 and run(restarted, "c", with_suffix(seed=3)) == hit
    close_engine(restarted)


def small_tiers(tmp_path: Path, model_groups: ModelGroups, admission: str) -> ConnectorConfig:
    block_bytes = 2 * attention_page_bytes(BLOCK_SIZE)  # two layers per group
    num_groups = model_groups.num_groups
    tiers: list[dict[str, Any]] = [
        {"kind": "cpu", "capacity_bytes": 48 * num_groups * block_bytes, "pin_memory": False},
        {
            "kind": "disk",
            "path": str(tmp_path / "disk"),
            "capacity_bytes": "1MiB",
            "segment_bytes": "256KiB",
            "num_io_threads": 1,
        },
    ]
    return make_config(tmp_path, tiers=tiers, admission=admission)


@pytest.mark.parametrize("admission", ["all", "reused"])
def test_one_off_prompts_do_not_push_a_shared_prefix_out_of_disk(
    tmp_path: Path, admission: str
) -> None:
    """The cpu tier holds about one prompt, the disk a few (a 256 B block takes a 4 KiB
    page there): between two requests that share a prefix come one-off prompts worth
    more than the disk. Every hit is checked against a cold run (``run``)."""
    model_groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    config = small_tiers(tmp_path, model_groups, admission)
    engine = full_disk_engine(model_groups, config)
    cpu = engine.worker.store.tiers[0]
    prefix_keys = full_keys(model_groups, PREFIX, range(16))
    hits, in_cpu = [], []
    for round_ in range(6):
        for n in range(6):
            one_off = prompt(160, seed=1000 + 10 * round_ + n)
            assert run(engine, f"one-off {round_}.{n}", one_off) == 0
        in_cpu.append(cpu.contains_many(prefix_keys).count(True))
        hits.append(run(engine, f"shared {round_}", with_suffix(seed=round_)))
    assert in_cpu == [0] * 6, "the cpu tier kept the prefix: make the one-offs larger"
    disk_stats = engine.worker.store.stats_by_tier()["disk"]
    if admission == "reused":
        # The second request is the prefix's second sighting: it computes it (the cpu
        # tier lost it, the disk never had it), and its stores are admitted.
        assert hits == [0, 0] + [len(PREFIX)] * 4
        assert on_disk(config, full_keys(model_groups, PREFIX, range(16))) == [True] * 16
        assert disk_stats.rejected > 10 * disk_stats.admitted
    else:
        assert hits == [0] * 6, "the disk kept the prefix: make the one-offs larger"
        assert disk_stats.rejected == 0
    close_engine(engine)


class GatedStores(GatedTier):
    """A real CPU tier, offered without its memory (stores go through ``put_many``), whose
    puts wait until ``release()``: a store stays in flight."""

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        assert self.gate.wait(timeout=30)
        return self.inner.put_many(keys, buffers, checksums)

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        return self.inner.get_many_into(keys, buffers)


def test_blocks_admitted_while_their_store_runs_go_on_once_it_ends(tmp_path: Path) -> None:
    model_groups = make_groups((SW, FULL), block_size=BLOCK_SIZE)
    config = full_disk_config(tmp_path, admission="reused")
    first = GatedStores(CpuTier(CpuConfig(capacity_bytes=8 << 20, pin_memory=False)))
    first.release()
    disk = DiskTier(disk_config(config))
    fill_disk(disk)
    store = TieredStore([first, disk], admission=Admission.REUSED, name="gated")
    engine = make_engine(model_groups, config, store=store)
    assert run(engine, "a", with_suffix(seed=1)) == 0
    prefix_keys = stored_keys(model_groups, engine, PREFIX)
    assert first.delete_many(prefix_keys) == len(prefix_keys)
    first.gate.clear()
    assert engine.add("b", with_suffix(seed=2)) == 0
    engine.step({"b": CHUNK})  # stores blocks 0-7, admitted at once, still in flight
    assert engine.last_meta is not None and engine.last_meta.admitted
    assert engine.worker.store.tiers[0].contains_many(prefix_keys[:1]) == [False]
    first.release()
    run_to_end(engine, "b", CHUNK)
    engine.settle()
    assert engine.finish("b") is False
    assert store.flush(30)
    assert on_disk(config, prefix_keys) == [True] * len(prefix_keys)
    close_engine(engine)


def test_reused_sends_every_store_on_while_the_disk_has_room(tmp_path: Path) -> None:
    """A prompt seen once reaches a disk with room, and a restarted engine hits it."""
    model_groups = make_groups((MAMBA, FULL), block_size=BLOCK_SIZE)
    config = make_config(tmp_path, admission="reused")
    engine = make_engine(model_groups, config)
    tokens = with_suffix(seed=1)
    assert run(engine, "once", tokens) == 0
    stored = stored_keys(model_groups, engine, tokens)
    assert on_disk(config, stored) == [True] * len(stored)
    disk_stats = engine.worker.store.stats_by_tier()["disk"]
    assert (disk_stats.admitted, disk_stats.rejected) == (len(stored), 0)
    close_engine(engine)
    restarted = make_engine(model_groups, config)
    assert run(restarted, "again", tokens) == len(tokens) - CHUNK  # the last aligned state
    close_engine(restarted)
