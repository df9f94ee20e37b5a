"""The server's command line and the parsing of its streamed chunks."""

from __future__ import annotations

from typing import Any

from hybridkv.cli.bench.server import SERVED_NAME, _take_chunk, server_argv


def test_engine_kwargs_become_flags() -> None:
    argv = server_argv(
        {"model": "/m", "max_model_len": 512, "enforce_eager": True, "seed": 0,
         "disable_thing": False, "kv_cache_memory_bytes": None},
        8123,
        {"kv_connector": "HybridKVConnector"},
    )  # fmt: skip
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 8123" in joined
    assert f"--served-model-name {SERVED_NAME}" in joined
    assert "--model /m --max-model-len 512 --enforce-eager --seed 0" in joined
    assert "--disable-thing" not in joined and "--kv-cache-memory-bytes" not in joined
    assert argv[-2:] == ["--kv-transfer-config", '{"kv_connector": "HybridKVConnector"}']


def test_chunks_give_tokens_log_probabilities_and_cached_tokens() -> None:
    reply: dict[str, Any] = {"first": None, "tokens": [], "logprobs": [], "cached": 0}
    _take_chunk({"choices": [{"token_ids": [], "logprobs": None}]}, reply)
    assert reply["first"] is None
    _take_chunk({"choices": [{"token_ids": [17, 4],
                 "logprobs": {"top_logprobs": [{"token_id:17": -0.5, "token_id:3": -1.5},
                                               {"token_id:4": -0.1}]}}]}, reply)  # fmt: skip
    assert reply["first"] is not None
    _take_chunk({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 96}}}, reply)
    assert reply["tokens"] == [17, 4]
    assert reply["logprobs"] == [{"17": -0.5, "3": -1.5}, {"4": -0.1}]
    assert reply["cached"] == 96
