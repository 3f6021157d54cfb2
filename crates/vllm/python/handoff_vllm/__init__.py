"""handoff as vLLM's KV connector.

    vllm serve ... --kv-transfer-config '{"kv_connector": "HandoffConnector",
        "kv_connector_module_path": "handoff_vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {...}}'

On D, ``--middleware handoff_vllm.RefusalRelease`` lets P release at once the blocks of a
request vLLM's API server refuses before the connector sees it (:mod:`handoff_vllm.refusals`).

The connector class lives in :mod:`handoff_vllm.connector`; the Rust core in
``handoff_vllm._native``.
"""

from handoff_vllm.connector import HandoffConnector
from handoff_vllm.refusals import RefusalRelease

__all__ = ["HandoffConnector", "RefusalRelease"]
