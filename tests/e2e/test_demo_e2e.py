"""``hybridkv demo`` end to end: README's main command, as it runs by default.

Gemma 3 270M's shape built here, two 4096-token prompts on hybridkv's
embedded default (no tiers configured), cold, on vLLM's cache, from the CPU
tier after vLLM's cache is reset, and from disk after a restart. Speed is
the bench's business (docs/PERFORMANCE.md); this test checks what a user
must be able to trust: the runs happen, hits come from where the table says,
outputs match the cold run, the disk tier is where the default puts it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.harness import REPO_ROOT, Harness

pytestmark = pytest.mark.slow


def test_demo_runs_cold_then_from_each_cache_and_matches(harness: Harness) -> None:
    cache_dir = harness.cache_dir("demo")
    report_path = harness.work_dir / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "demo", "--cache-dir", str(cache_dir),
         "--json", str(report_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    for text in ("building gemma3-270m", "6 KV cache groups", "speedup", "outputs vs cold"):
        assert text in proc.stdout, output
    document = json.loads(report_path.read_text())
    found = {s["phase"]: s for s in document["summaries"]}
    assert list(found) == ["cold", "engine-cache", "tiers", "restarted"]
    align = document["engine_facts"]["alignment_tokens"]
    full_hit = 2 * ((4096 - 1) // align * align)
    for phase, source in (("engine-cache", "device"), ("tiers", "host"), ("restarted", "disk")):
        summary = found[phase]
        assert summary["prompt_tokens"] == 2 * 4096, phase
        assert summary["cached_tokens"] == full_hit, phase
        assert round(summary["hit_rate_by_source"][source] * 8192) == full_hit, phase
        assert document["outputs"][phase]["differ"] == 0, document["outputs"]
        assert document["outputs"][phase]["not_compared"] == 0, document["outputs"]
    for phase in ("tiers", "restarted"):
        blocks = found[phase]["loaded_blocks_by_group"]
        # Five sliding-window groups load the window, the full group the whole prefix.
        assert len(blocks) == 6 and max(blocks.values()) == blocks["5"], blocks
        assert all(n < blocks["5"] for g, n in blocks.items() if g != "5"), blocks
    assert found["cold"]["cached_tokens"] == 0
    assert any((cache_dir / "kv").rglob("*.seg")), "the default disk tier is <cache_dir>/kv"
    assert (cache_dir / "models" / "gemma3-270m-seed0" / "config.json").exists()
