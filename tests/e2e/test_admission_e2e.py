"""``admission: reused`` on real vLLM: a prefix vLLM's own cache serves at its second
sighting reaches the disk tier, even after the CPU tier evicted it.

The disk tier is filled first with objects noted reused, so a prompt seen once
stays in the CPU tier (Gemma 3 tiny model). The first request stores a prefix
there; unrelated prompts then push it out of the 1 MiB CPU tier, while vLLM's
64 MiB cache keeps it. The second request with that prefix is served by vLLM's
cache and computes none of it: its admission stores the prefix again from
vLLM's KV blocks and sends it on (``hybridkv_refreshed_blocks_total``). A new
engine on the same disk then hits the whole prefix from it, with the greedy
tokens of the engine alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.connector.config import ConnectorConfig
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tools.models import TinyModelKind, default_prompt_token_ids
from tests.e2e.expect import assert_same_outputs, describe, engine_facts, summed
from tests.e2e.harness import Harness
from tests.e2e.scenarios import SETTLE, engine, generate
from tests.support.connector import fill_disk

pytestmark = pytest.mark.slow

PREFIX_TOKENS = 320
TAIL_TOKENS = 8
"""Short: at the end of a prompt, the sliding window (32 tokens) still holds the
prefix's last block, so vLLM's cache keeps it for a hit at the prefix's end."""
FILLER_TOKENS = 480
NUM_FILLERS = 3
"""Unrelated prompts: about 1.4 MiB of KV (1 KiB per token), more than the CPU tier."""


def test_a_prefix_vllm_serves_again_reaches_the_disk_after_the_cpu_tier_evicted_it(
    harness: Harness,
) -> None:
    model = harness.model(TinyModelKind.GEMMA3)
    vocab = model.vocab_size
    prefix = default_prompt_token_ids(PREFIX_TOKENS, vocab_size=vocab, seed=500)

    def with_tail(seed: int) -> list[int]:
        return prefix + default_prompt_token_ids(TAIL_TOKENS, vocab_size=vocab, seed=seed)

    fillers = [
        default_prompt_token_ids(FILLER_TOKENS, vocab_size=vocab, seed=600 + i)
        for i in range(NUM_FILLERS)
    ]
    disk_dir = harness.cache_dir("admission-e2e") / "disk"
    connector: dict[str, Any] = {
        "admission": "reused",
        "tiers": [
            {"kind": "cpu", "capacity_bytes": "1MiB"},
            {
                "kind": "disk",
                "path": str(disk_dir),
                "capacity_bytes": "2MiB",
                "segment_bytes": "256KiB",
            },
        ],
    }
    disk_config = ConnectorConfig.from_dict(connector).tier_configs[1]
    assert isinstance(disk_config, DiskConfig)
    with DiskTier(disk_config) as disk:
        fill_disk(disk)  # every segment noted reused: a first sighting stays in the CPU tier

    first_steps = [
        generate("first", [with_tail(1)]),
        generate("fillers", fillers),
        generate("second", [with_tail(2)]),
        SETTLE,
    ]
    plan = [
        engine("alone", model, [generate("third", [with_tail(3)])]),
        engine("served", model, first_steps, connector),
        engine("restarted", model, [generate("third", [with_tail(3)])], connector),
    ]
    run = harness.run("admission-e2e", plan)
    assert run.returncode == 0, run.describe_failure()
    facts = engine_facts(run, "served")
    align = int(facts["alignment_tokens"])
    expected_hit = PREFIX_TOKENS // align * align
    assert expected_hit > 0, f"the prefix is shorter than the engine's {align}-token alignment"

    second = run.step("served", "second")
    assert second["num_cached_tokens"] == [expected_hit], describe(second)  # vLLM's own
    assert summed(second["connector"], "refreshed_blocks") > 0, describe(second)

    third = run.step("restarted", "third")
    assert third["num_cached_tokens"] == [expected_hit], describe(third)  # from the disk
    assert_same_outputs(third, run.step("alone", "third"), model, "after the restart")
