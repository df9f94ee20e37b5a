"""An engine's private tiers and prefix cache, read from its KV events, answer as the
tiers themselves would: the same blocks give the same hit.

A real connector stores a prompt (CPU, then disk); the events say the CPU tier (or
the GPU) holds exactly the blocks the disk holds, named as vLLM names blocks (a
chained hash the lookup cannot compute: here a digest of the parent and tokens)
and built with vLLM's own event classes. The lookup must then find through the
events the hit it finds on the disk tier directly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from hybridkv.connector.card import EngineCard
from hybridkv.groups import GroupKind
from hybridkv.integrations.vllm.event_feed import EventFeed
from hybridkv.route.engines import Engines
from hybridkv.route.events import EventIndex
from hybridkv.route.lookup import EngineHits, EngineLookup, HitQuery
from hybridkv.tools.sim.build import make_config
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.cards import store_through_engine, write_engine_card

F, S, M = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
SHAPES = {"full": (F,), "sliding+full": (S, F), "mamba+full": (M, F)}


def vllm_names(tokens: Sequence[int], size: int, salt: str | None = None) -> list[bytes]:
    """A chained hash per whole block, as an engine names them (its seed unknown here)."""
    names, parent = [], b"seed"
    for n in range(len(tokens) // size):
        extra = (salt,) if salt and n == 0 else None
        block = (parent, tuple(tokens[n * size : (n + 1) * size]), extra)
        parent = hashlib.sha256(repr(block).encode()).digest()
        names.append(parent)
    return names


def stored_events(
    tokens: Sequence[int],
    size: int,
    held: dict[int, list[int]],
    *,
    medium: str,
    ownership: str | None = None,
    salt: str | None = None,
) -> list[BlockStored]:
    """One ``BlockStored`` per held block of each group, each with its parent and tokens."""
    names = vllm_names(tokens, size, salt)
    events = []
    for group_id, indices in held.items():
        for j in indices:
            events.append(
                BlockStored(
                    block_hashes=[names[j]],
                    parent_block_hash=names[j - 1] if j else None,
                    token_ids=list(tokens[j * size : (j + 1) * size]),
                    block_size=size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    extra_keys=[[salt] if salt and j == 0 else None],
                    group_idx=group_id,
                    ownership=ownership,
                )
            )
    return events


def disk_blocks(
    lookup: EngineLookup, tokens: list[int], salt: str | None = None
) -> dict[int, list[int]]:
    """Per group, the block indices the disk tier (tier 1) holds for ``tokens``."""
    chain, _ = lookup.chain(HitQuery(token_ids=tokens, cache_salt=salt))
    builder, disk = lookup.search.builders[0], lookup.tiers.views[0][1]
    assert disk is not None
    held = {}
    for g in range(lookup.card.model_groups.num_groups):
        indices = list(range(len(chain)))
        keys = builder.keys_of(g, builder.block_hashes(g, chain, indices))
        found = disk.contains_many(list(keys))
        held[g] = [i for i, hit in zip(indices, found, strict=True) if hit]
    return held


def setup(tmp_path: Path, shape: str, salt: str | None = None) -> tuple[EngineCard, list[int]]:
    model_groups = make_groups(SHAPES[shape])
    config = make_config(tmp_path)
    card = write_engine_card(tmp_path / "a.json", config, model_groups)
    tokens = prompt(41)
    store_through_engine(model_groups, config, tokens, salt=salt)
    return card, tokens


@pytest.mark.parametrize("shape", SHAPES)
def test_events_naming_the_disks_blocks_give_the_disks_hit(tmp_path: Path, shape: str) -> None:
    card, tokens = setup(tmp_path, shape)
    size = card.model_groups.hash_block_size
    index = EventIndex()
    lookup = EngineLookup("a", card, events=index)
    before = lookup.find(HitQuery(token_ids=tokens))
    cpu, disk = before.tiers
    assert disk.hit_tokens > 0 and (cpu.visible, cpu.via_events) == (True, True)
    assert cpu.hit_tokens == 0 and before.device_hit_tokens == 0

    held = disk_blocks(lookup, tokens)
    assert len(held[len(held) - 1]) == 10
    if len(held) > 1:  # a window or a state needs only the last blocks before the hit;
        held[0] = held[0][-3:]  # the blocks before them are named by the full group's events
    index.apply(stored_events(tokens, size, held, medium="CPU"))
    after = lookup.find(HitQuery(token_ids=tokens))
    assert after.tiers[0].hit_tokens == disk.hit_tokens
    assert after.tiers[0].load_bytes_per_rank == disk.load_bytes_per_rank
    assert after.hit_tokens == before.hit_tokens == disk.hit_tokens
    assert after.device_hit_tokens == 0  # the CPU tier is not the engine's own cache

    # Without the last group's blocks the events give no hit: a hit needs every group.
    index.apply(
        [BlockRemoved(block_hashes=vllm_names(tokens, size), medium="CPU", group_idx=len(held) - 1)]
    )
    assert lookup.find(HitQuery(token_ids=tokens)).tiers[0].hit_tokens == 0

    # The GPU's blocks are the engine's own prefix cache; AllBlocksCleared clears only it.
    index.apply(stored_events(tokens, size, held, medium="GPU"))
    gpu = lookup.find(HitQuery(token_ids=tokens))
    assert gpu.device_hit_tokens == disk.hit_tokens == gpu.usable_tokens
    assert gpu.tiers[0].hit_tokens == 0
    index.apply([AllBlocksCleared()])
    assert lookup.find(HitQuery(token_ids=tokens)).device_hit_tokens == 0
    lookup.close()


def test_a_hole_in_the_chain_ends_the_hit_there(tmp_path: Path) -> None:
    card, tokens = setup(tmp_path, "full")
    size = card.model_groups.hash_block_size
    index = EventIndex()
    lookup = EngineLookup("a", card, events=index)
    index.apply(stored_events(tokens, size, {0: list(range(10))}, medium="CPU"))
    assert lookup.find(HitQuery(token_ids=tokens)).tiers[0].hit_tokens == 40
    names = vllm_names(tokens, size)
    index.apply([BlockRemoved(block_hashes=[names[6]], medium="CPU", group_idx=0)])
    assert lookup.find(HitQuery(token_ids=tokens)).tiers[0].hit_tokens == 24
    # Another prompt sharing the first 5 blocks: its chain is named that far only.
    other = [*tokens[:20], *prompt(21, seed=3)]
    assert lookup.find(HitQuery(token_ids=other)).tiers[0].hit_tokens == 20
    lookup.close()


def test_names_are_salted_as_the_engine_salts_them(tmp_path: Path) -> None:
    card, tokens = setup(tmp_path, "sliding+full", salt="tenant-1")
    size = card.model_groups.hash_block_size
    index = EventIndex()
    lookup = EngineLookup("a", card, events=index)
    held = disk_blocks(lookup, tokens, "tenant-1")
    assert held[1]
    index.apply(stored_events(tokens, size, held, medium="CPU", salt="tenant-1"))
    salted = lookup.find(HitQuery(token_ids=tokens, cache_salt="tenant-1"))
    assert salted.tiers[0].hit_tokens == salted.tiers[1].hit_tokens > 0
    assert lookup.find(HitQuery(token_ids=tokens)).tiers[0].hit_tokens == 0
    assert lookup.find(HitQuery(token_ids=tokens, cache_salt="t2")).tiers[0].hit_tokens == 0
    # Block hashes carry no tokens: the events cannot be followed for them.
    hashes, _ = lookup.chain(HitQuery(token_ids=tokens, cache_salt="tenant-1"))
    by_hashes = lookup.find(HitQuery(block_hashes=hashes, num_tokens=len(tokens)))
    assert by_hashes.tiers[0].visible is False and by_hashes.device_hit_tokens is None
    lookup.close()


def test_the_oldest_names_go_first_and_the_hit_then_under_counts() -> None:
    index = EventIndex(max_names=4)
    tokens = prompt(41)
    index.apply(stored_events(tokens, 4, {0: list(range(10))}, medium="CPU"))
    # Blocks 0-5 lost their names: the chain cannot start.
    assert index.chain(tokens, 4) == []
    assert index.sources() == {"CPU": 4}  # and the CPU tier is followed for 4 blocks only
    with pytest.raises(ValueError, match="max_names"):
        EventIndex(max_names=0)


def _wait(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_feed_applies_what_a_publisher_sends_and_survives_garbage(tmp_path: Path) -> None:
    card, tokens = setup(tmp_path, "sliding+full")
    size = card.model_groups.hash_block_size
    index = EventIndex()
    feed = EventFeed(index.apply)
    assert feed.endpoint.startswith("tcp://127.0.0.1:")
    engines = Engines({"a": tmp_path / "a.json"}, events={"a": index})
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.connect(feed.endpoint)  # as vLLM's publisher does with such an endpoint
    try:
        (before,) = engines.find(HitQuery(token_ids=tokens))
        entry = engines.entries["a"]
        assert entry.lookup is not None
        held = disk_blocks(entry.lookup, tokens)
        batch = KVEventBatch(ts=time.time(), events=stored_events(tokens, size, held, medium="CPU"))
        encoder = msgspec.msgpack.Encoder()
        # A slow joiner may miss the first messages: send until one lands.
        for seq in range(200):
            publisher.send_multipart([b"kv", seq.to_bytes(8, "big"), b"\x00garbage"])
            publisher.send_multipart([b"kv", seq.to_bytes(8, "big"), encoder.encode(batch)])
            if feed.batches:
                break
            time.sleep(0.05)
        _wait(lambda: feed.batches >= 1 and feed.errors >= 1)
        (hits,) = engines.find(HitQuery(token_ids=tokens))
        assert isinstance(before, EngineHits) and isinstance(hits, EngineHits)
        assert before.tiers[0].hit_tokens == 0
        assert hits.tiers[0].hit_tokens == hits.tiers[1].hit_tokens > 0
        assert engines.entries["a"].describe()["tiers"][0]["via_events"] is True
        with pytest.raises(ValueError, match="without a card"):
            Engines({"a": tmp_path / "a.json"}, events={"b": EventIndex()})
    finally:
        publisher.close(linger=0)
        engines.close()
        feed.close()
