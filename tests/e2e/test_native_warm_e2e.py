"""Nothing compiles while serving: every numba function hybridkv runs is compiled (or
loaded from its cache) when the engine starts, before the first request.

One driver process with an empty numba cache (a fresh install) runs real vLLM
with hybridkv over a small CPU tier (it evicts; ``second_chance`` passes read
objects over) and a small disk tier, with admission ``reused`` (the
scheduler's table of hashes seen) and eviction order ``worth``: prompts
computed and stored, their write-back to disk, hits from the CPU tier, then a
second engine in the same process (an empty CPU tier) hitting from disk. The
numba functions compiled, with the argument types of each, are read right
after each engine starts and again after its requests: serving adds none.
Compiling one while serving holds the interpreter for seconds, which every
request then waits for.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import counter, describe
from tests.e2e.harness import Harness
from tests.e2e.scenarios import RESET, SETTLE, base_prompts, concurrent_prompts, engine, generate

pytestmark = pytest.mark.slow

NATIVE_AT_START = {"op": "native", "label": "at_start"}
NATIVE_AFTER = {"op": "native", "label": "after"}


def test_serving_compiles_no_native_function(harness: Harness, tmp_path: Any) -> None:
    model = harness.model(TinyModelKind.GEMMA3)
    prompts = base_prompts(model.vocab_size)
    disk = tmp_path / "disk"
    tiers = {
        "tiers": [
            {"kind": "cpu", "capacity_bytes": "1MiB", "second_chance": True},
            {"kind": "disk", "path": str(disk), "capacity_bytes": "4MiB"},
        ],
        "eviction_order": "worth",
        "admission": "reused",
    }
    first = [
        NATIVE_AT_START,
        generate("cold", prompts),
        RESET,
        generate("warm", prompts),
        RESET,
        generate("concurrent", concurrent_prompts(model.vocab_size)),
        SETTLE,
        NATIVE_AFTER,
    ]
    second = [NATIVE_AT_START, generate("restart", prompts), SETTLE, NATIVE_AFTER]
    plan = [engine("first", model, first, tiers), engine("second", model, second, tiers)]
    numba_cache = tmp_path / "numba"
    run = harness.run("native-warm", plan, env={"NUMBA_CACHE_DIR": str(numba_cache)})
    assert run.returncode == 0, run.describe_failure()
    restart = run.step("second", "restart")
    reads = {
        "cpu": counter(run.step("first", "warm")["connector"], "tier_reads", tier="cpu"),
        "disk": counter(restart["connector"], "tier_reads", tier="disk"),
    }
    assert all(n > 0 for n in reads.values()), reads
    assert sum(restart["num_cached_tokens"]) > 0, describe(restart)
    for label in ("first", "second"):
        at_start = run.step(label, "at_start")["signatures"]
        after = run.step(label, "after")["signatures"]
        assert at_start, "no native function compiled at start"
        added = {
            name: sorted(set(sigs) - set(at_start.get(name, [])))
            for name, sigs in after.items()
            if set(sigs) - set(at_start.get(name, []))
        }
        assert not added, f"{label}: compiled while serving: {added}"
    assert any(numba_cache.rglob("*.nbi")), "the native functions were not cached there"
