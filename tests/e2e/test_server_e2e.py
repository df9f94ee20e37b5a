"""The OpenAI server users run, with vLLM's default process model and the embedded default.

``python -m vllm.entrypoints.openai.api_server`` (the CPU build has no working
``vllm`` command) with ``HybridKVConnector`` and no extra config, on
127.0.0.1. Completions over HTTP; the engine's prefix cache is reset
(``VLLM_SERVER_DEV_MODE=1``, ``POST /reset_prefix_cache``) and the same
prompts are sent again: identical outputs, hits counted by vLLM with their
source (host memory), hybridkv's own metrics in ``/metrics``. A restarted
server (its CPU tier empty) hits the disk tier.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.tools.models import TinyModel, TinyModelKind, default_prompt_token_ids
from hybridkv.tools.servers import free_port, http_ok
from tests.e2e.harness import REPO_ROOT, Harness

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3
PROMPT_LENGTHS = (140, 260, 333)
MAX_TOKENS = 12
START_TIMEOUT_S = 240
TRANSFER_CONFIG = {
    "kv_connector": "HybridKVConnector",
    "kv_connector_module_path": "hybridkv.vllm",
    "kv_role": "kv_both",
}


class Server:
    def __init__(self, model: TinyModel, cache_dir: Path, log: Path) -> None:
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            HYBRIDKV_CACHE_DIR=str(cache_dir),
            MC_TCP_BIND_ADDRESS="127.0.0.1",
        )
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default process model
        kwargs = model.engine_kwargs()
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model.path), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", model.dtype, "--max-model-len", str(model.max_model_len),
            "--block-size", str(model.block_size), "--enable-prefix-caching",
            "--enforce-eager", "--seed", str(model.seed),
            "--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"]),
            "--kv-transfer-config", json.dumps(TRANSFER_CONFIG),
        ]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(
            args, cwd=REPO_ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not http_ok(f"{self.url}/health"):
            assert self.proc.poll() is None, f"server exited: {self.log_tail()}"
            assert time.monotonic() < deadline, f"server not healthy: {self.log_tail()}"
            time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def complete(self, prompts: list[list[int]]) -> list[str]:
        texts = []
        for prompt in prompts:  # one at a time: each request's own cached tokens
            reply = self.post(
                "/v1/completions",
                {"model": str(self.model_name), "prompt": prompt, "max_tokens": MAX_TOKENS,
                 "temperature": 0.0, "ignore_eos": True},
            )  # fmt: skip
            texts.append(reply["choices"][0]["text"])
        return texts

    @property
    def model_name(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
            return str(json.loads(response.read())["data"][0]["id"])

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``name{labels but engine and model_name}`` -> value (summed)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not match:
                continue
            name, labels, value = match.groups()
            kept = ",".join(
                part
                for part in (labels or "{}")[1:-1].split(",")
                if part and not part.startswith(("engine=", "model_name="))
            )
            key = f"{name}{{{kept}}}" if kept else name
            values[key] = values.get(key, 0.0) + float(value)
        return values

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def served(harness: Harness) -> Iterator[dict[str, Any]]:
    """Two servers one after another on one cache directory; what each saw."""
    model = harness.model(KIND)
    prompts = [
        default_prompt_token_ids(n, vocab_size=model.vocab_size, seed=40 + i)
        for i, n in enumerate(PROMPT_LENGTHS)
    ]
    cache_dir = harness.cache_dir("server")
    seen: dict[str, Any] = {"prompts": prompts}
    server = Server(model, cache_dir, harness.work_dir / "server-first.log")
    try:
        seen["cold"] = server.complete(prompts)
        seen["after_cold"] = server.metrics()
        seen["reset"] = server.post("/reset_prefix_cache")
        time.sleep(1.0)  # the write-back to the disk tier runs between requests
        seen["warm"] = server.complete(prompts)
        time.sleep(1.0)  # stats reach the frontend with the engine's next report
        seen["after_warm"] = server.metrics()
    finally:
        seen["first_exit"] = server.stop()
        seen["first_log"] = server.log_tail(20000)
    server = Server(model, cache_dir, harness.work_dir / "server-restarted.log")
    try:
        seen["restarted"] = server.complete(prompts)
        time.sleep(1.0)
        seen["after_restart"] = server.metrics()
    finally:
        seen["second_exit"] = server.stop()
    yield seen


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_outputs_after_a_reset_and_a_restart_equal_the_cold_run(served: dict[str, Any]) -> None:
    assert served["reset"] == {"success": True}
    assert served["warm"] == served["cold"]
    assert served["restarted"] == served["cold"]
    assert "hybridkv scheduler: 2 KV groups" in served["first_log"]


def test_vllm_counts_the_hits_and_their_source(served: dict[str, Any]) -> None:
    cold, warm = served["after_cold"], served["after_warm"]
    hits = _delta(warm, cold, "vllm:external_prefix_cache_hits_total")
    assert hits > 0 and cold.get("vllm:external_prefix_cache_hits_total", 0.0) == 0
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert _delta(warm, cold, f'{by_source}{{source="host"}}') == hits
    assert warm.get(f'{by_source}{{source="external_unspecified"}}', 0.0) == 0
    restarted = served["after_restart"]
    assert restarted.get(f'{by_source}{{source="disk"}}', 0.0) > 0, restarted


def test_hybridkv_metrics_are_in_the_servers_metrics(served: dict[str, Any]) -> None:
    cold, warm = served["after_cold"], served["after_warm"]
    assert cold.get("hybridkv_lookups_total", 0.0) >= len(PROMPT_LENGTHS)
    assert sum(v for k, v in cold.items() if k.startswith("hybridkv_stored_blocks_total")) > 0
    assert _delta(warm, cold, 'hybridkv_loads_total{outcome="ok"}') == len(PROMPT_LENGTHS)
    assert _delta(warm, cold, "hybridkv_load_seconds_count") == len(PROMPT_LENGTHS)
    loaded = {k: v for k, v in warm.items() if k.startswith("hybridkv_loaded_blocks_total")}
    assert len(loaded) == 2 and all(v > 0 for v in loaded.values()), loaded  # both groups
    assert _delta(warm, cold, "hybridkv_hit_tokens_total") == _delta(
        warm, cold, "vllm:external_prefix_cache_hits_total"
    )
    restarted = served["after_restart"]
    assert restarted.get('hybridkv_tier_reads_total{tier="disk"}', 0.0) > 0, restarted


def test_servers_shut_down_cleanly(served: dict[str, Any]) -> None:
    assert served["first_exit"] == 0 and served["second_exit"] == 0
