"""A simulated vLLM model runner over real KV tensors, with hybridkv's worker side.

Test helper for ``tests.support.vllm_scheduler``, which describes the model.
``SimWorker`` is called as vLLM's GPU model runner is called, with the
``SchedulerOutput`` of vLLM's own scheduler, and calls hybridkv's
``HybridKVConnector`` (worker role) in the order that runner does
(``KVConnectorModelRunnerMixin``): preemptions, the forward pass, loads, saves,
results. Mamba states go where the GPU runner puts them in "align" mode
(``vllm/v1/worker/mamba_utils.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput

from hybridkv.integrations.vllm.facts import groups_from_config
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.tools.sim.model import next_state, token_kv
from tests.support.vllm_configs import VOCAB_SIZE


def model_token(kv_digest: bytes, states: Sequence[bytes]) -> int:
    """The sampled token after a position: a digest of every attention layer's KV up to
    it and of every Mamba layer's state after it."""
    return 1 + xxhash.xxh3_64_intdigest(b"".join((kv_digest, *states))) % (VOCAB_SIZE - 1)


@dataclass
class _Running:
    """One request in the worker (vLLM's ``CachedRequestState`` plus its Mamba index)."""

    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int
    state_col: int | None = None
    """``mamba_state_idx``: the column of the last step's running state."""
    num_accepted: int = 1
    """Tokens the last step accepted (1: no accepted draft)."""


@dataclass
class SimWorker:
    """A model runner over real KV tensors; ``connector`` None: the engine alone."""

    vllm_config: Any
    kv_cache_config: KVCacheConfig
    connector: Any | None
    requests: dict[str, _Running] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    bad_resumes: list[str] = field(default_factory=list)
    num_drafts: int = 0
    """Drafted tokens verified so far; ``num_accepted_drafts`` of them accepted."""
    num_accepted_drafts: int = 0

    def __post_init__(self) -> None:
        groups = self.kv_cache_config.kv_cache_groups
        self.block_size = groups[0].kv_cache_spec.block_size
        model_groups = groups_from_config(self.kv_cache_config, "sim")
        self.kv = allocate_kv_caches(model_groups, self.kv_cache_config.num_blocks).kv_caches
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv)
        self.layer_group = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self.mamba: dict[str, MambaSpec] = {}
        self.attention: list[str] = []
        """Attention layers, the draft model's too (the outputs read the target's)."""
        for group in groups:
            for name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, MambaSpec):
                    self.mamba[name] = spec
                else:
                    self.attention.append(name)
        speculative = self.vllm_config.speculative_config
        self.spec_decoding = speculative is not None
        self.drop_eagle = speculative is not None and speculative.use_eagle_block_drop()
        self.use_model_drafts = speculative is not None and speculative.method != "ngram"
        self.num_spec = self.vllm_config.num_speculative_tokens
        self.slot_bytes = self.kv[self.attention[0]].shape[1] // self.block_size
        self.target_attention = [a for a in self.attention if not a.startswith("draft.")]

    # --- one step, in the order of vLLM's GPU model runner --------------------------------

    def execute(self, out: Any) -> ModelRunnerOutput:
        meta = out.kv_connector_metadata
        if self.connector is not None:
            self.connector.handle_preemptions(meta)
        self._update_states(out)
        if self.connector is not None:
            self.connector.bind_connector_metadata(meta)
        sampled: dict[str, list[int]] = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            drafts = list(out.scheduled_spec_decode_tokens.get(req_id, ()))
            sampled[req_id] = self._forward(req_id, num_tokens, drafts)
        kv_output = self._connector_output(out)
        req_ids = list(sampled)
        self.drafts = {r: self._propose(r, tokens) for r, tokens in sampled.items() if tokens}
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=kv_output,
        )

    def _connector_output(self, out: Any) -> KVConnectorOutput | None:
        """``KVConnectorModelRunnerMixin._get_kv_connector_output``: asynchronous loads
        start after the forward pass, then the step's stores, then the results."""
        connector = self.connector
        if connector is None:
            return None
        connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(out.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return kv_output

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self.spec_decoding or not self.drafts:
            return None
        req_ids = list(self.drafts)
        return DraftTokenIds(req_ids, [self.drafts[r] for r in req_ids])

    def _update_states(self, out: Any) -> None:
        if out.preempted_req_ids:
            raise AssertionError("the simulated worker does not resume preempted requests")
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            ids = [list(ids) for ids in new.block_ids]
            running = _Running(list(new.prompt_token_ids), ids, new.num_computed_tokens)
            self.requests[new.req_id] = running
            self._check_resumed(new.req_id, running)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self.requests[req_id]
            running.num_computed = cached.num_computed_tokens[i]
            if cached.new_block_ids[i] is not None:
                for ids, new_ids in zip(running.block_ids, cached.new_block_ids[i], strict=True):
                    ids.extend(new_ids)

    # --- the model ------------------------------------------------------------------------

    def _forward(self, req_id: str, num_tokens: int, drafts: list[int]) -> list[int]:
        """Compute ``num_tokens`` tokens (the last ``len(drafts)`` drafted); the tokens
        sampled: none for a prefill chunk short of the prompt's end, else one per
        accepted draft plus one."""
        req = self.requests[req_id]
        start, k = req.num_computed, len(drafts)
        real_end = start + num_tokens - k
        tokens = req.tokens[:real_end] + drafts
        states = self._mamba_forward(req, tokens, num_tokens, k)
        for layer in self.attention:
            for p in range(start, start + num_tokens):
                self._slot(req, layer, p)[:] = token_kv(tokens, p, layer).view(torch.int8).flatten()
        if real_end < len(req.tokens):
            return []  # a chunk of the prompt: the sampled token is dropped
        kv = xxhash.xxh3_64()
        for p in range(real_end - 1):
            kv.update(self._kv_bytes(req, p))
        targets = []
        for i in range(k + 1):
            kv.update(self._kv_bytes(req, real_end - 1 + i))
            targets.append(model_token(kv.digest(), [s[i] for s in states.values()]))
        accepted = 0
        while accepted < k and drafts[accepted] == targets[accepted]:
            accepted += 1
        self.num_drafts += k
        self.num_accepted_drafts += accepted
        self._postprocess(req, num_tokens, k, accepted + 1)
        sampled = targets[: accepted + 1]
        req.tokens = req.tokens[:real_end] + sampled
        return sampled

    def _mamba_forward(
        self, req: _Running, tokens: list[int], num_tokens: int, k: int
    ) -> dict[str, list[bytes]]:
        """Every Mamba layer's states after the step's last ``k + 1`` positions, written
        where vLLM keeps them (see the module docstring)."""
        start, end = req.num_computed, req.num_computed + num_tokens
        prev = req.state_col if req.state_col is not None else (start - 1) // self.block_size
        curr = cdiv(end, self.block_size) - 1
        copy = prev != -1 and prev != curr  # preprocess_mamba
        source = prev + req.num_accepted - 1
        if copy:
            req.num_accepted = 1
        req.state_col = curr
        tails: dict[str, list[bytes]] = {}
        for layer, spec in self.mamba.items():
            size = spec.real_page_size_bytes
            if copy:
                self._state(req, layer, curr)[:size] = self._state(req, layer, source)[:size]
            state = (
                bytes(self._state(req, layer, curr + req.num_accepted - 1)[:size].numpy())
                if start
                else bytes(size)
            )
            after = [state]
            for token in tokens[start:end]:
                after.append(next_state(after[-1], [token], layer))
            tails[layer] = after[-(k + 1) :]
            for i, state_i in enumerate(tails[layer]):  # running state, then per draft
                self._write_state(req, layer, curr + i, state_i)
            offset, col = self._checkpoint(spec, start, end, k)
            if offset and req.block_ids[self.layer_group[layer]][col]:
                # A column the scheduler left null is skipped, as vLLM's export kernels do.
                self._write_state(req, layer, col, after[offset])
        return tails

    def _checkpoint(self, spec: MambaSpec, start: int, end: int, k: int) -> tuple[int, int]:
        """Where a prefill chunk exports its checkpoint (``MambaPrefillCheckpointBuilder``)."""
        if spec.num_prefill_checkpoint_blocks == 0 or k or end - start <= 1:
            return 0, -1
        cache = self.vllm_config.cache_config
        (offset,), (col,) = compute_mamba_prefill_checkpoints(
            [end],
            [end - start],
            hash_block_size=cache.hash_block_size,
            mamba_block_size=self.block_size,
            checkpoint_alignment=spec.prefill_checkpoint_alignment,
            drop_eagle_block=self.drop_eagle,
            cache_hit_alignment_tokens=cache.cache_hit_alignment_tokens,
        )
        return offset, col

    def _postprocess(self, req: _Running, num_tokens: int, k: int, num_accepted: int) -> None:
        """``postprocess_mamba_fused_kernel``: the state at a block boundary the accepted
        tokens reached, copied into that boundary's column."""
        req.num_accepted = num_accepted
        if not self.spec_decoding:
            return
        assert req.state_col is not None
        running = req.num_computed + num_tokens - k
        aligned = (running + num_accepted - 1) // self.block_size * self.block_size
        if aligned < running:
            return
        dest, bias = aligned // self.block_size - 1, aligned - running
        if dest == req.state_col:
            req.num_accepted = 1
            if bias == 0:
                return
        for layer, spec in self.mamba.items():
            size = spec.real_page_size_bytes
            source = self._state(req, layer, req.state_col + bias)[:size].clone()
            self._state(req, layer, dest)[:size] = source

    def _propose(self, req_id: str, sampled: list[int]) -> list[int]:
        """The next step's drafts (the request's tokens end with ``sampled``)."""
        tokens = self.requests[req_id].tokens
        if self.use_model_drafts:
            return self._model_drafts(tokens)
        for n in (3, 2, 1):  # prompt lookup: the tokens after the latest earlier n-gram
            tail = tokens[-n:]
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == tail:
                    return tokens[i + n : i + n + self.num_spec]
        return []

    def _model_drafts(self, tokens: list[int]) -> list[int]:
        """The model's own next tokens from a cold run of ``tokens``; every third wrong."""
        kv = xxhash.xxh3_64()
        states = {layer: bytes(spec.real_page_size_bytes) for layer, spec in self.mamba.items()}
        seq = list(tokens)
        drafts: list[int] = []
        for p in range(len(seq) + self.num_spec - 1):
            states = {layer: next_state(s, [seq[p]], layer) for layer, s in states.items()}
            for layer in self.target_attention:
                kv.update(token_kv(seq, p, layer).view(torch.int8).numpy().tobytes())
            if p >= len(tokens) - 1:
                token = model_token(kv.digest(), list(states.values()))
                if xxhash.xxh3_64_intdigest(str(seq).encode()) % 3 == 0:
                    token = token % (VOCAB_SIZE - 1) + 1  # a wrong guess
                drafts.append(token)
                seq.append(token)
        return drafts

    # --- the KV tensors --------------------------------------------------------------------

    def _block(self, req: _Running, layer: str, index: int) -> int:
        block = req.block_ids[self.layer_group[layer]][index]
        assert block != 0, f"column {index} of {layer} is the null block"
        return block

    def _slot(self, req: _Running, layer: str, p: int) -> torch.Tensor:
        row = self.kv[layer][self._block(req, layer, p // self.block_size)]
        first = (p % self.block_size) * self.slot_bytes
        return row[first : first + self.slot_bytes]

    def _kv_bytes(self, req: _Running, p: int) -> bytes:
        return b"".join(bytes(self._slot(req, layer, p).numpy()) for layer in self.target_attention)

    def _state(self, req: _Running, layer: str, col: int) -> torch.Tensor:
        return self.kv[layer][self._block(req, layer, col)]

    def _write_state(self, req: _Running, layer: str, col: int, state: bytes) -> None:
        self._state(req, layer, col)[: len(state)] = torch.frombuffer(
            bytearray(state), dtype=torch.int8
        )

    def _check_resumed(self, req_id: str, req: _Running) -> None:
        """A request starting from computed tokens finds what a cold run writes: every
        attention position before them, and each Mamba layer's state at them."""
        c = req.num_computed
        if c == 0:
            return
        for layer in self.attention:
            for p in range(c):
                want = token_kv(req.tokens, p, layer).view(torch.int8).numpy().tobytes()
                if bytes(self._slot(req, layer, p).numpy()) != want:
                    self.bad_resumes.append(f"{req_id}: {layer} position {p} of {c}")
                    break
        for layer, spec in self.mamba.items():
            size = spec.real_page_size_bytes
            want = next_state(bytes(size), req.tokens[:c], layer)
            got = bytes(self._state(req, layer, (c - 1) // self.block_size)[:size].numpy())
            if got != want:
                self.bad_resumes.append(f"{req_id}: {layer} state at {c}")
