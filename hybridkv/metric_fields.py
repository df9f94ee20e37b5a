"""Metrics declared where they are counted: a stats field says what it is exported as.

Any process; imports nothing of hybridkv. A stats dataclass (``TierStats``,
the connector's ``SchedulerStats``, ...) declares each field it exports with
``counter``, ``counters``, ``gauge`` or ``histogram``: the metric's name (the
field's own unless given), help text and labels. ``declared`` lists them in
field order; the connector builds its catalog, its samples and the table of
docs/METRICS.md from that (``hybridkv.connector.metrics``), so each metric is written
down once, next to the number it reports.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

PREFIX = "hybridkv_"
_METRIC = "metric"
T = TypeVar("T")


class MetricType(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exported_name(self) -> str:
        suffix = "_total" if self.type is MetricType.COUNTER else ""
        return f"{PREFIX}{self.name}{suffix}"


def counter(help: str, *, name: str = "", labels: tuple[str, ...] = ()) -> int:
    """A monotonic count, exported as a counter."""
    return dataclasses.field(default=0, metadata=_declare(name, MetricType.COUNTER, help, labels))


def counters(factory: Callable[[], T], help: str, *, labels: tuple[str, ...], name: str = "") -> T:
    """A dict of monotonic counts made by ``factory``: one counter per key, whose
    value (an enum's, else the key as text) is the last label's."""
    metadata = _declare(name, MetricType.COUNTER, help, labels)
    return dataclasses.field(default_factory=factory, metadata=metadata)


def gauge(help: str, *, name: str = "", labels: tuple[str, ...] = ()) -> int:
    """A value that goes up and down, exported as what it is when sampled."""
    return dataclasses.field(default=0, metadata=_declare(name, MetricType.GAUGE, help, labels))


def histogram(factory: Callable[[], T], help: str, *, name: str = "") -> T:
    """Observations the exporter takes (never sampled as a value)."""
    metadata = _declare(name, MetricType.HISTOGRAM, help, ())
    return dataclasses.field(default_factory=factory, metadata=metadata)


def _declare(name: str, kind: MetricType, help: str, labels: tuple[str, ...]) -> dict[str, Metric]:
    return {_METRIC: Metric(name, kind, help, labels)}


class Declared(NamedTuple):
    """One exported field of a stats dataclass."""

    field: str
    metric: Metric


def declared(stats_type: type) -> tuple[Declared, ...]:
    """The exported fields of a stats dataclass, in declaration order."""
    found = []
    for f in dataclasses.fields(stats_type):
        metric = f.metadata.get(_METRIC)
        if isinstance(metric, Metric):
            named = metric if metric.name else dataclasses.replace(metric, name=f.name)
            found.append(Declared(f.name, named))
    return tuple(found)


def label_value(key: object) -> str:
    """A dict key of ``counters`` as the value of its label."""
    return str(key.value) if isinstance(key, enum.Enum) else str(key)
