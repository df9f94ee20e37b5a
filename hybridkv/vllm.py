"""Short module path for vLLM's ``kv_connector_module_path``: ``hybridkv.vllm``.

The adapter itself lives in ``hybridkv.integrations.vllm``.
"""

from hybridkv.integrations.vllm.connector import HybridKVConnector

__all__ = ["HybridKVConnector"]
