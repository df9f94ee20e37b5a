"""``benchmarks/bench_gpu.py`` runs end to end here on CPU tensors (CI has no GPU, and a
benchmark nobody runs rots): every section reports, and every bytes check holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_cpu_tensors_with_exact_bytes(tmp_path: Path) -> None:
    report, stdout = run_benchmark(
        "bench_gpu.py", tmp_path / "bench.json", "--device", "cpu", "--quick"
    )
    assert len(report["copy"]) == 8 and all(row["bytes_equal"] for row in report["copy"])
    assert all(row["copier_device_MiB"] == 32 for row in report["copy"])
    setups = ["cpu", "cpu+disk", "cpu, 2 workers", "cpu, 64 MiB chunk"]
    assert [row["tiers"] for row in report["jobs"]] == setups
    assert all(row["bytes_equal"] for row in report["jobs"])
    engine = report["engine"]
    assert engine["hybridkv"]["hit_tokens"] > 0 and engine["alone"]["hit_tokens"] == 0
    assert "simulated engine" in stdout and "limit (pinned)" in stdout
