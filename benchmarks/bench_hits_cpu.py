"""Hits from the CPU tier against vLLM's own prefix-cache hit, on real vLLM (CPU build).

One engine in this process (engine core in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
on a random-weight model of Gemma 3 270M's shape, hybridkv with a CPU tier in
front of a disk tier. Each round takes a document never sent before, of
``--tokens`` tokens, and sends, one request at a time, each asking for one
token (so its latency is its time to first token):

* ``cold``: the document and a question: computed, stored in the CPU tier,
  and written back to the disk tier in the background;
* ``read-your-writes``: at once, vLLM's prefix cache reset, the document and
  another question: hybridkv's tiers serve it while the write-back of its
  blocks still runs; then ``engine``: the same again, from vLLM's own cache;
* once the write-back is done, ``--pairs`` times: ``cpu``, the prefix cache
  reset, again (the CPU tier serves it with nothing else running), then
  ``engine`` again.

Each hit from the tiers is divided by the engine hit right after it, so a
machine that slows down part way slows both sides of a ratio alike; a
round's ``cpu`` ratio is the median of its pairs. The table gives the
medians and spread (least and most) over the rounds after the first, and the
first round's alone: on a fresh install (``--fresh-numba-cache``: an empty
numba cache, as after ``pip install``) the first round's hits must be no
slower than the later ones. Targets: ``cpu`` <= 1.10x, ``read-your-writes``
<= 1.20x the engine's own hit, the first round's within both, and every hit
a full one. Two short requests (shorter than a block: nothing stored) warm
the engine first, as ``hybridkv bench`` does. The tiers start empty each run.
Exits non-zero only on a crash or a hit that is not a full one.

    python benchmarks/bench_hits_cpu.py [--rounds N] [--pairs N] [--tokens N]
                                        [--fresh-numba-cache] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

KINDS = ("read-your-writes", "cpu")
TARGETS = {"read-your-writes": 1.20, "cpu": 1.10}
QUESTION_TOKENS = 32


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="documents, one per round")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per document")
    parser.add_argument(
        "--pairs", type=int, default=3, help="CPU-tier hits per round, each beside an engine hit"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="model and tiers")
    parser.add_argument(
        "--fresh-numba-cache",
        action="store_true",
        help="compile every native function again, in an empty numba cache",
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def make_llm(work_dir: Path, tokens: int) -> tuple[Any, int]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from hybridkv.tools.models import ShapeKind, build_shape_model

    shape = build_shape_model(ShapeKind.GEMMA3_270M, work_dir / "models")
    kwargs = shape.engine_kwargs(kv_cache_memory_bytes=256 << 20)
    longest = tokens + 2 * QUESTION_TOKENS
    kwargs.update(max_model_len=-(-longest // 1024) * 1024, skip_tokenizer_init=True)
    kwargs["kv_transfer_config"] = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={
            "cache_dir": tempfile.mkdtemp(prefix="tiers-", dir=work_dir),  # empty each run
            "cpu_capacity_bytes": "2GiB",
        },
    )
    return LLM(**kwargs), shape.vocab_size


def ask(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first (and only) token, and the tokens the prompt hit."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start, int(out.num_cached_tokens or 0)


def settle() -> None:
    """Wait until the worker's write-back is done (the engine core runs in this process,
    and so does its one worker's connector)."""
    from hybridkv.integrations.vllm.plumbing import worker_connector_in_process

    connector = worker_connector_in_process()
    flushed = connector is not None and connector.flush_writes(60.0)  # type: ignore[attr-defined]
    assert flushed, "the write-back did not finish"


def run_round(llm: Any, vocab_size: int, tokens: int, seed: int, pairs: int) -> dict[str, Any]:
    from hybridkv.tools.models import default_prompt_token_ids

    document = default_prompt_token_ids(tokens, vocab_size=vocab_size, seed=seed)
    asked = 0

    def measure(kind: str) -> None:
        nonlocal asked
        asked += 1
        question = default_prompt_token_ids(QUESTION_TOKENS, vocab_size=vocab_size, seed=asked)
        took, hit = ask(llm, document + question)
        seconds.setdefault(kind, []).append(took)
        hits.setdefault(kind, []).append(hit)

    seconds: dict[str, list[float]] = {}
    hits: dict[str, list[int]] = {}
    measure("cold")
    llm.reset_prefix_cache()
    measure("read-your-writes")
    measure("engine")
    settle()
    for _ in range(pairs):
        llm.reset_prefix_cache()
        measure("cpu")
        measure("engine")
    engine = seconds["engine"]
    cpu = [c / e for c, e in zip(seconds["cpu"], engine[1:], strict=True)]
    ratios = {"read-your-writes": seconds["read-your-writes"][0] / engine[0], "cpu": median(cpu)}
    return {"seconds": seconds, "hit_tokens": hits, "ratios": ratios}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    later = rounds[1:] or rounds
    rows = {}
    for kind in ("cold", "engine", *KINDS):
        values = [t for r in later for t in r["seconds"][kind]]
        rows[kind] = {
            "first_s": rounds[0]["seconds"][kind][0],
            "median_s": median(values),
            "least_s": min(values),
            "most_s": max(values),
        }
    ratios = {}
    for kind in KINDS:
        values = [r["ratios"][kind] for r in later]
        first = rounds[0]["ratios"][kind]
        ratios[kind] = {
            "first": first,
            "median": median(values),
            "least": min(values),
            "most": max(values),
            "target": TARGETS[kind],
            "met": median(values) <= TARGETS[kind] and first <= TARGETS[kind],
        }
    return {"rows": rows, "ratios": ratios}


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['tokens']}-token documents, {report['rounds']} rounds"
        + (", empty numba cache at start" if report["fresh_numba_cache"] else "")
        + f", {report['pairs']} CPU-tier hits a round; load average "
        + "{:.1f} at the start, {:.1f} at the end".format(*report["load_average"])
        + f" on {os.cpu_count()} CPUs",
        "",
        "| request | first round | median of the later rounds | least | most |",
        "|---|---|---|---|---|",
    ]
    for kind, row in report["summary"]["rows"].items():
        lines.append(
            f"| {kind} | {row['first_s'] * 1e3:.0f} ms | {row['median_s'] * 1e3:.0f} ms "
            f"| {row['least_s'] * 1e3:.0f} | {row['most_s'] * 1e3:.0f} |"
        )
    lines += [
        "",
        "| ratio to the engine's own hit, per round | first round | median of the later "
        "| least | most | target |",
        "|---|---|---|---|---|---|",
    ]
    for kind, ratio in report["summary"]["ratios"].items():
        verdict = "met" if ratio["met"] else "**missed**"
        lines.append(
            f"| {kind} | {ratio['first']:.2f} | {ratio['median']:.2f} | {ratio['least']:.2f} "
            f"| {ratio['most']:.2f} | <= {ratio['target']:.2f} {verdict} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-hits-cpu-"))
    if args.fresh_numba_cache:  # before anything imports numba
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-", dir=work_dir)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    llm, vocab_size = make_llm(work_dir, args.tokens)
    for _ in range(2):
        ask(llm, list(range(3, 15)))
    load_at_start = os.getloadavg()[0]
    rounds = []
    for r in range(args.rounds):
        result = run_round(llm, vocab_size, args.tokens, 1000 * (r + 1), args.pairs)
        rounds.append(result)
        print(f"round {r}: {json.dumps(result)}", flush=True)
    full = max(rounds[0]["hit_tokens"]["engine"][0], 1)
    wrong = [
        (r, kind, got)
        for r, result in enumerate(rounds)
        for kind, hits in result["hit_tokens"].items()
        for got in hits
        if got != (0 if kind == "cold" else full)
    ]
    report = {
        "tokens": args.tokens,
        "rounds": args.rounds,
        "pairs": args.pairs,
        "fresh_numba_cache": args.fresh_numba_cache,
        "load_average": [load_at_start, os.getloadavg()[0]],
        "per_round": rounds,
        "summary": summarize(rounds),
    }
    print(table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    llm.llm_engine.engine_core.shutdown()
    if wrong:
        print(f"hits that are not full hits (round, request, tokens): {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
