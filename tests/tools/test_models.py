"""Tiny model builder: checkpoints, tokenizer, caching and the documented layout.

What vLLM makes of these models (groups, hits, which groups matter) is
checked on real vLLM in ``tests/e2e/test_vllm_models.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridkv.tools.models.build as models
from hybridkv.groups import GroupKind
from hybridkv.tools.models import (
    TinyModel,
    TinyModelKind,
    build_tiny_model,
    default_prompt_token_ids,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module")
def built(model_dir: Path) -> dict[TinyModelKind, TinyModel]:
    return {kind: build_tiny_model(kind, model_dir) for kind in TinyModelKind}


def _layer_types(model: TinyModel) -> list[str]:
    config = json.loads((model.path / "config.json").read_text())
    return list(config["layer_types"])


@pytest.mark.parametrize("kind", list(TinyModelKind), ids=lambda k: k.value)
def test_checkpoint_and_tokenizer_are_written(
    kind: TinyModelKind, built: dict[TinyModelKind, TinyModel]
) -> None:
    model = built[kind]
    names = {p.name for p in model.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((model.path / "config.json").read_text())
    assert config["vocab_size"] == model.vocab_size == 512
    assert config["dtype"] == model.dtype
    assert (model.path / "model.safetensors").stat().st_size < 4 << 20


def test_tokenizer_round_trips_text(built: dict[TinyModelKind, TinyModel]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[TinyModelKind.GEMMA3].path)
    text = "Offloading moves blocks to CPU memory, 42 times."
    ids = tokenizer(text)["input_ids"]
    assert ids and max(ids) < 512
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("kind", list(TinyModelKind), ids=lambda k: k.value)
def test_groups_partition_the_layers_by_attention_kind(
    kind: TinyModelKind, built: dict[TinyModelKind, TinyModel]
) -> None:
    model = built[kind]
    layer_types = _layer_types(model)
    expected_kind = {
        "sliding_attention": GroupKind.SLIDING_WINDOW,
        "full_attention": GroupKind.FULL,
        "linear_attention": GroupKind.MAMBA,
    }
    seen: list[int] = []
    for group in model.groups:
        for name in group.layer_names:
            layer_id = int(name.split(".")[2])
            seen.append(layer_id)
            assert expected_kind[layer_types[layer_id]] is group.kind, name
    assert sorted(seen) == list(range(len(layer_types)))
    assert model.block_size == 32  # asked of the engine; it may choose larger


def test_multi_variants_have_several_groups_with_one_spec(
    built: dict[TinyModelKind, TinyModel],
) -> None:
    def spec_counts(kind: TinyModelKind) -> list[int]:
        keys = [(g.kind, len(g.layer_names), g.sliding_window) for g in built[kind].groups]
        return sorted(keys.count(k) for k in set(keys))

    assert spec_counts(TinyModelKind.GEMMA3) == [1, 1]
    assert spec_counts(TinyModelKind.GEMMA3_MULTI) == [1, 2]
    assert spec_counts(TinyModelKind.QWEN3_NEXT) == [1, 1]
    assert spec_counts(TinyModelKind.QWEN3_NEXT_MULTI) == [1, 3]


def test_qwen_branches_are_scaled_and_the_state_decays_slowly(
    built: dict[TinyModelKind, TinyModel],
) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(built[TinyModelKind.QWEN3_NEXT].path / "model.safetensors"))
    decay = weights["model.layers.0.linear_attn.A_log"].float().exp()
    low, high = models._LINEAR_DECAY_RANGE
    assert float(decay.min()) >= low * 0.99 and float(decay.max()) <= high * 1.01

    # Default init is N(0, 0.02); the scaled projections spread 8x and 4x wider.
    def std(name: str) -> float:
        return float(weights[f"model.layers.{name}.weight"].float().std())

    plain = std("1.self_attn.v_proj")
    assert 6 * plain < std("0.linear_attn.in_proj_qkvz") < 10 * plain
    assert 3 * plain < std("1.self_attn.o_proj") < 5 * plain
    assert std("0.linear_attn.out_proj") < 0.5 * plain
    # Zero-centred norms: a weight of 3 multiplies queries and keys by 4.
    assert weights["model.layers.1.self_attn.q_norm.weight"].float().eq(3.0).all()


def test_second_build_reuses_the_cached_model(model_dir: Path) -> None:
    first = build_tiny_model(TinyModelKind.GEMMA3, model_dir)
    weights = first.path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = build_tiny_model(TinyModelKind.GEMMA3, model_dir)
    assert again == first
    assert weights.stat().st_mtime_ns == mtime


def test_seeds_give_different_weights_and_same_seed_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = build_tiny_model(TinyModelKind.GEMMA3, tmp_path / "a", seed=1)
    b = build_tiny_model(TinyModelKind.GEMMA3, tmp_path / "b", seed=1)
    c = build_tiny_model(TinyModelKind.GEMMA3, tmp_path / "a", seed=2)
    assert c.path != a.path
    wa, wb, wc = (load_file(str(m.path / "model.safetensors")) for m in (a, b, c))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert wa[name].equal(wb[name])
    assert not wa[name].equal(wc[name])


def test_stale_marker_triggers_a_rebuild(tmp_path: Path) -> None:
    model = build_tiny_model(TinyModelKind.GEMMA3, tmp_path)
    marker = model.path / models.MARKER
    marker.write_text(json.dumps({"digest": "stale"}))
    build_tiny_model(TinyModelKind.GEMMA3, tmp_path)
    assert json.loads(marker.read_text())["digest"] != "stale"


def test_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(out: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(models, "_write_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        build_tiny_model(TinyModelKind.GEMMA3, tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kind": "gemma3"}, "kind='gemma3' is not a TinyModelKind"),
        ({"kind": TinyModelKind.GEMMA3, "seed": -1}, "seed=-1 must be an int >= 0"),
        ({"kind": TinyModelKind.GEMMA3, "seed": True}, "seed=True"),
    ],
)
def test_bad_arguments_name_field_and_rule(
    tmp_path: Path, kwargs: dict[str, object], fragment: str
) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        build_tiny_model(kind, tmp_path, **kwargs)  # type: ignore[arg-type]


def test_engine_kwargs_ask_for_the_documented_block_size(
    built: dict[TinyModelKind, TinyModel],
) -> None:
    for model in built.values():
        kwargs = model.engine_kwargs(kv_cache_memory_bytes=1 << 20)
        assert kwargs["block_size"] == model.block_size
        assert kwargs["kv_cache_memory_bytes"] == 1 << 20
        assert kwargs["enable_prefix_caching"] is True
        assert kwargs["model"] == str(model.path)


@settings(max_examples=50, deadline=None)
@given(
    num_tokens=st.integers(0, 600),
    vocab_size=st.integers(4, 1000),
    seed=st.integers(0, 2**32),
)
def test_prompt_ids_are_deterministic_and_in_range(
    num_tokens: int, vocab_size: int, seed: int
) -> None:
    ids = default_prompt_token_ids(num_tokens, vocab_size=vocab_size, seed=seed)
    assert len(ids) == num_tokens
    assert all(3 <= i < vocab_size for i in ids)
    assert ids == default_prompt_token_ids(num_tokens, vocab_size=vocab_size, seed=seed)
    # A longer prompt of the same seed extends the shorter one (shared prefixes).
    longer = default_prompt_token_ids(num_tokens + 5, vocab_size=vocab_size, seed=seed)
    assert longer[:num_tokens] == ids


def test_prompt_ids_differ_across_seeds_and_reject_negative_length() -> None:
    assert default_prompt_token_ids(64, seed=1) != default_prompt_token_ids(64, seed=2)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        default_prompt_token_ids(-1)
