"""handoff as vLLM's KV connector.

    vllm serve ... --kv-transfer-config '{"kv_connector": "HandoffConnector",
        "kv_connector_module_path": "handoff_vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {...}}'

The connector class lives in :mod:`handoff_vllm.connector`; the Rust core in
``handoff_vllm._native``.
"""

from handoff_vllm.connector import HandoffConnector

__all__ = ["HandoffConnector"]
