"""The offline engine of ``hybridkv bench``: one vLLM ``LLMEngine`` in a spawned process.

CLI process (``OfflineEngine``) and engine process (``_engine_main``). The
engine process keeps the engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), writes vLLM's log to a file and takes
commands over a pipe: replay clients (its own step loop: requests are added
when their client is due, TTFT is the step that returns the first token),
reset the prefix cache, read counters, stop. Progress and results come back
over the same pipe.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.cli.bench import counters
from hybridkv.cli.bench.replay import TOP_LOGPROBS, ClientRun, Record, make_record, sleep_until
from hybridkv.cli.bench.workloads import Client

STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """How to start one engine process: its arguments, connector, log and environment."""

    engine_kwargs: dict[str, Any]
    """``vllm.LLM`` keyword arguments (no ``kv_transfer_config``)."""
    transfer: dict[str, Any] | None
    """A ``--kv-transfer-config`` document, or None for the engine alone."""
    log_path: Path
    env: dict[str, str]
    events: dict[str, Any] | None = None
    """vLLM's ``KVEventsConfig`` fields, or None: no KV events."""


class EngineFailed(RuntimeError):
    pass


KV_CACHE_TOO_SMALL = "To serve at least one request with the model's max seq len"
"""How vLLM refuses a KV cache smaller than one request of its model length."""


def report_failure(exc: EngineFailed, kv_cache_mib: int, engine_kwargs: dict[str, Any]) -> None:
    """Say why the bench stopped, and what to change where that is known."""
    print(f"[bench] FAILED: {exc}", file=sys.stderr, flush=True)
    advice = failure_advice(str(exc), kv_cache_mib, int(engine_kwargs["max_model_len"]))
    if advice is not None:
        print(f"[bench] {advice}", file=sys.stderr, flush=True)


def failure_advice(message: str, kv_cache_mib: int, max_model_len: int) -> str | None:
    """What to change in the bench's parameters when the engine failed thus, if known."""
    if KV_CACHE_TOO_SMALL in message:
        return (
            f"the KV cache of {kv_cache_mib} MiB cannot hold one request of {max_model_len} "
            "tokens (the workload's longest, rounded up): raise --param kv_cache_mib (vLLM's "
            "advice, gpu_memory_utilization, does not apply: the bench sizes the cache itself)"
        )
    return None


class OfflineEngine:
    """A handle on one engine process."""

    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_engine_main, args=(launch, child), name="hybridkv-bench-engine"
        )
        self._process.start()
        child.close()
        self.facts: dict[str, Any] = {}

    def wait_ready(self, on_tick: Callable[[], None]) -> dict[str, Any]:
        """Block until the engine serves (calling ``on_tick`` twice a second); its facts."""
        while not self._conn.poll(0.5):
            on_tick()
            if not self._process.is_alive():
                raise EngineFailed(self._failure("exited while starting"))
        self.facts = self._expect("ready")
        return self.facts

    def replay(
        self, clients: Sequence[tuple[int, Client]], phase: str, on_done: Callable[[], None]
    ) -> list[Record]:
        self._conn.send(("replay", {"clients": list(clients), "phase": phase}))
        while True:
            kind, payload = self._recv()
            if kind == "done":
                on_done()
            elif kind == "records":
                return [Record(**r) for r in payload]
            else:
                raise EngineFailed(f"unexpected reply {kind!r} during a replay")

    def reset(self) -> None:
        self._conn.send(("reset", None))
        if not self._expect("reset"):
            raise EngineFailed("the engine refused to reset its prefix cache")

    def counters(self) -> dict[str, float]:
        self._conn.send(("counters", None))
        return dict(self._expect("counters"))

    def close(self) -> None:
        """Stop the engine (its connector flushes the stores still in flight)."""
        if self._process.is_alive():
            try:
                self._conn.send(("stop", None))
                self._expect("stopped")
            except (EngineFailed, OSError):
                pass
            self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _recv(self) -> tuple[str, Any]:
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise EngineFailed(self._failure("exited")) from None
        if kind == "error":
            raise EngineFailed(f"engine failed:\n{payload}\n{self._log_tail()}")
        return str(kind), payload

    def _expect(self, wanted: str) -> Any:
        kind, payload = self._recv()
        if kind != wanted:
            raise EngineFailed(f"expected {wanted!r} from the engine, got {kind!r}")
        return payload

    def _failure(self, what: str) -> str:
        self._process.join(5)
        return f"engine process {what} (exit code {self._process.exitcode})\n{self._log_tail()}"

    def _log_tail(self, lines: int = 25) -> str:
        try:
            text = self.launch.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.launch.log_path})"
        return f"last lines of {self.launch.log_path}:\n" + "\n".join(text[-lines:])


# -- the engine process ------------------------------------------------------------------


def _engine_main(launch: EngineLaunch, conn: Any) -> None:
    os.environ.update(launch.env)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log_fd = os.open(launch.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    try:
        llm = _make_llm(launch)
        _warm_up(llm)
        conn.send(("ready", engine_facts(llm)))
        while True:
            command, payload = conn.recv()
            if command == "replay":
                records = replay_offline(
                    llm, payload["clients"], payload["phase"], lambda: conn.send(("done", None))
                )
                conn.send(("records", [vars(r) for r in records]))
            elif command == "reset":
                conn.send(("reset", bool(llm.reset_prefix_cache())))
            elif command == "counters":
                conn.send(("counters", counters.from_registry()))
            elif command == "stop":
                llm.llm_engine.engine_core.shutdown()
                conn.send(("stopped", None))
                return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _make_llm(launch: EngineLaunch) -> Any:
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs = dict(launch.engine_kwargs, disable_log_stats=False)
    if launch.transfer is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**launch.transfer)
    if launch.events is not None:
        kwargs["kv_events_config"] = KVEventsConfig(**launch.events)
    return LLM(**kwargs)


def sampling_params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=TOP_LOGPROBS,
    )


def _warm_up(llm: Any) -> None:
    """Two short requests (shorter than a block: nothing stored, nothing hit), so the
    first measured request does not pay one-off costs (the first request asking for
    log-probabilities sets them up)."""
    from vllm.inputs import TokensPrompt

    for _ in range(2):
        prompt = TokensPrompt(prompt_token_ids=list(range(3, 15)))
        llm.generate([prompt], sampling_params(2), use_tqdm=False)


def engine_facts(llm: Any) -> dict[str, Any]:
    """What the engine chose: its groups, block sizes, hit alignment, KV memory."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = []
    bytes_per_token = 0.0
    layers_per_block = 0
    padded_page = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        page = int(getattr(spec, "real_page_size_bytes", 0) or spec.page_size_bytes)
        layers = len(group.layer_names)
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "layers": layers,
                "page_size_bytes": page,
                "sliding_window": getattr(spec, "sliding_window", None),
            }
        )
        bytes_per_token += layers * page / int(spec.block_size)
        layers_per_block = max(layers_per_block, layers)
        padded_page = max(padded_page, int(spec.page_size_bytes))
    return {
        "groups": groups,
        "alignment_tokens": int(config.cache_hit_alignment_tokens),
        "kv_bytes_per_token": bytes_per_token,
        "num_blocks": int(config.num_blocks),
        # A block id holds one page in each of the largest group's layers (vLLM's
        # uniform-page pool).
        "kv_cache_bytes": int(config.num_blocks) * layers_per_block * padded_page,
    }


def replay_offline(
    llm: Any, clients: Sequence[tuple[int, Client]], phase: str, on_done: Callable[[], None]
) -> list[Record]:
    """Run the clients against ``llm.llm_engine`` until every request has finished."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    start = time.perf_counter()
    runs = [ClientRun(client_id, client, start) for client_id, client in clients]
    pending: dict[str, dict[str, Any]] = {}
    records: list[Record] = []
    serial = 0
    while pending or any(not run.done for run in runs):
        now = time.perf_counter()
        for run in runs:
            if run.ready(now):
                index, request, prompt = run.next_request()
                request_id = f"bench-{phase}-{run.client_id}-{index}-{serial}"
                serial += 1
                engine.add_request(
                    request_id,
                    TokensPrompt(prompt_token_ids=prompt),
                    sampling_params(request.max_tokens),
                )
                pending[request_id] = {
                    "run": run,
                    "index": index,
                    "request": request,
                    "prompt": prompt,
                    "sent": now,
                    "first": None,
                }
        if not engine.has_unfinished_requests():
            waiting = [run.due for run in runs if not run.done and not run.busy]
            sleep_until(min(waiting, default=now))
            continue
        outputs = engine.step()
        stepped = time.perf_counter()
        for output in outputs:
            entry = pending.get(output.request_id)
            if entry is None:
                continue
            completion = output.outputs[0]
            if entry["first"] is None and len(completion.token_ids) > 0:
                entry["first"] = stepped
            if not output.finished:
                continue
            del pending[output.request_id]
            run = entry["run"]
            records.append(
                make_record(
                    run,
                    entry["index"],
                    entry["request"],
                    entry["prompt"],
                    phase=phase,
                    replay_start=start,
                    sent=entry["sent"],
                    first_token=entry["first"],
                    done=stepped,
                    output=list(completion.token_ids),
                    top_logprobs=[
                        {str(t): float(lp.logprob) for t, lp in position.items()}
                        for position in completion.logprobs or []
                    ],
                    num_cached_tokens=int(output.num_cached_tokens or 0),
                )
            )
            run.finish(entry["prompt"], completion.token_ids, stepped)
            on_done()
    return records
