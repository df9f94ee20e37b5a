"""``benchmarks/bench_worth.py`` runs end to end (a benchmark nobody runs rots): each
policy replays the same conversations, every hit's KV equals a cold run's (the benchmark
compares them and stops on a difference), and ``worth`` changes what the tier keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.slow
def test_the_worth_benchmark_compares_worth_with_chain_order(tmp_path: Path) -> None:
    report, stdout = run_benchmark("bench_worth.py", tmp_path / "worth.json", "--quick")
    assert report["repeats"] == 1, "--quick replays each case once"
    assert len(report["cases"]) == 2, "one mix, two sizes of cpu tier"
    for rows in report["cases"].values():
        assert list(rows) == ["lru", "chain", "worth"]
        reusable = [row["total"]["reusable"] for row in rows.values()]
        assert len(set(reusable)) == 1 and reusable[0] > 0, "one workload for every policy"
        for row in rows.values():
            assert row["totals"] == [row["total"]["hit"]], "one run, reported as is"
            assert row["total"]["hit"] <= row["total"]["reusable"]
            assert (row["kv_blocks_checked"] > 0) == (row["total"]["hit"] > 0)
            assert all(c["hit"] <= c["reusable"] for c in row["classes"].values())
        assert rows["chain"]["over_chain"] == 1.0
        assert rows["chain"]["total"]["hit"] > 0, "the tier kept nothing: the case tests nothing"
    hits = [(rows["chain"]["hits"], rows["worth"]["hits"]) for rows in report["cases"].values()]
    assert any(chain != worth for chain, worth in hits), "worth kept what chain order keeps"
    assert "target: worth >= 1.1x" in stdout
