"""The vLLM adapter: everything that imports vLLM lives here.

Load the connector with ``kv_connector_module_path="hybridkv.vllm"`` (a
short alias of ``hybridkv.integrations.vllm.connector``).
"""
