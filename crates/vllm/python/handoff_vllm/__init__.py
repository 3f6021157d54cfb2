"""handoff as vLLM's KV connector.

    vllm serve ... --kv-transfer-config '{"kv_connector": "HandoffConnector",
        "kv_connector_module_path": "handoff_vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {...}}'

On D, ``--middleware handoff_vllm.RefusalRelease`` lets P release at once the blocks of a
request vLLM's API server refuses before the connector sees it; on a push P,
``--middleware handoff_vllm.HandoffInfo`` answers ``GET /v1/handoff/info`` for handoff's proxy
(:mod:`handoff_vllm.api_server`); on any of a fleet's servers, ``--middleware
handoff_vllm.HandoffOps`` answers ``GET /ready``, ``POST /handoff/drain`` (a Kubernetes
``preStop`` hook) and adds the compatibility key to ``/metrics``.

The connector class lives in :mod:`handoff_vllm.connector`; the Rust core in
``handoff_vllm._native``.
"""

from handoff_vllm.connector import HandoffConnector
from handoff_vllm.api_server import HandoffInfo, HandoffOps, RefusalRelease

__all__ = ["HandoffConnector", "HandoffInfo", "HandoffOps", "RefusalRelease"]
