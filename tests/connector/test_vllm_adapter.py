"""The vLLM translation layer on vLLM 0.32's own config, spec, request and output types."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm import SamplingParams
from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from hybridkv.integrations.vllm.engine import (
    check_engine,
    layout_from_config,
    step_input,
)
from hybridkv.integrations.vllm.metrics import (
    CounterDeltas,
    HybridKVPromMetrics,
    HybridKVStats,
)
from hybridkv.spec import GroupKind

GDN_SHAPES = ((3, 384), (1, 128, 128))


def attention(cls: type, **kw: object) -> object:
    return cls(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32, **kw)


def mamba(mode: str = "align", **kw: object) -> MambaSpec:
    return MambaSpec(
        block_size=32,
        shapes=GDN_SHAPES,
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
        page_size_padded=262144,
        **kw,
    )


def kv_config(*specs: object) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def engine_config(**parallel: int) -> VllmConfig:
    return VllmConfig(
        parallel_config=ParallelConfig(**parallel), cache_config=CacheConfig(block_size=32)
    )


def test_gemma_and_qwen_like_groups_become_our_layout() -> None:
    gemma = kv_config(attention(SlidingWindowSpec, sliding_window=32), attention(FullAttentionSpec))
    check_engine(engine_config(), gemma)
    layout = layout_from_config(gemma, "m")
    assert [g.kind for g in layout.groups] == [GroupKind.SLIDING_WINDOW, GroupKind.FULL]
    assert layout.groups[0].sliding_window == 32
    assert layout.groups[0].page_size_bytes == 32 * 2 * 32 * 4
    assert layout.groups[1].layer_names == ("model.layers.1.attn",)
    qwen = kv_config(mamba(), attention(FullAttentionSpec))
    check_engine(engine_config(), qwen)
    layout = layout_from_config(qwen, "m")
    assert layout.groups[0].kind is GroupKind.MAMBA
    # The state's own bytes, not the page the allocator pads it to.
    assert layout.groups[0].page_size_bytes == 3 * 384 * 2 + 128 * 128 * 2 < 262144


def test_everything_we_cannot_serve_is_refused_in_one_error() -> None:
    config = kv_config(
        attention(CrossAttentionSpec),
        mamba("none"),
        mamba(num_speculative_blocks=1),
        attention(FullAttentionSpec),
    )
    with pytest.raises(ValueError) as info:
        check_engine(
            engine_config(
                tensor_parallel_size=2, decode_context_parallel_size=2, pipeline_parallel_size=2
            ),
            config,
        )
    message = str(info.value)
    assert "group 0" in message and "cross-attention" in message
    assert "group 1" in message and "'none'" in message and "align" in message
    assert "group 2" in message and "speculative" in message
    assert "group 3" not in message
    assert "dcp=2" in message and "pipeline_parallel_size=2" in message


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
    )


def test_scheduler_output_becomes_step_input() -> None:
    new_req, old_req, resumed = (
        _request("new", list(range(3, 70))),
        _request("old", list(range(5, 40))),
        _request("back", list(range(7, 50))),
    )
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [
        NewRequestData.from_request(new_req, ([1, 2, 3], [4, 5, 6]))  # type: ignore[arg-type]
    ]
    output.scheduled_cached_reqs = CachedRequestData(
        req_ids=["old", "back", "gone"],
        resumed_req_ids={"back"},
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None, ([7], [8]), ([9], [10])],
        num_computed_tokens=[32, 0, 5],
        num_output_tokens=[0, 0, 0],
    )
    output.num_scheduled_tokens = {"new": 64, "old": 3, "back": 43, "gone": 1}
    output.preempted_req_ids = {"x"}
    requests = {"new": new_req, "old": old_req, "back": resumed}
    step = step_input(output, requests)
    by_id = {r.req_id: r for r in step.scheduled}
    assert set(by_id) == {"new", "old", "back"}  # unknown requests are skipped
    assert by_id["new"].replaces_block_ids and by_id["new"].new_block_ids == ((1, 2, 3), (4, 5, 6))
    assert by_id["new"].num_scheduled_tokens == 64 and list(by_id["new"].token_ids) == list(
        range(3, 70)
    )
    assert by_id["old"].new_block_ids is None and not by_id["old"].replaces_block_ids
    assert by_id["old"].num_computed_tokens == 32
    assert by_id["back"].replaces_block_ids and by_id["back"].new_block_ids == ((7,), (8,))
    assert step.preempted_req_ids == frozenset({"x"})


def test_stats_sum_counters_and_keep_maxima() -> None:
    deltas = CounterDeltas()
    assert deltas.delta({"load.loads": 2, "load.load_latency_s_max": 0.5}) == {
        "load.loads": 2.0,
        "load.load_latency_s_max": 0.5,
    }
    assert deltas.delta({"load.loads": 2, "load.load_latency_s_max": 0.5}) == {}
    assert deltas.delta({"load.loads": 5, "load.load_latency_s_max": 0.7}) == {
        "load.loads": 3.0,
        "load.load_latency_s_max": 0.7,
    }
    a = HybridKVStats(data={"load.loads_ok": 1, "load.load_latency_s_sum": 0.2, "x_max": 3})
    b = HybridKVStats(data={"load.loads_failed": 1, "load.load_latency_s_sum": 0.4, "x_max": 1})
    merged = a.aggregate(b)
    assert merged.data == {
        "load.loads_ok": 1,
        "load.loads_failed": 1,
        "load.load_latency_s_sum": pytest.approx(0.6),
        "x_max": 3,
    }
    assert merged.reduce()["load.latency_s_avg"] == pytest.approx(0.3)
    assert not merged.is_empty() and HybridKVStats(data={"a": 0}).is_empty()


def test_prometheus_counters_per_tier() -> None:
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": _with_registry(cls, registry)})

    metrics = HybridKVPromMetrics(
        VllmConfig(),
        {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)},
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    metrics.observe({"lookup.hit_tokens": 64, "tier.disk.get_bytes": 4096, "tier.cpu.hits": 2})
    metrics.observe({"lookup.hit_tokens": 32, "load.load_latency_s_max": 9.0})
    value = registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("hybridkv_lookup_hit_tokens_total", labels) == 96
    assert value("hybridkv_tier_get_bytes_total", {**labels, "tier": "disk"}) == 4096
    assert value("hybridkv_tier_hits_total", {**labels, "tier": "cpu"}) == 2


def _with_registry(cls: type, registry: CollectorRegistry) -> object:
    def init(self: object, *args: object, **kwargs: object) -> None:
        cls.__init__(self, *args, registry=registry, **kwargs)  # type: ignore[misc]

    return init


def test_a_second_engine_in_the_process_registers_its_metrics_again() -> None:
    from prometheus_client import REGISTRY

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    labels = {"model_name": "m", "engine": "0"}
    for _ in range(2):  # the second would be a duplicate registration without cleanup
        metrics = HybridKVPromMetrics(
            VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]}
        )
        metrics.observe({"load.loads_ok": 1})
        assert REGISTRY.get_sample_value("hybridkv_load_loads_ok_total", labels) == 1
