"""A guard against drift in vLLM's connector interface.

vLLM changes ``KVConnectorBase_V1`` in most releases: a hook added with a default may be one the
connector needs (0.33's ``supports_sleep_mode`` defaults to True, which would let vLLM remap KV
memory under registered transfers). This test lists every public name of the installed
``KVConnectorBase_V1`` and fails when one is neither implemented by ``HandoffConnector`` nor
named below as deliberately left to vLLM's default, with the reason. Run on every vLLM version
the suite installs, it makes a new hook a CI failure instead of a user's bug report.
"""

from __future__ import annotations

import inspect

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from handoff_vllm import HandoffConnector

# Names HandoffConnector leaves to vLLM's default, each with why the default is right.
LEFT_TO_DEFAULT = {
    "role": "a property of the base class: which side this instance is",
    "bind_connector_metadata": "the base class keeps the step's metadata for the worker hooks",
    "clear_connector_metadata": "the base class drops the step's metadata",
    "has_connector_metadata": "the base class answers from the metadata it keeps",
    "bind_gpu_block_pool": "the connector never touches vLLM's block pool: vLLM frees blocks",
    "bind_kv_cache_manager": "the connector gets block ids from the hooks, not the manager",
    "build_kv_connector_stats": "no vLLM-side stats: handoff exports its own /metrics",
    "build_prom_metrics": "no vLLM-side metrics object: handoff exports its own /metrics",
    "get_kv_connector_stats": "no vLLM-side stats: handoff exports its own /metrics",
    "get_kv_connector_kv_cache_events": "handoff emits no KV cache events (no offload store)",
    "take_events": "handoff emits no KV cache events (no offload store)",
    "finish_forward": "the push writes are released per layer by save_kv_layer and the step "
                      "by wait_for_save; nothing waits for the model to stop reading",
    "reset_capture_state": "no state changes while CUDA graphs are captured",
    "get_block_ids_with_load_errors": "a failed transfer fails its whole request "
                                      "(failed_recving), never single blocks",
    "get_external_cache_hit_sources": "statistics only: the default names the connector",
    "get_finished_count": "every worker reports; vLLM's default waits for all of them",
    "get_loaded_kv_cache_group_ids": "one KV cache group (no SupportsHMA): the default is it",
    "get_mem_pool_context": "KV tensors live in vLLM's own allocation",
    "get_required_kvcache_layout": "the worker reads the layout from shape and strides and "
                                   "refuses one it does not know",
    "handle_preemptions": "only async saves need it; a push request is never preempted while "
                          "its writes read its blocks (has_pending_block_frees)",
    "on_new_request": "get_num_new_matched_tokens sees every request first",
    "register_finished_partial_tail": "no offloading of partial tails: handoff transfers the "
                                      "request's own blocks",
    "requires_kv_delivery": "the default (producer role) makes vLLM 0.33 recompute a request "
                            "preempted with a hand-off pending, which is what P needs",
    "reset_cache": "handoff holds no cache of its own to reset",
    "set_host_xfer_buffer_ops": "no host staging buffer: transfers read vLLM's KV in place",
    "set_xfer_handshake_metadata_pp_aware": "no pipeline parallelism support; the plain hook "
                                            "carries every rank's hello",
    "supports_divergent_local_hybrid_hits": "no hybrid models (no SupportsHMA): False is right",
    "unregister_kv_caches": "sleep mode is refused (supports_sleep_mode is False)",
    "restore_kv_caches": "sleep mode is refused (supports_sleep_mode is False)",
}


def public_names() -> set[str]:
    return {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")}


def implemented(name: str) -> bool:
    """Whether HandoffConnector defines `name` itself (not inherited from vLLM's base)."""
    return any(name in cls.__dict__ for cls in HandoffConnector.__mro__
               if cls is not KVConnectorBase_V1 and issubclass(cls, KVConnectorBase_V1)
               and cls.__module__.startswith("handoff_vllm"))


def test_every_hook_of_the_installed_vllm_is_implemented_or_deliberately_left_to_its_default():
    unknown = sorted(n for n in public_names()
                     if not implemented(n) and n not in LEFT_TO_DEFAULT)
    assert not unknown, (
        "vLLM's KVConnectorBase_V1 has hooks HandoffConnector neither implements nor names in "
        f"LEFT_TO_DEFAULT: {unknown}. Read what each does in this vLLM and implement it, or add "
        "it with the reason its default is right.")


def test_every_abstract_hook_is_implemented():
    missing = sorted(n for n in KVConnectorBase_V1.__abstractmethods__ if not implemented(n))
    assert not missing, missing
    assert not inspect.isabstract(HandoffConnector)


def test_the_guard_has_power():
    """A hook vLLM might add tomorrow is caught: the check above, run against the base class
    with a made-up method, names it."""
    KVConnectorBase_V1.made_up_hook_of_a_future_vllm = lambda self: None
    try:
        unknown = [n for n in public_names() if not implemented(n) and n not in LEFT_TO_DEFAULT]
    finally:
        del KVConnectorBase_V1.made_up_hook_of_a_future_vllm
    assert unknown == ["made_up_hook_of_a_future_vllm"], unknown


def test_no_name_is_both_implemented_and_left_to_the_default():
    both = sorted(n for n in LEFT_TO_DEFAULT if implemented(n))
    assert not both, f"implemented, so not left to the default: {both}"


def test_sleep_mode_is_refused_and_push_asks_for_piecewise_cuda_graphs():
    assert HandoffConnector.supports_sleep_mode(None) is False
    assert HandoffConnector.requires_piecewise_for_cudagraph({"mode": "push"}) is True
    assert HandoffConnector.requires_piecewise_for_cudagraph({}) is False
