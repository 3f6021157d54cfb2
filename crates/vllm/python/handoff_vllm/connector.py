"""``HandoffConnector``: vLLM's ``KVConnectorBase_V1`` hooks onto handoff's connector.

vLLM builds this class twice: with the SCHEDULER role in EngineCore and with the WORKER role in
each worker process. Each side wraps its Rust half (``handoff_vllm._native``):

* scheduler: ``Scheduler`` runs the ledgers, the side channel and the timers on Rust threads;
  the hooks here only hand it vLLM's facts and collect, once per step, the work for the workers
  and the requests vLLM must release or resume;
* worker: ``Worker`` registers the rank's KV tensors with a transport agent and carries out the
  steps; its reports ride back to the scheduler in ``KVConnectorWorkerMetadata``.

Every hook returns after a short call; Rust threads never call into Python.

Pull mode (D reads P's blocks; requests for P must not stream: vLLM puts ``kv_transfer_params``
only in non-streamed responses) and push mode (``"mode": "push"`` in the extra config; P writes
into the blocks D registered). P and D may differ in TP size and block size wherever handoff's
planner maps one layout onto the other (the GPU layouts, MLA's latent); vLLM's CPU backend keeps
opaque pages, each KV head's chunk moved whole, which pair between engines of other TP sizes but
only of one block size and layout.

The connector's core picks the flow (pull or push) from each request's params; this glue only
says what vLLM does. When the step being built completes the prompt of a request P prefills for
a D, ``build_connector_meta`` tells the core its prefill starts; a push's handoff then holds the
blocks, and each worker posts a layer's writes from ``save_kv_layer`` as soon as the forward pass
saved it, while the next layers compute. That needs the request to finish right after that step
(``max_tokens`` 1); of any other request the core hears once ``request_finished`` says its
prefill ended. Under async scheduling (vLLM 0.33's default)
vLLM schedules the next step before that step's output is in, and may preempt the request then
to make room: it frees a preempted request's blocks without asking the connector, while the
writes still read them. From the step that starts such a handoff until ``request_finished``,
``has_pending_block_frees`` is true, which tells vLLM to wait for blocks instead of preempting.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from handoff_vllm import _native
from handoff_vllm.api_server import engine_id
from handoff_vllm.timeline import Timeline

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("handoff_vllm")

# vLLM fans a request with n>1 out into children named "{index}_{parent id}"
# (vllm/v1/engine/parallel_sampling.py), each with its own blocks and the parent's params.
_CHILD_ID = re.compile(r"^(\d+)_(.+)$")


class _AllCpus:
    """Widens the calling thread's CPU affinity to the engine's CPUs while handoff may start
    threads.

    vLLM's CPU worker pins its main thread to the cores it computes on (on a small machine, one
    core) and its OpenMP threads spin there; threads inherit the mask of the thread that starts
    them, so the transport's threads would share that core and starve (peers declared silent).
    The engine's CPUs are those of the worker's parent (EngineCore), which vLLM does not pin:
    what the operator gave the engine (taskset, a cpuset), never more. The mask is restored on
    exit: vLLM's own threads are untouched.
    """

    @staticmethod
    def engine_cpus() -> set[int]:
        try:
            return os.sched_getaffinity(os.getppid())
        except OSError:
            return set(range(os.cpu_count() or 1))

    def __enter__(self):
        try:
            self._saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.engine_cpus())
        except (AttributeError, OSError):
            self._saved = None
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            try:
                os.sched_setaffinity(0, self._saved)
            except OSError:
                pass
        return False


@dataclass
class HandoffMeta(KVConnectorMetadata):
    """What the scheduler side tells every worker for one step."""

    meta: bytes = b""
    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    # The workers hold push writes for this step's forward pass (``save_kv_layer`` sends them).
    forward: bool = False


@dataclass
class _Prefill:
    """P: a request whose prompt is being prefilled for a D, until its last chunk is scheduled."""

    params: dict[str, Any]
    prompt_len: int
    # n>1: the key its siblings share (None for a request of its own).
    family: tuple | None
    # One list per KV cache group.
    blocks: list[list[int]] = field(default_factory=list)


@dataclass
class HandoffWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side after one step."""

    reports: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, HandoffWorkerMeta):
            return self
        return HandoffWorkerMeta(self.reports + other.reports)


@dataclass
class HandoffHandshake(KVConnectorHandshakeMetadata):
    """A worker's hello (its KV layout and transport agent), for the scheduler side."""

    hello: bytes = b""
    opaque_blocks: bool = True


# Every key of kv_connector_extra_config the connector reads (docs/src/reference/vllm-extra-config.md).
EXTRA_KEYS = frozenset({
    "engine_id", "mode", "transport", "data_bind", "side_channel_host", "side_channel_port",
    "advertise_host", "cluster_key_file", "insecure", "peer_hosts", "initial_lease_ms",
    "wait_deadline_ms", "registration_lease_ms", "read_timeout_ms", "transfer_floor_mb_per_s",
    "push_deadline_ms", "hard_cap_ms", "kv_digest", "record_trace", "timeline", "model_name",
    "protocol_version",
})


def _extra(vllm_config) -> dict[str, Any]:
    """kv_connector_extra_config; a key the connector does not read (a typo) is refused, not
    ignored."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - EXTRA_KEYS)
    if unknown:
        def named(key: str) -> str:
            near = difflib.get_close_matches(key, EXTRA_KEYS, n=1)
            return f"{key} (did you mean {near[0]}?)" if near else key

        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(map(named, unknown))} "
            f"(HandoffConnector reads: {', '.join(sorted(EXTRA_KEYS))})"
        )
    return extra


class HandoffConnector(KVConnectorBase_V1, SupportsHMA):
    # How long the worker remembers that vLLM named a request finished, waiting for its send to
    # end: far past the longest a handoff lives on P (its hard cap, 120 s, plus the fence). Every
    # finished request is named, most never send; without a bound the set grows forever.
    FINISHED_TTL_S = 600.0

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = vllm_config
        self._extra = _extra(vllm_config)
        self._engine_id = engine_id(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler side.
        self._sched = None
        self._opaque = True
        self._prefilling: dict[str, _Prefill] = {}
        # P: requests whose handoff holds their blocks since their last prefill step and that
        # vLLM has not yet named finished (their blocks must not be preempted away).
        self._forwarded: set[str] = set()
        # P, n>1: per parent request, the handoff its first finished child keeps (see
        # request_finished), oldest first.
        self._siblings: OrderedDict[tuple, tuple[float, dict[str, Any] | None]] = OrderedDict()
        # Where a request's time goes (extra config "timeline"; off by default).
        self._timeline = Timeline(
            self._extra.get("timeline") if role == KVConnectorRole.SCHEDULER else None,
            self._engine_id,
        )
        # Worker side.
        self._worker = None
        self._on_gpu = False
        self._pending_sending: set[str] = set()
        # Request id -> when vLLM named it finished (monotonic), oldest first.
        self._seen_finished: dict[str, float] = {}
        self._report: bytes | None = None
        self._last: HandoffMeta | None = None
        self._applied: HandoffMeta | None = None
        self._layer_index: dict[str, int] = {}

    # ------------------------------------------------------------------ class-level answers

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        # vLLM 0.33: sleep mode remaps the KV cache's memory, and the transport registered the
        # tensors by address at start-up (no unregister/restore yet): vLLM refuses the pair at
        # start-up instead of letting transfers touch stale addresses.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Push posts each layer's writes from save_kv_layer while the next layers compute; a
        # full CUDA graph replays the forward pass without calling it (GPU only).
        return (extra_config or {}).get("mode", "pull") == "push"

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        devices = set()
        for name, t in kv_caches.items():
            device = getattr(t, "device", None)
            kind = getattr(device, "type", "cpu")
            if kind not in ("cpu", "cuda"):
                raise ValueError(
                    f"HandoffConnector: the KV cache of layer {name} is on {device}; handoff "
                    "moves KV in host memory and in CUDA device memory"
                )
            devices.add(None if kind == "cpu" else int(device.index or 0))
        if len(devices) > 1:
            raise ValueError(f"HandoffConnector: the KV cache spans {sorted(map(str, devices))}")
        # On a GPU, save_kv_layer and wait_for_save are called once the kernels are enqueued:
        # the worker orders each write after an event on the forward's stream.
        self._on_gpu = devices != {None}
        mc = self._config.model_config
        pc = self._config.parallel_config
        mla = bool(getattr(mc, "use_mla", False))
        tensors = [
            {
                "name": name,
                "data_ptr": int(t.data_ptr()),
                "shape": [int(d) for d in t.shape],
                "strides": [int(s) for s in t.stride()],
                "element_size": int(t.element_size()),
                "device": int(t.device.index or 0) if t.device.type == "cuda" else None,
            }
            for name, t in kv_caches.items()
        ]
        cfg = {
            "engine_id": self._engine_id,
            "transport": self._extra.get("transport", "tcp"),
            "data_bind": self._extra.get("data_bind", "127.0.0.1:0"),
            "advertise_host": self._extra.get("advertise_host"),
            "cluster_key_file": self._extra.get("cluster_key_file"),
            "insecure": bool(self._extra.get("insecure", False)),
            "facts": {
                # MLA keeps one latent vector per token, the same on every rank: one "head".
                "num_kv_heads": 1 if mla else int(mc.get_total_num_kv_heads()),
                "mla": mla,
                "head_dim": int(mc.get_head_size()),
                "block_size": int(self._block_size),
                "tp": int(pc.tensor_parallel_size),
                "rank": int(get_tensor_model_parallel_rank()),
            },
        }
        # The worker numbers layers in this order (the tensors' order above).
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        cfg["groups"] = self._kv_cache_groups()
        with _AllCpus():
            self._worker = _native.Worker(json.dumps(cfg), json.dumps(tensors))

    def _kv_cache_groups(self) -> list[dict[str, Any]]:
        """vLLM's KV cache groups under its hybrid KV cache manager, layers numbered as the
        worker numbers them; none for one group (every layer alike). A kind of group handoff does
        not move (Mamba state, chunked local attention) is refused at start-up."""
        config = getattr(self, "_kv_cache_config", None)
        groups = list(getattr(config, "kv_cache_groups", None) or [])
        if len(groups) <= 1:
            return []
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        out = []
        for i, g in enumerate(groups):
            spec = g.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                window = int(spec.sliding_window)
            elif isinstance(spec, FullAttentionSpec):
                window = None
            else:
                raise ValueError(
                    f"HandoffConnector: KV cache group {i} keeps {type(spec).__name__}; handoff "
                    "moves full-attention and sliding-window groups"
                )
            missing = [n for n in g.layer_names if n not in self._layer_index]
            if missing:
                raise ValueError(
                    f"HandoffConnector: KV cache group {i} names layers without a KV cache "
                    f"tensor: {missing}"
                )
            out.append({"window": window,
                        "layers": [self._layer_index[n] for n in g.layer_names]})
        return out

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        return HandoffHandshake(bytes(self._worker.hello()), self._worker.opaque_blocks())

    def _apply(self, meta: HandoffMeta) -> None:
        """Carries out a step once (from ``save_kv_layer`` or ``start_load_kv``, which vLLM
        calls after the forward pass)."""
        if self._applied is meta:
            return
        self._applied = meta
        if meta.meta:
            # Loading a peer may start the transport's connection threads.
            with _AllCpus():
                self._worker.apply(meta.meta)
        self._last = meta
        self._pending_sending.update(meta.finished_sending)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HandoffMeta) or self._worker is None:
            return
        self._apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, HandoffMeta) or not meta.forward:
            return
        self._apply(meta)
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._worker.waits_for_layer(layer):
            return
        with _AllCpus():
            self._worker.layer_saved(layer, self._stream())

    def wait_for_save(self):
        if self._worker is not None:
            self._worker.forward_done(self._stream())

    def _stream(self) -> int | None:
        """The forward's CUDA stream on a GPU (its kernels were enqueued there), else None."""
        if not self._on_gpu:
            return None
        import torch

        return int(torch.cuda.current_stream().cuda_stream)

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None, r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is not None:
            report = self._worker.poll()
            if report is not None:
                self._report = bytes(report)
        # A send may be reported only once vLLM named the request finished (base.py).
        now = time.monotonic()
        for r in finished_req_ids:
            self._seen_finished.setdefault(r, now)
        sending = {r for r in self._pending_sending if r in self._seen_finished}
        self._pending_sending -= sending
        for r in sending:
            del self._seen_finished[r]
        # Oldest first: stop at the first one still young enough.
        for r, at in list(self._seen_finished.items()):
            if now - at < self.FINISHED_TTL_S:
                break
            del self._seen_finished[r]
        meta, self._last = self._last, None
        recving = set(meta.finished_recving) if meta else set()
        failed = set(meta.failed_recving) if meta else set()
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving | failed,
            failed_recving=failed,
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._report = self._report, None
        return HandoffWorkerMeta([report]) if report else None

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
        self._timeline.close()

    # ------------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if not metadata or self._sched is not None:
            return
        hellos = [metadata[r] for r in sorted(metadata)]
        self._opaque = all(getattr(h, "opaque_blocks", True) for h in hellos)
        mc = self._config.model_config
        cfg = {
            "engine_id": self._engine_id,
            "model": str(self._extra.get("model_name") or mc.served_model_name or mc.model),
            "dtype": str(mc.dtype).replace("torch.", ""),
            "mode": self._extra.get("mode", "pull"),
            "side_channel_host": self._extra.get("side_channel_host", "127.0.0.1"),
            "side_channel_port": int(self._extra.get("side_channel_port", 0)),
            "advertise_host": self._extra.get("advertise_host"),
            "cluster_key_file": self._extra.get("cluster_key_file"),
            "insecure": bool(self._extra.get("insecure", False)),
            "peer_hosts": [str(h) for h in self._extra.get("peer_hosts") or []],
            "initial_lease_ms": self._extra.get("initial_lease_ms"),
            "wait_deadline_ms": self._extra.get("wait_deadline_ms"),
            "registration_lease_ms": self._extra.get("registration_lease_ms"),
            "read_timeout_ms": self._extra.get("read_timeout_ms"),
            "transfer_floor_mb_per_s": self._extra.get("transfer_floor_mb_per_s"),
            "push_deadline_ms": self._extra.get("push_deadline_ms"),
            "hard_cap_ms": self._extra.get("hard_cap_ms"),
            "protocol_version": self._extra.get("protocol_version"),
            "opaque_blocks": self._opaque,
            "kv_digest": bool(self._extra.get("kv_digest", False)),
            "record_trace": self._extra.get("record_trace"),
            "failure_policy": getattr(
                self._config.kv_transfer_config, "kv_load_failure_policy", None
            ),
        }
        self._sched = _native.Scheduler(json.dumps(cfg), [bytes(h.hello) for h in hellos])
        logger.info(
            "handoff connector %s: side channel on port %d",
            self._engine_id,
            self._sched.side_channel_port(),
        )

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params
        if self._timeline.on and params and (
            params.get("do_remote_decode") or params.get("do_remote_prefill")
        ):
            self._timeline.arrived(request.request_id, params.get("handoff_id"))
        if self._sched is None or not params or not params.get("do_remote_prefill"):
            return 0, False
        if not params.get("handoff_id"):
            return 0, False
        prompt = len(request.prompt_token_ids)
        n, later = self._sched.remote_prefill_arrived(
            request.request_id, json.dumps(params), prompt
        )
        if later:
            # n>1: a sibling's READ brings this prompt's KV; vLLM asks again next step and
            # then finds it in its prefix cache.
            return None, False
        if n is None:
            return 0, False
        count = n - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if self._sched is None or not params:
            return
        if params.get("do_remote_decode"):
            if self._plans_prefill(request):
                self._prefilling.setdefault(
                    request.request_id,
                    _Prefill(dict(params), len(request.prompt_token_ids),
                             self._family(request, params)),
                )
            return
        if not params.get("do_remote_prefill"):
            return
        if num_external_tokens <= 0:
            # vLLM computes the prompt here (a full prefix hit, or a request that skips every
            # cached prefix): P may release now, and nothing about this handoff may reach vLLM
            # for a request that does not wait for remote KV.
            self._sched.no_load(request.request_id)
            params["do_remote_prefill"] = False
            return
        prompt = len(request.prompt_token_ids)
        needed = -(-prompt // self._block_size)
        # One list per KV cache group (vLLM's hybrid manager gives each its blocks; a sliding
        # group's list still covers the whole prompt here).
        block_ids = [list(g)[:needed] for g in blocks.get_block_ids()]
        # vLLM's prefix cache may already hold the prompt's first blocks (computed here, shared
        # with other requests, and told to get_num_new_matched_tokens block-aligned): a pull
        # reads, and a push registers, only the rest, never a block another request may be
        # reading (P's writes start at the first token after the hit).
        cached = max(0, prompt - num_external_tokens) // self._block_size
        self._sched.blocks_allocated(request.request_id, block_ids, cached, prompt)
        self._timeline.mark(request.request_id, "allocated")
        # One transfer per request: once rescheduled after its KV landed, it is a local request.
        params["do_remote_prefill"] = False

    def _plans_prefill(self, request) -> bool:
        """Whether the core hears of a P request's prefill at its last prefill step (see the
        module doc): one vLLM finishes right after that step. n>1: only the first child; its
        siblings give their blocks back."""
        child = _CHILD_ID.match(request.request_id)
        return (child is None or child.group(1) == "0") and getattr(
            request, "max_tokens", None) == 1

    def _plan_prefills(self, so) -> None:
        """Tells the core of every prefill for a D whose prompt this step completes."""
        steps = []
        for new in so.scheduled_new_reqs:
            st = self._prefilling.get(new.req_id)
            if st is not None:
                st.blocks = [list(g) for g in new.block_ids]
                steps.append((new.req_id, st, new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._prefilling.get(req_id)
            if st is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                if req_id in cached.resumed_req_ids or len(st.blocks) != len(added):
                    st.blocks = [list(g) for g in added]
                else:
                    for have, more in zip(st.blocks, added):
                        have.extend(more)
            steps.append((req_id, st, cached.num_computed_tokens[i]))
        for req_id, st, computed in steps:
            if computed + so.num_scheduled_tokens.get(req_id, 0) < st.prompt_len:
                continue
            del self._prefilling[req_id]
            needed = -(-st.prompt_len // self._block_size)
            try:
                held = self._sched.prefill_planned(
                    req_id, json.dumps(st.params), [g[:needed] for g in st.blocks], st.prompt_len
                )
            except Exception as e:  # the core then hears of it at request_finished
                logger.warning("handoff: prefill of %s not planned: %s", req_id, e)
                continue
            if held:
                self._forwarded.add(req_id)
                if st.family is not None:
                    # This child keeps the family's handoff, whichever finishes first.
                    self._siblings[st.family] = (time.monotonic(), None)
                self._timeline.mark(req_id, "forwarded", st.params.get("handoff_id"))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._sched is None:
            return HandoffMeta()
        if self._prefilling:
            self._plan_prefills(scheduler_output)
        meta, sending, recving, failed, forward = self._sched.build_meta()
        if self._timeline.on:
            self._timeline.scheduled(scheduler_output)
            self._timeline.landed(list(recving))
        return HandoffMeta(bytes(meta), list(sending), list(recving), list(failed), forward)

    def update_connector_output(self, connector_output) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._sched is not None and isinstance(wm, HandoffWorkerMeta) and wm.reports:
            self._sched.worker_reports(wm.reports)

    def request_finished(self, request, block_ids: list[int]):
        # vLLM calls request_finished_all_groups on a connector that supports its hybrid KV
        # cache manager; this is the one-group form.
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        """One list of block ids per KV cache group (a sliding group's starts with vLLM's null
        block wherever it freed one); the core keeps each group's moved blocks."""
        if self._sched is None:
            return False, None
        needed = -(-len(request.prompt_token_ids) // self._block_size)
        lists = [[int(b) for b in g][:needed] for g in block_ids]
        self._prefilling.pop(request.request_id, None)
        keeps_family = request.request_id in self._forwarded
        self._forwarded.discard(request.request_id)
        params = request.kv_transfer_params
        remote_decode = bool(params and params.get("do_remote_decode"))
        if remote_decode and not self._finished_normally(request):
            remote_decode = False
        family = self._family(request, params) if remote_decode else None
        if family is not None and not (keeps_family or family not in self._siblings):
            # A sibling: one handoff per client request (the child whose handoff started with
            # its last prefill step keeps it, else the first to finish), so its blocks go back
            # now (D reads once and fans out); the response carries the kept handoff's params,
            # whichever child vLLM answers with.
            self._sched.request_finished(
                request.request_id, None, lists, int(request.num_computed_tokens))
            kept = self._siblings.get(family, (0.0, None))[1]
            return False, (dict(kept) if kept else None)
        keep, out = self._sched.request_finished(
            request.request_id,
            json.dumps(params) if remote_decode else None,
            lists,
            int(request.num_computed_tokens),
        )
        answer = json.loads(out) if out else None
        if keep and remote_decode:
            handoff = (answer or params).get("handoff_id")
            self._timeline.mark(request.request_id, "prefilled", handoff)
        self._timeline.forget(request.request_id)
        if family is not None:
            self._siblings[family] = (time.monotonic(), answer)
        return bool(keep), answer

    # How long P remembers the handoff an n>1 request's first child kept, for its siblings: they
    # finish in the same step or a few later (max_tokens 1).
    SIBLING_TTL_S = 60.0

    def _family(self, request, params: dict[str, Any]) -> tuple | None:
        """The key P's children of one n>1 request share: the parent's id, the prompt and the
        params (a request whose own id merely looks like a child's, "0_x", is in a family
        only with one of the same prompt and params, whose KV is the same)."""
        child = _CHILD_ID.match(request.request_id)
        if child is None:
            return None
        now = time.monotonic()
        while self._siblings:
            key, (at, _) = next(iter(self._siblings.items()))
            if now - at < self.SIBLING_TTL_S:
                break
            del self._siblings[key]
        return (child.group(2), tuple(request.prompt_token_ids),
                json.dumps(params, sort_keys=True))

    @staticmethod
    def _finished_normally(request) -> bool:
        from vllm.v1.request import RequestStatus

        return request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )

    def has_pending_block_frees(self) -> bool:
        # vLLM asks before it preempts a request for blocks; a streamed push whose request has
        # not finished yet is still reading its blocks (see the module doc). Its request finishes
        # with the step in flight, so vLLM waits at most a step.
        return bool(self._forwarded)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()
