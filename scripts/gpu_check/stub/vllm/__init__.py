"""The few names of vLLM that handoff_vllm.connector imports, for scripts/gpu-check: the GPU
machine has torch but no vLLM. The check drives HandoffConnector as vLLM's GPU model runner
does; these classes only carry what vLLM's own would (see vllm/distributed/kv_transfer/
kv_connector/v1/base.py for the originals' contracts)."""
