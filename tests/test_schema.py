"""The one configuration mechanism: parsing, error messages and documentation from declarations."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import Field
from pydantic.dataclasses import dataclass

from hybridkv.connector.config import ConnectorConfig
from hybridkv.schema import (
    CONFIG,
    SECRET,
    ByteSize,
    ConfigError,
    Distinct,
    Number,
    PositiveInt,
    Seconds,
    check_fields,
    field_docs,
    parse,
    parse_byte_size,
)
from hybridkv.tiers.registry import TierConfig


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class Inner:
    kind: Literal["inner"] = "inner"
    size: Annotated[ByteSize, Field(ge=1, description="how big")]
    token: Annotated[str | None, Field(json_schema_extra=SECRET, description="a secret")] = None


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class Outer:
    items: Annotated[tuple[Inner, ...], Field(description="the items")] = ()
    ratio: Annotated[Number, Field(gt=0, description="a ratio")] = 1.0

    def __post_init__(self) -> None:
        if len(self.items) > 2:
            raise ValueError(f"at most 2 items, got {len(self.items)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Built:
    """An object code builds: held to its declared field types when made."""

    size: PositiveInt
    names: Annotated[tuple[str, ...], Distinct] = ()
    timeout_s: Seconds | None = None
    limit: PositiveInt = 8

    def __post_init__(self) -> None:
        problems = check_fields(self)
        if problems.valid("size", "limit") and self.size > self.limit:
            problems.add([f"size={self.size} must be at most limit={self.limit}"])
        problems.raise_if_any()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("512KiB", 512 << 10),
        ("4 GiB", 4 << 30),
        ("1.5GB", 1_500_000_000),
        ("64mib", 64 << 20),
        ("10k", 10_000),
        ("7B", 7),
        ("lots", None),
        (True, None),
        (1.5, None),
        ("-3MiB", None),
    ],
)
def test_parse_byte_size(text: object, expected: int | None) -> None:
    assert parse_byte_size(text) == expected


@given(st.integers(0, 1 << 40), st.sampled_from(["", "B", "KiB", "MiB", "GiB", "KB", "MB"]))
def test_parse_byte_size_matches_unit_arithmetic(number: int, unit: str) -> None:
    scale = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000, "MB": 10**6}
    assert parse_byte_size(f"{number}{unit}") == number * scale[unit]


def test_parse_builds_typed_objects_and_converts_sizes() -> None:
    outer = parse(Outer, {"items": [{"size": "2KiB"}], "ratio": 2}, where="x")
    assert outer == Outer(items=(Inner(size=2048),), ratio=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outer.ratio = 3.0  # type: ignore[misc]


def test_every_problem_is_listed_with_where_value_and_rule() -> None:
    raw = {"items": [{"size": "big", "tokn": 1}, {"size": 0}], "ratio": True, "extra": 1}
    with pytest.raises(ConfigError) as info:
        parse(Outer, raw, where="my config")
    lines = str(info.value).splitlines()
    assert lines[0] == "my config: 5 problems:"
    assert set(lines[1:]) == {
        "  - items[0].size='big': must be a byte count: an int, or a string such as "
        '"512MiB" or "4GB"',
        "  - items[0].tokn: unknown key; allowed keys: kind, size, token",
        "  - items[1].size=0: must be greater than or equal to 1",
        "  - ratio=True: must be a number",
        "  - extra: unknown key; allowed keys: items, ratio",
    }


def test_checks_of_a_whole_object_run_once_its_fields_are_valid() -> None:
    with pytest.raises(ConfigError, match="at most 2 items, got 3"):
        parse(Outer, {"items": [{"size": 1}] * 3}, where="x")


def test_secrets_are_never_printed() -> None:
    with pytest.raises(ConfigError) as info:
        parse(Outer, {"items": [{"size": 1, "token": 123456}]}, where="x")
    assert "token=<hidden>" in str(info.value) and "123456" not in str(info.value)


def test_tier_kinds_are_told_apart_by_their_kind_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse(tuple[TierConfig, ...], [{"kind": "disk", "path": "/x"}, {}], where="tiers")
    message = str(info.value)
    assert "[0].capacity_bytes: required key is missing" in message
    assert "[1]: needs a 'kind' key (one of 'cpu', 'disk', 'mooncake', 'valkey')" in message


def test_docs_come_from_the_declarations() -> None:
    docs = {d.name: d for d in field_docs(Inner)}
    assert list(docs) == ["size", "token"]  # the kind tag is not a setting
    assert docs["size"].type_text == "bytes" and docs["size"].default_text == "required"
    assert docs["size"].description == "how big"
    connector = {d.name: d for d in field_docs(ConnectorConfig)}
    assert connector["selection"].type_text == "'per_block' or 'whole_request'"
    assert connector["selection"].default_text == "'per_block'"
    assert connector["load_timeout_s"].type_text == "number"
    assert connector["load_timeout_s"].default_text == "30.0"
    assert all(d.description for d in connector.values())


def test_objects_built_in_code_are_checked_by_their_declared_types() -> None:
    assert Built(size=3, names=("a", "b"), timeout_s=1).timeout_s == 1
    with pytest.raises(ConfigError) as info:
        Built(size=True, names=("a", "a"), timeout_s=math.inf)  # type: ignore[arg-type]
    assert str(info.value) == (
        "invalid Built: size=True: must be a valid integer; names=('a', 'a'): has duplicates "
        "['a']: give each once; timeout_s=inf: must be a finite number"
    )
    with pytest.raises(ConfigError, match=r"names=\['a'\]: must be a valid tuple"):
        Built(size=1, names=["a"])  # type: ignore[arg-type]  # strict: code passes tuples


def test_rules_across_fields_join_the_field_problems_once_their_fields_hold() -> None:
    with pytest.raises(ConfigError) as info:
        Built(size=9, timeout_s=0)
    assert str(info.value) == (
        "invalid Built: timeout_s=0: must be greater than 0; size=9 must be at most limit=8"
    )
    with pytest.raises(ConfigError) as info:
        Built(size=9, limit=0)
    assert str(info.value) == "invalid Built: limit=0: must be greater than 0"
