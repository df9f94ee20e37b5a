"""Arbitrary JSON values in every key of ``kv_connector_extra_config``: a config or one
ConfigError naming the key, nothing else (hypothesis)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.connector.config import ConnectorConfig
from hybridkv.schema import ConfigError, field_docs
from hybridkv.tiers.registry import TIER_CONFIGS
from tests.faults.report import record

BASE_TIERS: dict[str, dict[str, Any]] = {
    "cpu": {"kind": "cpu", "capacity_bytes": "64MiB"},
    "disk": {"kind": "disk", "path": "/tmp/hybridkv-fuzz", "capacity_bytes": "64MiB"},
    "mooncake": {"kind": "mooncake", "master_address": "127.0.0.1:50051"},
    "valkey": {"kind": "valkey", "port": 6379},
}
TARGETS = [("", f.name) for f in field_docs(ConnectorConfig)] + [
    (kind.kind, f.name) for kind in TIER_CONFIGS for f in field_docs(kind)
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
    | st.sampled_from(["", "..", "../x", "1GiB", "-1", "0", "nan", "\0", "~", "/", "xxh3_128"])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
NUM_EXAMPLES = 300
seen = {"num_valid": 0, "num_errors": 0}


def check(raw: dict[str, Any], field: str) -> None:
    """The whole ``hybridkv config --check`` path: parse, resolve the tiers, print them.

    ``field`` is the key's path; a check across keys names the object and the key
    (``tiers[0]: ssl_ca_certs=... given while ssl is false``).
    """
    try:
        config = ConnectorConfig.from_dict(raw)
        json.dumps([repr(t) for t in config.tier_configs])
    except ConfigError as exc:
        message = str(exc)
        head, *problems = message.splitlines()
        assert head.startswith("kv_connector_extra_config: ") and problems, message
        owner, _, name = field.rpartition(".")
        for line in problems:  # a value may break several rules: each names the key
            assert field in line or (f"{owner}: " in line and name in line), message
        seen["num_errors"] += 1
        return
    seen["num_valid"] += 1


@settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(TARGETS), value=JSON_VALUES)
def test_any_value_in_any_key_is_a_config_or_one_error_naming_it(
    target: tuple[str, str], value: Any
) -> None:
    kind, name = target
    if not kind:
        check({name: value}, name)
    else:
        check({"tiers": [{**BASE_TIERS[kind], name: value}]}, f"tiers[0].{name}")


@settings(max_examples=100, deadline=None)
@given(raw=JSON_VALUES)
def test_any_value_as_the_whole_config_is_a_config_or_one_error(raw: Any) -> None:
    try:
        ConnectorConfig.from_dict(raw)
    except ConfigError as exc:
        assert str(exc).startswith("kv_connector_extra_config:"), exc


@pytest.mark.timeout(120)
def test_fuzz_summary_row() -> None:
    """Runs last in this module: records what the fuzzing above saw."""
    assert seen["num_valid"] + seen["num_errors"] >= NUM_EXAMPLES
    assert seen["num_errors"] > 0 and seen["num_valid"] > 0
    record(
        "config: fuzzed values in every key",
        done=f"{NUM_EXAMPLES}+ hypothesis examples: JSON values (nested, NaN, huge ints, "
        f"'..', NUL) in each of {len(TARGETS)} keys of the connector and tier configs",
        seen="each a valid config or exactly one ConfigError naming the key; no other exception",
        counters=seen,
    )
