"""``benchmarks/bench_gpu.py`` runs end to end here on CPU tensors (CI has no GPU, and a
benchmark nobody runs rots): every section reports, and every bytes check holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_cpu_tensors_with_exact_bytes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--device", "cpu", "--quick", "--json", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["copy"]) == 8 and all(row["bytes_equal"] for row in report["copy"])
    assert all(row["copier_device_MiB"] == 32 for row in report["copy"])
    setups = ["cpu", "cpu+disk", "cpu, 2 workers", "cpu, 64 MiB chunk"]
    assert [row["tiers"] for row in report["jobs"]] == setups
    assert all(row["bytes_equal"] for row in report["jobs"])
    engine = report["engine"]
    assert engine["hybridkv"]["hit_tokens"] > 0 and engine["alone"]["hit_tokens"] == 0
    assert "simulated engine" in result.stdout and "limit (pinned)" in result.stdout
