"""A stats dataclass declares its metrics on its fields; ``declared`` reads them back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridkv.metric_fields import (
    Metric,
    MetricType,
    counter,
    counters,
    declared,
    gauge,
    histogram,
    label_value,
)


class Color(enum.Enum):
    RED = "red"


@dataclass(kw_only=True)
class Example:
    plain: int = counter("Plain things")
    renamed: int = counter("Renamed things", name="other_name", labels=("tier",))
    by_color: dict[Color, int] = counters(
        lambda: dict.fromkeys(Color, 0), "Things by color", labels=("color",)
    )
    level: int = gauge("A level")
    seconds: list[float] = histogram(list, "Durations", name="duration_seconds")
    internal: int = 0
    items: list[int] = field(default_factory=list)


def test_fields_declare_their_metric_and_keep_their_defaults() -> None:
    assert [(d.field, d.metric) for d in declared(Example)] == [
        ("plain", Metric("plain", MetricType.COUNTER, "Plain things")),
        ("renamed", Metric("other_name", MetricType.COUNTER, "Renamed things", ("tier",))),
        ("by_color", Metric("by_color", MetricType.COUNTER, "Things by color", ("color",))),
        ("level", Metric("level", MetricType.GAUGE, "A level")),
        ("seconds", Metric("duration_seconds", MetricType.HISTOGRAM, "Durations")),
    ]
    a, b = Example(), Example(plain=2)
    a.by_color[Color.RED] += 1
    a.seconds.append(0.5)
    assert (a.plain, b.plain, b.by_color, b.seconds, b.level) == (0, 2, {Color.RED: 0}, [], 0)
    assert [label_value(k) for k in (Color.RED, 3, "x")] == ["red", "3", "x"]


def test_exported_names_follow_prometheus() -> None:
    assert Metric("a", MetricType.COUNTER, "").exported_name == "hybridkv_a_total"
    assert Metric("b", MetricType.GAUGE, "").exported_name == "hybridkv_b"
    assert Metric("c", MetricType.HISTOGRAM, "").exported_name == "hybridkv_c"
