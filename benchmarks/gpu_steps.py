"""A simulated engine for ``bench_gpu.py``: vLLM's step loop on KV caches on a device.

Drives the engine-neutral connector (a real ``ConnectorScheduler`` and
``ConnectorWorker`` over real tiers) the way vLLM 0.32's worker does, each
step: metadata -> fence -> loads -> the forward pass -> save -> poll. The
forward pass is matrix products sized by the tokens scheduled (a stand-in for
the model's compute) plus writes of every scheduled token's block (KV
written where vLLM would write it); the step ends with a device sync, as
vLLM's does to read sampled tokens. The same steps run without the connector
give the baseline. Blocks come from one pool shared by the groups; a request
keeps its blocks until it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.setup import lookup_for_store, lower_switch_interval
from hybridkv.connector.steps import ScheduledRequest, StepInput
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import ModelGroups
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.allocate import AllocatedKVCaches
from hybridkv.transfer import TransferConfig


@dataclass
class _Request:
    req_id: str
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int = 0
    new: bool = True
    waiting_load: bool = False


@dataclass
class StepTimes:
    """Wall time of each step, by phase."""

    by_phase: dict[str, list[float]] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.by_phase.setdefault(phase, []).append(seconds)

    def total(self, phase: str) -> float:
        return sum(self.by_phase.get(phase, []))


class StepEngine:
    """vLLM's step loop over ``caches``; with ``store`` None, no connector at all."""

    def __init__(
        self,
        model_groups: ModelGroups,
        caches: AllocatedKVCaches,
        store: TieredStore | None,
        *,
        flops_per_token: int,
        transfer: TransferConfig | None = None,
    ) -> None:
        self.model_groups = model_groups
        self.caches = caches
        self.device = caches.canonical.device
        self.num_blocks = caches.canonical.num_blocks
        self.free_ids = list(range(1, self.num_blocks))
        self.requests: dict[str, _Request] = {}
        self.times = StepTimes()
        self._num_steps = 0
        # The model's stand-in: a square product of this size per token group.
        self._dim = 2048
        self._weight = torch.randn(self._dim, self._dim, device=self.device, dtype=self._dtype())
        self._products_per_token = max(1, flops_per_token // (2 * self._dim * self._dim))
        self.worker: ConnectorWorker | None = None
        self.scheduler: ConnectorScheduler | None = None
        if store is not None:
            # As ``build_worker`` does in vLLM's worker: the copy thread then waits at most
            # this long for the interpreter while the loop launches the forward pass.
            lower_switch_interval(ConnectorConfig.thread_switch_interval_s)
            self.worker = ConnectorWorker(model_groups, store, transfer_config=transfer)
            self.worker.register_kv_caches(caches.kv_caches)
            self.scheduler = ConnectorScheduler(model_groups, lookup_for_store(store))

    def _dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    # --- requests ---------------------------------------------------------------

    def add(self, req_id: str, tokens: Sequence[int]) -> int:
        """Admit a request; returns the tokens it loads from the connector's tiers."""
        req = _Request(req_id, list(tokens), [[] for _ in self.model_groups.groups])
        self.requests[req_id] = req
        if self.scheduler is None:
            return 0
        self.scheduler.add_request(req_id)
        hit = self.scheduler.lookup(req_id, req.tokens, 0).num_tokens
        if hit:
            self._allocate(req, hit)
            req.num_computed = hit
            req.waiting_load = True
        self.scheduler.allocated(req_id, req.block_ids, hit)
        return hit

    def finish(self, req_id: str) -> None:
        req = self.requests.pop(req_id)
        if self.scheduler is not None:
            self.scheduler.request_finished(req_id)
        for ids in req.block_ids:
            self.free_ids.extend(b for b in ids if b)

    def _allocate(self, req: _Request, end: int) -> list[list[int]]:
        new: list[list[int]] = []
        for g, group in enumerate(self.model_groups.groups):
            need = -(-end // group.block_size) - len(req.block_ids[g])
            if need > len(self.free_ids):
                raise RuntimeError("the simulated engine ran out of KV blocks; lower the work")
            taken = [self.free_ids.pop() for _ in range(max(0, need))]
            req.block_ids[g].extend(taken)
            new.append(taken)
        return new

    # --- one step -----------------------------------------------------------------

    def step(self, phase: str, budget: dict[str, int]) -> None:
        """Schedule ``budget[req_id]`` tokens per request and run the step."""
        start = time.perf_counter()
        scheduled: list[ScheduledRequest] = []
        for req_id, n in budget.items():
            req = self.requests[req_id]
            if req.waiting_load:
                continue
            n = min(n, len(req.tokens) - req.num_computed)
            if n <= 0:
                continue
            new_ids = self._allocate(req, req.num_computed + n)
            scheduled.append(
                ScheduledRequest(
                    req_id=req_id,
                    num_computed_tokens=req.num_computed,
                    num_scheduled_tokens=n,
                    token_ids=req.tokens,
                    new_block_ids=[list(ids) for ids in req.block_ids] if req.new else new_ids,
                    replaces_block_ids=req.new,
                )
            )
            req.new = False
        meta = None
        if self.scheduler is not None and self.worker is not None:
            meta = self.scheduler.build_metadata(StepInput(scheduled=scheduled))
            self.worker.fence(meta.written_block_ids)
            self.worker.start_loads(meta.loads)
        self._forward(scheduled)
        if meta is not None and self.worker is not None and self.scheduler is not None:
            self.worker.save(meta.stores)
            report = self.worker.poll()
            self.scheduler.process_report(report)
            for rank in report.ranks:
                for load in rank.finished_loads:
                    self.requests[load.req_id].waiting_load = False
                    self.requests[load.req_id].new = True
        for s in scheduled:
            self.requests[s.req_id].num_computed += s.num_scheduled_tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # vLLM reads the sampled tokens
        self.times.add(phase, time.perf_counter() - start)

    def _forward(self, scheduled: Sequence[ScheduledRequest]) -> None:
        num_tokens = sum(s.num_scheduled_tokens for s in scheduled)
        if not num_tokens:
            return
        rows = min(num_tokens, 8192)
        x = torch.ones(rows, self._dim, device=self.device, dtype=self._dtype())
        for _ in range(max(1, self._products_per_token * num_tokens // rows)):
            x = torch.mm(x, self._weight).clamp_(-1, 1)
        written: set[int] = set()
        for s in scheduled:
            req = self.requests[s.req_id]
            for g, group in enumerate(self.model_groups.groups):
                first = req.num_computed // group.block_size
                last = -(-(req.num_computed + s.num_scheduled_tokens) // group.block_size)
                written.update(req.block_ids[g][first:last])
        index = torch.tensor(sorted(written), device=self.device)
        self._num_steps += 1
        for tensor in self.caches.canonical.tensors:  # after the products, on their stream
            tensor.index_fill_(0, index, self._num_steps % 127)

    def wait_loads(self, phase: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(r.waiting_load for r in self.requests.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("loads did not finish")
            self.step(phase, {})
            time.sleep(0.0005)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.wait_idle(60)
            self.worker.close()
