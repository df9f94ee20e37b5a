"""Zero cross hits between identities on shared tiers: a shared disk directory and a real
Valkey server, through the real scheduler, worker and tiers (``SimEngine``).

One engine stores a prompt under the base identity; a fresh engine of every
other identity (model id, revision, KV dtype, in-page layout, page size,
tensor-parallel rank, cache salt) asks for the same prompt and must get no
hit, while a fresh engine of the base identity hits (so the store happened).
Namespaces come from the vLLM adapter's own ``model_namespace``, fed the
config fields it reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybridkv.connector.config import ConnectorConfig
from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.integrations.vllm.facts import default_model_id, model_namespace
from hybridkv.tiers.base import Tier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.sim.build import close_engine, make_engine
from hybridkv.tools.sim.drive import run_to_end
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.faults.report import record
from tests.support.connector import block_keys
from tests.support.servers import ValkeyServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
KINDS = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)
TOKENS = prompt(48, seed=13)
BASE = {"model": "org/tiny", "revision": None, "dtype": "bfloat16", "cache_dtype": "auto",
        "kv_cache_layout": "NHD", "block_size": 4}  # fmt: skip
OTHERS: dict[str, dict[str, Any]] = {
    "model id": {"model": "org/tiny-2"},
    "revision": {"revision": "v2"},
    "KV dtype": {"cache_dtype": "fp8_e4m3"},
    "model dtype": {"dtype": "float16"},
    "in-page layout": {"kv_cache_layout": "HND"},
    "page size (block size)": {"block_size": 8},
}


def namespace(identity: dict[str, Any]) -> str:
    """What the vLLM adapter names this engine's keys by."""
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            model=identity["model"], revision=identity["revision"], dtype=identity["dtype"]
        ),
        cache_config=SimpleNamespace(cache_dtype=identity["cache_dtype"]),
    )
    kv_cache_config = SimpleNamespace(kv_cache_layout=identity["kv_cache_layout"])
    return model_namespace(default_model_id(vllm_config), vllm_config, kv_cache_config)


def layout_of(identity: dict[str, Any]) -> ModelGroups:
    return make_groups(KINDS, block_size=identity["block_size"], model_id=namespace(identity))


@pytest.fixture(scope="module")
def valkey() -> Iterator[LocalPool]:
    with ValkeyServer() as running:
        yield running


@pytest.fixture
def config(tmp_path: Path, valkey: LocalPool) -> ConnectorConfig:
    """Only shared tiers: a disk directory every engine opens, and the Valkey server."""
    valkey_port = valkey.valkey_port
    return ConnectorConfig.from_dict(
        {
            "tiers": [
                {"kind": "disk", "path": str(tmp_path / "shared"), "capacity_bytes": "64MiB"},
                {"kind": "valkey", "port": valkey_port, "op_timeout_s": 2.0},
            ]
        }
    )


def hit_tokens(
    model_groups: ModelGroups, config: ConnectorConfig, *, cache_salt: str | None
) -> int:
    engine = make_engine(model_groups, config)
    try:
        return engine.add("ask", TOKENS, cache_salt=cache_salt)
    finally:
        close_engine(engine)


def shared_tiers(config: ConnectorConfig) -> list[Tier]:
    disk, valkey = config.tier_configs
    assert isinstance(disk, DiskConfig) and isinstance(valkey, ValkeyConfig)
    return [DiskTier(disk.lookup_only()), ValkeyTier(valkey)]


def test_no_identity_hits_another_on_shared_tiers(config: ConnectorConfig) -> None:
    base = layout_of(BASE)
    first = make_engine(base, config)
    assert first.add("cold", TOKENS) == 0
    run_to_end(first, "cold", 8)
    first.settle()
    first.finish("cold")
    close_engine(first)  # flushes the write-back to the shared tiers

    hits = {"same identity": hit_tokens(base, config, cache_salt=None)}
    for name, change in OTHERS.items():
        hits[name] = hit_tokens(layout_of(BASE | change), config, cache_salt=None)
    hits["cache salt"] = hit_tokens(base, config, cache_salt="tenant-b")
    assert hits["same identity"] >= 40, hits  # the store happened: a miss below means isolation
    assert {k: v for k, v in hits.items() if k != "same identity"} == dict.fromkeys(
        [*OTHERS, "cache salt"], 0
    )

    # Tensor-parallel ranks: the same blocks under rank r of 2 are other keys on both tiers.
    tiers = shared_tiers(config)
    try:
        num_blocks = len(TOKENS) // 4
        stored = block_keys(base, TOKENS, 0, range(num_blocks))
        assert [t.contains_many(stored) for t in tiers] == [[True] * num_blocks] * 2
        for rank in (0, 1):
            keys = block_keys(base, TOKENS, 0, range(num_blocks), tp_rank=rank, tp_size=2)
            assert not set(keys) & set(stored)
            assert [t.contains_many(keys) for t in tiers] == [[False] * num_blocks] * 2, rank
    finally:
        for tier in tiers:
            tier.close()
    names = [*OTHERS, "cache salt", "tensor-parallel rank 0 and 1 of 2"]
    record(
        "isolation: identities on shared disk + valkey",
        done="store a 48-token prompt under one identity on a shared disk directory and a "
        "real valkey-server; ask for it under each other identity: " + ", ".join(names),
        seen=f"the same identity hits {hits['same identity']} tokens; every other identity "
        "0 tokens and 0 keys found on either tier",
        counters={"same_identity_hit_tokens": hits["same identity"], "cross_hits": 0},
    )
