"""The tiers' KV events in vLLM 0.32's format, next to vLLM's own GPU events.

Real vLLM requests (hashed by vLLM's own block hasher) and a real ``BlockPool``
give the GPU events of the same blocks: ours must name each block exactly as
they do (hash, parent, tokens, LoRA, extra keys) so an indexer can join them,
and a batch of both must decode the way a subscriber decodes it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
import torch
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from hybridkv.connector.events import event_source
from hybridkv.connector.metadata import (
    BlockRef,
    BlockTransfer,
    ConnectorMetadata,
    RankReport,
    StorePlan,
    TierChange,
    WorkerReport,
)
from hybridkv.integrations.vllm.events import BlockEvents, group_events
from hybridkv.integrations.vllm.served import ServedGroups
from hybridkv.keys import BlockHash, RequestBlockHasher
from hybridkv.tiers.cpu import CpuConfig
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.valkey.config import ValkeyConfig

HASH_BLOCK_SIZE = 16
BLOCK_SIZES = (16, 32)
"""Group 0 sliding window, group 1 full attention (two hash blocks per block)."""
WINDOW = 48


@pytest.fixture(scope="module", autouse=True)
def none_hash() -> None:
    init_none_hash(sha256)


def kv_cache_config() -> KVCacheConfig:
    attention: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    sliding = SlidingWindowSpec(block_size=BLOCK_SIZES[0], sliding_window=WINDOW, **attention)
    full = FullAttentionSpec(block_size=BLOCK_SIZES[1], **attention)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["sw"], sliding), KVCacheGroupSpec(["full"], full)],
        hash_block_size=HASH_BLOCK_SIZE,
    )


def request(req_id: str, tokens: list[int], **kwargs: Any) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
        **kwargs,
    )


def our_refs(tokens: list[int], group_id: int, indices: range, **kwargs: Any) -> list[BlockRef]:
    """hybridkv's names of the blocks (its own hash, not the engine's)."""
    hasher = RequestBlockHasher(HASH_BLOCK_SIZE, **kwargs)
    hasher.extend(tokens)
    m = BLOCK_SIZES[group_id] // HASH_BLOCK_SIZE
    return [BlockRef(group_id, BlockHash(hasher.block_hashes[(i + 1) * m - 1])) for i in indices]


def gpu_events(req: Request, group_id: int, num_blocks: int) -> BlockStored:
    """What vLLM publishes when its GPU prefix cache takes the blocks."""
    pool = BlockPool(64, True, HASH_BLOCK_SIZE, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(req, blocks, 0, num_blocks, BLOCK_SIZES[group_id], group_id)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


def plan(req_id: str, refs: list[BlockRef], indices: range) -> StorePlan:
    transfer = BlockTransfer(
        group_id=refs[0].group_id,
        block_hashes=tuple(r.block_hash for r in refs),
        block_ids=tuple(range(1, len(refs) + 1)),
        block_indices=tuple(indices),
    )
    return StorePlan(req_id=req_id, transfers=(transfer,))


def changes(tier_index: int, refs: list[BlockRef], stored: bool) -> WorkerReport:
    tier_changes = tuple(TierChange(tier_index, r, stored) for r in refs)
    return WorkerReport(ranks=(RankReport(rank=0, tier_changes=tier_changes),))


def block_events(num_tiers: int = 2) -> BlockEvents:
    tiers = [
        CpuConfig(capacity_bytes=1 << 20),
        DiskConfig(path="/tmp/unused", capacity_bytes=1 << 30),
        ValkeyConfig(port=6379),
    ][:num_tiers]
    config = kv_cache_config()
    return BlockEvents(
        group_events(config, ServedGroups.of(config)),
        HASH_BLOCK_SIZE,
        [event_source(c) for c in tiers],
    )


def test_blocks_stored_again_carry_the_engine_s_names_too() -> None:
    """Blocks the engine's own cache served a request, stored again where the CPU tier
    evicted them (``StorePlan.refresh``), are named from that request."""
    tokens = list(range(100, 100 + 4 * HASH_BLOCK_SIZE))
    req = request("again", tokens)
    indices = range(1, 4)
    refs = our_refs(tokens, 0, indices)
    again = plan(req.request_id, refs, indices)
    stores = (StorePlan(req_id=req.request_id, transfers=(), refresh=again.transfers),)
    ours = block_events()
    ours.note_plans(ConnectorMetadata(stores=stores), {req.request_id: req})
    ours.take_report(changes(0, refs, True))
    (event,) = ours.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == gpu_events(req, 0, 4).block_hashes[1:]
    assert ours.num_unnamed == 0


def test_stored_blocks_carry_the_engine_s_names_of_them() -> None:
    tokens = list(range(100, 100 + 7 * HASH_BLOCK_SIZE))
    salted = {"cache_salt": "tenant-a", "lora_request": LoRARequest("adapter", 3, "/loras/a")}
    reqs = [request("plain", tokens), request("salted", tokens, **salted)]
    ours = block_events()
    expected: list[tuple[BlockStored, list[BlockRef]]] = []
    salts = [{}, {"cache_salt": "tenant-a", "lora_name": "adapter"}]
    for req, kwargs in zip(reqs, salts, strict=True):
        for group_id, num_blocks in ((0, 7), (1, 3)):
            indices = range(1, num_blocks)  # from the second block: a parent to name
            refs = our_refs(tokens, group_id, indices, **kwargs)
            stores = (plan(req.request_id, refs, indices),)
            ours.note_plans(ConnectorMetadata(stores=stores), {req.request_id: req})
            expected.append((gpu_events(req, group_id, num_blocks), refs))

    all_refs = [r for _, refs in expected for r in refs]
    ours.take_report(changes(0, all_refs, True))
    published = ours.take_events()
    assert len(published) == len(expected)  # one event per request and group: merged
    for event, (gpu, refs) in zip(published, expected, strict=True):
        assert isinstance(event, BlockStored)
        n = len(refs)
        assert event.block_hashes == gpu.block_hashes[-n:]
        assert event.parent_block_hash == gpu.block_hashes[-n - 1]
        assert event.token_ids == gpu.token_ids[-n * event.block_size :]
        assert event.extra_keys == (gpu.extra_keys or [None] * (n + 1))[-n:]
        same = ("block_size", "lora_id", "lora_name", "group_idx")
        assert [getattr(event, f) for f in same] == [getattr(gpu, f) for f in same]
        assert (event.medium, event.locality, event.ownership) == ("CPU", None, None)
        kind = "sliding_window" if event.group_idx == 0 else "full_attention"
        window = WINDOW if event.group_idx == 0 else None
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (kind, window)
    assert published[2].lora_name == "adapter" and published[2].lora_id == 3
    assert published[2].extra_keys is not None and published[2].extra_keys[0] == ("adapter",)

    # The disk tier stores them too, later; then the CPU tier evicts one.
    ours.take_report(changes(1, all_refs[:2], True))
    ours.take_report(changes(0, all_refs[:1], False))
    disk, removed = ours.take_events()
    assert isinstance(disk, BlockStored) and isinstance(removed, BlockRemoved)
    assert (disk.medium, disk.locality, disk.ownership) == ("STORAGE", "LOCAL", "disk")
    assert disk.block_hashes == expected[0][0].block_hashes[1:3]
    assert removed.block_hashes == expected[0][0].block_hashes[1:2]
    assert (removed.medium, removed.group_idx) == ("CPU", 0)
    ours.check_integrity()

    # A subscriber decodes the batch, GPU events and ours, with vLLM's own classes.
    gpu = [g for g, _ in expected]
    batch = KVEventBatch(ts=time.time(), events=[*gpu, *published, disk, removed])
    payload = msgspec.msgpack.Encoder().encode(batch)
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert decoded.events == batch.events


def test_removals_name_only_blocks_announced_on_that_tier() -> None:
    tokens = list(range(7, 7 + 4 * HASH_BLOCK_SIZE))
    req = request("r", tokens)
    refs = our_refs(tokens, 1, range(2))
    ours = block_events(num_tiers=3)
    ours.note_plans(ConnectorMetadata(stores=(plan("r", refs, range(2)),)), {"r": req})
    ours.take_report(changes(2, refs[:1], False))  # never announced
    ours.take_report(changes(2, refs, True))
    ours.take_report(changes(0, refs, False))  # announced on the pool, not on the CPU tier
    (stored,) = ours.take_events()
    assert isinstance(stored, BlockStored)
    assert (stored.medium, stored.locality, stored.ownership) == ("STORAGE", "REMOTE", "valkey")
    ours.take_report(changes(2, refs, False))
    (removed,) = ours.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    ours.check_integrity()


def test_a_block_whose_name_was_dropped_is_not_published() -> None:
    tokens = list(range(3, 3 + 4 * HASH_BLOCK_SIZE))
    req = request("r", tokens)
    refs = our_refs(tokens, 1, range(2))
    ours = block_events()
    ours.max_pending_tokens = BLOCK_SIZES[1]  # room for one block's name
    ours.note_plans(ConnectorMetadata(stores=(plan("r", refs, range(2)),)), {"r": req})
    assert ours.num_names == 1
    ours.take_report(changes(0, refs, True))
    (event,) = ours.take_events()
    assert isinstance(event, BlockStored) and len(event.block_hashes) == 1
    assert ours.num_unnamed == 1
    ours.take_report(changes(0, refs, False))
    (removed,) = ours.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == event.block_hashes
    ours.check_integrity()


def test_tiers_are_named_with_vllm_s_own_media() -> None:
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE

    from hybridkv.connector.events import source_name

    cpu = event_source(CpuConfig(capacity_bytes=1 << 20))
    disk = event_source(DiskConfig(path="/tmp/unused", capacity_bytes=1 << 20))
    assert (cpu.medium, cpu.locality, cpu.ownership) == (MEDIUM_CPU, None, None)
    assert (disk.medium, disk.locality, disk.ownership) == (MEDIUM_STORAGE, "LOCAL", "disk")
    assert (cpu.name, disk.name) == (MEDIUM_CPU, f"{MEDIUM_STORAGE}/disk")
    assert source_name(None, None) == source_name(MEDIUM_GPU, None) == MEDIUM_GPU
