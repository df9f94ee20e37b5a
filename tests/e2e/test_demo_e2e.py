"""``hybridkv demo`` end to end: the README's main command on a fresh cache directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.harness import REPO_ROOT, Harness

pytestmark = pytest.mark.slow


def test_demo_runs_cold_warm_and_restart(harness: Harness) -> None:
    cache_dir = harness.cache_dir("demo")
    report_path = harness.work_dir / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridkv.cli",
            "demo",
            "--cache-dir",
            str(cache_dir),
            "--json",
            str(report_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    for line in ("building tiny model", "starting engine (about 20 s)", "restart run"):
        assert line in proc.stdout, output[-4000:]
    assert "TTFT ms" in proc.stdout and "bytes loaded" in proc.stdout
    reports = {r["name"]: r for r in json.loads(report_path.read_text())}
    assert list(reports) == ["cold", "warm", "restart"]
    cold, warm, restart = reports["cold"], reports["warm"], reports["restart"]
    assert cold["num_external_tokens"] == 0 and cold["store_bytes"] > 0
    # 4 prompts of 392 tokens: each resumes at 384 from the tiers.
    for run in (warm, restart):
        assert run["output_token_ids"] == cold["output_token_ids"], run["name"]
        assert run["cached_tokens_per_request"] == [384] * 4, run["name"]
        assert run["num_external_tokens"] == 4 * 384, run["name"]
        assert run["load_bytes"] > 0 and run["loaded_blocks"] > 0, run["name"]
    # The restart is a new process with an empty CPU tier: the first request's
    # blocks come from disk (and are promoted, so later ones may hit CPU).
    assert restart["tier_get_bytes"].get("disk", 0) > 0
    assert sum(restart["tier_get_bytes"].values()) == restart["load_bytes"]
    assert warm["tier_get_bytes"] == {"cpu": warm["load_bytes"]}
    assert (cache_dir / "models" / "gemma3-seed0" / "config.json").exists()
    assert any((cache_dir / "kv").rglob("*.seg"))
