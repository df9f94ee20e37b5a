"""The KV cache model: validation messages, derived block sizes, round trips, fingerprint."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.groups import GroupKind, KVGroup, ModelGroups, make_layer_names, merge_stages
from tests.support.errors import assert_names_every_problem


def group(**overrides: Any) -> KVGroup:
    fields: dict[str, Any] = {
        "kind": GroupKind.FULL,
        "block_size": 16,
        "page_size_bytes": 1024,
        "layer_names": ("layers.0",),
    }
    fields.update(overrides)
    return KVGroup(**fields)


def sliding(**overrides: Any) -> KVGroup:
    base: dict[str, Any] = {
        "kind": GroupKind.SLIDING_WINDOW,
        "sliding_window": 128,
        "layer_names": ("layers.1",),
    }
    return group(**{**base, **overrides})


# ---------------------------------------------------------------- KVGroup validation

INVALID_GROUPS = [
    # (overrides, fragments every message must contain: field, value, rule); checked
    # with INVALID_LAYOUTS by test_invalid_input_names_field_value_and_rule.
    ({"block_size": 0}, ["block_size=0", "must be greater than 0"]),
    ({"block_size": -16}, ["block_size=-16", "must be greater than 0"]),
    ({"block_size": "16"}, ["block_size='16'", "must be a valid integer"]),
    ({"block_size": True}, ["block_size=True", "must be a valid integer"]),
    ({"page_size_bytes": 0}, ["page_size_bytes=0", "must be greater than 0"]),
    ({"page_size_bytes": 1.5}, ["page_size_bytes=1.5", "must be a valid integer"]),
    ({"layer_names": ("a", "b", "a")}, ["layer_names=('a', 'b', 'a')", "duplicates ['a']"]),
    ({"kind": "full"}, ["kind='full'", "must be an instance of GroupKind"]),
    (
        {"kind": GroupKind.SLIDING_WINDOW},
        ["sliding_window=None", "must be an int", "required for kind sliding_window"],
    ),
    (
        {"kind": GroupKind.SLIDING_WINDOW, "sliding_window": 0},
        ["sliding_window=0", "must be greater than 0"],
    ),
    ({"sliding_window": 64}, ["sliding_window=64", "only allowed for kind sliding_window"]),
    (
        {"kind": GroupKind.CHUNKED_LOCAL},
        ["attention_chunk_size=None", "must be an int", "required for kind chunked_local"],
    ),
    (
        {"kind": GroupKind.CHUNKED_LOCAL, "attention_chunk_size": 24},
        ["attention_chunk_size=24", "must be a multiple of block_size=16"],
    ),
    (
        {"attention_chunk_size": 64},
        ["attention_chunk_size=64", "only allowed for kind chunked_local"],
    ),
]


def test_a_pipeline_stage_may_hold_no_layer_of_a_group_but_of_some_group() -> None:
    stage = ModelGroups(groups=(group(), sliding(layer_names=())))
    assert stage.groups[1].block_bytes == 0 and stage.groups[0].block_bytes == 1024
    with pytest.raises(ValueError, match="every group has no layers"):
        ModelGroups(groups=(group(layer_names=()), sliding(layer_names=())))


def test_stages_merge_into_the_groups_of_one_stage_holding_every_layer() -> None:
    whole = ModelGroups(
        groups=(group(layer_names=("l.1", "l.3")), sliding(layer_names=("l.0", "l.2")))
    )
    stages = (
        ModelGroups(groups=(group(layer_names=()), sliding(layer_names=("l.0",)))),
        ModelGroups(groups=(group(layer_names=("l.1", "l.3")), sliding(layer_names=("l.2",)))),
    )
    merged = merge_stages(stages)
    assert merged == whole and merged.fingerprint == whole.fingerprint
    assert len({s.fingerprint for s in (*stages, whole)}) == 3  # each stage its own keys


def test_group_collects_every_problem_into_one_error() -> None:
    with pytest.raises(ValueError) as info:
        group(
            kind=GroupKind.CHUNKED_LOCAL,
            block_size=16,
            page_size_bytes=0,
            layer_names=("a", "a"),
            sliding_window=3,
            attention_chunk_size=24,
        )
    problems = str(info.value).removeprefix("invalid KVGroup: ").split("; ")
    assert len(problems) == 4
    assert any("page_size_bytes=0" in p for p in problems)
    assert any("duplicates" in p for p in problems)
    assert any("sliding_window=3" in p for p in problems)
    assert any("attention_chunk_size=24" in p for p in problems)


def test_valid_groups_and_their_derived_sizes() -> None:
    g = group(layer_names=make_layer_names("model.layers", [0, 2, 4]), page_size_bytes=4096)
    assert g.layer_names == ("model.layers.0", "model.layers.2", "model.layers.4")
    assert g.num_layers == 3
    assert g.block_bytes == 3 * 4096
    chunked = group(kind=GroupKind.CHUNKED_LOCAL, attention_chunk_size=8192)
    assert chunked.search_key == (GroupKind.CHUNKED_LOCAL, 16, 1024, None, 8192, ())
    assert sliding(layer_names=["x"]).layer_names == ("x",)  # lists become tuples


def test_per_layer_pages_size_the_block_and_make_their_own_spec() -> None:
    mixed = group(
        layer_names=("a", "b", "c"), page_size_bytes=300, layer_page_sizes_bytes=[300, 100, 20]
    )
    assert mixed.page_sizes_bytes == (300, 100, 20)
    assert mixed.block_bytes == 420
    twin = group(
        layer_names=("d", "e", "f"), page_size_bytes=300, layer_page_sizes_bytes=(300, 100, 20)
    )
    assert (
        mixed.search_key != twin.search_key
    )  # vLLM's per-layer spec collections never compare equal
    assert KVGroup.from_dict(mixed.to_dict()) == mixed
    uniform = group(layer_names=("a", "b"), page_size_bytes=64)
    assert "layer_page_sizes_bytes" not in uniform.to_dict()  # old groups files stay valid
    assert uniform.page_sizes_bytes == (64, 64)


@pytest.mark.parametrize(
    ("pages", "page_size", "message"),
    [
        ((64, 32), 64, "2 pages for 3 layers"),
        ((64, 32, 16), 32, "must be the largest"),
        ((64, 0, 16), 64, r"layer_page_sizes_bytes\[1\]=0: must be greater than 0"),
    ],
)
def test_bad_per_layer_pages_are_named(
    pages: tuple[int, ...], page_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        group(layer_names=("a", "b", "c"), page_size_bytes=page_size, layer_page_sizes_bytes=pages)


def test_string_layer_names_are_rejected() -> None:
    with pytest.raises((ValueError, TypeError)):
        KVGroup.from_dict(
            {"kind": "full", "block_size": 16, "page_size_bytes": 64, "layer_names": "abc"}
        )


# ---------------------------------------------------------------- ModelGroups validation


def test_layout_defaults_are_lcm_and_gcd_of_block_sizes() -> None:
    model_groups = ModelGroups(
        groups=(
            group(block_size=256, layer_names=("a",)),
            sliding(block_size=64, layer_names=("b",)),
            sliding(block_size=64, layer_names=("c",)),
            sliding(block_size=4, layer_names=("d",), sliding_window=8),
            sliding(block_size=8, layer_names=("e",)),
        )
    )
    assert model_groups.scheduler_block_size == 256
    assert model_groups.hash_block_size == 4
    assert model_groups.block_sizes == (256, 64, 64, 4, 8)
    assert model_groups.num_groups == 5
    mixed = ModelGroups(groups=(group(block_size=6), sliding(block_size=4)))
    assert (mixed.scheduler_block_size, mixed.hash_block_size) == (12, 2)


def brute_lcm(values: list[int]) -> int:
    n = max(values)
    while any(n % v for v in values):
        n += max(values)
    return n


def brute_gcd(values: list[int]) -> int:
    return max(d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values))


@given(st.lists(st.integers(min_value=1, max_value=24), min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_default_block_sizes_match_brute_force(block_sizes: list[int]) -> None:
    groups = tuple(
        group(block_size=bs, layer_names=(f"layers.{i}",)) for i, bs in enumerate(block_sizes)
    )
    model_groups = ModelGroups(groups=groups)
    assert model_groups.scheduler_block_size == brute_lcm(block_sizes)
    assert model_groups.hash_block_size == brute_gcd(block_sizes)


INVALID_LAYOUTS = [
    (
        {"groups": (group(block_size=16), sliding(block_size=6)), "hash_block_size": 4},
        ["group 1 block_size=6", "not divisible by hash_block_size=4", "e.g. their GCD 2"],
    ),
    (
        {"groups": (group(block_size=16), sliding(block_size=6)), "scheduler_block_size": 32},
        ["scheduler_block_size=32", "not a multiple of group 1 block_size=6", "LCM 48"],
    ),
    (
        {"groups": (group(layer_names=("x",)), sliding(layer_names=("x",)))},
        ["layer 'x' is in group 0 and group 1"],
    ),
    ({"groups": ()}, ["groups=()", "must have at least 1 item"]),
    (
        {"groups": (group(),), "hash_block_size": -1},
        ["hash_block_size=-1", "must be greater than or equal to 0"],
    ),
    (
        {"groups": (group(),), "scheduler_block_size": True},
        ["scheduler_block_size=True", "must be a valid integer"],
    ),
]


INVALID_INPUTS = [
    *(pytest.param(group, "KVGroup", o, f, id=f"KVGroup-{f[0]}") for o, f in INVALID_GROUPS),
    *(
        pytest.param(ModelGroups, "ModelGroups", o, f, id=f"ModelGroups-{f[0]}")
        for o, f in INVALID_LAYOUTS
    ),
]


@pytest.mark.parametrize(("make", "name", "fields", "fragments"), INVALID_INPUTS)
def test_invalid_input_names_field_value_and_rule(
    make: Callable[..., object], name: str, fields: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        make(**fields)
    assert_names_every_problem(info, f"invalid {name}: ", fragments)


def test_layout_collects_every_problem_into_one_error() -> None:
    groups = (group(block_size=16, layer_names=("a",)), sliding(block_size=6, layer_names=("a",)))
    with pytest.raises(ValueError) as info:
        ModelGroups(groups=groups, hash_block_size=4, scheduler_block_size=32)
    problems = str(info.value).removeprefix("invalid ModelGroups: ").split("; ")
    assert len(problems) == 3


def test_group_of_layer() -> None:
    model_groups = ModelGroups(groups=(group(layer_names=("a", "b")), sliding(layer_names=("c",))))
    assert [model_groups.group_of_layer(n) for n in ("a", "b", "c")] == [0, 0, 1]
    with pytest.raises(KeyError, match="'z' is in no group"):
        model_groups.group_of_layer("z")


# ---------------------------------------------------------------- dict round trip

group_strategy = st.builds(
    lambda kind, m, page, window, chunk_m: {
        "kind": kind,
        "block_size": 4 * m,
        "page_size_bytes": page,
        "sliding_window": window if kind is GroupKind.SLIDING_WINDOW else None,
        "attention_chunk_size": 4 * m * chunk_m if kind is GroupKind.CHUNKED_LOCAL else None,
    },
    st.sampled_from(list(GroupKind)),
    st.integers(1, 16),
    st.integers(1, 1 << 20),
    st.integers(1, 4096),
    st.integers(1, 8),
)


@st.composite
def layouts(draw: st.DrawFn) -> ModelGroups:
    raw_groups = draw(st.lists(group_strategy, min_size=1, max_size=4))
    groups = []
    for i, raw in enumerate(raw_groups):
        num_layers = draw(st.integers(1, 3))
        names = tuple(f"model.layers.{i}.{j}" for j in range(num_layers))
        groups.append(KVGroup(layer_names=names, **raw))
    model_id = draw(st.text(min_size=1, max_size=20))
    return ModelGroups(groups=tuple(groups), model_id=model_id)


@given(layouts())
@settings(max_examples=100, deadline=None)
def test_to_dict_from_dict_round_trip(model_groups: ModelGroups) -> None:
    data = json.loads(json.dumps(model_groups.to_dict()))
    again = ModelGroups.from_dict(data)
    assert again == model_groups
    assert again.fingerprint == model_groups.fingerprint
    assert again.to_dict() == model_groups.to_dict()


def valid_layout_dict() -> dict[str, Any]:
    return {
        "model_id": "m",
        "groups": [
            {"kind": "full", "block_size": 16, "page_size_bytes": 64, "layer_names": ["a"]},
            {
                "kind": "sliding_window",
                "block_size": 16,
                "page_size_bytes": 64,
                "layer_names": ["b"],
                "sliding_window": 32,
            },
        ],
    }


def test_from_dict_defaults_derived_sizes() -> None:
    model_groups = ModelGroups.from_dict(valid_layout_dict())
    assert (model_groups.scheduler_block_size, model_groups.hash_block_size) == (16, 16)
    assert model_groups.groups[1].sliding_window == 32


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [
        (
            lambda d: d.update(colour=1),
            ["model groups: 1 problem", "colour: unknown key; allowed keys: groups,"],
        ),
        (lambda d: d.update(groups=[]), ["groups=[]: must have at least 1 item"]),
        (lambda d: d.pop("groups"), ["groups: required key is missing"]),
        (lambda d: d["groups"].append(3), ["groups[2]=3: must be a dictionary or an instance"]),
        (
            lambda d: d["groups"][0].update(window=3),
            ["groups[0].window: unknown key; allowed keys: kind, block_size", "sliding_window"],
        ),
        (
            lambda d: d["groups"][1].pop("page_size_bytes"),
            ["groups[1].page_size_bytes: required key is missing"],
        ),
        (
            lambda d: d["groups"][0].update(kind="linear"),
            ["groups[0].kind='linear': must be 'full', 'sliding_window'", "'mamba'"],
        ),
        (
            lambda d: d["groups"][1].update(sliding_window=None),
            ["groups[1]: invalid KVGroup: sliding_window=None", "required for kind sliding_window"],
        ),
    ],
)
def test_from_dict_errors_name_the_key(mutate: Any, fragments: list[str]) -> None:
    data = valid_layout_dict()
    mutate(data)
    with pytest.raises(ValueError) as info:
        ModelGroups.from_dict(data)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_from_dict_collects_problems_of_every_group() -> None:
    data = valid_layout_dict()
    data["groups"][0]["kind"] = "linear"
    data["groups"][1]["block_size"] = 0
    with pytest.raises(ValueError) as info:
        ModelGroups.from_dict(data)
    assert "groups[0]" in str(info.value) and "groups[1]" in str(info.value)


def test_from_dict_rejects_a_non_object_with_value_error() -> None:
    with pytest.raises(ValueError):
        ModelGroups.from_dict(["groups"])  # type: ignore[arg-type]


# ---------------------------------------------------------------- fingerprint


def base_groups() -> ModelGroups:
    return ModelGroups(
        groups=(
            group(block_size=16, layer_names=("a", "b")),
            sliding(block_size=32, layer_names=("c",)),
        ),
        model_id="m",
    )


def test_fingerprint_is_16_hex_and_equal_for_equal_specs() -> None:
    fp = base_groups().fingerprint
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert base_groups().fingerprint == fp


FINGERPRINT_SCRIPT = """
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
g = (
    KVGroup(kind=GroupKind.FULL, block_size=16, page_size_bytes=1024, layer_names=("a", "b")),
    KVGroup(kind=GroupKind.SLIDING_WINDOW, block_size=32, page_size_bytes=1024,
            layer_names=("c",), sliding_window=128),
)
print(ModelGroups(groups=g, model_id="m").fingerprint)
"""


def test_fingerprint_is_stable_across_processes() -> None:
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", FINGERPRINT_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(result.stdout.strip())
    assert outputs == {base_groups().fingerprint}


def replace_group(model_groups: ModelGroups, index: int, **changes: Any) -> ModelGroups:
    groups = list(model_groups.groups)
    groups[index] = dataclasses.replace(groups[index], **changes)
    return dataclasses.replace(model_groups, groups=tuple(groups))


BYTE_SHAPING_CHANGES = {
    "kind": lambda x: replace_group(x, 1, kind=GroupKind.FULL, sliding_window=None),
    "block_size": lambda x: replace_group(x, 0, block_size=32),
    "layer_names": lambda x: replace_group(x, 0, layer_names=("a", "z")),
    "layer_order": lambda x: replace_group(x, 0, layer_names=("b", "a")),
    "sliding_window": lambda x: replace_group(x, 1, sliding_window=256),
    "attention_chunk_size": lambda x: replace_group(
        x, 1, kind=GroupKind.CHUNKED_LOCAL, sliding_window=None, attention_chunk_size=128
    ),
    "group_order": lambda x: dataclasses.replace(x, groups=x.groups[::-1]),
    "scheduler_block_size": lambda x: dataclasses.replace(x, scheduler_block_size=64),
    "hash_block_size": lambda x: dataclasses.replace(x, hash_block_size=8),
}


@pytest.mark.parametrize("field", sorted(BYTE_SHAPING_CHANGES))
def test_fingerprint_changes_with_every_field_that_shapes_bytes(field: str) -> None:
    model_groups = base_groups()
    changed = BYTE_SHAPING_CHANGES[field](model_groups)
    assert changed != model_groups
    assert changed.fingerprint != model_groups.fingerprint


def test_fingerprints_of_all_variants_are_distinct() -> None:
    variants = [f(base_groups()) for f in BYTE_SHAPING_CHANGES.values()] + [base_groups()]
    assert len({v.fingerprint for v in variants}) == len(variants)


def test_fingerprint_ignores_pages() -> None:
    """vLLM's scheduler sees a per-layer-page group as its first layer's spec, its
    workers see every page: both must name the same blocks."""
    model_groups = base_groups()
    first = model_groups.groups[0]
    worker_view = replace_group(
        model_groups,
        0,
        page_size_bytes=4 * first.page_size_bytes,
        layer_page_sizes_bytes=(first.page_size_bytes, 4 * first.page_size_bytes),
    )
    assert worker_view.groups[0].block_bytes != first.block_bytes
    assert worker_view.fingerprint == model_groups.fingerprint
    assert (
        replace_group(model_groups, 0, page_size_bytes=2048).fingerprint == model_groups.fingerprint
    )


def test_fingerprint_ignores_model_id() -> None:
    # The model id enters keys through the namespace, not the groups fingerprint.
    model_groups = base_groups()
    assert (
        dataclasses.replace(model_groups, model_id="other").fingerprint == model_groups.fingerprint
    )
