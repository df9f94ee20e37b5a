"""Groups vLLM does not let a connector store under a prefix hash are skipped, not refused.

vLLM's own ``KVCacheConfig`` with five groups: a bounded-replay sliding window
(DeepSeek-V4.1; not prefix-cacheable), a full-attention group, a group vLLM
rebuilds after a load (``enable_kv_transfer=False``), a host-resident group
(HiSparse's host pool), and a sliding window. The real connector, both roles,
on real tiers, driven with vLLM's own scheduler-output and block types: only
the full and sliding groups are stored and loaded, at vLLM's block ids of those
groups; the other groups' device blocks are fenced (one pool), their layers left
alone; a second request hits every served block.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import KVConnectorBlockState, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from hybridkv.connector.steps import StateHandoff
from hybridkv.groups import GroupKind
from hybridkv.integrations.vllm.connector import HybridKVConnector
from hybridkv.integrations.vllm.facts import check_engine, groups_from_config
from hybridkv.integrations.vllm.plumbing import state_handoffs
from hybridkv.integrations.vllm.served import ServedGroups
from hybridkv.tools.models import TinyModelKind, build_tiny_model

BLOCK = 16
NUM_BLOCKS = 64
ATTENTION: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
TOKENS = list(range(3, 3 + 5 * BLOCK + 7))  # 87 tokens: 5 full blocks, hits of 80


def kv_cache_config() -> KVCacheConfig:
    mla = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}
    replay = SlidingWindowMLASpec(block_size=BLOCK, sliding_window=32, bounded_replay=True, **mla)
    full = FullAttentionSpec(block_size=BLOCK, **ATTENTION)
    sliding = SlidingWindowSpec(block_size=BLOCK, sliding_window=32, **ATTENTION)
    groups = [
        KVCacheGroupSpec(["replay.0"], replay),
        KVCacheGroupSpec(["full.0", "full.1"], full),
        KVCacheGroupSpec(["replica.0"], full, enable_kv_transfer=False),
        KVCacheGroupSpec(["host.0"], full, host_resident=True),
        KVCacheGroupSpec(["sliding.0"], sliding),
    ]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        hash_block_size=BLOCK,
        cache_hit_alignment_tokens=BLOCK,
    )


def test_served_groups_are_vllms_prefix_cacheable_device_groups() -> None:
    config = kv_cache_config()
    served = ServedGroups.of(config)
    assert config.prefix_cacheable_group_ids == (1, 3, 4)  # vLLM's own choice
    assert served.engine_group_ids == (1, 4) and served.skipped_group_ids == (0, 2, 3)
    assert served.select(["r", "f", "x", "h", "s"]) == ("f", "s")
    assert served.unserved_device_blocks([[1], [2], [3], [4], [5]]) == (1, 3)  # not host's 4
    assert served.ours([0, 3, 4]) == frozenset({1})
    with pytest.raises(ValueError, match="3 entries for the engine's 5 KV cache groups"):
        served.select([1, 2, 3])


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    model = build_tiny_model(TinyModelKind.GEMMA3, tmp_path_factory.mktemp("models"))
    cache_dir = tmp_path_factory.mktemp("cache")
    return VllmConfig(
        model_config=ModelConfig(model=str(model.path), dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"cache_dir": str(cache_dir)},
        ),
    )


def test_the_engine_is_served_with_the_skipped_groups_left_out(vllm_config: VllmConfig) -> None:
    config = kv_cache_config()
    check_engine(vllm_config, config)
    model_groups = groups_from_config(config, "m")
    assert [g.kind for g in model_groups.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    assert [g.layer_names for g in model_groups.groups] == [("full.0", "full.1"), ("sliding.0",)]
    only_skipped = kv_cache_config()
    only_skipped.kv_cache_groups = only_skipped.kv_cache_groups[:1]
    with pytest.raises(ValueError, match="none of the model's 1 KV cache groups can be stored"):
        check_engine(vllm_config, only_skipped)


def _request(req_id: str) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=TOKENS,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


def _blocks(first: int) -> list[list[int]]:
    """Per vLLM group, the request's blocks (the host group's come from its own pool)."""
    return [list(range(first + 8 * g, first + 8 * g + 6)) for g in range(5)]


def _step(
    scheduler: HybridKVConnector, worker: HybridKVConnector, request: Request, blocks: Any
) -> Any:
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(request, tuple(blocks))]
    output.num_scheduled_tokens = {request.request_id: len(TOKENS)}
    meta = scheduler.build_connector_meta(output)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.flush_writes(30)
    finished = set[str]()
    for _ in range(200):  # the load finishes on the transfer threads
        finished |= worker.get_finished(set())[1]
        output_meta = worker.build_connector_worker_meta()
        if output_meta is not None:
            scheduler.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=output_meta)
            )
        if not meta.meta.loads or request.request_id in finished:
            break
    worker.clear_connector_metadata()
    return meta.meta


def test_only_served_groups_move_and_a_second_request_hits_them(vllm_config: VllmConfig) -> None:
    config = kv_cache_config()
    scheduler = HybridKVConnector(vllm_config, KVConnectorRole.SCHEDULER, config)
    worker = HybridKVConnector(vllm_config, KVConnectorRole.WORKER, config)
    layers = [name for group in config.kv_cache_groups for name in group.layer_names]
    kv = {name: torch.randn(NUM_BLOCKS, 1, BLOCK, 16) for name in layers}
    worker.register_kv_caches(kv)
    assert worker._worker is not None and worker._worker.caches is not None
    assert worker._worker.caches.model_groups.num_groups == 2  # skipped layers left out
    before = {name: t.clone() for name, t in kv.items()}

    first = _request("a")
    assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    meta = _step(scheduler, worker, first, _blocks(1))
    stored = {t.group_id: t.block_ids for plan in meta.stores for t in plan.transfers}
    assert stored[0] == tuple(_blocks(1)[1][:5])  # vLLM's group 1 is our group 0
    assert set(stored) <= {0, 1} and 1 in stored
    assert set(_blocks(1)[0]) | set(_blocks(1)[2]) <= set(meta.written_block_ids)
    assert not set(_blocks(1)[3]) & set(meta.written_block_ids)  # the host pool's own ids
    scheduler.request_finished_all_groups(first, tuple(_blocks(1)))

    second = _request("b")
    assert scheduler.get_num_new_matched_tokens(second, 0) == (5 * BLOCK, True)
    blocks = _blocks(41 - 8 * 4)  # other blocks than the first request's
    scheduler.update_state_after_alloc(
        second, KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in blocks)), 5 * BLOCK
    )
    for tensor in kv.values():
        tensor.zero_()
    meta = _step(scheduler, worker, second, blocks)
    loaded = {t.group_id: t.block_ids for plan in meta.loads for t in plan.transfers}
    assert loaded[0] == tuple(blocks[1][:5])  # every full block at vLLM's group 1 ids
    for name in ("full.0", "full.1"):
        assert torch.equal(kv[name][blocks[1][:5]], before[name][_blocks(1)[1][:5]]), name
    for name in ("replay.0", "replica.0", "host.0"):
        assert not kv[name].any(), f"{name}: a skipped group's layer was written"
    worker.shutdown()
    scheduler.shutdown()


def test_state_handoffs_name_the_served_groups_by_hybridkv_ids() -> None:
    """vLLM names a hand-off's group by its own id; a skipped group's hand-offs are left
    out and a served group's carry hybridkv's id, or a state would be stored under
    another group's key."""
    served = ServedGroups.of(kv_cache_config())  # vLLM's groups 1 and 4 are ours 0 and 1
    output = SchedulerOutput.make_empty()
    output.kv_connector_block_state = KVConnectorBlockState(
        req_ids={"a", "b"},
        resolve_block_ids=lambda req_id: ([], [], [], [], []),
        boundary_state_offloads={"a": [(4, 11, 32), (0, 12, 32), (1, 13, 16)], "b": [(2, 14, 16)]},
    )
    handoffs = state_handoffs(output, served)
    assert handoffs == {"a": (StateHandoff(1, 11, 32), StateHandoff(0, 13, 16))}
