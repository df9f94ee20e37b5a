"""``benchmarks/bench_shared_admission.py`` runs end to end (a benchmark nobody runs
rots): two engines in turn over a real valkey-server, each policy on the same
workloads, every hit's KV equal to a cold run's (the benchmark compares them and
stops on a difference), and marks found only where they are on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.slow
def test_the_shared_admission_benchmark_compares_marks_with_judging_alone(
    tmp_path: Path,
) -> None:
    report, stdout = run_benchmark(
        "bench_shared_admission.py", tmp_path / "shared.json", "--quick", timeout_s=900
    )
    assert report["repeats"] == 1, "--quick replays each case once"
    assert len(report["cases"]) == 4, "two workloads, two shapes"
    evicted = 0
    for rows in report["cases"].values():
        assert list(rows) == ["lru", "reused", "reused+marks"]
        assert len({row["reusable"] for row in rows.values()}) == 1, "one workload for all"
        for row in rows.values():
            assert row["totals"] == [row["hit"]] == [sum(row["hits"])]
            assert row["hit"] <= row["reusable"]
            assert (row["kv_blocks_checked"] > 0) == (row["hit"] > 0)
        assert rows["lru"]["marked_before"] == rows["reused"]["marked_before"] == 0
        assert rows["reused+marks"]["marked_before"] > 0, (
            "round-robin: each engine sees the other's"
        )
        assert rows["lru"]["hit"] > 0
        evicted += rows["lru"]["pool_evicted_keys"]
    assert evicted > 0, "the pool never filled: admission had nothing to decide"
    assert "target: reused+marks >= 0.98x" in stdout
