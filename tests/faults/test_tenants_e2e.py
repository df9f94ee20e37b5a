"""Two tenants with different ``cache_salt`` on the real OpenAI server: no cross hits.

One server (vLLM's default process model, the embedded default tiers) on
127.0.0.1. Tenant A sends a prompt; the engine's own prefix cache is reset
(``VLLM_SERVER_DEV_MODE=1``), so what follows can only hit hybridkv's tiers.
Tenant B sends the same prompt with its own salt: vLLM counts no external
hit. Tenant A again: it hits (so the store happened and B's miss means
isolation).
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
from pathlib import Path
from typing import Any

import pytest

from hybridkv.tools.models import TinyModelKind, build_tiny_model, default_prompt_token_ids
from hybridkv.tools.servers import HOST, free_port, http_ok
from tests.faults.report import record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO_ROOT = Path(__file__).resolve().parents[2]
HITS = "vllm:external_prefix_cache_hits_total"
TRANSFER_CONFIG = {
    "kv_connector": "HybridKVConnector",
    "kv_connector_module_path": "hybridkv.vllm",
    "kv_role": "kv_both",
}


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def external_hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    pattern = rf"^{re.escape(HITS)}(\{{[^}}]*\}})?\s+(\S+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M))


def test_tenants_with_different_cache_salts_never_hit_each_other(tmp_path: Path) -> None:
    model = build_tiny_model(TinyModelKind.GEMMA3, tmp_path / "models")
    prompt = default_prompt_token_ids(200, vocab_size=model.vocab_size, seed=77)
    port = free_port()
    url = f"http://{HOST}:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "MC_TCP_BIND_ADDRESS": HOST,
           "HYBRIDKV_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    kwargs = model.engine_kwargs()
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.path), "--host", HOST, "--port", str(port),
        "--dtype", model.dtype, "--max-model-len", str(model.max_model_len),
        "--block-size", str(model.block_size), "--enable-prefix-caching", "--enforce-eager",
        "--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"]),
        "--kv-transfer-config", json.dumps(TRANSFER_CONFIG),
    ]  # fmt: skip
    log = tmp_path / "server.log"
    server = subprocess.Popen(
        args, cwd=REPO_ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300
        while not http_ok(f"{url}/health"):
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        name = str(model.path)

        def ask(salt: str) -> float:
            """Send the prompt as one tenant after a prefix-cache reset; its external hits."""
            assert post(f"{url}/reset_prefix_cache", {}) == {"success": True}
            time.sleep(1.0)  # the write-back of earlier stores runs between requests
            before = external_hits(url)
            post(f"{url}/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 4,
                                           "temperature": 0.0, "cache_salt": salt})  # fmt: skip
            time.sleep(1.0)  # stats reach the frontend with the engine's next report
            return external_hits(url) - before

        first = ask("tenant-a")
        other = ask("tenant-b")
        again = ask("tenant-a")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert first == 0 and other == 0 and again > 0, (first, other, again, log.read_text()[-2000:])
    record(
        "isolation: tenants with different cache_salt on the OpenAI server",
        done="one real OpenAI server; tenant A, then B, then A send the same 200-token prompt "
        "with their own cache_salt, the engine's prefix cache reset before each",
        seen=f"B hits 0 external tokens; A's second request hits {int(again)}",
        counters={"tenant_b_hit_tokens": int(other), "tenant_a_again_hit_tokens": int(again)},
    )
