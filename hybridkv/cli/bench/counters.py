"""Prometheus counters of an engine (vLLM's and hybridkv's) as flat ``name{labels}`` keys.

Any process; ``prometheus_client`` is imported by the callers. Keys drop the
``_total`` suffix and vLLM's ``engine`` and ``model_name`` labels, e.g.
``vllm:prompt_tokens_cached_by_source{source=host}`` or
``hybridkv_loaded_bytes{group=1,kind=full}``; values of equal keys are summed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

PREFIXES = ("vllm:", "hybridkv_")
_DROPPED_LABELS = ("engine", "model_name")


def flatten(families: Iterable[Any]) -> dict[str, float]:
    """Counter and histogram ``_sum``/``_count`` samples of metric families."""
    totals: dict[str, float] = {}
    for family in families:
        if not family.name.startswith(PREFIXES):
            continue
        for sample in family.samples:
            name = sample.name
            if name.endswith(("_created", "_bucket")):
                continue
            if family.type == "gauge":
                continue
            labels = sorted((k, v) for k, v in sample.labels.items() if k not in _DROPPED_LABELS)
            suffix = ",".join(f"{k}={v}" for k, v in labels)
            key = name.removesuffix("_total") + (f"{{{suffix}}}" if suffix else "")
            totals[key] = totals.get(key, 0.0) + float(sample.value)
    return totals


def from_registry() -> dict[str, float]:
    """This process's registry: where an in-process engine's stat logger records."""
    from prometheus_client import REGISTRY

    return flatten(REGISTRY.collect())


def from_text(text: str) -> dict[str, float]:
    """A ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families

    return flatten(text_string_to_metric_families(text))


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def total(counters: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name`` over the keys whose labels include ``labels``."""
    found = 0.0
    for key, value in counters.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r"(\w+)=([^,}]*)", rest))
        if all(have.get(k) == v for k, v in labels.items()):
            found += value
    return found


def by_label(counters: Mapping[str, float], name: str, label: str) -> dict[str, float]:
    """``name``'s values summed per value of ``label``."""
    out: dict[str, float] = {}
    for key, value in counters.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r"(\w+)=([^,}]*)", rest))
        if label in have:
            out[have[label]] = out.get(have[label], 0.0) + value
    return out
