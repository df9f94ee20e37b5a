"""The GPU data path against the PCIe link: copies, whole stores and loads, host time,
device memory, and a simulated engine's step time.

One command for a machine with one NVIDIA GPU. The limit is what contiguous
copies of the same bytes between device memory and pinned host memory carry
(one copy of the job, or 16 MiB copies back to back, whichever is faster),
measured in the same run (device to host for stores, host to device for
loads). Copies, stores, loads and the host time run both ways
``ChunkedCopies`` can move a piece's spans: one kernel launch per piece
(``fused``, CUDA with Triton) and one indexed op per span (``per_span``, the
baseline), so the gain is measured in the same run (``--device cpu`` has only
the second; in the JSON a copy row has each path's ratios under its name, a
job row and the host figures have the first path's at the top and the other's
under its name). Every figure is a ratio to the limit:

* ``copy``: ``BlockCopier`` gathers and scatters of random blocks of one
  group, into consecutive rows and into rows with 64 bytes of header room
  (a framing tier's staging), for page layouts vLLM 0.32 gives on GPU (its
  default ``LBNHC``, one page per layer; ``BLHNC``, block-major, when
  hybridkv asks) and pages of 4 KiB (DeepSeek-V4's small groups), 16 KiB,
  64 KiB and Mamba states; bytes checked against the CPU copier.
* ``store``/``load``: 512 MiB through ``TransferEngine`` into the CPU tier
  (``cpu``) and the CPU tier with a disk tier behind it (``cpu+disk``), in
  jobs as the connector cuts them (a quarter of the staging arena at most),
  from the first submit to the last result; bytes checked after the load.
* ``host``: how long a store call holds the calling thread while compute is
  queued on the device (target: under 1 ms), each path.
* ``device``: the device memory the copies took beyond the KV cache.
* ``engine``: the engine-neutral connector driven like vLLM's worker over
  a simulated run (prefill of long prompts, decode of many requests, hits
  loaded); step time added over the same steps without hybridkv (target:
  at most 3% with every prefill stored).

Targets: copy and framed rows >= 0.90; store and load through the CPU tier
>= 0.80. Prints a table; ``--json`` writes every figure. ``--device cpu``
runs the same code on CPU tensors (the chunked path's logic; no targets).

    python benchmarks/bench_gpu.py [--quick] [--json PATH] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridkv.connector.worker import JOB_SHARE
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import BlockCopier, TransferConfig, TransferEngine, TransferPart
from hybridkv.transfer.chunked import FUSED_ENV
from hybridkv.transfer.copier import HostRows

sys.path.insert(0, str(Path(__file__).parent))
from gpu_steps import StepEngine

MIB = 1 << 20
LAYOUTS = {"LBNHC": KVLayoutKind.LAYER_MAJOR, "BLHNC": KVLayoutKind.BLOCK_MAJOR}
"""vLLM's GPU page layouts, by the storage kind they give a group's blocks."""


def model(
    name: str, num_layers: int, page_bytes: int, block_size: int, second: GroupKind
) -> ModelGroups:
    def group(kind: GroupKind, prefix: str) -> KVGroup:
        return KVGroup(
            kind=kind,
            block_size=block_size,
            page_size_bytes=page_bytes,
            layer_names=tuple(f"{prefix}.{i}" for i in range(num_layers)),
            sliding_window=1024 if kind is GroupKind.SLIDING_WINDOW else None,
        )

    return ModelGroups(groups=(group(GroupKind.FULL, "f"), group(second, "s")), model_id=name)


CASES = {
    "4 KiB pages x 8 (DeepSeek-V4-like)": model("dsv4", 8, 4 << 10, 4, GroupKind.SLIDING_WINDOW),
    "16 KiB pages x 13 (Gemma 3 1B-like)": model("g1b", 13, 16 << 10, 16, GroupKind.SLIDING_WINDOW),
    "64 KiB pages x 16 (8B-like)": model("8b", 16, 64 << 10, 16, GroupKind.SLIDING_WINDOW),
    "256 KiB Mamba states x 8": model("mamba", 8, 256 << 10, 16, GroupKind.MAMBA),
}


@contextmanager
def copy_path(path: str) -> Iterator[None]:
    """Copiers made inside move spans ``path``'s way: ``fused`` or ``per_span``."""
    saved = os.environ.get(FUSED_ENV)
    os.environ[FUSED_ENV] = "1" if path == "fused" else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[FUSED_ENV]
        else:
            os.environ[FUSED_ENV] = saved


class Bench:
    def __init__(self, device: torch.device, job_bytes: int, reps: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        fused = self.cuda and importlib.util.find_spec("triton") is not None
        self.paths = ["fused", "per_span"] if fused else ["per_span"]
        """The ways to move spans measured, the default (where it runs) first."""
        self.job_bytes = job_bytes
        self.reps = reps
        self.report: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if self.cuda else "cpu",
            "torch": torch.__version__,
            "job_MiB": job_bytes / MIB,
            "paths": self.paths,
        }

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object]) -> float:
        """Median wall seconds of ``fn`` with the device idle before and after."""
        fn()
        times = []
        for _ in range(self.reps):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def pinned(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.cuda)

    # --- the limit ----------------------------------------------------------------

    def limit(self) -> None:
        """The link: the faster of one contiguous copy of the job and the same bytes
        in contiguous 16 MiB copies back to back (on one H100 the one large host to
        device copy ran at 40 GB/s where the pieces ran at 51), per direction."""
        dev = torch.empty(self.job_bytes, dtype=torch.uint8, device=self.device)
        host = self.pinned(self.job_bytes)
        step = min(16 * MIB, self.job_bytes)

        def pieces(dst: torch.Tensor, src: torch.Tensor) -> None:
            for start in range(0, self.job_bytes, step):
                dst[start : start + step].copy_(src[start : start + step], non_blocking=True)

        d2h = min(
            self.timed(lambda: host.copy_(dev, non_blocking=True)),
            self.timed(lambda: pieces(host, dev)),
        )
        h2d = min(
            self.timed(lambda: dev.copy_(host, non_blocking=True)),
            self.timed(lambda: pieces(dev, host)),
        )
        self.report["limit_GBps"] = {
            "d2h": self.job_bytes / d2h / 1e9,
            "h2d": self.job_bytes / h2d / 1e9,
        }

    def ratio(self, num_bytes: int, seconds: float, direction: str) -> float:
        return num_bytes / seconds / 1e9 / self.report["limit_GBps"][direction]

    # --- copies -------------------------------------------------------------------

    def copies(self) -> None:
        rows = []
        for label, spec in CASES.items():
            for layout_name, kind in LAYOUTS.items():
                rows.append({"case": label, "layout": layout_name, **self._copy_case(spec, kind)})
                print("copy", json.dumps(rows[-1]), flush=True)
        self.report["copy"] = rows

    def _copy_case(self, spec: ModelGroups, kind: KVLayoutKind) -> dict[str, Any]:
        block_bytes = spec.groups[0].block_bytes
        n = max(2, self.job_bytes // block_bytes)
        num_blocks = 2 * n + 1
        alloc = allocate_kv_caches(spec, num_blocks, kind=kind, device=self.device)
        alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
        ids = random.Random(0).sample(range(num_blocks), n)
        stride = block_bytes + 64
        host = self.pinned((n - 1) * stride + block_bytes)
        tight = HostRows(host, np.arange(n, dtype=np.int64) * block_bytes)
        framed = HostRows(host, np.arange(n, dtype=np.int64) * stride, scratch_gaps=True)
        row: dict[str, Any] = {"block_KiB": block_bytes >> 10, "blocks": n, "bytes_equal": True}
        for path in self.paths:
            base = torch.cuda.memory_allocated(self.device) if self.cuda else 0
            with copy_path(path):
                copier = BlockCopier(alloc.canonical, chunked=True)
            row["bytes_equal"] &= self._check_bytes(spec, kind, alloc.buffer, ids, copier, tight)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            times = self._copy_times(copier, ids, tight, framed)
            peak = torch.cuda.max_memory_allocated(self.device) - base if self.cuda else 0
            row[path] = {
                k: self.ratio(n * block_bytes, t, "d2h" if "gather" in k else "h2d")
                for k, t in times.items()
            }
            row["device_extra_MiB"] = max(row.get("device_extra_MiB", 0.0), peak / MIB)
            row["copier_device_MiB"] = copier.device_bytes / MIB
        return row

    def _copy_times(
        self, copier: BlockCopier, ids: list[int], tight: HostRows, framed: HostRows
    ) -> dict[str, float]:
        def run(op: Callable[..., object], rows: HostRows) -> Callable[[], object]:
            return lambda: (op(0, ids, rows), copier.wait_done(copier.copies_mark()))

        return {
            "gather": self.timed(run(copier.gather_at, tight)),
            "scatter": self.timed(run(copier.scatter_at, tight)),
            "gather_framed": self.timed(run(copier.gather_at, framed)),
            "scatter_framed": self.timed(run(copier.scatter_at, framed)),
        }

    def _check_bytes(
        self,
        spec: ModelGroups,
        kind: KVLayoutKind,
        buffer: torch.Tensor,
        ids: list[int],
        copier: BlockCopier,
        rows: HostRows,
    ) -> bool:
        """Gather and scatter against the CPU's native copier on the same contents."""
        reference = allocate_kv_caches(spec, 2 * len(ids) + 1, kind=kind)
        reference.buffer.copy_(buffer.cpu())
        native = BlockCopier(reference.canonical, chunked=False)
        want = np.zeros(len(ids) * spec.groups[0].block_bytes, np.uint8)
        native.gather(0, ids, want)
        copier.gather_at(0, ids, rows)
        copier.wait_done(copier.copies_mark())
        gathered = np.array_equal(rows.memory[: want.size].numpy(), want)
        saved = buffer.clone()
        buffer.zero_()
        reference.buffer.zero_()
        copier.scatter_at(0, ids, rows)
        copier.wait_done(copier.copies_mark())
        native.scatter(0, ids, want)
        scattered = torch.equal(buffer.cpu(), reference.buffer)
        buffer.copy_(saved)
        return bool(gathered and scattered)

    # --- whole jobs through the tiers --------------------------------------------------

    def jobs(self, cache_dir: Path) -> None:
        spec = CASES["64 KiB pages x 16 (8B-like)"]
        block_bytes = spec.groups[0].block_bytes
        n = max(2, self.job_bytes // block_bytes)
        rows = []
        setups = {  # the defaults through each stack, then one knob changed each
            "cpu": ("cpu", TransferConfig()),
            "cpu+disk": ("cpu+disk", TransferConfig()),
            "cpu, 2 workers": ("cpu", TransferConfig(num_workers=2)),
            "cpu, 64 MiB chunk": ("cpu", TransferConfig(device_chunk_bytes=64 * MIB)),
        }
        for label, (tiers, config) in setups.items():
            row: dict[str, Any] = {"tiers": label}
            for path in self.paths:  # the default path's figures first, at the row's top
                alloc = allocate_kv_caches(
                    spec, 2 * n + 1, kind=KVLayoutKind.LAYER_MAJOR, device=self.device
                )
                alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
                path_dir = cache_dir / f"{label}-{path}"
                store = self._store(tiers, 2 * n * block_bytes + 64 * MIB, path_dir)
                with copy_path(path), TransferEngine(alloc.canonical, store, config) as engine:
                    figures = self._job_case(engine, alloc.buffer, n, block_bytes)
                store.close()
                if path == self.paths[0]:
                    row.update(figures)
                else:
                    row[path] = figures
                del alloc
            rows.append(row)
            print("jobs", json.dumps(rows[-1]), flush=True)
        self.report["jobs"] = rows

    def _store(self, tiers: str, cpu_bytes: int, path: Path) -> TieredStore:
        cpu = CpuTier(CpuConfig(capacity_bytes=cpu_bytes))
        if tiers == "cpu":
            return TieredStore([cpu])
        disk = DiskTier(DiskConfig(path=str(path), capacity_bytes=2 * cpu_bytes))
        return TieredStore([cpu, disk])

    def _job_case(
        self, engine: TransferEngine, buffer: torch.Tensor, n: int, block_bytes: int
    ) -> dict[str, Any]:
        """The ``n`` blocks stored, then loaded, in jobs as the connector cuts them (at
        most 1/JOB_SHARE of the staging arena each); from the first submit to the last
        result."""
        ids = random.Random(1).sample(range(1, 2 * n + 1), n)
        per_job = max(1, engine.max_job_bytes // JOB_SHARE // block_bytes)
        saved = buffer.clone()
        store_s, load_s, host_ms, equal = [], [], [], True
        for rep in range(self.reps):
            keys = [StoreKey(f"bench/{rep}/{i}") for i in range(n)]
            parts = [
                TransferPart(0, ids[i : i + per_job], keys[i : i + per_job])
                for i in range(0, n, per_job)
            ]
            self.sync()
            seconds, calls, ok = self._move_all(engine, engine.submit_store, parts)
            store_s.append(seconds)
            host_ms += calls
            for tensor in engine.caches.tensors:  # wipe the stored blocks only
                tensor[ids] = 0
            self.sync()
            seconds, _, loaded = self._move_all(engine, engine.submit_load, parts)
            load_s.append(seconds)
            equal &= ok and loaded and torch.equal(buffer, saved)
            buffer.copy_(saved)
        nbytes = n * block_bytes
        return {
            "MiB": nbytes / MIB,
            "jobs": len(parts),
            "store": self.ratio(nbytes, statistics.median(store_s), "d2h"),
            "load": self.ratio(nbytes, statistics.median(load_s), "h2d"),
            "submit_ms": statistics.median(host_ms),
            "bytes_equal": equal,
        }

    @staticmethod
    def _move_all(
        engine: TransferEngine,
        submit: Callable[[list[TransferPart]], Any],
        parts: list[TransferPart],
    ) -> tuple[float, list[float], bool]:
        """Submit one job per part, waiting for the oldest while staging is full;
        (seconds until every result, each submit call's ms, every block OK)."""
        start = time.perf_counter()
        pending: list[Any] = []
        calls: list[float] = []
        results = []
        for part in parts:
            while True:
                called = time.perf_counter()
                job = submit([part])
                calls.append((time.perf_counter() - called) * 1e3)
                if job is not None:
                    pending.append(job)
                    break
                assert pending and engine.wait([pending.pop(0)], 120), "staging never freed"
                results += engine.poll_finished()
        assert engine.wait(pending, 120)
        seconds = time.perf_counter() - start
        results += engine.poll_finished()
        ok = len(results) == len(parts) and all(r.ok and not r.num_failed for r in results)
        return seconds, calls, ok

    # --- the host time of a store call with compute queued ---------------------------

    def host_time(self) -> None:
        """The first path's figures, and each other path's under its name."""
        host: dict[str, Any] = {}
        for path in self.paths:
            with copy_path(path):
                figures = self._host_case()
            if path == self.paths[0]:
                host.update(figures)
            else:
                host[path] = figures
        self.report["host"] = host
        print("host", json.dumps(host), flush=True)

    def _host_case(self) -> dict[str, Any]:
        spec = CASES["16 KiB pages x 13 (Gemma 3 1B-like)"]
        blocks_per_step = 4096 // spec.groups[0].block_size  # one 4096-token prefill step
        alloc = allocate_kv_caches(spec, 4 * blocks_per_step + 1, device=self.device)
        store = TieredStore([CpuTier(CpuConfig(capacity_bytes=256 * MIB))])
        weight = torch.randn(4096, 4096, device=self.device)
        calls = []
        with TransferEngine(alloc.canonical, store) as engine:
            for rep in range(self.reps):
                for _ in range(8 if self.cuda else 1):  # tens of ms of compute queued
                    weight = torch.mm(weight, weight).clamp_(-1, 1)
                ids = list(range(1, blocks_per_step + 1))
                parts = [
                    TransferPart(g, ids, [StoreKey(f"host/{rep}/{g}/{i}") for i in ids])
                    for g in range(spec.num_groups)
                ]
                start = time.perf_counter()
                job = engine.submit_store(parts)
                calls.append((time.perf_counter() - start) * 1e3)
                assert job is not None and engine.wait([job], 60)
                engine.poll_finished()
        store.close()
        return {
            "blocks_per_call": blocks_per_step * spec.num_groups,
            "store_call_ms": statistics.median(calls),
            "asynchronous": self.cuda,
        }

    # --- the simulated engine ------------------------------------------------------------

    def engine(self, quick: bool) -> None:
        spec = CASES["64 KiB pages x 16 (8B-like)"]
        prompt_tokens, num_prompts = (1024, 2) if quick else (8192, 8)
        num_decoding, decode_steps = (4, 4) if quick else (64, 32)
        block_size = spec.groups[0].block_size
        blocks_needed = (
            3 * spec.num_groups * (num_prompts * prompt_tokens + num_decoding * 64) // block_size
        )
        figures: dict[str, Any] = {}
        # An 8B model's compute per token on a GPU; a thousandth of it on CPU tensors.
        flops_per_token = 2 * 8 * 10**9 // (1 if self.cuda else 1000)
        if self.cuda:  # the first products pay for the BLAS set-up: not the baseline's cost
            for rows in (2048, num_decoding):
                x = torch.ones(rows, 2048, device=self.device, dtype=torch.bfloat16)
                torch.mm(x, torch.ones(2048, 2048, device=self.device, dtype=x.dtype))
            self.sync()
        for with_connector in (False, True):
            alloc = allocate_kv_caches(
                spec, blocks_needed + 1, kind=KVLayoutKind.LAYER_MAJOR, device=self.device
            )
            store = (
                TieredStore(
                    [CpuTier(CpuConfig(capacity_bytes=blocks_needed * spec.groups[0].block_bytes))]
                )
                if with_connector
                else None
            )
            sim = StepEngine(spec, alloc, store, flops_per_token=flops_per_token)
            rng = np.random.default_rng(5)
            prompts = [rng.integers(3, 30000, prompt_tokens).tolist() for _ in range(num_prompts)]
            for i, tokens in enumerate(prompts):  # prefill, in chunks of 2048 tokens
                sim.add(f"p{i}", tokens)
                while sim.requests[f"p{i}"].num_computed < prompt_tokens:
                    sim.step("prefill", {f"p{i}": 2048})
            decoders = [f"d{i}" for i in range(num_decoding)]
            for req_id in decoders:
                sim.add(req_id, rng.integers(3, 30000, 64 + decode_steps).tolist())
            sim.step("prefill", {r: 64 for r in decoders})
            for _ in range(decode_steps):
                sim.step("decode", {r: 1 for r in decoders})
            for i in range(num_prompts):
                sim.finish(f"p{i}")
            start = time.perf_counter()
            hits = [sim.add(f"again{i}", tokens) for i, tokens in enumerate(prompts)]
            sim.wait_loads("hit")
            for i in range(num_prompts):  # the last tokens (all of them without a hit)
                while sim.requests[f"again{i}"].num_computed < prompt_tokens:
                    sim.step("hit", {f"again{i}": 2048})
            name = "hybridkv" if with_connector else "alone"
            figures[name] = {
                "prefill_s": sim.times.total("prefill"),
                "decode_s": sim.times.total("decode"),
                "hit_phase_s": time.perf_counter() - start,
                "hit_tokens": sum(hits),
            }
            sim.close()
            if store is not None:
                store.close()
        alone, ours = figures["alone"], figures["hybridkv"]
        figures["prefill_added"] = ours["prefill_s"] / alone["prefill_s"] - 1
        figures["decode_added"] = ours["decode_s"] / alone["decode_s"] - 1
        self.report["engine"] = figures
        print("engine", json.dumps(figures), flush=True)


def table(report: dict[str, Any]) -> str:
    limit = report["limit_GBps"]
    lines = [
        f"{report['device']}, torch {report['torch']}, {report['job_MiB']:.0f} MiB per job",
        f"limit (pinned): {limit['d2h']:.1f} GB/s device->host, {limit['h2d']:.1f} host->device",
        "",
        "copies, ratio to the limit: gather, scatter, then both into framed rows; "
        "fused kernel | one op per span",
        f"{'':40} {'layout':6} {'gather':>6} {'scatter':>7} {'framed':>6} {'framed':>6} | "
        f"{'gather':>6} {'scatter':>7} {'framed':>6} {'framed':>6} {'device':>7} bytes",
    ]
    for row in report.get("copy", []):
        lines.append(
            f"{row['case']:40} {row['layout']:6} {_ratios(row.get('fused'))} | "
            f"{_ratios(row['per_span'])} "
            f"{row['device_extra_MiB']:3.0f} MiB {'ok' if row['bytes_equal'] else 'WRONG'}"
        )
    lines.append("")
    first = report["paths"][0].replace("_", "-")
    for row in report.get("jobs", []):
        others = "".join(
            f" ({p.replace('_', '-')}: store {row[p]['store']:.2f}, load {row[p]['load']:.2f},"
            f" submit {row[p]['submit_ms']:.2f} ms)"
            for p in report["paths"][1:]
        )
        ok = row["bytes_equal"] and all(row[p]["bytes_equal"] for p in report["paths"][1:])
        lines.append(
            f"{row['MiB']:.0f} MiB in {row['jobs']} jobs through {row['tiers']:17} {first}: "
            f"store {row['store']:.2f}, "
            f"load {row['load']:.2f} of the limit; submit {row['submit_ms']:.2f} ms{others}; "
            f"{'bytes ok' if ok else 'BYTES WRONG'}"
        )
    if "host" in report:
        host = report["host"]
        others = "".join(
            f", {p.replace('_', '-')}: {host[p]['store_call_ms']:.3f} ms"
            for p in report["paths"][1:]
        )
        lines.append(
            f"a store call with compute queued: {first}: {host['store_call_ms']:.3f} ms"
            f"{others} ({host['blocks_per_call']} blocks)"
        )
    if "engine" in report:
        eng, ours, alone = report["engine"], report["engine"]["hybridkv"], report["engine"]["alone"]
        lines.append(
            f"simulated engine, step time added: prefill {eng['prefill_added']:+.1%}, "
            f"decode {eng['decode_added']:+.1%}; hits: {ours['hit_phase_s']:.3f} s "
            f"({ours['hit_tokens']} tokens loaded), recomputed: {alone['hit_phase_s']:.3f} s"
        )
    return "\n".join(lines)


def _ratios(ratios: dict[str, float] | None) -> str:
    """One path's four copy ratios as table columns (dashes where it did not run)."""
    keys = ("gather", "scatter", "gather_framed", "scatter_framed")
    widths = (6, 7, 6, 6)
    if ratios is None:
        return " ".join(f"{'-':>{w}}" for w in widths)
    return " ".join(f"{ratios[k]:{w}.2f}" for k, w in zip(keys, widths, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small jobs, few repetitions")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; --device cpu runs the same code on CPU tensors")
        return 2
    job_bytes = (16 if args.quick else 512) * MIB
    bench = Bench(device, job_bytes, args.reps or (2 if args.quick else 5))
    bench.limit()
    bench.copies()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-gpu-") as tmp:
        bench.jobs(Path(tmp))
    bench.host_time()
    bench.engine(args.quick)
    print(table(bench.report))
    if args.json:
        args.json.write_text(json.dumps(bench.report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
