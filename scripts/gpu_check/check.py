"""The device check's driver (scripts/gpu-check runs it; see docs/src/guides/gpu.md).

HandoffConnector is driven as vLLM's GPU model runner drives it, without vLLM (a stub of the
few vLLM names it imports is on the path): a P and a D engine, each a process holding the
scheduler-side connector and one worker-side connector per TP rank over KV tensors of the
layout under test. Each engine process steps on its own, as vLLM's engine loop does
(build_connector_meta; per worker bind_connector_metadata, start_load_kv, per layer
wait_for_layer_load / the layer's kernel / save_kv_layer, wait_for_save, get_finished,
build_connector_worker_meta; update_connector_output), and takes short commands from the
coordinator between steps: the coordinator plays the client and the proxy.

What is checked, for every layout, pull and streamed push, TP 1→1, 2→1 and 1→2:
- every prompt token's K and V in D's blocks equal what P's kernels wrote (a pattern both sides
  compute from the token's position, layer, head and dim: nothing crosses but the transfer);
- every block of D's pool that no request used keeps its sentinel bytes;
- nothing is left pending on either side afterwards (no stranded block).
Negative controls that must be caught: a READ that lands with one byte changed (D's digest
check fails the request), and a push whose layer kernels run late
(torch.cuda._sleep) with the connector's stream ordering switched off (D's bytes differ or its
digest check fails). On a CUDA device it then times handoff's tcp against a raw pipeline of
pinned copies and a loopback socket, and a device-to-device copy as the roof.

Prints progress on stderr and one JSON object on its last stdout line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from types import SimpleNamespace

import torch

HEADS = 4  # KV heads of the model (TP 2: two per rank)
HEAD_DIM = 64
LAYERS = 4
BLOCK = 16  # the scheduler's block size
NUM_BLOCKS = 64  # per rank, logical
SENTINEL = 77.0
DTYPE = torch.bfloat16

# Each layout: the tensor's logical shape (kv_first: FlashAttention's [2, blocks, tokens, heads,
# dim]; blocks_first: FlashInfer's [blocks, 2, ...]; view: vLLM 0.33's per-layer [blocks, heads,
# tokens, K|V]), the stride order of its memory (outermost first), and the kernel block size
# (None: the scheduler's).
LAYOUTS = {
    "flash_nhd": ("kv_first", (0, 1, 2, 3, 4), None),
    "flash_hnd": ("kv_first", (0, 1, 3, 2, 4), None),
    "flashinfer_nhd": ("blocks_first", (0, 1, 2, 3, 4), None),
    "flashinfer_hnd": ("blocks_first", (0, 1, 3, 2, 4), None),
    "flash_nhd_kernel8": ("kv_first", (0, 1, 2, 3, 4), 8),
    "views_lbhnc": ("view", (0, 1, 2, 3), None),
    "views_lbnhc": ("view", (0, 2, 1, 3), None),
    "views_lbnhc_kernel8": ("view", (0, 2, 1, 3), 8),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- KV tensors


def allocate(layout: str, hpr: int, device, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """One layer's KV tensor as the backend allocates it: memory in the stride order, viewed in
    the backend's logical dim order."""
    kind, order, kernel = LAYOUTS[layout]
    kbs = kernel or BLOCK
    nbk = num_blocks * (BLOCK // kbs)
    logical = {
        "kv_first": (2, nbk, kbs, hpr, HEAD_DIM),
        "blocks_first": (nbk, 2, kbs, hpr, HEAD_DIM),
        "view": (nbk, hpr, kbs, 2 * HEAD_DIM),
    }[kind]
    physical = torch.full([logical[i] for i in order], SENTINEL, dtype=DTYPE, device=device)
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    t = physical.permute(*inverse)
    assert tuple(t.shape) == logical
    return t


def canonical(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The tensor indexed [kv, kernel block, token, head, dim] whatever its layout."""
    kind = LAYOUTS[layout][0]
    if kind == "view":
        # [block, head, token, K|V] with K's row then V's in the last dim.
        return t.unflatten(-1, (2, HEAD_DIM)).permute(3, 0, 2, 1, 4)
    return t if kind == "kv_first" else t.transpose(0, 1)


def kernel_ids(layout: str, blocks: list[int], device) -> torch.Tensor:
    kbs = LAYOUTS[layout][2] or BLOCK
    r = BLOCK // kbs
    return torch.tensor([b * r + j for b in blocks for j in range(r)], device=device)


def pattern(salt: int, layer: int, n_blocks: int, heads: range, prompt_len: int, device):
    """What P's kernels write for a prompt in `n_blocks` blocks: [2, n_blocks, BLOCK, heads,
    HEAD_DIM], small integers (exact in bf16) from the position, layer, head and dim; tokens
    past the prompt hold -1 (a kernel's garbage: they are not the prompt's)."""
    kv = torch.arange(2, device=device).view(2, 1, 1, 1, 1)
    pos = torch.arange(n_blocks * BLOCK, device=device).view(1, n_blocks, BLOCK, 1, 1)
    h = torch.tensor(list(heads), device=device).view(1, 1, 1, -1, 1)
    d = torch.arange(HEAD_DIM, device=device).view(1, 1, 1, 1, HEAD_DIM)
    v = (salt * 29 + layer * 7 + kv * 3 + pos * 13 + h * 5 + d) % 251 - 125
    v = torch.where(pos < prompt_len, v, torch.full_like(v, -1))
    return v.to(DTYPE)


# ---------------------------------------------------------------------------- one engine


class Request:
    """What HandoffConnector reads of vLLM's Request."""

    def __init__(self, rid: str, params: dict | None, prompt_len: int):
        from vllm.v1.request import RequestStatus

        self.request_id = rid
        self.kv_transfer_params = params
        self.prompt_token_ids = list(range(prompt_len))
        self.num_computed_tokens = 0
        self.max_tokens = 1
        self.status = RequestStatus.RUNNING


class Engine:
    def __init__(self, name: str, role: str, mode: str, tp: int, layout: str, device: str,
                 num_blocks: int = NUM_BLOCKS, kv_digest: bool = True, transport: str = "tcp"):
        from handoff_vllm.connector import HandoffConnector
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.name, self.tp, self.layout, self.mode = name, tp, layout, mode
        self.device = torch.device(device)
        self.hpr = HEADS // tp
        self.num_blocks = num_blocks
        extra = {"engine_id": name, "mode": mode, "kv_digest": kv_digest, "transport": transport}
        cfg = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config=extra, engine_id=name, kv_load_failure_policy=None
            ),
            cache_config=SimpleNamespace(block_size=BLOCK),
            model_config=SimpleNamespace(
                get_total_num_kv_heads=lambda: HEADS,
                get_head_size=lambda: HEAD_DIM,
                served_model_name="gpu-check",
                model="gpu-check",
                dtype=DTYPE,
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        )
        # The forward's stream: not the default one (vLLM's runner computes on its own).
        self.stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self.workers, self.kv = [], []
        for rank in range(tp):
            parallel_state.RANK = rank
            w = HandoffConnector(cfg, KVConnectorRole.WORKER)
            kv = {f"model.layers.{l}.self_attn.attn":
                  allocate(layout, self.hpr, self.device, num_blocks)
                  for l in range(LAYERS)}
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kv.append(list(kv.items()))
        self.sched = HandoffConnector(cfg, KVConnectorRole.SCHEDULER)
        self.sched.set_xfer_handshake_metadata(
            {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)})
        self.requests: dict[str, tuple[Request, list[int]]] = {}
        self.finished_now: set[str] = set()
        self.sending: set[str] = set()
        self.recving: dict[str, int] = {}  # request -> ranks that reported it
        self.failed: set[str] = set()
        self.used: set[int] = set()
        self.unordered = False

    def blocks_of(self, b):
        return SimpleNamespace(get_block_ids=lambda: (list(b),))

    def step(self, scheduled=None, forward=None):
        """One engine step; `forward(rank, layer, tensor)` is the layer's kernel."""
        so = scheduled or SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]),
            num_scheduled_tokens={},
        )
        meta = self.sched.build_connector_meta(so)
        finished, self.finished_now = self.finished_now, set()
        out = None
        for rank, w in enumerate(self.workers):
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            if forward is not None:
                ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullctx()
                with ctx:
                    if self.unordered:
                        # The negative control: the connector is handed a stream with no
                        # work on it, so its event passes at once and the layer's writes go
                        # while its kernel may still run.
                        idle = torch.cuda.Stream()
                        w._stream = lambda: int(idle.cuda_stream)
                    for layer, (name, t) in enumerate(self.kv[rank]):
                        w.wait_for_layer_load(name)
                        forward(rank, layer, t)
                        w.save_kv_layer(name, t, None)
                    w.wait_for_save()
            sending, recving = w.get_finished(finished)
            for r in sending or ():
                self.sending.add(r)
            for r in recving or ():
                self.recving[r] = self.recving.get(r, 0) + 1
            wm = w.build_connector_worker_meta()
            if wm is not None:
                out = wm if out is None else out.aggregate(wm)
            w.clear_connector_metadata()
        for r in meta.failed_recving:
            self.failed.add(r)
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))

    # P ---------------------------------------------------------------------------------

    def prefill(self, rid, params, prompt_len, blocks, salt, slow_cycles=0):
        """Admits the request, runs its prompt's forward (each layer's kernel after a sleep of
        `slow_cycles` when set) and finishes it as vLLM does after one sampled token."""
        from vllm.v1.request import RequestStatus

        req = Request(rid, params, prompt_len)
        self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, self.blocks_of(blocks), 0)
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(blocks),),
                                                num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]),
            num_scheduled_tokens={rid: prompt_len},
        )
        ids = kernel_ids(self.layout, blocks, self.device)

        def kernel(rank, layer, t):
            if slow_cycles and self.stream is not None:
                torch.cuda._sleep(slow_cycles)
            heads = range(rank * self.hpr, (rank + 1) * self.hpr)
            v = pattern(salt, layer, len(blocks), heads, prompt_len, self.device)
            canonical(t, self.layout)[:, ids] = v.view(2, len(ids), -1, self.hpr, HEAD_DIM)

        self.step(so, kernel)
        if self.stream is not None:
            # vLLM reads the step's sampled token back before it finishes the request: the
            # forward's kernels are done by then (a pull relies on it; a push must not).
            self.stream.synchronize()
        req.num_computed_tokens = prompt_len
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        keep, answer = self.sched.request_finished(req, list(blocks))
        self.finished_now.add(rid)
        self.requests[rid] = (req, list(blocks))
        return bool(keep), answer

    # D ---------------------------------------------------------------------------------

    def admit(self, rid, params, prompt_len, blocks):
        req = Request(rid, params, prompt_len)
        n, load = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, self.blocks_of(blocks), n or 0)
        self.requests[rid] = (req, list(blocks))
        self.used.update(blocks)
        return n

    def landed(self, rid):
        if rid in self.failed:
            return "failed"
        return "landed" if self.recving.get(rid, 0) >= self.tp else None

    def verify(self, rid, salt, prompt_len):
        """Mismatched prompt rows of the request, and sentinel blocks that changed."""
        if self.stream is not None:
            torch.cuda.synchronize()
        _, blocks = self.requests[rid]
        ids = kernel_ids(self.layout, blocks, self.device)
        rows, sentinels = 0, 0
        unused = torch.ones(self.num_blocks, dtype=torch.bool)
        unused[list(self.used)] = False
        spare = kernel_ids(self.layout, [b for b in range(self.num_blocks) if unused[b]],
                           self.device)
        for rank in range(self.tp):
            heads = range(rank * self.hpr, (rank + 1) * self.hpr)
            for layer, (_, t) in enumerate(self.kv[rank]):
                c = canonical(t, self.layout)
                got = c[:, ids].reshape(2, len(blocks) * BLOCK, self.hpr, HEAD_DIM)
                want = pattern(salt, layer, len(blocks), heads, prompt_len, self.device)
                want = want.reshape(2, len(blocks) * BLOCK, self.hpr, HEAD_DIM)
                bad = (got[:, :prompt_len] != want[:, :prompt_len]).any(dim=-1)
                rows += int(bad.sum())
                if len(spare):
                    sentinels += int((c[:, spare] != SENTINEL).sum())
        return rows, sentinels

    def finish(self, rid):
        from vllm.v1.request import RequestStatus

        req, blocks = self.requests.pop(rid)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        keep, _ = self.sched.request_finished(req, blocks)
        self.finished_now.add(rid)
        return bool(keep)

    def pending(self):
        return bool(self.sched._sched.has_pending_work())

    def shutdown(self):
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def engine_main(conn, name, role, mode, tp, layout, device, options, env):
    """An engine process: steps continuously, between steps carries out one command."""
    os.environ.update(env)
    try:
        e = Engine(name, role, mode, tp, layout, device, **options)
        conn.send(("ready", e.sched._sched.side_channel_port()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            if conn.poll(0.002):
                cmd, args = conn.recv()
                if cmd == "stop":
                    e.shutdown()
                    conn.send(("ok", None))
                    return
                if cmd == "unordered":
                    e.unordered = bool(args[0])
                    conn.send(("ok", None))
                    continue
                conn.send(("ok", getattr(e, cmd)(*args)))
            else:
                e.step()
        except Exception:
            conn.send(("error", traceback.format_exc()))


def engine_processes():
    """Where engine processes come from: a fork server that imported torch once.

    Every case starts a P and a D process (more for TP); spawning each anew imports torch
    again, seconds apiece (three minutes of the CPU check went to that). The server forks
    before any CUDA call, so each engine still initialises CUDA itself."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


class Handle:
    def __init__(self, name, role, mode, tp, layout, device, options, env):
        ctx = engine_processes()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main,
                                args=(child, name, role, mode, tp, layout, device, options, env),
                                daemon=True)
        self.proc.start()
        self.port = self._answer(60)

    def _answer(self, timeout):
        if not self.conn.poll(timeout):
            raise RuntimeError("engine did not answer")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    def __call__(self, cmd, *args, timeout=60):
        self.conn.send((cmd, args))
        return self._answer(timeout)

    def stop(self):
        try:
            self("stop", timeout=10)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------- the checks


def until(f, seconds=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        v = f()
        if v:
            return v
        time.sleep(0.005)
    return None


class Pair:
    """A P and a D engine; requests through them as a proxy sends them."""

    seq = 0

    def __init__(self, layout, mode, tp_p, tp_d, device, d_env=None, **options):
        Pair.seq += 1
        tag = f"{os.getpid()}-{Pair.seq}"
        self.mode, self.tp_p = mode, tp_p
        # "a>b": P's tensors in layout a, D's in b.
        p_layout, _, d_layout = layout.partition(">")
        self.p = Handle(f"gc-p-{tag}", "p", mode, tp_p, p_layout, device, options, {})
        self.d = Handle(f"gc-d-{tag}", "d", mode, tp_d, d_layout or p_layout, device, options,
                        d_env or {})
        self.p_name = f"gc-p-{tag}"
        self.next_block = {"p": 0, "d": 0}

    def blocks(self, side, n):
        """`n` blocks of `side`'s pool no request of this pair used yet."""
        b = list(range(self.next_block[side], self.next_block[side] + n))
        self.next_block[side] += n
        return b

    def run(self, rid, prompt_len, salt, corrupt_file=None, slow_cycles=0):
        """One request end to end: its outcome on D ('landed' or 'failed'), mismatched rows and
        changed sentinels, seconds from P's prefill to D's landing."""
        n = -(-prompt_len // BLOCK)
        p_blocks, d_blocks = self.blocks("p", n), self.blocks("d", n)
        handoff = os.urandom(16).hex()
        t0 = time.monotonic()
        if self.mode == "push":
            p_leg = {"do_remote_decode": True, "transfer_mode": "push", "handoff_id": handoff}
            d_leg = {"do_remote_prefill": True, "transfer_mode": "push", "handoff_id": handoff,
                     "remote_engine_id": self.p_name, "remote_host": "127.0.0.1",
                     "remote_port": self.p.port, "tp_size": self.tp_p, "epoch": 1}
            assert self.d("admit", f"d-{rid}", d_leg, prompt_len, d_blocks)
            time.sleep(0.2)  # D's registration reaches P while P prefills
            keep, _ = self.p("prefill", f"p-{rid}", p_leg, prompt_len, p_blocks, salt,
                             slow_cycles)
            assert keep, "P keeps its blocks until its writes landed"
        else:
            keep, params = self.p("prefill", f"p-{rid}", {"do_remote_decode": True}, prompt_len,
                                  p_blocks, salt, 0)
            assert keep and params, "P keeps its blocks for D"
            if corrupt_file:
                open(corrupt_file, "w").close()
            t0 = time.monotonic()
            assert self.d("admit", f"d-{rid}", params, prompt_len, d_blocks)
        outcome = until(lambda: self.d("landed", f"d-{rid}"))
        seconds = time.monotonic() - t0
        if corrupt_file:
            os.unlink(corrupt_file)
        rows, sentinels = self.d("verify", f"d-{rid}", salt, prompt_len)
        self.d("finish", f"d-{rid}")
        return outcome, rows, sentinels, seconds

    def drained(self):
        return until(lambda: not self.p("pending") and not self.d("pending"), 10.0) is not None

    def stop(self):
        self.p.stop()
        self.d.stop()


def nixl_carried():
    """Whether NIXL is here for the connector: HANDOFF_NIXL_LIB (scripts/gpu-check sets it to
    the carried library) or the project's .venv-nixl/."""
    lib = os.environ.get("HANDOFF_NIXL_LIB")
    if lib:
        return os.path.isfile(lib)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import glob

    return bool(glob.glob(f"{root}/.venv-nixl/lib/python3*/site-packages/*/libnixl_capi.so"))


def correctness(device, results, only=None):
    cases = [(layout, mode, 1, 1, "tcp") for layout in LAYOUTS for mode in ("pull", "push")]
    cases += [("flash_hnd", mode, tp_p, tp_d, "tcp") for mode in ("pull", "push")
              for tp_p, tp_d in ((2, 1), (1, 2))]
    cases += [("flashinfer_nhd", "pull", 2, 1, "tcp")]
    # vLLM 0.33's views (K and V rows interleaved) across TP sizes, and against an engine whose
    # K and V are planes of their own (P's layout > D's): the planner pairs them row by row.
    cases += [("views_lbnhc", "push", 2, 1, "tcp"), ("views_lbhnc", "pull", 1, 2, "tcp"),
              ("views_lbhnc>flash_hnd", "pull", 1, 1, "tcp"),
              ("flash_nhd>views_lbnhc", "push", 2, 1, "tcp")]
    # Over NIXL (VRAM registered as such on a GPU, DRAM on host memory): pull, streamed push,
    # a TP mismatch, and a 0.33 view (contiguous LBHNC: on the host, as without the fake
    # device, the CPU backend's opaque page; interleaved rows on a GPU).
    nixl = [("flash_hnd", "pull", 1, 1, "nixl"), ("flash_hnd", "push", 1, 1, "nixl"),
            ("flash_hnd", "pull", 2, 1, "nixl"), ("views_lbhnc", "push", 1, 1, "nixl")]
    if only == "nixl":
        cases = nixl
    elif os.environ.get("HANDOFF_VLLM_TEST_FAKE_DEVICE"):
        # NIXL registers real memory: a fake device's addresses are for handoff's own paths.
        results["nixl"] = "not run over the fake device (NIXL refuses its memory as VRAM)"
    elif nixl_carried():
        cases += nixl
    else:
        results["nixl"] = "not run: no NIXL here (scripts/gpu-check --prepare packs it)"
    ok = True
    for layout, mode, tp_p, tp_d, transport in cases:
        name = f"{layout} {mode} tp {tp_p}->{tp_d}" + (" nixl" if transport == "nixl" else "")
        pair = Pair(layout, mode, tp_p, tp_d, device, transport=transport)
        try:
            got = []
            for i, prompt_len in enumerate((BLOCK * 3, BLOCK * 2 + 5, 1)):
                outcome, rows, sentinels, _ = pair.run(f"r{i}", prompt_len, salt=i + 1)
                got.append(outcome == "landed" and rows == 0 and sentinels == 0)
                if not got[-1]:
                    log(f"  {name} prompt {prompt_len}: {outcome}, {rows} rows differ, "
                        f"{sentinels} sentinel elements changed")
            drained = pair.drained()
            passed = all(got) and drained
        finally:
            pair.stop()
        log(f"{'ok  ' if passed else 'FAIL'} {name}" + ("" if drained else " (left pending)"))
        results["cases"][name] = passed
        ok &= passed
    return ok


def negative_controls(device, results):
    # D's workers land every READ with one byte changed while this file exists (the vLLM
    # suite's switch, HANDOFF_VLLM_TEST_CORRUPT_FILE in crates/vllm/src/worker.rs).
    corrupt = f"/tmp/handoff-gpu-check-corrupt-{os.getpid()}"
    pair = Pair("flash_hnd", "pull", 1, 1, device,
                d_env={"HANDOFF_VLLM_TEST_CORRUPT_FILE": corrupt})
    try:
        outcome, rows, _, _ = pair.run("corrupt", BLOCK * 2, salt=9, corrupt_file=corrupt)
        caught = outcome == "failed"
        log(f"{'ok  ' if caught else 'FAIL'} digest control: a READ landed with one byte "
            f"changed -> {outcome}")
        results["controls"]["digest"] = caught
    finally:
        pair.stop()
    if device == "cpu":
        results["controls"]["ordering"] = "needs a GPU (host kernels finish before they return)"
        return caught
    pair = Pair("flash_hnd", "push", 1, 1, device)
    try:
        cycles = 200_000_000  # ~0.1 s per layer at ~2 GHz
        outcome, rows, _, _ = pair.run("slow", BLOCK * 4, salt=11, slow_cycles=cycles)
        ordered = outcome == "landed" and rows == 0
        pair.p("unordered", True)
        outcome2, rows2, _, _ = pair.run("slow-unordered", BLOCK * 4, salt=12, slow_cycles=cycles)
        control = outcome2 == "failed" or rows2 > 0
        log(f"{'ok  ' if ordered else 'FAIL'} late kernels, ordered: {outcome}, {rows} rows differ")
        log(f"{'ok  ' if control else 'FAIL'} late kernels, ordering off: {outcome2}, "
            f"{rows2} rows differ (must differ)")
        results["controls"]["late_kernel_ordered"] = ordered
        results["controls"]["ordering_off_caught"] = control
        return caught and ordered and control
    finally:
        pair.stop()


# ---------------------------------------------------------------------------- throughput

CHUNK = 1 << 20


def raw_sender(port, nbytes, device, ready):
    """The raw staged pipeline's sending side: device -> pinned (on a copy stream of its own,
    the next chunk's copy in flight while this one is on the socket) -> loopback socket."""
    import numpy as np  # noqa: F401 (torch's .numpy() needs it)

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    bufs = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in bufs]
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event(), torch.cuda.Event()]
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ready.wait()
    chunks = nbytes // CHUNK
    with torch.cuda.stream(stream):
        bufs[0].copy_(src[:CHUNK], non_blocking=True)
        events[0].record(stream)
        for k in range(chunks):
            if k + 1 < chunks:
                n = (k + 1) % 2
                bufs[n].copy_(src[(k + 1) * CHUNK:(k + 2) * CHUNK], non_blocking=True)
                events[n].record(stream)
            events[k % 2].synchronize()
            s.sendall(views[k % 2])
    s.close()


def raw_pipeline_gbps(nbytes):
    """GB/s of pinned copies and raw TCP between two processes, device to device."""
    ctx = engine_processes()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    ready = ctx.Event()
    proc = ctx.Process(target=raw_sender, args=(srv.getsockname()[1], nbytes, "cuda", ready))
    proc.start()
    conn, _ = srv.accept()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    bufs = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in bufs]
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event(), torch.cuda.Event()]
    for e in events:
        e.record(stream)
    t0 = time.monotonic()
    ready.set()
    for k in range(nbytes // CHUNK):
        i = k % 2
        events[i].synchronize()  # the copy out of this buffer two chunks ago is done
        got = 0
        while got < CHUNK:
            n = conn.recv_into(views[i][got:], CHUNK - got)
            if n == 0:
                raise RuntimeError("raw sender closed early")
            got += n
        with torch.cuda.stream(stream):
            dst[k * CHUNK:(k + 1) * CHUNK].copy_(bufs[i], non_blocking=True)
            events[i].record(stream)
    stream.synchronize()
    seconds = time.monotonic() - t0
    proc.join(30)
    conn.close()
    srv.close()
    return nbytes / seconds / 1e9


def nixl_api():
    """NIXL's own Python API, from the package carried beside its libraries."""
    import importlib

    for name in ("nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise RuntimeError("no NIXL Python package (nixl_cu13 or nixl_cu12) on the path")


def raw_nixl_source(conn, nbytes, device, pieces):
    """Raw NIXL's source side: `nbytes` registered on `device`, its metadata and the pieces'
    descriptors sent to the reader, kept until the reader is done."""
    api = nixl_api()
    agent = api.nixl_agent(f"raw-src-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    agent.register_memory(src)
    step = nbytes // pieces
    dev = max(src.get_device(), 0)
    conn.send((agent.get_agent_metadata(),
               [(src.data_ptr() + i * step, step, dev) for i in range(pieces)]))
    conn.recv()


def raw_nixl_gbps(nbytes, device="cuda", pieces=8):
    """GB/s of raw NIXL (its own API, no handoff) READing `nbytes` in `pieces` descriptors
    (one per layer's K or V plane, as handoff's pull of one long prompt coalesces them)
    between two processes, device to device: the baseline of handoff NIXL."""
    api = nixl_api()
    ctx = engine_processes()
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=raw_nixl_source, args=(child, nbytes, device, pieces))
    proc.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("raw NIXL source did not answer")
        md, remote = conn.recv()
        agent = api.nixl_agent(f"raw-dst-{os.getpid()}",
                               api.nixl_agent_config(backends=["UCX"]))
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        agent.register_memory(dst)
        peer = agent.add_remote_agent(md)
        mem = "VRAM" if dst.get_device() >= 0 else "DRAM"
        step = nbytes // pieces
        dev = max(dst.get_device(), 0)
        local = agent.get_xfer_descs([(dst.data_ptr() + i * step, step, dev)
                                      for i in range(pieces)], mem)
        best = None
        for _ in range(3):
            handle = agent.initialize_xfer("READ", local, agent.get_xfer_descs(remote, mem), peer)
            t0 = time.monotonic()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            seconds = time.monotonic() - t0
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended {state}")
            best = seconds if best is None else min(best, seconds)
        return nbytes / best / 1e9
    finally:
        conn.send("done")
        proc.join(30)


def device_copy_gbps(nbytes):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.monotonic() - t0) / 1e9


def pull_gbps(device, transport, num_blocks, prompt, nbytes):
    """GB/s of the best of three pulls of one long prompt over `transport`, or None."""
    pair = Pair("flash_hnd", "pull", 1, 1, device, num_blocks=num_blocks + 8, kv_digest=False,
                transport=transport)
    try:
        times = []
        for i in range(3):
            pair.next_block = {"p": 0, "d": 0}
            outcome, rows, _, seconds = pair.run(f"big{i}", prompt, salt=20 + i)
            if outcome != "landed" or rows:
                log(f"FAIL throughput pull {i} over {transport}: {outcome}, {rows} rows differ")
                return None
            times.append(seconds)
        return nbytes / min(times) / 1e9
    finally:
        pair.stop()


def throughput(device, results):
    """handoff tcp (a pull of one long prompt) against the raw staged pipeline, same run; and
    handoff NIXL on VRAM when NIXL was carried."""
    num_blocks = 16384
    prompt = num_blocks * BLOCK - 7  # 262,137 tokens, 1 GiB of KV
    nbytes = prompt * LAYERS * 2 * HEADS * HEAD_DIM * 2
    handoff = pull_gbps(device, "tcp", num_blocks, prompt, nbytes)
    if handoff is None:
        return False
    nixl = pull_gbps(device, "nixl", num_blocks, prompt, nbytes) if nixl_carried() else None
    raw_nixl = None
    if nixl is not None:
        try:
            raw_nixl = raw_nixl_gbps(nbytes)
        except Exception:
            log("raw NIXL: " + traceback.format_exc())
    raw = max(raw_pipeline_gbps(nbytes) for _ in range(2))
    roof = device_copy_gbps(nbytes)
    results["throughput"] = {
        "bytes": nbytes,
        "handoff_tcp_gbps": round(handoff, 3),
        "raw_staged_tcp_gbps": round(raw, 3),
        "handoff_tcp_vs_raw": round(handoff / raw, 3),
        "device_copy_gbps": round(roof, 1),
        "handoff_nixl_gbps": round(nixl, 3) if nixl else "not measured (no NIXL carried)",
        "raw_nixl_gbps": round(raw_nixl, 3) if raw_nixl else "not measured (see stderr)",
        "handoff_nixl_vs_raw": round(nixl / raw_nixl, 3) if nixl and raw_nixl else None,
    }
    log(f"throughput: handoff tcp {handoff:.2f} GB/s, raw staged tcp {raw:.2f} GB/s "
        f"({handoff / raw:.3f}x), device copy {roof:.0f} GB/s")
    return True


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    results = {"device": device, "torch": torch.__version__, "cases": {}, "controls": {}}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
        pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        results["pinned_alloc"] = bool(pinned.is_pinned())
        log(f"device: {results['gpu']}, torch {torch.__version__}, pinned host memory: "
            f"{results['pinned_alloc']}")
    # "controls": those alone (debugging); "nixl": the NIXL cases alone.
    only = sys.argv[2] if len(sys.argv) > 2 else None
    ok = correctness(device, results, only) if only != "controls" else True
    if only == "nixl":
        # The throughput's NIXL half, small and on host memory: that both sides of the
        # comparison run (a ratio on two shared cores means nothing).
        num_blocks = 256
        prompt = num_blocks * BLOCK - 7
        nbytes = prompt * LAYERS * 2 * HEADS * HEAD_DIM * 2
        handoff = pull_gbps(device, "nixl", num_blocks, prompt, nbytes)
        raw = raw_nixl_gbps(nbytes, device)
        results["nixl_throughput"] = {"bytes": nbytes, "handoff_nixl_gbps": handoff,
                                      "raw_nixl_gbps": raw}
        ok &= bool(handoff) and bool(raw)
    if only != "nixl":
        ok &= negative_controls(device, results)
    if device == "cuda":
        try:
            throughput(device, results)
        except Exception:
            log("throughput: " + traceback.format_exc())
            results["throughput"] = "error (see stderr)"
    results["passed"] = bool(ok)
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
