"""What the simulated model computes: KV derived from the token prefix and the layer, and
for Mamba a recurrent state derived from the previous state bytes and the new tokens.

Pure functions, run wherever KV is written or checked (the simulated engine,
tests of vLLM's own worker): a wrong loaded block or state changes what a
cold run would have written, and every later state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from hybridkv.tools.sim.shapes import HEAD_DIM, MAMBA_STATE_BYTES, NUM_KV_HEADS


def _digest(*parts: bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(b"|".join(parts)))


def token_kv(tokens: Sequence[int], position: int, layer: str) -> torch.Tensor:
    """KV of one token: a function of the prefix up to it and of the layer."""
    seed = _digest(np.asarray(tokens[: position + 1], np.int64).tobytes(), layer.encode())
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((NUM_KV_HEADS, 2 * HEAD_DIM)).astype(np.float32))


def next_state(state: bytes, tokens: Sequence[int], layer: str) -> bytes:
    """The recurrent state after ``tokens``, one token at a time (chunking-invariant);
    as many bytes as ``state``."""
    for token in tokens:
        seed = _digest(state, str(token).encode(), layer.encode())
        state = np.random.default_rng(seed).integers(-128, 128, len(state), np.int8).tobytes()
    return state


def expected_state(
    tokens: Sequence[int], num_tokens: int, layer: str, state_bytes: int = MAMBA_STATE_BYTES
) -> bytes:
    """A cold run's state after the first ``num_tokens`` tokens."""
    return next_state(bytes(state_bytes), tokens[:num_tokens], layer)


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` seeded random token ids (3 to 499)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]
