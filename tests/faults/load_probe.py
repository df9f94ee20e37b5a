"""A worker extension for the load tests: the connector's worker side, checked over HTTP.

Loaded into the server's worker with ``--worker-extension-cls`` and called
through vLLM's dev endpoint ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``).
The scheduler side runs in another process; its per-request state is read
from the ``hybridkv_scheduler_state_entries`` gauge at ``/metrics`` instead.
"""

from __future__ import annotations

from typing import Any


class LoadProbe:
    """Mixed into vLLM's worker class; its method names are the RPC names."""

    def hybridkv_probe(self, timeout_s: str = "60") -> dict[str, Any]:
        """Flush the write-backs and run the integrity check."""
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        worker_side = get_kv_transfer_group()
        flushed = bool(worker_side.flush_writes(float(timeout_s)))
        try:
            worker_side.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = f"failed: {exc!r}"
        return {"flushed": flushed, "integrity": integrity}
