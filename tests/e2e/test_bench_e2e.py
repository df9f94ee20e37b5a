"""``hybridkv bench`` end to end on the tiny float32 Gemma 3 model (exact outputs).

* ``restart`` on the offline engine, alone and cpu+disk: hits from the engine's
  cache, then (after its reset) from the CPU tier, then (restarted) from disk,
  each at the engine's alignment, with the per-group blocks of a sliding
  window; the engine alone recomputes what it lost. Plots are written.
* ``multi-turn`` on the OpenAI server, alone and cpu, with a KV cache of 1 MiB
  (six conversations do not fit): conversations over HTTP, answers fed back,
  the same tokens as the engine alone, hits from the CPU tier.
* ``shared`` over a Mooncake pool the bench starts: engine 1 hits what engine 0
  stored.
* ``route``: two engine processes on a small Valkey pool, each with a CPU tier
  smaller than the workload; the router by hits (lookups over the pool and the
  engines' KV events) against round-robin.
* ``mixed``: shared prompts, documents, conversations and one-off prompts, one
  at a time in a seeded order, through CPU and disk tiers smaller than them,
  LRU everything against the reuse policies: outputs equal the engine alone's.

Each run is a ``hybridkv bench`` subprocess writing ``--json``; the tests read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import REPO_ROOT, Harness

pytestmark = pytest.mark.slow

_runs: dict[str, dict[str, Any]] = {}


def bench(harness: Harness, name: str, *args: str) -> dict[str, Any]:
    """Run ``hybridkv bench ARGS --json`` once per name; its document."""
    if name in _runs:
        return _runs[name]
    out = harness.work_dir / f"bench-{name}.json"
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "bench", *args, "--model", "tiny-gemma3",
         "--work-dir", str(harness.work_dir / f"bench-{name}"), "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr[-6000:]
    assert proc.returncode == 0, output
    document: dict[str, Any] = json.loads(out.read_text())
    document["stdout"] = proc.stdout
    _runs[name] = document
    return document


def summaries(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(s["setup"], s["phase"]): s for s in document["summaries"]}


def records(document: dict[str, Any], setup: str, phase: str) -> list[dict[str, Any]]:
    return [r for r in document["records"] if r["setup"] == setup and r["phase"] == phase]


def restart_run(harness: Harness) -> dict[str, Any]:
    plots = harness.work_dir / "bench-plots"
    return bench(harness, "restart", "restart", "--setups", "cpu+disk",
                 "--param", "documents=3", "--param", "document_tokens=300",
                 "--param", "kv_cache_mib=64", "--plot", str(plots))  # fmt: skip


def test_restart_hits_each_source_in_turn_and_matches(harness: Harness) -> None:
    document = restart_run(harness)
    found = summaries(document)
    assert set(found) == {(s, p) for s in ("alone", "cpu+disk")
                          for p in ("cold", "engine-cache", "tiers", "restarted")}  # fmt: skip
    facts = document["setups"][1]["engine_facts"]
    align = facts["alignment_tokens"]
    assert [g["spec"] for g in facts["groups"]] == ["SlidingWindowSpec", "FullAttentionSpec"]
    source_of = {"engine-cache": "device", "tiers": "host", "restarted": "disk"}
    for phase, source in source_of.items():
        summary = found[("cpu+disk", phase)]
        for record in records(document, "cpu+disk", phase):
            n = record["num_prompt_tokens"]
            assert record["num_cached_tokens"] == (n - 1) // align * align, (phase, record)
        assert summary["hit_rate_by_source"][source] * summary["prompt_tokens"] == pytest.approx(
            summary["cached_tokens"]
        ), phase
        assert summary["recomputed_tokens"] == 0, phase
        assert summary["outputs"] == {"match": 3, "near_tie": 0, "differ": 0, "not_compared": 0}
    for phase in ("tiers", "restarted"):
        blocks = found[("cpu+disk", phase)]["loaded_blocks_by_group"]
        # A window of 32 tokens needs at most two blocks per request; full needs them all.
        assert 0 < blocks["0"] <= 2 * 3 < blocks["1"], blocks
    assert found[("cpu+disk", "cold")]["cached_tokens"] == 0
    # The engine alone lost its cache with the reset and the restart: all recomputed.
    for phase in ("tiers", "restarted"):
        alone = found[("alone", phase)]
        assert alone["cached_tokens"] == 0 and alone["recomputed_tokens"] > 0, phase
    names = [t["name"] for t in document["targets"]]
    assert "cpu+disk: TTFT p50 after a restart / cold" in names
    assert "TTFT p50" in document["stdout"] and "hit device/host/disk/p2p" in document["stdout"]
    assert f"cores, {document['machine']['memory_gib']} GiB" in document["stdout"]


def test_restart_plots_are_pngs(harness: Harness) -> None:
    restart_run(harness)
    for name in ("ttft.png", "hit_rate.png"):
        data = (harness.work_dir / "bench-plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_multi_turn_over_the_server_matches_and_hits_the_cpu_tier(harness: Harness) -> None:
    document = bench(harness, "multi-turn-server", "multi-turn", "--engine", "server",
                     "--setups", "cpu", "--param", "clients=6", "--param", "rounds=3",
                     "--param", "document_tokens=200", "--param", "question_tokens=16",
                     "--param", "answer_tokens=8", "--param", "think_s=0.1",
                     "--param", "kv_cache_mib=1")  # fmt: skip
    found = summaries(document)
    alone, cpu = found[("alone", "run")], found[("cpu", "run")]
    assert alone["requests"] == cpu["requests"] == 18
    # Every round's prompt is the conversation so far: equal outputs all the way.
    assert cpu["outputs"] == {"match": 18, "near_tie": 0, "differ": 0, "not_compared": 0}
    later = [r for r in records(document, "cpu", "run") if r["index"] > 0]
    assert all(r["num_prompt_tokens"] > 200 + 16 for r in later)
    # The engine alone could not keep six conversations; hybridkv's CPU tier could.
    assert alone["recomputed_tokens"] > 0 and alone["hit_rate_by_source"]["host"] == 0
    assert cpu["hit_rate_by_source"]["host"] > 0
    assert cpu["recomputed_tokens"] < alone["recomputed_tokens"]
    assert document["engine"] == "server"


def test_shared_pool_serves_the_second_engine(harness: Harness) -> None:
    document = bench(harness, "shared", "shared", "--setups", "mooncake",
                     "--param", "documents=2", "--param", "document_tokens=300",
                     "--param", "kv_cache_mib=64")  # fmt: skip
    found = summaries(document)
    first, second = found[("mooncake", "engine0")], found[("mooncake", "engine1")]
    assert second["hit_rate_by_source"]["p2p"] > 0 and first["hit_rate_by_source"]["p2p"] == 0
    # Engine 1 never saw the documents: every hit of its first asks came from the pool.
    firsts = [r for r in records(document, "mooncake", "engine1") if r["reusable_tokens"]]
    assert firsts and all(r["num_cached_tokens"] == r["reusable_tokens"] for r in firsts)
    alone = found[("alone", "engine1")]
    assert alone["hit_rate_by_source"]["p2p"] == 0
    (target,) = [t for t in document["targets"] if "engine 1's hit rate" in t["name"]]
    assert target["met"], target
    assert second["outputs"]["differ"] == 0 and second["outputs"]["match"] == 4


def test_routing_by_hits_beats_round_robin_and_predicts_the_engines_hits(
    harness: Harness,
) -> None:
    params = {"documents": 6, "document_tokens": 320, "questions": 3, "clients": 3,
              "rounds": 3, "question_tokens": 32, "kv_cache_mib": 1, "cpu_tier_mib": 1,
              "pool_mib": 2}  # fmt: skip
    args = [a for name, value in params.items() for a in ("--param", f"{name}={value}")]
    document = bench(harness, "route", "route", *args)
    policies = document["policies"]
    rr, hits = policies["round-robin"], policies["hits"]
    assert rr["requests"] == hits["requests"] == 27
    for policy in policies.values():
        assert policy["outputs"]["differ"] == 0 and policy["outputs"]["match"] == 27
    # Each engine's caches hold what it served: sent back there, a request hits more.
    assert hits["hit_tokens"] >= 1.2 * rr["hit_tokens"] > 0
    assert min(hits["per_engine"]) >= 5  # ties go to the engine that served fewer
    assert rr["per_engine"] == [14, 13]
    # The router's answer for the engine it chose is what that engine then had cached
    # (its events may trail it by a step: then the router under-counts).
    predicted = [(r["predicted"], r["num_cached_tokens"]) for r in hits["records"]]
    assert all(p >= 0 for p, _ in predicted)
    assert sum(p == c for p, c in predicted) >= 0.8 * len(predicted)
    assert sum(p > c for p, c in predicted) <= 1
    assert all(r["predicted"] == -1 for r in rr["records"])
    (ratio,) = [t for t in document["targets"] if t["name"].startswith("router hit tokens")]
    assert ratio["value"] == pytest.approx(hits["hit_tokens"] / rr["hit_tokens"])


def test_mixed_workload_compares_the_reuse_policies_with_lru(harness: Harness) -> None:
    params = {"document_tokens": 320, "question_tokens": 16, "one_offs": 3,
              "kv_cache_mib": 1, "cpu_tier_mib": 1, "disk_tier_mib": 2}  # fmt: skip
    args = [a for name, value in params.items() for a in ("--param", f"{name}={value}")]
    document = bench(harness, "mixed", "mixed", *args)
    found = summaries(document)
    # 2 conversations x 4 turns, 2 system prompts x 4, 3 documents x 2, 4 x 3 one-offs
    requests = 8 + 8 + 6 + 12
    alone, lru, reuse = (found[(s, "run")] for s in ("alone", "cpu+disk-lru", "cpu+disk-reuse"))
    for summary in (lru, reuse):
        assert summary["requests"] == requests
        assert summary["outputs"] == {
            "match": requests, "near_tie": 0, "differ": 0, "not_compared": 0
        }  # fmt: skip
        assert summary["recomputed_tokens"] < alone["recomputed_tokens"]
    # In the schedule's order: a conversation's turn comes after its previous turn.
    sent = records(document, "cpu+disk-reuse", "run")
    assert [r["index"] for r in sent if r["client"] == 0] == [0, 1, 2, 3]
    (ratio,) = [t for t in document["targets"] if "reuse / cpu+disk-lru" in t["name"]]
    assert ratio["value"] == pytest.approx(reuse["cached_tokens"] / lru["cached_tokens"])


def test_work_dir_holds_the_engine_logs(harness: Harness) -> None:
    restart_run(harness)
    logs = sorted(p.name for p in Path(harness.work_dir / "bench-restart").glob("*.log"))
    assert logs == [f"{s}-engine{i}.log" for s in ("alone", "cpu+disk") for i in (0, 1)]
