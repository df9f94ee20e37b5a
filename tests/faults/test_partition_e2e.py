"""A network partition between an engine and its pool, on real vLLM and Mooncake.

The pool (master + storage daemon) runs in network namespace "pool", engine C
(the pool its only tier) in "c", joined by a bridge (addresses only inside
them). C stores, hits; then the bridge's end of C's link is taken down (C's
packets are dropped silently, as in a real partition) while C serves the stored
prompts again, and brought up once that step is done. While cut off no request
waits longer than ``load_timeout_s`` beyond its recompute, the failures are
counted, the outputs stay those of the engine alone; after the link is back the
hits resume, and ``check_integrity`` is clean.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind, default_prompt_token_ids
from hybridkv.tools.netns import Network
from hybridkv.tools.pool import LocalPool
from tests.e2e.expect import EXTERNAL_HITS, assert_same_outputs, counter, describe
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, base_prompts, engine, generate
from tests.faults.report import record
from tests.support.netns import needs_netns
from tests.support.servers import MIB

pytestmark = [pytest.mark.slow, needs_netns]

KIND = TinyModelKind.GEMMA3
SUBNET = "10.213.61.0/24"
LOAD_TIMEOUT_S = 4.0
MOONCAKE_TUNING = {"op_timeout_s": 1.0, "retry_interval_s": 0.5}
AFTER_LABELS = tuple(f"after{i}" for i in range(1, 7))
"""Steps once the link is up again: the hits must come back within them."""
AFTER_PAUSE_S = 2.0
"""Wall time before each of those steps."""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return Harness(tmp_path_factory.mktemp("partition"))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Network, LocalPool]]:
    with Network.create(["pool", "c"], subnet=SUBNET) as network:
        run_dir = tmp_path_factory.mktemp("partition-pool")
        pool = network.start_pool("pool", run_dir, segment_bytes=128 * MIB, client_ttl_s=2)
        try:
            yield network, pool
        finally:
            pool.stop()


class LinkCutter:
    """Watches the driver's results: cuts C's link once ``before`` is recorded, mends
    it once ``during`` is, and notes when each step's record appeared."""

    def __init__(self, network: Network, harness: Harness, name: str) -> None:
        self.network, self.results = network, harness.work_dir / f"{name}.results.jsonl"
        self.seen_at: dict[str, float] = {}
        self.done = threading.Event()

    def watch(self) -> None:
        try:
            self._wait_for("before")
            self.network.set_link("c", up=False)
            self.seen_at["cut"] = time.monotonic()
            self._wait_for("during")
        finally:
            self.network.set_link("c", up=True)  # also when the run failed
            self.seen_at["mended"] = time.monotonic()
        while not self.done.is_set():
            self._note()
            time.sleep(0.02)
        self._note()

    def _wait_for(self, label: str) -> None:
        while label not in self.seen_at and not self.done.is_set():
            self._note()
            time.sleep(0.02)

    def _note(self) -> None:
        if not self.results.exists():
            return
        for line in self.results.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line still being written
                label = json.loads(line).get("label")
                if label:
                    self.seen_at.setdefault(label, time.monotonic())


def _partition_run(
    harness: Harness, network: Network, pool: LocalPool
) -> tuple[PlanRun, dict[str, float]]:
    model = harness.model(KIND)
    prompts = base_prompts(model.vocab_size)
    tiers = [t | MOONCAKE_TUNING for t in network.tier_configs(pool, "c")]
    connector = {"tiers": tiers, "load_timeout_s": LOAD_TIMEOUT_S}
    # "gap" (fresh prompts, computed) gives the cut time to land before "during" starts.
    gap_prompts = [
        default_prompt_token_ids(300, vocab_size=model.vocab_size, seed=900 + i) for i in range(3)
    ]
    gap = [generate("gap", gap_prompts)]
    steps = [generate("store", prompts), RESET, generate("before", prompts), *gap, RESET]
    steps += [generate("during", prompts)]
    # Time, not only steps, after the mend: quick steps (0.1 s on a quiet machine) would
    # all fall inside TCP's first retransmission back-off and Mooncake's reconnect.
    for label in AFTER_LABELS:
        steps += [RESET, {"op": "sleep", "seconds": AFTER_PAUSE_S}, generate(label, prompts)]
    plan = [
        engine("ref", model, [generate("cold", prompts), RESET, *gap]),
        engine("C", model, steps, connector),
    ]
    name = "partition-c"
    cutter = LinkCutter(network, harness, name)
    watcher = threading.Thread(target=cutter.watch)
    watcher.start()
    try:
        with network.entered("c") as inside:
            run = harness.run(name, plan, {"MC_TCP_BIND_ADDRESS": inside.address})
    finally:
        cutter.done.set()
        watcher.join()
    assert run.returncode == 0, run.describe_failure()
    return run, cutter.seen_at


def _full_hit(step: dict[str, Any]) -> bool:
    return step["metrics"].get(EXTERNAL_HITS, 0.0) > 0 and all(step["num_cached_tokens"])


def test_partition_costs_hits_not_correctness_and_hits_resume(
    harness: Harness, hosts: tuple[Network, LocalPool]
) -> None:
    network, pool = hosts
    model = harness.model(KIND)
    run, seen_at = _partition_run(harness, network, pool)
    reference = run.step("ref", "cold")
    assert_same_outputs(run.step("C", "gap"), run.step("ref", "gap"), model, "gap")
    labels = ("store", "before", "during", *AFTER_LABELS)
    for label in labels:
        assert_same_outputs(run.step("C", label), reference, model, label)
    assert _full_hit(run.step("C", "before")), describe(run.step("C", "before"))

    during = run.step("C", "during")
    where = describe(during)
    stats = during["connector"]
    # Nothing crossed the cut link; every call that tried failed and was counted.
    assert counter(stats, "loads", outcome="ok") == 0, where
    assert counter(stats, "tier_read_bytes", tier="mooncake") == 0, where
    faults = counter(stats, "tier_errors", tier="mooncake") + counter(
        stats, "loads", outcome="failed"
    )
    assert faults > 0, where
    # The stall the cut adds is bounded by the load timeout, not TCP's (minutes).
    assert during["seconds"] <= LOAD_TIMEOUT_S + 2 * reference["seconds"], where

    resumed = [label for label in AFTER_LABELS if _full_hit(run.step("C", label))]
    assert resumed, [describe(run.step("C", label)) for label in AFTER_LABELS]
    assert resumed[-1] == AFTER_LABELS[-1], resumed  # once back, the hits stay
    assert run.op("integrity", engine="C")["integrity"] == "ok"
    hits_resumed_s = seen_at[resumed[0]] - seen_at["mended"]
    record(
        "network partition between an engine and its pool",
        done="the bridge end of the engine's veth link taken down for one step, then up",
        seen=f"{faults:.0f} calls failed and were counted, tokens recomputed; hits back "
        f"from step {resumed[0]}",
        counters={"faults": faults, "load_timeout_s": LOAD_TIMEOUT_S},
        outputs_identical=True,
        max_stall_s=during["seconds"],
        hits_resumed_s=hits_resumed_s,
    )
