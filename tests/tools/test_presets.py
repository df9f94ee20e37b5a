"""Real-model presets, checked against vLLM's own grouping and page-size code."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.tools.mamba2_presets import (
    GRANITE_4_0_H_TINY_STATE_BYTES,
    NEMOTRON_NANO_9B_V2_PATTERN,
    NEMOTRON_NANO_9B_V2_STATE_BYTES,
    granite_4_0_h_tiny,
    nemotron_nano_9b_v2,
)
from hybridkv.tools.preset_groups import (
    LayerKV,
    attention_block_size_for_state,
    attention_page_size_bytes,
    group_layers_like_vllm,
)
from hybridkv.tools.presets import (
    PRESETS,
    QWEN3_NEXT_STATE_BYTES,
    deepseek_v4_flash,
    deepseek_v4_pro,
    gemma3_27b,
    gpt_oss_20b,
    load_groups,
    qwen3_next_80b_a3b,
)

BF16 = torch.bfloat16


def vllm_groups(specs: dict[str, KVCacheSpec]) -> list[tuple[str, list[str], int]]:
    """vLLM's grouping of the given per-layer specs: (spec type, layer names, page bytes)."""
    return [
        (type(g.kv_cache_spec).__name__, list(g.layer_names), g.kv_cache_spec.page_size_bytes)
        for g in _get_kv_cache_groups_uniform_page_size(specs)
    ]


VLLM_TYPE = {
    GroupKind.FULL: "FullAttentionSpec",
    GroupKind.SLIDING_WINDOW: "SlidingWindowSpec",
    GroupKind.MAMBA: "MambaSpec",
}


def ours(model_groups: ModelGroups) -> list[tuple[str, list[str], int]]:
    return [
        (VLLM_TYPE[g.kind], list(g.layer_names), g.page_size_bytes) for g in model_groups.groups
    ]


def test_preset_names() -> None:
    assert sorted(PRESETS) == [
        "deepseek-v4-flash",
        "deepseek-v4-pro",
        "gemma3-27b",
        "gpt-oss-20b",
        "granite-4.0-h-tiny",
        "nemotron-nano-9b-v2",
        "qwen3-next-80b-a3b",
    ]
    for name, build in PRESETS.items():
        model_groups = build()
        assert model_groups == build()  # deterministic
        assert load_groups(name) == model_groups


# ---------------------------------------------------------------- Gemma 3 27B


def test_gemma3_27b_matches_vllm() -> None:
    model_groups = gemma3_27b()
    specs: dict[str, KVCacheSpec] = {}
    for i in range(62):
        name = f"language_model.model.layers.{i}.self_attn.attn"
        if (i + 1) % 6 == 0:
            specs[name] = FullAttentionSpec(
                block_size=16, num_kv_heads=16, head_size=128, dtype=BF16
            )
        else:
            specs[name] = SlidingWindowSpec(
                block_size=16, num_kv_heads=16, head_size=128, dtype=BF16, sliding_window=1024
            )
    assert ours(model_groups) == vllm_groups(specs)
    assert [g.num_layers for g in model_groups.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert model_groups.groups[-1].kind is GroupKind.FULL
    assert {g.sliding_window for g in model_groups.groups[:-1]} == {1024}
    assert model_groups.groups[0].page_size_bytes == 2 * 16 * 16 * 128 * 2 == 131072
    assert (model_groups.scheduler_block_size, model_groups.hash_block_size) == (16, 16)
    assert sum(g.num_layers for g in model_groups.groups) == 62


# ---------------------------------------------------------------- gpt-oss-20b


def test_gpt_oss_20b_matches_vllm() -> None:
    model_groups = gpt_oss_20b()
    specs: dict[str, KVCacheSpec] = {}
    for i in range(24):
        name = f"model.layers.{i}.attn.attn"
        if i % 2 == 0:
            specs[name] = SlidingWindowSpec(
                block_size=16, num_kv_heads=8, head_size=64, dtype=BF16, sliding_window=128
            )
        else:
            specs[name] = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=BF16)
    assert ours(model_groups) == vllm_groups(specs)
    assert [(g.kind, g.num_layers) for g in model_groups.groups] == [
        (GroupKind.SLIDING_WINDOW, 12),
        (GroupKind.FULL, 12),
    ]
    assert model_groups.groups[0].sliding_window == 128
    assert model_groups.groups[0].page_size_bytes == 32768


# ---------------------------------------------------------------- Qwen3-Next-80B-A3B


def test_qwen3_next_state_size_is_vllms() -> None:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4)
    state = MambaSpec(shapes=shapes, dtypes=(BF16, BF16), block_size=544)
    assert state.page_size_bytes == QWEN3_NEXT_STATE_BYTES == 1_097_728


def test_qwen3_next_block_size_is_the_smallest_that_fits_the_state() -> None:
    per_token = FullAttentionSpec(
        block_size=1, num_kv_heads=2, head_size=256, dtype=BF16
    ).page_size_bytes
    assert per_token == attention_page_size_bytes(block_size=1, num_kv_heads=2, head_dim=256)
    brute = next(bs for bs in range(16, 10_000, 16) if bs * per_token >= QWEN3_NEXT_STATE_BYTES)
    assert brute == 544
    assert (
        attention_block_size_for_state(
            state_bytes=QWEN3_NEXT_STATE_BYTES, attention_bytes_per_token=per_token
        )
        == brute
    )
    # The CPU backend's kernel alignment of 32 lands on the same size.
    assert (
        attention_block_size_for_state(
            state_bytes=QWEN3_NEXT_STATE_BYTES,
            attention_bytes_per_token=per_token,
            kernel_block_size=32,
        )
        == 544
    )


def test_qwen3_next_80b_a3b_matches_vllm() -> None:
    model_groups = qwen3_next_80b_a3b()
    attention_page = 544 * 2048
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(48):
        if (i + 1) % 4 == 0:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=544, num_kv_heads=2, head_size=256, dtype=BF16
            )
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=shapes,
                dtypes=(BF16, BF16),
                block_size=544,
                page_size_padded=attention_page,
                mamba_cache_mode="align",
            )
    assert ours(model_groups) == vllm_groups(specs)
    assert [(g.kind, g.num_layers) for g in model_groups.groups] == [(GroupKind.MAMBA, 12)] * 3 + [
        (GroupKind.FULL, 12)
    ]
    assert model_groups.block_sizes == (544,) * 4
    assert {g.page_size_bytes for g in model_groups.groups} == {attention_page}


# ---------------------------------------------------------------- DeepSeek-V4-Flash


def test_deepseek_v4_flash_has_five_groups_of_the_noted_block_sizes() -> None:
    model_groups = deepseek_v4_flash()
    assert model_groups.block_sizes == (64, 64, 256, 4, 8)
    assert (model_groups.scheduler_block_size, model_groups.hash_block_size) == (256, 4)
    assert [g.kind for g in model_groups.groups] == [GroupKind.SLIDING_WINDOW] * 2 + [
        GroupKind.FULL
    ] + [GroupKind.SLIDING_WINDOW] * 2
    assert [g.sliding_window for g in model_groups.groups] == [128, 128, None, 8, 128]
    # 43 sliding-window caches split even/odd; 41 compressed layers + 21 CSA indexers;
    # 21 CSA attention + 21 CSA indexer compressor states; 20 HCA compressor states.
    assert [g.num_layers for g in model_groups.groups] == [22, 21, 62, 42, 20]
    mla = model_groups.groups[2]
    assert sorted(set(mla.page_sizes_bytes)) == [2 * 584, 64 * 132, 64 * 584]
    assert mla.block_bytes == 21 * 64 * 584 + 21 * 64 * 132 + 20 * 2 * 584
    assert model_groups.groups[3].block_bytes == 21 * (4 * 2048 * 4) + 21 * (4 * 512 * 4)
    # The MTP layer is sliding-window only and joins the odd layers' group.
    with_mtp = deepseek_v4_flash(mtp=True)
    assert with_mtp.groups[1].layer_names[-1] == "model.layers.43.attn.swa_cache"
    assert [g.num_layers for g in with_mtp.groups] == [22, 22, 62, 42, 20]


def test_deepseek_v4_pro_has_no_sliding_only_layers_and_swaps_the_state_groups() -> None:
    model_groups = deepseek_v4_pro()
    assert model_groups.block_sizes == (64, 64, 256, 8, 4)
    # 61 sliding caches; 61 compressed + 30 indexers; 31 HCA states; 30 + 30 CSA states.
    assert [g.num_layers for g in model_groups.groups] == [31, 30, 91, 31, 60]
    assert "model.layers.0.attn" in model_groups.groups[2].layer_names


# ---------------------------------------------------------------- the grouping rule itself

KINDS = {
    "full": (
        LayerKV(kind=GroupKind.FULL, block_size=16, page_size_bytes=4096),
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=BF16),
    ),
    "sw32": (
        LayerKV(
            kind=GroupKind.SLIDING_WINDOW, block_size=16, page_size_bytes=4096, sliding_window=32
        ),
        SlidingWindowSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=BF16, sliding_window=32
        ),
    ),
    "sw64": (
        LayerKV(
            kind=GroupKind.SLIDING_WINDOW, block_size=16, page_size_bytes=4096, sliding_window=64
        ),
        SlidingWindowSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=BF16, sliding_window=64
        ),
    ),
}


@given(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=40))
@settings(max_examples=100, deadline=None)
def test_grouping_matches_vllm_for_any_layer_pattern(pattern: list[str]) -> None:
    ours_groups = group_layers_like_vllm([(f"l{i}", KINDS[k][0]) for i, k in enumerate(pattern)])
    theirs = _get_kv_cache_groups_uniform_page_size(
        {f"l{i}": KINDS[k][1] for i, k in enumerate(pattern)}
    )
    assert [list(g.layer_names) for g in ours_groups] == [list(g.layer_names) for g in theirs]
    for mine, vllm_group in zip(ours_groups, theirs, strict=True):
        window = getattr(vllm_group.kv_cache_spec, "sliding_window", None)
        assert mine.sliding_window == window


# ---------------------------------------------------------------- load_groups


def test_load_layout_reads_a_layout_file(tmp_path: Path) -> None:
    path = tmp_path / "groups.json"
    path.write_text(json.dumps(gpt_oss_20b().to_dict()))
    assert load_groups(path) == gpt_oss_20b()
    assert load_groups(str(path)).fingerprint == gpt_oss_20b().fingerprint


def test_load_layout_unknown_name_lists_presets() -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_groups("llama-9000")
    message = str(info.value)
    assert "'llama-9000' is neither a preset nor a groups JSON file" in message
    for name in PRESETS:
        assert name in message


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "is not readable JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"groups": [], "model_id": "m"}', "groups=[]: must have at least 1 item"),
        (
            json.dumps(
                {
                    "groups": [
                        {
                            "kind": "full",
                            "block_size": 0,
                            "page_size_bytes": 8,
                            "layer_names": ["a"],
                        }
                    ]
                }
            ),
            "groups[0].block_size=0: must be greater than 0",
        ),
    ],
)
def test_load_layout_bad_files_name_the_file_and_problem(
    tmp_path: Path, content: str, fragment: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_groups(path)
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


# ---------------------------------------------------------------- Mamba2 + attention


def mamba2_spec(num_heads: int, head_dim: int, n_groups: int, block_size: int) -> MambaSpec:
    """A Mamba2 layer's state with vLLM's shapes and dtypes (bf16 model, cache dtypes
    "auto"), unpadded."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=num_heads * head_dim,
        n_groups=n_groups,
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=128,
        conv_kernel=4,
    )
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(BF16, "auto", "auto")
    return MambaSpec(shapes=shapes, dtypes=dtypes, block_size=block_size)


def padded(spec: MambaSpec, page: int) -> MambaSpec:
    """As ``MambaMixer2.get_kv_cache_spec`` declares it with prefix caching: padded to the
    attention page, "align" mode, one prefill checkpoint block."""
    return replace(
        spec,
        page_size_padded=page,
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )


def smallest_block(state_bytes: int, per_token: int) -> int:
    """vLLM's rule by brute force: the first multiple of 16 whose page holds the state."""
    return next(bs for bs in range(16, 100_000, 16) if bs * per_token >= state_bytes)


def mamba2_hybrid_specs(
    *, num_heads: int, head_dim: int, n_groups: int, num_kv_heads: int, block_size: int
) -> tuple[MambaSpec, MambaSpec, FullAttentionSpec]:
    """A Mamba2 + attention model's specs at ``block_size``: the state unpadded, the state
    as its layers declare it (padded), the attention. ``block_size`` must be vLLM's pick."""
    state = mamba2_spec(num_heads, head_dim, n_groups, block_size)
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=128, dtype=BF16
    )
    per_token = attention.page_size_bytes // block_size
    assert smallest_block(state.page_size_bytes, per_token) == block_size
    return state, padded(state, attention.page_size_bytes), attention


def test_granite_4_0_h_tiny_matches_vllm() -> None:
    state, layer_state, attention = mamba2_hybrid_specs(
        num_heads=48, head_dim=64, n_groups=1, num_kv_heads=4, block_size=400
    )
    assert state.page_size_bytes == GRANITE_4_0_H_TINY_STATE_BYTES == 806_400
    specs: dict[str, KVCacheSpec] = {}
    for i in range(40):
        if i in (5, 15, 25, 35):
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{i}.mixer"] = layer_state
    model_groups = granite_4_0_h_tiny()
    assert ours(model_groups) == vllm_groups(specs)
    assert [(g.kind, g.num_layers) for g in model_groups.groups] == [
        *[(GroupKind.MAMBA, 4)] * 9,
        (GroupKind.FULL, 4),
    ]
    assert model_groups.groups[0].page_size_bytes == 819_200
    assert model_groups.scheduler_block_size == 400


def test_nemotron_nano_9b_v2_matches_vllm() -> None:
    state, layer_state, attention = mamba2_hybrid_specs(
        num_heads=128, head_dim=80, n_groups=8, num_kv_heads=8, block_size=672
    )
    assert state.page_size_bytes == NEMOTRON_NANO_9B_V2_STATE_BYTES == 2_695_168
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(NEMOTRON_NANO_9B_V2_PATTERN):
        if kind == "M":
            specs[f"model.layers.{i}.mixer"] = layer_state
        elif kind == "*":
            specs[f"model.layers.{i}.mixer.attn"] = attention
    assert (len(NEMOTRON_NANO_9B_V2_PATTERN), len(specs)) == (56, 31)
    model_groups = nemotron_nano_9b_v2()
    assert ours(model_groups) == vllm_groups(specs)
    assert [(g.kind, g.num_layers) for g in model_groups.groups] == [
        *[(GroupKind.MAMBA, 4)] * 6,
        (GroupKind.MAMBA, 3),
        (GroupKind.FULL, 4),
    ]
    assert model_groups.groups[-1].page_size_bytes == 2_752_512
