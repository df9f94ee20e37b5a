"""A lookup from outside the engine answers what the engine's scheduler finds and its
worker then loads: the same tokens, groups, alignment, drafting and tiers."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.connector.card import EngineCard, card_for
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.setup import EngineFacts, build_scheduler
from hybridkv.connector.steps import StepInput
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.keys import KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.route.lookup import EngineLookup, HitQuery
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.registry import build_tier
from hybridkv.tools.sim.build import close_engine, make_config, make_engine
from hybridkv.tools.sim.drive import wait_loaded
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.cards import store_through_engine, write_engine_card

F, S, M = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
SHAPES = {"full": (F,), "sliding+full": (S, F), "mamba+full": (M, F), "all": (S, M, F)}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_lookup_answers_what_the_restarted_engine_finds_and_loads(
    tmp_path: Path, shape: str
) -> None:
    model_groups = make_groups(SHAPES[shape])
    config = make_config(tmp_path)
    card = write_engine_card(tmp_path / "a.json", config, model_groups)
    stored = prompt(41)
    store_through_engine(model_groups, config, stored, salt=None)
    store_through_engine(model_groups, config, stored, salt="tenant-1")
    router = EngineLookup("a", card)
    engine = make_engine(model_groups, config)  # a restart: its CPU tier is empty
    shared_prefix = [*stored[:30], *prompt(15, seed=9)]
    cases: list[tuple[list[int], str | None]] = [
        (stored, None),
        (shared_prefix, None),
        (stored, "tenant-1"),
        (stored, "tenant-2"),
        (prompt(20, seed=5), None),
    ]
    answers = []
    for i, (tokens, salt) in enumerate(cases):
        hits = router.find(HitQuery(token_ids=tokens, cache_salt=salt))
        loaded_before = sum(g.loaded_bytes for g in engine.worker.stats.groups)
        assert engine.add(f"r{i}", tokens, cache_salt=salt) == hits.hit_tokens
        if hits.hit_tokens:
            assert wait_loaded(engine, f"r{i}").outcomes[-1].ok
        loaded = sum(g.loaded_bytes for g in engine.worker.stats.groups) - loaded_before
        assert hits.load_bytes == hits.load_bytes_per_rank == loaded
        cpu, disk = hits.tiers
        assert (cpu.kind, cpu.visible, cpu.hit_tokens) == ("cpu", False, 0)
        assert (disk.kind, disk.visible, disk.hit_tokens) == ("disk", True, hits.hit_tokens)
        assert disk.load_bytes_per_rank == loaded
        assert not hits.complete and hits.tier_index is None
        answers.append(hits.hit_tokens)
        engine.finish(f"r{i}")
    # The whole prompt hits (less the last token; Mamba: where a step of 12 tokens
    # ended), salted only with its own salt.
    full, prefix, salted, other_salt, cold = answers
    assert full == salted == (36 if M in SHAPES[shape] else 40)
    assert 0 < prefix <= 28 and other_salt == cold == 0
    router.close()
    close_engine(engine)


def test_block_hashes_answer_as_the_token_ids_do(tmp_path: Path) -> None:
    model_groups = make_groups((S, F))
    config = make_config(tmp_path)
    card = write_engine_card(tmp_path / "a.json", config, model_groups)
    tokens = prompt(41)
    store_through_engine(model_groups, config, tokens, salt="x")
    router = EngineLookup("a", card)
    hasher = RequestBlockHasher(model_groups.hash_block_size, cache_salt="x")
    hasher.extend(tokens)
    by_tokens = router.find(HitQuery(token_ids=tokens, cache_salt="x"))
    by_hashes = router.find(HitQuery(block_hashes=hasher.block_hashes, num_tokens=len(tokens)))
    assert by_hashes == by_tokens and by_tokens.hit_tokens > 0
    # Without num_tokens the hashes' own tokens (40) bound the hit: 39 tokens at most.
    short = router.find(HitQuery(block_hashes=hasher.block_hashes))
    assert short.num_tokens == 40 and short.hit_tokens == 36
    with pytest.raises(ValueError, match=r"give 15 hashes, or num_tokens in \[40, 44\)"):
        router.find(HitQuery(block_hashes=hasher.block_hashes, num_tokens=60))
    with pytest.raises(ValueError, match=r"block hashes of \[32\] bytes: engine a uses xxh3_128"):
        router.find(HitQuery(block_hashes=[b"\0" * 32] * 10))
    router.close()


def test_a_query_is_one_of_tokens_or_hashes() -> None:
    with pytest.raises(ValueError, match="either token_ids or block_hashes"):
        HitQuery()
    with pytest.raises(ValueError, match="cache_salt and lora_name enter the block hashes"):
        HitQuery(block_hashes=[], cache_salt="s")
    with pytest.raises(ValueError, match="num_tokens goes with block_hashes"):
        HitQuery(token_ids=[1], num_tokens=1)
    with pytest.raises(ValueError, match="token id -1 is negative"):
        HitQuery(token_ids=[1, -1])
    with pytest.raises(TypeError, match="must be integers"):
        HitQuery(token_ids=[1.5])


# --- property: for random stores, the lookup equals the scheduler's ------------------------

MODEL_GROUPS = [
    make_groups((F,)),
    make_groups((S, F)),
    make_groups((M, F)),
    make_groups((S, M, F)),
    ModelGroups(  # block sizes 4 and 8: hashes every 4 tokens, hits every 8
        groups=(
            KVGroup(kind=S, block_size=4, page_size_bytes=64, layer_names=("s",), sliding_window=8),
            KVGroup(kind=F, block_size=8, page_size_bytes=96, layer_names=("f",)),
        )
    ),
]


def disk_tiers(root: Path, num_disks: int) -> list[dict[str, Any]]:
    """A CPU tier (private: neither the scheduler in another process nor the lookup sees
    it) and ``num_disks`` disk tiers, the first one cheaper."""
    disks = [
        {"kind": "disk", "path": str(root / "a"), "capacity_bytes": "1MiB", "load_weight": 2},
        {"kind": "disk", "path": str(root / "b"), "capacity_bytes": "1MiB", "load_weight": 5},
    ]
    return [{"kind": "cpu", "capacity_bytes": "1MiB"}, *disks[:num_disks]]


def put_random_blocks(
    config: ConnectorConfig,
    model_groups: ModelGroups,
    tokens: Sequence[int],
    salt: str | None,
    lora: str | None,
    tp_size: int,
    rng: np.random.Generator,
) -> None:
    """Each disk tier gets a random run of each group's blocks, with holes; each rank's
    copy of it misses a few more (placeholder bytes: lookups read none)."""
    hasher = RequestBlockHasher(model_groups.hash_block_size, cache_salt=salt, lora_name=lora)
    hasher.extend(tokens)
    builders = [
        KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups, tp_rank=r, tp_size=tp_size))
        for r in range(tp_size)
    ]
    num_tiers = len(config.tier_configs)
    for tier_index in range(1, num_tiers):
        kept_by_group = []
        for group_id in range(model_groups.num_groups):
            num_blocks = builders[0].num_full_blocks(group_id, len(hasher.block_hashes))
            end = int(rng.integers(0, num_blocks + 1))
            kept_by_group.append([i for i in range(end) if rng.random() < 0.9])
        for rank, builder in enumerate(builders):
            keys = []
            for group_id, kept in enumerate(kept_by_group):
                ours = [i for i in kept if rng.random() < 0.97]
                keys += builder.keys(group_id, hasher.block_hashes, ours)
            with build_tier(
                config.for_rank(WorkerRank(tp_rank=rank, tp_size=tp_size))[tier_index]
            ) as tier:
                tier.put_many(keys, [np.zeros(8, np.uint8)] * len(keys))


def scheduler_answer(
    config: ConnectorConfig,
    facts: EngineFacts,
    tokens: list[int],
    salt: str | None,
    lora: str | None,
) -> tuple[int, int]:
    """Hit tokens and bytes of the load the engine's scheduler plans for ``tokens``."""
    scheduler, opened = build_scheduler(config, facts)
    scheduler.add_request("r", cache_salt=salt, lora_name=lora)
    hit = scheduler.lookup("r", tokens, 0).num_tokens
    block_ids = [list(range(1, len(tokens) // g.block_size + 2)) for g in facts.model_groups.groups]
    scheduler.allocated("r", block_ids, hit)
    meta = scheduler.build_metadata(StepInput(scheduled=[], preempted_req_ids=frozenset()))
    groups = facts.model_groups.groups
    load_bytes = sum(
        len(t.block_ids) * groups[t.group_id].block_bytes for p in meta.loads for t in p.transfers
    )
    for tier in opened:
        tier.close()
    return hit, load_bytes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from(range(len(MODEL_GROUPS))),
    num_tokens=st.integers(0, 70),
    salt=st.sampled_from([None, "s"]),
    lora=st.sampled_from([None, "adapter"]),
    tp_size=st.sampled_from([1, 2]),
    selection=st.sampled_from(["per_block", "whole_request"]),
    use_eagle=st.booleans(),
    seed=st.integers(0, 2**16),
    num_disks=st.sampled_from([0, 1, 2]),
)
def test_for_random_stores_the_lookup_equals_the_scheduler(
    shape: int,
    num_tokens: int,
    salt: str | None,
    lora: str | None,
    tp_size: int,
    selection: str,
    use_eagle: bool,
    seed: int,
    num_disks: int,
) -> None:
    model_groups = MODEL_GROUPS[shape]
    use_eagle = use_eagle and all(g.kind is not M for g in model_groups.groups)
    tokens = prompt(num_tokens, seed=seed)
    facts = EngineFacts(
        model_groups=model_groups,
        alignment_tokens=model_groups.scheduler_block_size,
        tp_size=tp_size,
        use_eagle=use_eagle,
    )
    with tempfile.TemporaryDirectory() as root:
        config = ConnectorConfig.from_dict(
            {"tiers": disk_tiers(Path(root), num_disks), "selection": selection}
        )
        rng = np.random.default_rng(seed)
        put_random_blocks(config, model_groups, tokens, salt, lora, tp_size, rng)
        expected = scheduler_answer(config, facts, tokens, salt, lora)
        card = EngineCard.from_dict(card_for(config, facts, facts.alignment_tokens).to_dict())
        router = EngineLookup("e", card)
        hits = router.find(HitQuery(token_ids=tokens, cache_salt=salt, lora_name=lora))
        router.close()
    assert (hits.hit_tokens, hits.load_bytes_per_rank) == expected
    assert hits.load_bytes == expected[1] * tp_size
    if selection == "per_block":
        assert hits.hit_tokens >= max(t.hit_tokens for t in hits.tiers)
