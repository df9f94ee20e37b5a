"""A worker extension for the load tests: the connector's bookkeeping, read over HTTP.

Loaded into the server's worker with ``--worker-extension-cls`` and called
through vLLM's dev endpoint ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``).
With one rank the worker runs in the engine-core process, beside the
scheduler-side connector, which is found among that process's objects.
"""

from __future__ import annotations

import gc
from typing import Any


class LoadProbe:
    """Mixed into vLLM's worker class; its method names are the RPC names."""

    def hybridkv_probe(self, timeout_s: str = "60") -> dict[str, Any]:
        """Flush the write-backs, run the integrity check, and count per-request state."""
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        from hybridkv.connector.scheduler import ConnectorScheduler
        from hybridkv.integrations.vllm.connector import HybridKVConnector

        worker_side = get_kv_transfer_group()
        flushed = bool(worker_side.flush_writes(float(timeout_s)))
        try:
            worker_side.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = f"failed: {exc!r}"
        schedulers = [o for o in gc.get_objects() if isinstance(o, ConnectorScheduler)]
        adapters = [
            o for o in gc.get_objects() if isinstance(o, HybridKVConnector) and o is not worker_side
        ]
        state: dict[str, int] = {"num_schedulers": len(schedulers)}
        for sched in schedulers:
            for name, size in sched.state_sizes().items():
                state[name] = state.get(name, 0) + size
        for adapter in adapters:
            state["adapter_requests"] = state.get("adapter_requests", 0) + len(adapter._requests)
        return {"flushed": flushed, "integrity": integrity, "scheduler": state}
