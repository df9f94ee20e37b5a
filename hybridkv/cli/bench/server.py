"""The OpenAI server as ``hybridkv bench``'s engine: started, replayed against, stopped.

CLI process. ``ServerEngine`` starts ``python -m vllm.entrypoints.openai.api_server``
(the CPU build has no working ``vllm`` command) on 127.0.0.1 with vLLM's
default process model, with ``VLLM_SERVER_DEV_MODE=1`` for
``POST /reset_prefix_cache``. Clients are asyncio tasks sending streaming
``/v1/completions`` with token-id prompts: TTFT is the first chunk carrying
a token, the token ids and log-probabilities come back in the chunks
(``return_token_ids``, ``return_tokens_as_token_ids``), the cached tokens in
the usage of the last one (``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.cli.bench import counters
from hybridkv.cli.bench.offline import EngineFailed, EngineLaunch
from hybridkv.cli.bench.replay import TOP_LOGPROBS, ClientRun, Record, make_record
from hybridkv.cli.bench.workloads import Client
from hybridkv.tools.servers import HOST, free_port, http_ok

SERVED_NAME = "bench"
STATS_SETTLE_S = 1.5
"""The frontend's metrics trail the engine by a report; wait this long before reading."""
STOP_TIMEOUT_S = 90.0


def server_argv(
    engine_kwargs: dict[str, Any], port: int, transfer: dict[str, Any] | None
) -> list[str]:
    """The server's command line: ``engine_kwargs`` as flags (``max_model_len`` ->
    ``--max-model-len``; True -> a bare flag)."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--enable-prompt-tokens-details",
    ]
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return argv


class ServerEngine:
    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        self.port = free_port()
        env = dict(os.environ, **launch.env, VLLM_SERVER_DEV_MODE="1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self._log = launch.log_path.open("a")
        self._proc = subprocess.Popen(
            server_argv(launch.engine_kwargs, self.port, launch.transfer),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.facts: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, on_tick: Callable[[], None]) -> dict[str, Any]:
        while not http_ok(f"{self.url}/health"):
            if self._proc.poll() is not None:
                raise EngineFailed(f"the server exited ({self._proc.returncode})\n{self._tail()}")
            on_tick()
            time.sleep(0.5)
        info = self._cache_config_info()
        block_size = int(float(info.get("block_size", 0) or 0))
        # What /metrics tells of the engine's choices; the hit alignment is the block
        # size for attention-only models (the offline engine reads the real one).
        self.facts = {"alignment_tokens": block_size, "groups": [], "kv_bytes_per_token": 0.0}
        return self.facts

    def replay(
        self, clients: Sequence[tuple[int, Client]], phase: str, on_done: Callable[[], None]
    ) -> list[Record]:
        return asyncio.run(self._replay(clients, phase, on_done))

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            if response.status != 200:
                raise EngineFailed(f"POST /reset_prefix_cache answered {response.status}")

    def counters(self) -> dict[str, float]:
        time.sleep(STATS_SETTLE_S)
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return counters.from_text(response.read().decode())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def _cache_config_info(self) -> dict[str, str]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                return dict(family.samples[0].labels) if family.samples else {}
        return {}

    def _tail(self, lines: int = 25) -> str:
        text = self.launch.log_path.read_text(errors="replace").splitlines()
        return f"last lines of {self.launch.log_path}:\n" + "\n".join(text[-lines:])

    async def _replay(
        self, clients: Sequence[tuple[int, Client]], phase: str, on_done: Callable[[], None]
    ) -> list[Record]:
        import aiohttp

        start = time.perf_counter()
        records: list[Record] = []
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def client_task(run: ClientRun) -> None:
                while not run.done:
                    await asyncio.sleep(max(0.0, run.due - time.perf_counter()))
                    index, request, prompt = run.next_request()
                    sent = time.perf_counter()
                    reply = await self._complete(session, prompt, request.max_tokens)
                    done = time.perf_counter()
                    records.append(
                        make_record(
                            run,
                            index,
                            request,
                            prompt,
                            phase=phase,
                            replay_start=start,
                            sent=sent,
                            first_token=reply["first"],
                            done=done,
                            output=reply["tokens"],
                            top_logprobs=reply["logprobs"],
                            num_cached_tokens=reply["cached"],
                        )
                    )
                    run.finish(prompt, reply["tokens"], done)
                    on_done()

            runs = [ClientRun(client_id, client, start) for client_id, client in clients]
            await asyncio.gather(*(client_task(run) for run in runs))
        return records

    async def _complete(self, session: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": TOP_LOGPROBS,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        reply: dict[str, Any] = {"first": None, "tokens": [], "logprobs": [], "cached": 0}
        async with session.post(f"{self.url}/v1/completions", json=body) as response:
            if response.status != 200:
                text = await response.text()
                raise EngineFailed(f"/v1/completions answered {response.status}: {text[:500]}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                _take_chunk(json.loads(line[5:]), reply)
        return reply


def _take_chunk(chunk: dict[str, Any], reply: dict[str, Any]) -> None:
    for choice in chunk.get("choices") or ():
        tokens = choice.get("token_ids") or []
        if tokens and reply["first"] is None:
            reply["first"] = time.perf_counter()
        reply["tokens"] += tokens
        logprobs = choice.get("logprobs") or {}
        for top in logprobs.get("top_logprobs") or ():
            reply["logprobs"].append(
                {key.removeprefix("token_id:"): float(lp) for key, lp in (top or {}).items()}
            )
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        reply["cached"] = int(details["cached_tokens"])
