"""The simulated engine: a real ``ConnectorScheduler`` and a real ``ConnectorWorker`` (real
tiers) driven the way vLLM 0.32 drives them, step by step.

Runs in one process, the test's or the benchmark's: the scheduler side and
the worker side of the connector, and the engine between them. A step goes
lookup -> allocate -> metadata -> forward -> loads -> save -> report. The
block manager follows vLLM's rules for the hybrid allocator: one block pool
shared by every group (block 0 is the null block), sliding-window blocks
freed once out of the window of the tokens computed before a step, align-mode
Mamba keeping only the state block of the last step. The forward pass writes
what ``model`` computes into the tensors of ``shapes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.connector.metadata import (
    BlockRef,
    ConnectorMetadata,
    LoadOutcome,
    LoadResult,
    WorkerReport,
)
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.steps import ScheduledRequest, StepInput
from hybridkv.connector.worker import ConnectorWorker
from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.tools.sim.model import next_state, token_kv
from hybridkv.tools.sim.shapes import (
    HEAD_DIM,
    MAMBA_STATE_BYTES,
    NUM_KV_HEADS,
    make_kv_caches,
)


@dataclass
class SimRequest:
    req_id: str
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int = 0
    waiting_load: bool = False
    finished: bool = False
    new: bool = True
    """The next scheduling sends the whole block table (new or resumed)."""
    outcomes: list[LoadResult] = field(default_factory=list)
    """How each of its loads ended, as the worker reported it."""


class SimEngine:
    """Drives a scheduler/worker pair like vLLM (see the module docstring)."""

    def __init__(
        self,
        model_groups: ModelGroups,
        scheduler: ConnectorScheduler,
        worker: ConnectorWorker,
        *,
        num_blocks: int = 256,
        reuse_freed_first: bool = False,
        fence: bool = True,
    ) -> None:
        self.model_groups = model_groups
        self.scheduler = scheduler
        self.worker = worker
        self.num_blocks = num_blocks
        self.kv = make_kv_caches(model_groups, num_blocks)
        worker.register_kv_caches(self.kv)
        self.free_ids = list(range(1, num_blocks))
        self.reuse_freed_first = reuse_freed_first
        """Hand out the most recently freed block first (the hazard for late stores)."""
        self.fence = fence
        """Tell the worker which blocks a step writes before writing them, as vLLM's
        connector does; False is an engine that writes them at once (to show the
        hazard)."""
        self.last_meta: ConnectorMetadata | None = None
        self.metas: list[ConnectorMetadata] = []
        self.handed_out: list[tuple[str, int, int]] = []
        """(req_id, group_id, block_id) for every block handed out, in order."""
        self.requests: dict[str, SimRequest] = {}
        self.reports: list[WorkerReport] = []
        self.preempted: set[str] = set()

    # --- blocks ---------------------------------------------------------------

    def _take(self) -> int:
        return self.free_ids.pop() if self.reuse_freed_first else self.free_ids.pop(0)

    def _free(self, block_id: int) -> None:
        if block_id:
            self.free_ids.append(block_id)

    def _retire(self, req: SimRequest) -> None:
        """vLLM's remove_skipped_blocks, before a step, from ``num_computed``."""
        for g, group in enumerate(self.model_groups.groups):
            ids = req.block_ids[g]
            if group.kind is GroupKind.SLIDING_WINDOW:
                assert group.sliding_window is not None
                skipped = max(0, req.num_computed - group.sliding_window + 1) // group.block_size
            elif group.kind is GroupKind.MAMBA:
                skipped = max(0, -(-req.num_computed // group.block_size) - 1)
            else:
                continue
            for i in range(min(skipped, len(ids))):
                self._free(ids[i])
                ids[i] = 0

    def _allocate(self, req: SimRequest, end: int, *, hit_tokens: int | None = None) -> None:
        """Blocks up to token ``end``; for a hit, only the blocks each kind keeps."""
        for g, group in enumerate(self.model_groups.groups):
            ids = req.block_ids[g]
            need = -(-end // group.block_size)
            while len(ids) < need:
                i = len(ids)
                keep = True
                if hit_tokens is not None and group.kind is GroupKind.SLIDING_WINDOW:
                    assert group.sliding_window is not None
                    first = max(0, hit_tokens - group.sliding_window + 1) // group.block_size
                    keep = i >= first
                elif group.kind is GroupKind.MAMBA:
                    keep = i == need - 1  # align mode: only the state block of the step end
                block_id = self._take() if keep else 0
                if block_id:
                    self.handed_out.append((req.req_id, g, block_id))
                ids.append(block_id)

    def free_request(self, req_id: str) -> None:
        req = self.requests.pop(req_id)
        for ids in req.block_ids:
            for b in ids:
                self._free(b)

    # --- requests ----------------------------------------------------------------

    def add(
        self, req_id: str, tokens: Sequence[int], *, cache_salt: str | None = None, cached: int = 0
    ) -> int:
        """Admit a request: lookup, allocate; returns the tokens it will load. The engine's
        own prefix cache serves its first ``cached`` tokens (in the blocks kinds keep)."""
        req = SimRequest(req_id, list(tokens), [[] for _ in self.model_groups.groups])
        self.requests[req_id] = req
        if cached:
            self._allocate(req, cached, hit_tokens=cached)
            self._compute(req, cached)
        self.scheduler.add_request(req_id, cache_salt=cache_salt)
        return self._admit(req)

    def _admit(self, req: SimRequest) -> int:
        result = self.scheduler.lookup(req.req_id, req.tokens, req.num_computed)
        if result.num_tokens:
            end = req.num_computed + result.num_tokens
            self._allocate(req, end, hit_tokens=end)
            self.scheduler.allocated(req.req_id, req.block_ids, result.num_tokens)
            req.waiting_load = True
            req.num_computed = end
        else:
            self.scheduler.allocated(req.req_id, req.block_ids, 0)
        return result.num_tokens

    def preempt(self, req_id: str) -> None:
        """Free every block; the request starts over (and may hit the store)."""
        req = self.requests[req_id]
        for ids in req.block_ids:
            for b in ids:
                self._free(b)
        req.block_ids = [[] for _ in self.model_groups.groups]
        req.num_computed = 0
        req.new = True
        self.preempted.add(req_id)

    def readmit(self, req_id: str) -> int:
        return self._admit(self.requests[req_id])

    def finish(self, req_id: str) -> bool:
        """The engine finishes a request; True if its blocks must wait for the worker."""
        hold = self.scheduler.request_finished(req_id)
        self.worker.finish_requests({req_id})
        if hold:
            self.requests[req_id].finished = True
        else:
            self.free_request(req_id)
        return hold

    # --- one engine step -----------------------------------------------------------

    def step(self, budget: dict[str, int] | None = None) -> WorkerReport:
        """Schedule ``budget[req_id]`` tokens per request and run the step.

        ``budget=None`` schedules every request's remaining tokens; ``{}`` none
        (a step that only moves loads and stores along).
        """
        scheduled: list[ScheduledRequest] = []
        for req in self.requests.values():
            if req.waiting_load or (budget is not None and req.req_id not in budget):
                continue
            todo = len(req.tokens) - req.num_computed
            n = todo if budget is None else min(budget[req.req_id], todo)
            if n <= 0:
                continue
            self._retire(req)
            before = [len(ids) for ids in req.block_ids]
            self._allocate(req, req.num_computed + n)
            new_ids = (
                [list(ids) for ids in req.block_ids]
                if req.new
                else [ids[k:] for ids, k in zip(req.block_ids, before, strict=True)]
            )
            scheduled.append(
                ScheduledRequest(
                    req_id=req.req_id,
                    num_computed_tokens=req.num_computed,
                    num_scheduled_tokens=n,
                    token_ids=req.tokens,
                    new_block_ids=new_ids,
                    replaces_block_ids=req.new,
                )
            )
            req.new = False
        meta = self.scheduler.build_metadata(
            StepInput(scheduled=scheduled, preempted_req_ids=frozenset(self.preempted))
        )
        self.preempted.clear()
        self.last_meta = meta
        self.metas.append(meta)
        self.worker.cancel(meta.cancelled_req_ids)
        if self.fence:
            self.worker.fence(meta.written_block_ids)
        for s in scheduled:  # the forward pass
            self._compute(self.requests[s.req_id], s.num_scheduled_tokens)
        self.worker.start_loads(meta.loads)
        self.worker.save(meta.stores, meta.mode)
        self.worker.admit(meta.admitted)
        report = self.worker.poll()
        self._take_report(report)
        return report

    def _take_report(self, report: WorkerReport) -> None:
        self.reports.append(report)
        self.scheduler.process_report(report)
        for rank in report.ranks:
            for result in rank.finished_loads:
                req = self.requests.get(result.req_id)
                if req is None:
                    continue
                req.outcomes.append(result)
                req.waiting_load = False
                req.new = True
                if req.finished:
                    self.free_request(req.req_id)
                elif not result.ok:
                    self._recover(req, result)

    def reported(self, what: str) -> list[BlockRef]:
        """Blocks the worker reported ``stored``, ``missing`` or ``dropped`` so far."""
        return [ref for rep in self.reports for rank in rep.ranks for ref in getattr(rank, what)]

    def finished_loads(self) -> list[LoadResult]:
        return [r for rep in self.reports for rank in rep.ranks for r in rank.finished_loads]

    def _recover(self, req: SimRequest, result: LoadResult) -> None:
        """vLLM 0.32 after a failed load: one full-attention group keeps the prefix before
        its first failed block (invalid block ids); otherwise the request starts over
        (failed_recving), asking the connector again."""
        groups = self.model_groups.groups
        failed = set(result.failed_block_ids[0]) if result.failed_block_ids else set()
        if (
            len(groups) == 1
            and groups[0].kind is GroupKind.FULL
            and (result.outcome is LoadOutcome.FAILED and failed)
        ):
            ids = req.block_ids[0]
            first = min(i for i, b in enumerate(ids) if b in failed)
            req.num_computed = min(req.num_computed, first * groups[0].block_size)
            return
        for ids in req.block_ids:
            for b in ids:
                self._free(b)
        req.block_ids = [[] for _ in self.model_groups.groups]
        req.num_computed = 0
        self._admit(req)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Let the worker finish every job and deliver the results."""
        self.worker.wait_idle(timeout_s)
        self._take_report(self.worker.poll())

    def _compute(self, req: SimRequest, n: int) -> None:
        start, end = req.num_computed, req.num_computed + n
        for g, group in enumerate(self.model_groups.groups):
            ids = req.block_ids[g]
            bs = group.block_size
            for layer in group.layer_names:
                t = self.kv[layer]
                if group.kind is GroupKind.MAMBA:
                    prev = self.state_bytes(req, g, layer, start) if start else None
                    state = next_state(
                        prev or bytes(MAMBA_STATE_BYTES), req.tokens[start:end], layer
                    )
                    row = torch.frombuffer(bytearray(state), dtype=torch.int8)
                    t[ids[-(-end // bs) - 1], 0, 0] = row
                    continue
                for p in range(start, end):
                    if ids[p // bs]:  # not a block the engine left out
                        t[ids[p // bs], :, p % bs, :] = token_kv(req.tokens, p, layer)
        req.num_computed = end

    # --- reading KV back ---------------------------------------------------------------

    def state_bytes(self, req: SimRequest, group_id: int, layer: str, num_tokens: int) -> bytes:
        bs = self.model_groups.groups[group_id].block_size
        block = req.block_ids[group_id][-(-num_tokens // bs) - 1]
        assert block != 0, f"no state block for {num_tokens} tokens"
        return bytes(self.kv[layer][block, 0, 0].numpy().tobytes())

    def block_bytes(self, group_id: int, block_id: int) -> bytes:
        group = self.model_groups.groups[group_id]
        out = b""
        for layer in group.layer_names:
            t = self.kv[layer]
            out += t[block_id].contiguous().view(torch.int8).numpy().tobytes()
        return out

    def expected_block(self, tokens: Sequence[int], group_id: int, index: int) -> bytes:
        """What a cold run writes into block ``index`` of an attention group."""
        group = self.model_groups.groups[group_id]
        bs = group.block_size
        out = b""
        for layer in group.layer_names:
            rows = torch.zeros(NUM_KV_HEADS, bs, 2 * HEAD_DIM, dtype=torch.float32)
            for p in range(index * bs, (index + 1) * bs):
                rows[:, p % bs, :] = token_kv(tokens, p, layer)
            out += rows.view(torch.int8).numpy().tobytes()
        return out
