"""KV events of the tiers on real vLLM (CPU), read the way a router's indexer reads them.

Gemma 3 (a sliding-window group and a full-attention group) with a CPU tier too
small for the prompts in front of a disk tier, and vLLM's ``kv_events_config``
publishing on a ZMQ endpoint this test listens on (loopback). The batches are
decoded with vLLM's own classes, as vLLM's example subscriber does. Replaying
them must give exactly the blocks each tier holds at the end (the worker looks
them up by their store keys, and names them with the engine's own hash function),
the CPU tier's evictions must come out as removals, and each block must carry
its group, block size, spec kind, tokens and parent, with the hash vLLM's own
GPU events give the same block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from hybridkv.tools.models import TinyModelKind, default_prompt_token_ids
from tests.e2e.harness import Harness
from tests.e2e.scenarios import SETTLE, engine, generate

pytestmark = pytest.mark.slow

CPU_BLOCKS = 6
"""The CPU tier's room, in blocks of one group: far less than the prompts store."""
PROMPT_LENGTHS = (150, 200, 230)


@dataclass
class Subscriber:
    """A SUB socket bound on loopback (vLLM's publisher connects to it), decoding every
    batch it receives on a thread until stopped."""

    endpoint: str = ""
    batches: list[KVEventBatch] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, ready: threading.Event) -> None:
        context = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind("tcp://127.0.0.1:0")
        self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        ready.set()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            while not self._stop.is_set():
                if sub.poll(100):
                    _topic, _seq, payload = sub.recv_multipart()
                    self.batches.append(decoder.decode(payload))
        finally:
            sub.close(linger=0)

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    sub, ready = Subscriber(), threading.Event()
    thread = threading.Thread(target=sub.run, args=(ready,), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield sub
    sub.stop()
    thread.join(10)


def _source(event: BlockStored | BlockRemoved) -> str:
    return str(event.medium) if event.ownership is None else f"{event.medium}/{event.ownership}"


def _hash(block_hash: Any) -> int | str:
    return block_hash if isinstance(block_hash, int) else bytes(block_hash).hex()


def test_events_name_exactly_what_the_tiers_hold(harness: Harness, subscriber: Subscriber) -> None:
    model = harness.model(TinyModelKind.GEMMA3)
    prompts = [
        default_prompt_token_ids(n, vocab_size=model.vocab_size, seed=300 + i)
        for i, n in enumerate(PROMPT_LENGTHS)
    ]
    # Shorter than a block: a step that stores nothing and publishes what the write-back
    # finished after the first run (events go out with an engine step).
    pump = generate("pump", [prompts[0][:5]])
    steps = [
        generate("cold", prompts),
        SETTLE,
        {**pump, "max_tokens": 2},
        {"op": "tier_blocks", "label": "held", "after": "cold"},
    ]
    block_bytes = 2 * 32 * 1 * 32 * 4 * 2  # two layers of one group, 8 KiB each
    connector = {
        "tiers": [
            {"kind": "cpu", "capacity_bytes": CPU_BLOCKS * block_bytes},
            {
                "kind": "disk",
                "path": str(harness.cache_dir("kv-events") / "kv"),
                "capacity_bytes": "64MiB",
            },
        ]
    }
    plan = engine("events", model, steps, connector)
    plan["kv_events"] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": subscriber.endpoint,
    }
    run = harness.run("kv-events", [plan])
    subscriber.stop()
    assert run.returncode == 0, run.describe_failure()
    facts = run.op("groups", engine="events")
    groups = facts["groups"]
    assert [g["kind"] for g in groups] == ["sliding_window", "full"]
    cold, held = run.step("events", "cold"), run.step("events", "held")
    sequences = [[*p, *o] for p, o in zip(cold["prompts"], cold["output_token_ids"], strict=True)]
    rows = {(r["group_id"], r["engine_hash"]): r for r in held["rows"]}
    assert len(rows) == len(held["rows"])  # one name per block and group
    names = {(r["sequence"], r["group_id"], r["index"]): r["engine_hash"] for r in held["rows"]}

    events = [e for batch in subscriber.batches for e in batch.events]
    ours = [e for e in events if isinstance(e, BlockStored | BlockRemoved) and e.medium != "GPU"]
    gpu_hashes = {
        (e.group_idx, _hash(h))
        for e in events
        if isinstance(e, BlockStored) and e.medium == "GPU"
        for h in e.block_hashes
    }

    # Replayed, the events are exactly what each tier holds.
    announced: dict[str, set[tuple[int, int | str]]] = {"CPU": set(), "STORAGE/disk": set()}
    removed_from_cpu = 0
    for event in ours:
        blocks = {(event.group_idx, _hash(h)) for h in event.block_hashes}
        assert len(blocks) == len(event.block_hashes)
        held_now = announced[_source(event)]
        if isinstance(event, BlockStored):
            assert not blocks & held_now, "announced twice"
            held_now |= blocks
            _check_stored(event, groups, rows, names, sequences)
        else:
            assert blocks <= held_now, "removed before announced"
            held_now -= blocks
            removed_from_cpu += len(blocks) if event.medium == "CPU" else 0
    for tier_index, source in enumerate(announced):
        expected = {slot for slot, row in rows.items() if row["tiers"][tier_index]}
        assert announced[source] == expected, source
        assert expected, f"the {source} tier holds nothing"
    assert len(announced["STORAGE/disk"]) > len(announced["CPU"])

    # The CPU tier's evictions, and nothing else, come out as its removals.
    assert held["evictions"]["cpu"] > 0
    assert removed_from_cpu == held["evictions"]["cpu"]

    # Each block carries the hash vLLM's own GPU events give it. Every full-attention
    # block went through the GPU prefix cache; of the sliding-window group the GPU
    # caches (and publishes) only a few blocks, but with one block size for both
    # groups a block's hash is the same in either, so all of them are found there.
    stored = announced["CPU"] | announced["STORAGE/disk"]
    full = {slot for slot in stored if slot[0] == 1}
    assert full and full <= gpu_hashes
    assert len({g["block_size"] for g in groups}) == 1
    assert {h for _, h in stored} <= {h for _, h in gpu_hashes}


def _check_stored(
    event: BlockStored,
    groups: list[dict[str, Any]],
    rows: dict[tuple[int, int | str], dict[str, Any]],
    names: dict[tuple[int, int, int], int | str],
    sequences: list[list[int]],
) -> None:
    """Group, block size, spec kind and window as vLLM's; each block's tokens and
    parent as the engine names them."""
    group_id = event.group_idx
    assert group_id is not None
    group = groups[group_id]
    size = group["block_size"]
    assert event.block_size == size
    kind = {"sliding_window": "sliding_window", "full": "full_attention"}[group["kind"]]
    assert event.kv_cache_spec_kind == kind
    assert event.kv_cache_spec_sliding_window == group["sliding_window"]
    assert len(event.token_ids) == size * len(event.block_hashes)
    assert event.extra_keys == [None] * len(event.block_hashes)
    assert (event.lora_name, event.lora_id) == (None, None)
    parent = event.parent_block_hash
    for n, block_hash in enumerate(event.block_hashes):
        row = rows[(group_id, _hash(block_hash))]
        sequence, index = row["sequence"], row["index"]
        tokens = sequences[sequence][index * size : (index + 1) * size]
        assert event.token_ids[n * size : (n + 1) * size] == tokens
        before = names.get((sequence, group_id, index - 1))
        assert (None if parent is None else _hash(parent)) == before
        parent = block_hash
