"""Checking a request's KV in the simulated engine against what a cold run writes.

Runs in the process of the test or benchmark, on its ``SimEngine``. The
check raises, never returns a verdict to ignore, and it holds under
``python -O`` (a benchmark's hits count only when their bytes are right).
"""

from __future__ import annotations

from hybridkv.groups import GroupKind
from hybridkv.tools.sim.engine import SimEngine, SimRequest
from hybridkv.tools.sim.model import expected_state


class KVMismatchError(AssertionError):
    """A block or state differs from a cold run's (an ``AssertionError``: in a test it is
    a failed check)."""


def assert_kv_matches_cold(engine: SimEngine, req: SimRequest, num_tokens: int) -> int:
    """Every non-null block of the request up to ``num_tokens`` equals a cold run's;
    raises ``KVMismatchError`` naming the group and block (or layer) that does not.

    Returns the number of blocks compared (so callers can insist it is > 0).
    """
    compared = 0
    for g, group in enumerate(engine.model_groups.groups):
        ids = req.block_ids[g]
        if group.kind is GroupKind.MAMBA:
            for layer in group.layer_names:
                got = engine.state_bytes(req, g, layer, num_tokens)
                if got != expected_state(req.tokens, num_tokens, layer):
                    raise KVMismatchError(f"{req.req_id}: state of group {g}, layer {layer}")
                compared += 1
            continue
        for index in range(num_tokens // group.block_size):
            if ids[index] == 0:
                continue
            got = engine.block_bytes(g, ids[index])
            if got != engine.expected_block(req.tokens, g, index):
                raise KVMismatchError(f"{req.req_id}: block {index} of group {g}")
            compared += 1
    return compared
