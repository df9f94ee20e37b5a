"""``benchmarks/bench_eviction.py`` runs end to end (a benchmark nobody runs rots): every
policy replays the same workloads (mixed, long-doc-qa) on both shapes, and every hit's
KV equals a cold run's (the benchmark compares them and stops on a difference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.slow
def test_the_eviction_benchmark_compares_every_policy_on_each_workload(tmp_path: Path) -> None:
    report, stdout = run_benchmark("bench_eviction.py", tmp_path / "eviction.json", "--quick")
    assert list(report["workloads"]) == ["mixed", "long-doc-qa"]
    assert report["repeats"] == 1, "--quick replays each case once"
    for part in report["workloads"].values():
        assert len(part["shapes"]) == 4, "two shapes, two sizes of cpu tier"
        for rows in part["shapes"].values():
            policies = ["lru", "chain", "chain+2nd", "chain+2nd+reused", "worth+2nd+reused"]
            assert list(rows) == policies
            reusable = [
                {k: c["reusable"] for k, c in row["classes"].items()} for row in rows.values()
            ]
            assert all(r == reusable[0] for r in reusable), "the same workload for every policy"
            assert rows["lru"]["over_lru"] == 1.0
            for row in rows.values():
                assert len(row["hits"]) == part["requests"]
                assert row["totals"] == [row["total"]["hit"]], "one run, reported as is"
                assert row["total"]["hit"] <= row["total"]["reusable"]
                assert (row["kv_blocks_checked"] > 0) == (row["total"]["hit"] > 0)
            assert rows["lru"]["total"]["hit"] > 0, "the tiers kept nothing: the case tests nothing"
    docs = report["workloads"]["long-doc-qa"]
    for rows in docs["shapes"].values():
        only_docs = {k for k, c in rows["lru"]["classes"].items() if c["reusable"]}
        assert only_docs == {"docs"}, "long-doc-qa asks documents only"
    assert "targets: mixed >= 1.3x" in stdout
