"""vLLM's own scheduler and KV cache manager driving hybridkv, over a simulated worker.

Test helper, for configurations vLLM's CPU build cannot run (a Mamba2 model
with prefix caching; any Mamba model with speculative decoding): both fail in
vLLM itself, without a connector. ``SimVllmEngine`` is an engine core's loop:

* scheduler process: vLLM's ``Scheduler`` with its real ``KVCacheManager``,
  built from the specs the model's layers declare (``tests.support.vllm_configs``),
  and hybridkv's ``HybridKVConnector`` in the scheduler role, which vLLM's
  scheduler builds and calls itself (lookups, allocation, metadata, reports,
  the Mamba states it hands over in ``boundary_state_offloads``);
* worker: ``SimWorker``, a model runner over real KV tensors
  (``hybridkv.tools.allocate``) with ``HybridKVConnector`` in the worker role over
  real tiers (CPU memory and a disk directory), called in the order vLLM's GPU
  model runner calls it. Its "model" writes, per token, attention KV derived
  from the token prefix (``hybridkv.tools.sim.model.token_kv``) and, per Mamba layer,
  a state derived from the previous state and the token (``sim.next_state``).
  Mamba states go where vLLM's GPU model runner puts them in "align" mode
  (``vllm/v1/worker/mamba_utils.py``): the running state in column
  ``cdiv(computed + scheduled, block_size) - 1``, copied there from the previous
  one (``preprocess_mamba``); with drafts, one state per drafted position in the
  next columns, the accepted one read back at an offset, and the state at a
  block boundary the accepted tokens crossed copied into that boundary's column
  (``postprocess_mamba_fused_kernel``); prefill checkpoints where vLLM's
  ``compute_mamba_prefill_checkpoints`` puts them. Sampled tokens are a digest
  of the attention KV of every position so far and of the Mamba states, both
  read back from the KV tensors: a wrong loaded block changes the outputs.
  Drafts: ngram proposes from earlier occurrences (mostly rejected); EAGLE
  and MTP propose the model's own next tokens with every third one wrong.

The worker also checks, whenever a request starts from computed tokens (the
engine's own prefix cache or a load), that its blocks hold exactly what a cold
run writes (``SimWorker.bad_resumes`` lists any that do not).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hybridkv.keys import RequestBlockHasher
from hybridkv.tiers.base import GetStatus
from hybridkv.tools.sim.model import next_state, token_kv
from tests.support.vllm_configs import (
    VOCAB_SIZE,
    Setup,
    build_vllm_config,
    kv_cache_config,
    layer_specs,
)
from tests.support.vllm_worker import SimWorker

Handoff = tuple[str, int, int, int]
"""(request, group, block id, tokens): one state vLLM handed to the connector."""


class SimVllmEngine:
    """vLLM's scheduler over a ``SimWorker``, stepped as vLLM's engine core steps.

    ``connector_extra`` None: the engine alone (its own prefix cache only); else
    hybridkv's connector with this ``kv_connector_extra_config``.
    """

    def __init__(
        self,
        setup: Setup,
        root: Path,
        connector_extra: dict[str, Any] | None,
        *,
        num_blocks: int = 512,
    ) -> None:
        self.vllm_config = build_vllm_config(setup, root, connector_extra)
        specs = layer_specs(setup, self.vllm_config)
        self.kv_cache_config = kv_cache_config(self.vllm_config, specs, num_blocks)
        cache = self.vllm_config.cache_config
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=max(
                g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups
            ),
            hash_block_size=cache.hash_block_size,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(cache.hash_block_size, hash_fn)
        worker_connector = None
        if connector_extra is not None:
            worker_connector = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
        self.worker = SimWorker(self.vllm_config, self.kv_cache_config, worker_connector)
        self.handoffs: list[Handoff] = []
        self._record_handoffs()
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.prefill_stats: dict[str, Any] = {}
        """vLLM's ``PrefillStats`` of each request: where its prompt tokens came from."""

    def _record_handoffs(self) -> None:
        """Note every state vLLM's KV cache manager hands over (its method still runs)."""
        manager = self.scheduler.kv_cache_manager
        take = manager.take_boundary_state_offloads

        def recording() -> dict[str, list[tuple[int, int, int]]]:
            offloads = take()
            for req_id, entries in offloads.items():
                self.handoffs += [(req_id, g, b, n) for g, b, n in entries]
            return offloads

        manager.take_boundary_state_offloads = recording  # type: ignore[method-assign]

    @property
    def connector(self) -> Any:
        """hybridkv's scheduler-side connector (vLLM's scheduler built it)."""
        return self.scheduler.connector

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.requests[req_id] = request
        self.scheduler.add_request(request)

    def step(self) -> bool:
        """One engine step; False once no request is left."""
        if not self.scheduler.has_requests():
            return False
        out = self.scheduler.schedule()
        model_output = self.worker.execute(out)
        for outputs in self.scheduler.update_from_output(out, model_output).values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.prefill_stats is not None:
                    self.prefill_stats[o.request_id] = o.prefill_stats
        if out.total_num_scheduled_tokens > 0:
            drafts = self.worker.take_draft_token_ids()
            if drafts is not None:
                self.scheduler.update_draft_token_ids(drafts)
        else:
            time.sleep(0.002)  # waiting for loads: let the transfer threads run
        return True

    def run(self, *, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError(f"requests still running after {max_steps} steps")

    def generate(self, prompts: dict[str, Sequence[int]], max_tokens: int) -> None:
        for req_id, prompt in prompts.items():
            self.add(req_id, prompt, max_tokens)
        self.run()

    def num_cached_tokens(self, req_id: str) -> int:
        """Tokens of the prompt the engine did not compute (its own cache and loads)."""
        return int(self.prefill_stats[req_id].num_cached_tokens)

    def num_external_tokens(self, req_id: str) -> int:
        """Tokens of the prompt the connector loaded."""
        return int(self.prefill_stats[req_id].num_external_cached_tokens)

    def reset_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache()

    def flush(self) -> None:
        """Wait until the worker's stores reached every tier (the disk too)."""
        if self.worker.connector is not None:
            assert self.worker.connector.flush_writes(30.0)

    def close(self) -> None:
        self.flush()
        if self.worker.connector is not None:
            self.worker.connector.shutdown()
        self.scheduler.shutdown()


def random_prompt(seed: int, num_tokens: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB_SIZE, num_tokens)]


def connector_extra(cache_dir: Path) -> dict[str, Any]:
    """hybridkv's default tiers (CPU memory, then a disk directory), small."""
    return {
        "cache_dir": str(cache_dir),
        "cpu_capacity_bytes": "16MiB",
        "disk_capacity_bytes": "64MiB",
    }


def stored_objects(engine: SimVllmEngine, token_ids: Sequence[int]) -> dict[tuple[int, int], bytes]:
    """What the worker's tiers hold for the prefixes of ``token_ids``: (group, tokens the
    block ends at) -> the object's bytes."""
    worker = engine.worker.connector._worker
    model_groups = worker.model_groups
    hasher = RequestBlockHasher(
        model_groups.hash_block_size, algo=engine.connector.config.hash_algo
    )
    hasher.extend(list(token_ids))
    found: dict[tuple[int, int], bytes] = {}
    for group_id, group in enumerate(model_groups.groups):
        indices = list(range(len(token_ids) // group.block_size))
        hashes = worker.keys.block_hashes(group_id, hasher.block_hashes, indices)
        keys = worker.keys.keys_of(group_id, hashes)
        held = worker.store.contains_many(keys)
        for i, key, is_held in zip(indices, keys, held, strict=True):
            if is_held:
                buffer = np.zeros(group.block_bytes, np.uint8)
                (status,) = worker.store.get_many_into([key], [buffer])
                assert status is GetStatus.OK, status
                found[(group_id, (i + 1) * group.block_size)] = buffer.tobytes()
    return found


def cold_object(
    engine: SimVllmEngine, token_ids: Sequence[int], group_id: int, num_tokens: int
) -> bytes:
    """A cold run's object of a group's block ending at ``num_tokens``: every layer's page,
    in layer order (a state, or the block's attention KV)."""
    group = engine.kv_cache_config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    out = b""
    for layer in group.layer_names:
        if isinstance(spec, MambaSpec):
            size = spec.real_page_size_bytes
            out += next_state(bytes(size), list(token_ids[:num_tokens]), layer)
            continue
        for p in range(num_tokens - spec.block_size, num_tokens):
            out += token_kv(list(token_ids), p, layer).view(torch.int8).numpy().tobytes()
    return out
