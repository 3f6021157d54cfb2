"""TTFT benchmark on the real model: vLLM P/D through HandoffConnector (pull and push) against
the same P/D through vLLM's own NixlConnector and against a single vLLM engine; same prompts, same
machine, one run.

A benchmark, not a timed test: it prints a table and writes the numbers into the report
(``conftest.REPORT``, the last line of ``scripts/test-vllm``); it asserts only that every request
of handoff's paths and the single engine completed. Every server runs SmolLM2-135M-Instruct (the
suite's real model: 30 layers, a prefill of ~350 tokens/s here, so a P/D ratio measures more than
fixed costs) with ``--max-model-len 4096`` so that 2048-token prompts fit, on one core of its own
(``P_CPUS``, ``D_CPUS``: P and the single engine on CPU 0, D on CPU 1; why at ``P_CPUS``), and
each request starts ``SETTLE_S`` after the previous one ended. Servers of its own, one setup at a
time:

1. handoff P + D in pull mode (``HandoffConnector``, no digest, no test switches) and a single
   engine, started together (the cores idle servers burn are measured first:
   ``ttft_bench_idle_cores``); each prompt goes through the pull path, then to the single
   engine (interleaved: a drift of the machine's speed moves both alike). P and D are stopped.
2. handoff P + D in push mode, started beside the same single engine; each prompt goes through
   push, then to the single engine again (``single_push``, push's baseline). All stopped.
3. NixlConnector P + D, started and measured alone: NIXL's progress thread spins a core per
   engine, so no NIXL server is ever up while another path is measured. Then the baseline for
   handoff's dead-D tests: P prefills one more prompt for D, D is SIGKILLed, and the time until
   P releases those blocks (its log says so) is ``nixl_reclaim_after_kill_s`` (waited for at
   most ``NIXL_RECLAIM_LIMIT_S``; null if longer). Stopped.

The pull and NIXL P/D setups go through the same tiny proxy (``pd_ttft``): P gets the prompt
with ``max_tokens`` 1, not streamed, ``kv_transfer_params={"do_remote_decode": true}``; D gets
P's response ``kv_transfer_params`` and streams. Push (``push_ttft``) sends both legs at once, as
handoff's proxy does: D (streamed) with a fresh handoff id and P's side channel address, P with
the same id; P writes its KV into the blocks D registered, layer by layer during its last prefill
step. TTFT is from the client's start (before the P request) until the first streamed chunk from
D that carries a token. The single engine gets the same request streamed directly.
HandoffConnector moves the KV over its own tcp transport (its default in vLLM); NixlConnector over
UCX (shared memory / CMA on one host).

Phases (``ttft_phases_ms``): handoff's P and D write their scheduler's moments to a timeline
(extra config ``timeline``, :mod:`handoff_vllm.timeline`), joined with the client's clock by the
handoff id. Each handoff P/D TTFT splits into consecutive phases that add up to it:
``p_queue`` (client to P's scheduler), ``p_prefill`` (P's scheduler to P's request finished),
``p_answer`` (P finished to the client holding P's response; pull), ``hop_to_d`` (the client's
response to D's scheduler seeing the request; pull), ``d_alloc`` (D's scheduler to blocks given;
pull), ``kv_landed`` (pull: blocks given, push: P's request finished, to D's connector telling
vLLM the KV is in; negative in push when the layer-wise writes were in before P's request
finished), ``d_first_step`` (to the first step computing for it being built) and
``first_token`` (that step to the client's first token). The p50 of each over all measured
requests, and at 2048 tokens.

Prompts: random token ids in 5..4000, fixed seeds, a distinct prompt per request (no prefix-cache
hits), lengths 256, 512, 1024 and 2048; concurrency 1; requests alternate between lengths (one of
each length, then the next round), so slow drift spreads over all lengths. ``WARMUP`` requests
per setup are not counted.

Ratios (``*_vs_*_ttft_p50``/``_p99``): the p50 (p99) of the first path's TTFTs over the p50 (p99)
of the second's, each **pooled over all measured requests of all lengths** (the same number per
length in every path); a ratio to ``single`` takes the single engine's requests of the same
setup (``BASELINE``: push's are ``single_push``). Per-length p50/p99 and per-length p50 ratios
are under ``ttft_ms`` and ``ttft_p50_ratio_by_length``. Greedy output token ids of D are
compared with the single engine's for every measured prompt (``output_mismatches_bench``:
reported; random prompts may hold a near-tie that two batch shapes break differently).

Also reported: P's share of each P/D TTFT (``ttft_ms.<path>.p_share_all``: the P round trip
before D is asked), the cores idle servers burn (``ttft_bench_idle_cores``: NIXL's spin shows
there), and the cores other processes used while each path was measured
(``ttft_bench_other_load_cores``: this machine is shared; a busy neighbour shows up there). Every
sample goes to ``bench-ttft-samples.json`` beside the server logs.

Knobs: HANDOFF_BENCH_REQUESTS (measured requests per length and path, default 3; at 5 the
bench took 22 of a CI run's 71 minutes),
HANDOFF_BENCH_WARMUP (default 1), HANDOFF_BENCH_MAX_TOKENS (D's output tokens, default 4).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import threading
import time
from pathlib import Path

import requests

from conftest import (LOGS, P_MAX_MODEL_LEN, REAL_MODEL_NAME, REPORT, STARTUP_S, Server,
                      connector, free_port)

LENGTHS = [256, 512, 1024, 2048]
N = int(os.environ.get("HANDOFF_BENCH_REQUESTS", "3"))
WARMUP = int(os.environ.get("HANDOFF_BENCH_WARMUP", "1"))
MAX_TOKENS = int(os.environ.get("HANDOFF_BENCH_MAX_TOKENS", "4"))
TIMEOUT_S = 120
PATHS = ["handoff", "push", "nixl", "single", "single_push"]
# Each P/D path's baseline: the single engine measured in the same setup, its requests
# interleaved with the path's one by one, so a machine whose speed drifts between setups (this
# one is shared) moves both sides of a ratio alike. One CI run measured pull and the single engine
# in turn, then push: push came out 0.75x the single engine.
BASELINE = {"handoff": "single", "push": "single_push", "nixl": "single"}
# NixlConnector frees a request's blocks on P when D's read notification arrives or its lease
# (kv_lease_duration, 30 s by default) ends: wait a little longer than that for the baseline.
NIXL_RECLAIM_LIMIT_S = 45
# One core per engine, as each engine of a cluster has a host (or GPU) of its own: P (and the
# single engine) on CPU 0, D on CPU 1. Unpinned, the two engines of a P/D pair take each other's
# cores: vLLM steps without pause while a request waits for remote KV (D during a push's whole
# prefill) and its worker then spins (sched_yield) for 1 s after every step (shm_broadcast's
# SpinCondition, busy_loop_s = 1, not configurable). Measured unpinned: P's prefill of 256
# tokens took 280-840 ms back to back against 282-298 ms on the single engine, and a waiting
# push D burnt a whole core while its P prefilled 2048 tokens 30% slower than the single engine.
P_CPUS, D_CPUS = ("0", "1") if (os.cpu_count() or 1) >= 2 else (None, None)
# Each request of every path starts this long after the previous one ended: past that spin.
SETTLE_S = 1.2
# The bench's P and D log what a failed request needs explained.
BENCH_LOG = {"RUST_LOG": "info,handoff_vllm=debug,handoff_transport=debug"}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def schedule(setup: int = 0) -> list[tuple[int, list[int]]]:
    """The measured requests of a setup, in order: (length, prompt); round r holds one of each
    length. Each setup has prompts of its own: the single engine serves two setups, and would
    find the first one's prompts in its prefix cache."""
    return [(n, prompt(n, seed=100_000 * (setup + 1) + 1000 * r + n))
            for r in range(N) for n in LENGTHS]


def warmups(setup: int = 0) -> list[list[int]]:
    return [prompt(LENGTHS[-1 - (i % len(LENGTHS))], seed=900_000 + 100 * setup + i)
            for i in range(WARMUP)]


def body(ids: list[int], max_tokens: int, **extra) -> dict:
    b = {"model": REAL_MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
         "return_token_ids": True}
    b.update(extra)
    return b


def stream_tokens(session: requests.Session, url: str, b: dict, t0: float) -> tuple[float, list[int]]:
    """POSTs a streamed completion; returns (seconds from t0, a `time.time()`, to the first chunk
    carrying a token, all generated token ids)."""
    first = None
    tokens: list[int] = []
    with session.post(url + "/v1/completions", json=dict(b, stream=True), stream=True,
                      timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"{url}: error in stream: {chunk['error']}")
            for c in chunk.get("choices", []):
                if c.get("finish_reason") == "error":
                    raise RuntimeError(f"{url}: finish_reason error: {chunk}")
                got = c.get("token_ids") or []
                if got and first is None:
                    first = time.time() - t0
                tokens.extend(got)
    if first is None:
        raise RuntimeError(f"{url}: stream ended without a token")
    return first, tokens


def pd_ttft(session: requests.Session, p: Server, d: Server, ids: list[int],
            marks: dict) -> tuple[float, list[int]]:
    """The tiny proxy, as vLLM's toy proxy does it: P (max_tokens 1, not streamed,
    do_remote_decode), then D streamed with P's kv_transfer_params. Fills `marks` with the
    client's moments (unix seconds: `t0`, `p_answer`) and the handoff id."""
    t0 = marks["t0"] = time.time()
    r = session.post(p.url + "/v1/completions",
                     json=body(ids, 1, kv_transfer_params={"do_remote_decode": True}),
                     timeout=TIMEOUT_S)
    if r.status_code != 200:
        raise RuntimeError(f"{p.name}: {r.status_code} {r.text[:300]}")
    params = r.json().get("kv_transfer_params")
    if not params or not params.get("do_remote_prefill"):
        raise RuntimeError(f"{p.name} returned no kv_transfer_params: {r.text[:300]}")
    marks["p_answer"] = time.time()
    marks["handoff"] = params.get("handoff_id")
    return stream_tokens(session, d.url, body(ids, MAX_TOKENS, kv_transfer_params=params), t0)


def push_ttft(session: requests.Session, p: Server, d: Server, p_side_port: int,
              ids: list[int], marks: dict) -> tuple[float, list[int]]:
    """Both legs at once under a fresh handoff id, as handoff's proxy sends them in push mode:
    P's (max_tokens 1, not streamed) from a thread, D's streamed here."""
    handoff = secrets.token_hex(16)
    p_params = {"do_remote_decode": True, "transfer_mode": "push", "handoff_id": handoff}
    d_params = {"do_remote_prefill": True, "transfer_mode": "push", "handoff_id": handoff,
                "remote_engine_id": "bench-push-p", "remote_host": "127.0.0.1",
                "remote_port": p_side_port, "tp_size": 1, "epoch": 1}
    marks["handoff"] = handoff
    t0 = marks["t0"] = time.time()
    errors: list[str] = []

    def p_leg():
        try:
            r = requests.post(p.url + "/v1/completions",
                              json=body(ids, 1, kv_transfer_params=p_params), timeout=TIMEOUT_S)
            if r.status_code != 200:
                errors.append(f"{p.name}: {r.status_code} {r.text[:300]}")
        except requests.RequestException as e:
            errors.append(f"{p.name}: {e}")

    leg = threading.Thread(target=p_leg, daemon=True)
    leg.start()
    try:
        return stream_tokens(session, d.url, body(ids, MAX_TOKENS, kv_transfer_params=d_params),
                             t0)
    finally:
        leg.join(TIMEOUT_S)
        if errors:
            raise RuntimeError(errors[0])


def single_ttft(session: requests.Session, s: Server, ids: list[int],
                marks: dict) -> tuple[float, list[int]]:
    marks["t0"] = time.time()
    return stream_tokens(session, s.url, body(ids, MAX_TOKENS), marks["t0"])


def stop(servers: list[Server]) -> None:
    """SIGTERM every server's process group, then SIGKILL whatever of the group is left."""
    for s in servers:
        try:
            os.killpg(s.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20
    for s in servers:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            pass
    for s in servers:
        for _ in range(50):
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        try:
            s.proc.wait(timeout=5)
        except Exception:
            pass
        s.log.close()


def start(specs: list[tuple[str, dict | None, dict, str | None]]) -> list[Server]:
    """Starts (name, connector, env, cpus) servers and waits until all are healthy."""
    servers: list[Server] = []
    try:
        for name, conn, env, cpus in specs:
            servers.append(Server(name, conn, ["--max-model-len", str(P_MAX_MODEL_LEN)],
                                  env_extra=env, cpus=cpus))
        deadline = time.monotonic() + STARTUP_S
        for s in servers:
            s.wait_healthy(deadline)
    except BaseException:
        stop(servers)
        raise
    return servers


def group_cpu_s(pgids: set[int]) -> float:
    """CPU seconds used so far by every process in these process groups (from /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # pgrp; utime, stime follow at 11, 12
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def idle_cores(servers: list[Server], seconds: float = 2.0) -> float:
    """Cores the servers burn while serving nothing (NIXL's progress threads spin)."""
    pgids = {s.proc.pid for s in servers}
    before = group_cpu_s(pgids)
    time.sleep(seconds)
    return round((group_cpu_s(pgids) - before) / seconds, 2)


def busy_cores_s() -> float:
    """CPU seconds the whole machine has spent busy so far (from /proc/stat)."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")


class Load:
    """Cores used during a phase by processes other than this test and the given servers: the
    benchmark's noise floor on a shared machine."""

    def __init__(self, servers: list[Server]):
        self.pgids = {s.proc.pid for s in servers} | {os.getpgrp()}

    def __enter__(self):
        self.t, self.busy, self.ours = time.monotonic(), busy_cores_s(), group_cpu_s(self.pgids)
        return self

    def __exit__(self, *exc):
        dt = time.monotonic() - self.t
        other = (busy_cores_s() - self.busy) - (group_cpu_s(self.pgids) - self.ours)
        self.other_cores = round(max(0.0, other) / dt, 2) if dt > 0 else 0.0
        return False


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Bench:
    """Everything one run measured."""

    def __init__(self):
        self.ttft: dict[str, dict[int, list[float]]] = {p: {} for p in PATHS}  # ms
        self.p_share: dict[str, list[float]] = {"handoff": [], "nixl": []}  # ms
        # Per measured request of a handoff path: its length, TTFT and the client's moments.
        self.marks: dict[str, list[dict]] = {"handoff": [], "push": []}
        # Per handoff path: P's and D's timeline files.
        self.timelines: dict[str, tuple[Path, Path]] = {}
        self.outputs: dict[str, list] = {p: [] for p in PATHS}
        self.errors: list[str] = []
        self.phases: dict[str, float] = {}  # seconds
        self.idle: dict[str, float] = {}  # cores
        self.other_load: dict[str, float] = {}  # cores
        self.nixl_reclaim_after_kill_s: float | None = None

    def run(self, paths: list[tuple[str, object]], servers: list[Server], setup: int = 0) -> None:
        """Warm-ups, then every measured prompt in order, each sent through every path in turn
        (interleaved); failures are recorded, not raised. Each `fn(session, ids, marks)` of
        `paths` returns (TTFT s, token ids) and fills `marks` (the client's moments, see
        `pd_ttft`)."""
        session = requests.Session()
        t = time.monotonic()
        with Load(servers) as load:
            for i, ids in enumerate(warmups(setup)):
                for path, fn in paths:
                    time.sleep(SETTLE_S)
                    try:
                        fn(session, ids, {})
                    except Exception as e:  # noqa: BLE001 - a benchmark records and goes on
                        self.errors.append(f"{path} warm-up {i}: {e}")
            for n, ids in schedule(setup):
                for path, fn in paths:
                    self.one(path, fn, session, n, ids)
        session.close()
        names = "_".join(path for path, _ in paths)
        self.phases[f"{names}_measure_s"] = round(time.monotonic() - t, 1)
        for path, _ in paths:
            self.other_load[path] = load.other_cores

    def one(self, path: str, fn, session: requests.Session, n: int, ids: list[int]) -> None:
        marks: dict = {}
        time.sleep(SETTLE_S)
        try:
            ttft, tokens = fn(session, ids, marks)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{path} prompt of {n}: {e}")
            return
        self.ttft[path].setdefault(n, []).append(ttft * 1000)
        if "p_answer" in marks and path in self.p_share:
            self.p_share[path].append((marks["p_answer"] - marks["t0"]) * 1000)
        if path in self.marks:
            self.marks[path].append(dict(marks, length=n, first_token=marks["t0"] + ttft))
        self.outputs[path].append((n, tuple(ids[:4]), tokens))


def timeline_of(name: str) -> tuple[dict, Path]:
    """A connector config's timeline extra, and its file (emptied first)."""
    path = LOGS / f"timeline-{name}.jsonl"
    LOGS.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return {"timeline": str(path)}, path


def test_ttft_handoff_vs_nixl_vs_single():
    started = time.monotonic()
    b = Bench()

    # 1. handoff P/D (pull) and the single engine, interleaved.
    t = time.monotonic()
    servers: list[Server] = []
    single: Server | None = None
    p_tl, p_tl_path = timeline_of("bench-handoff-p")
    d_tl, d_tl_path = timeline_of("bench-handoff-d")
    b.timelines["handoff"] = (p_tl_path, d_tl_path)
    try:
        servers = start([("bench-handoff-p", connector("bench-p", **p_tl), BENCH_LOG, P_CPUS),
                         ("bench-handoff-d", connector("bench-d", **d_tl), BENCH_LOG, D_CPUS),
                         ("bench-single", None, {}, P_CPUS)])
        b.phases["handoff_single_start_s"] = round(time.monotonic() - t, 1)
        p, d, single = servers
        b.idle["handoff_pd"] = idle_cores([p, d])
        b.idle["single"] = idle_cores([single])
        b.run([("handoff", lambda s, ids, marks: pd_ttft(s, p, d, ids, marks)),
               ("single", lambda s, ids, marks: single_ttft(s, single, ids, marks))], servers)
    except Exception as e:  # noqa: BLE001 - the other setup still runs; asserted below
        b.errors.append(f"handoff/single setup: {e}")
    finally:
        # The single engine stays for the push setup (its baseline there).
        stop([x for x in servers if x is not single])

    # 2. handoff P/D in push mode, interleaved with the same single engine.
    t = time.monotonic()
    servers = [single] if single is not None else []
    side = free_port()
    p_tl, p_tl_path = timeline_of("bench-push-p")
    d_tl, d_tl_path = timeline_of("bench-push-d")
    b.timelines["push"] = (p_tl_path, d_tl_path)
    try:
        if single is None:
            raise RuntimeError("no single engine to interleave with (setup 1 failed)")
        pair = start([("bench-push-p", connector("bench-push-p", mode="push",
                                                 side_channel_port=side, **p_tl),
                       BENCH_LOG, P_CPUS),
                      ("bench-push-d", connector(
                          "bench-push-d", mode="push", **d_tl),
                       BENCH_LOG, D_CPUS)])
        servers += pair
        b.phases["push_start_s"] = round(time.monotonic() - t, 1)
        push_p, push_d = pair
        b.idle["push_pd"] = idle_cores([push_p, push_d])
        b.run([("push", lambda s, ids, marks: push_ttft(s, push_p, push_d, side, ids, marks)),
               ("single_push", lambda s, ids, marks: single_ttft(s, single, ids, marks))],
              servers, setup=1)
    except Exception as e:  # noqa: BLE001
        b.errors.append(f"push setup: {e}")
    finally:
        stop(servers)

    # 3. NixlConnector P/D, alone on the machine.
    t = time.monotonic()
    servers = []
    try:
        servers = start([(f"bench-nixl-{role}", nixl_connector(f"bench-nixl-{role}"), nixl_env(),
                          cpus) for role, cpus in (("p", P_CPUS), ("d", D_CPUS))])
        b.phases["nixl_start_s"] = round(time.monotonic() - t, 1)
        p, d = servers
        b.idle["nixl_pd"] = idle_cores([p, d])
        b.run([("nixl", lambda s, ids, marks: pd_ttft(s, p, d, ids, marks))], servers)
        b.nixl_reclaim_after_kill_s = nixl_reclaim_after_kill(p, d)
    except Exception as e:  # noqa: BLE001
        b.errors.append(f"nixl setup: {e}")
    finally:
        stop(servers)

    report(b, time.monotonic() - started)
    expected = N * len(LENGTHS)
    counts = {p: sum(len(v) for v in b.ttft[p].values()) for p in PATHS}
    # handoff's path and the single engine must serve every request. NixlConnector's failures
    # (its first handshake times out now and then on this machine: zmq "Resource temporarily
    # unavailable" under two spinning progress threads) are vLLM's, not handoff's: they are
    # counted in the report (ttft_bench_errors, ttft_ms.nixl.n), not asserted.
    ours = [e for e in b.errors if not e.startswith("nixl")]
    assert not ours and all(counts[p] == expected
                            for p in ("handoff", "push", "single", "single_push")), \
        f"completed {counts} of {expected} each; errors: {b.errors[:10]}"


def nixl_reclaim_after_kill(p: Server, d: Server) -> float | None:
    """NixlConnector's P holds a prompt's blocks for D, and D is SIGKILLed: seconds until P
    releases them (None: not within NIXL_RECLAIM_LIMIT_S). P learns of its D only from D's
    read, so whether D dies before or after it hears of the request, P waits for its lease.
    Read from P's log (NixlConnector's "Releasing expired KV blocks for request ..."): on an
    idle engine vLLM's KV usage gauge is not refreshed, so it cannot tell. NixlConnector reaps
    expired leases only when its engine steps, so a one-token request every half second keeps
    P stepping, as a cluster's other traffic would."""
    r = requests.post(p.url + "/v1/completions", timeout=TIMEOUT_S,
                      json=body(prompt(2048, seed=7), 1,
                                kv_transfer_params={"do_remote_decode": True}))
    if r.status_code != 200:
        raise RuntimeError(f"{p.name}: {r.status_code} {r.text[:300]}")
    params = r.json().get("kv_transfer_params") or {}
    if not params.get("do_remote_prefill"):
        raise RuntimeError(f"{p.name} holds nothing for D: {r.text[:300]}")
    seen = len(p.log_path.read_bytes())
    killed = time.time()
    d.kill()
    nudged = 0.0
    while time.time() < killed + NIXL_RECLAIM_LIMIT_S:
        if b"Releasing expired KV blocks" in p.log_path.read_bytes()[seen:]:
            return round(time.time() - killed, 2)
        if time.time() - nudged >= 0.5:
            nudged = time.time()
            requests.post(p.url + "/v1/completions", json=body([11], 1), timeout=TIMEOUT_S)
        time.sleep(0.1)
    return None


def nixl_connector(engine_id: str) -> dict:
    """vLLM's NixlConnector on CPU: kv_buffer_device defaults to "cpu" on the CPU platform (the
    KV cache is registered with NIXL as DRAM); said explicitly here."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_buffer_device": "cpu"}


def nixl_env() -> dict:
    """Each engine's NIXL handshake listener (a ZMQ ROUTER in EngineCore) on its own loopback
    port; UCX kept on the loopback device (on one machine it moves the KV through shared
    memory / CMA anyway)."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "UCX_NET_DEVICES": "lo"}


PHASES = {
    "handoff": ["p_queue", "p_prefill", "p_answer", "hop_to_d", "d_alloc", "kv_landed",
                "d_first_step", "first_token"],
    "push": ["p_queue", "p_prefill", "kv_landed", "d_first_step", "first_token"],
}


def read_timeline(path: Path) -> dict[str, dict[str, float]]:
    """handoff id -> {event: first unix time} from one engine's timeline. A pull P learns its
    handoff id only when the request finishes: its earlier lines are joined by the request id."""
    lines: list[dict] = []
    try:
        text = path.read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    handoff_of = {e["request"]: e["handoff"] for e in lines if e.get("handoff")}
    out: dict[str, dict[str, float]] = {}
    for e in lines:
        h = handoff_of.get(e["request"])
        if h:
            out.setdefault(h, {}).setdefault(e["event"], e["at"])
    return out


def request_phases(path: str, m: dict, p: dict[str, float], d: dict[str, float]) -> dict | None:
    """One request's consecutive phases in ms (they add up to its TTFT), or None when a moment
    is missing."""
    if path == "handoff":
        points = [m["t0"], p.get("arrived"), p.get("prefilled"), m.get("p_answer"),
                  d.get("arrived"), d.get("allocated"), d.get("landed"), d.get("scheduled"),
                  m["first_token"]]
    else:
        # A streamed push's writes go out during P's last prefill step, so D's KV may be in
        # before P's request finished: then kv_landed is negative (the overlap won it).
        points = [m["t0"], p.get("arrived"), p.get("prefilled"), d.get("landed"),
                  d.get("scheduled"), m["first_token"]]
    if any(x is None for x in points):
        return None
    return {name: (b - a) * 1000 for name, a, b in zip(PHASES[path], points, points[1:])}


def phases(b: Bench) -> tuple[dict, int]:
    """p50 of each phase per handoff path, over all measured requests and at the longest
    prompt; and how many measured requests had no complete timeline."""
    out: dict = {}
    missing = 0
    for path, marks in b.marks.items():
        if path not in b.timelines:
            continue
        p_tl, d_tl = (read_timeline(f) for f in b.timelines[path])
        rows: list[tuple[int, dict]] = []
        for m in marks:
            h = m.get("handoff")
            row = request_phases(path, m, p_tl.get(h, {}), d_tl.get(h, {}))
            if row is None:
                missing += 1
            else:
                rows.append((m["length"], row))
        if not rows:
            continue
        out[path] = {
            scope: {ph: round(percentile([r[ph] for n, r in rows if keep(n)], 0.5), 1)
                    for ph in PHASES[path]}
            for scope, keep in (("all", lambda n: True),
                                (str(LENGTHS[-1]), lambda n: n == LENGTHS[-1]))
            if any(keep(n) for n, _ in rows)
        }
    return out, missing


def report(b: Bench, wall: float) -> None:
    def stats(xs):
        return {"p50": round(percentile(xs, 0.5), 1), "p99": round(percentile(xs, 0.99), 1),
                "n": len(xs)} if xs else None

    ttft: dict = {}
    pooled: dict[str, list[float]] = {}
    for path in PATHS:
        ttft[path] = {str(n): stats(b.ttft[path].get(n, [])) for n in LENGTHS}
        pooled[path] = [x for n in LENGTHS for x in b.ttft[path].get(n, [])]
        ttft[path]["all"] = stats(pooled[path])
        if path in b.p_share:
            ttft[path]["p_share_all"] = stats(b.p_share[path])

    def ratio(x, y, q):
        y = BASELINE.get(x, y) if y == "single" else y
        if not pooled[x] or not pooled[y]:
            return None
        return round(percentile(pooled[x], q) / percentile(pooled[y], q), 3)

    pairs = (("handoff", "nixl"), ("push", "nixl"), ("handoff", "single"), ("push", "single"),
             ("nixl", "single"))
    by_length = {}
    for n in LENGTHS:
        row = {}
        for x, y in pairs:
            xs = b.ttft[x].get(n)
            ys = b.ttft[BASELINE.get(x, y) if y == "single" else y].get(n)
            row[f"{x}_vs_{y}"] = round(percentile(xs, 0.5) / percentile(ys, 0.5), 3) \
                if xs and ys else None
        by_length[str(n)] = row

    # Greedy outputs: each P/D path against the single engine, prompt by prompt.
    single_out = {(n, head): toks for path in ("single", "single_push")
                  for n, head, toks in b.outputs[path]}
    mismatches = []
    for path in ("handoff", "push", "nixl"):
        for n, head, toks in b.outputs[path]:
            want = single_out.get((n, head))
            if want is not None and toks != want:
                mismatches.append(f"{path} prompt of {n} starting {list(head)}: {toks} vs {want}")

    phase_ms, phases_missing = phases(b)
    REPORT.update(
        handoff_vs_nixl_ttft_p50=ratio("handoff", "nixl", 0.5),
        handoff_vs_nixl_ttft_p99=ratio("handoff", "nixl", 0.99),
        handoff_vs_single_ttft_p50=ratio("handoff", "single", 0.5),
        nixl_vs_single_ttft_p50=ratio("nixl", "single", 0.5),
        push_vs_nixl_ttft_p50=ratio("push", "nixl", 0.5),
        push_vs_nixl_ttft_p99=ratio("push", "nixl", 0.99),
        push_vs_single_ttft_p50=ratio("push", "single", 0.5),
        ttft_ms=ttft,
        ttft_phases_ms=phase_ms,
        ttft_phases_missing=phases_missing,
        ttft_bench_model=REAL_MODEL_NAME,
        ttft_p50_ratio_by_length=by_length,
        ttft_bench_requests=N * len(LENGTHS),
        ttft_bench_errors=len(b.errors),
        output_mismatches_bench=len(mismatches),
        ttft_bench_wall_s=round(wall, 1),
        ttft_bench_idle_cores=b.idle,
        ttft_bench_other_load_cores=b.other_load,
        nixl_reclaim_after_kill_s=b.nixl_reclaim_after_kill_s,
        nixl_reclaim_limit_s=NIXL_RECLAIM_LIMIT_S,
    )
    # Every sample, for a closer look (not in the report line).
    LOGS.mkdir(parents=True, exist_ok=True)
    samples = LOGS / "bench-ttft-samples.json"
    samples.write_text(json.dumps({"ttft_ms": b.ttft, "p_share_ms": b.p_share,
                                   "errors": b.errors, "mismatches": mismatches,
                                   "marks": b.marks,
                                   "phases_s": b.phases}))

    print()
    print(f"TTFT ms, concurrency 1, {N} requests per length and path "
          f"(+{WARMUP} warm-up), {MAX_TOKENS} output tokens")
    print(f"{'prompt':>8} | " + " | ".join(f"{p:>16}" for p in PATHS)
          + " | " + " | ".join(f"{x}/{y}" for x, y in pairs))
    print(f"{'':>8} | " + " | ".join(f"{'p50':>7} {'p99':>8}" for _ in PATHS) + " | (p50 ratios)")
    for key in [str(n) for n in LENGTHS] + ["all", "p_share_all"]:
        cells = []
        for p in PATHS:
            s = ttft[p].get(key)
            cells.append(f"{s['p50']:7.1f} {s['p99']:8.1f}" if s else f"{'-':>16}")
        if key == "all":
            rs = [REPORT[f"{x}_vs_{y}_ttft_p50"] for x, y in pairs]
        elif key in by_length:
            rs = list(by_length[key].values())
        else:
            rs = [None] * len(pairs)
        label = "P share" if key == "p_share_all" else key
        print(f"{label:>8} | " + " | ".join(cells) + " | "
              + " | ".join(f"{r:>{w}}" if r is not None else f"{'':>{w}}"
                           for r, w in zip(rs, (len(f"{x}/{y}") for x, y in pairs))))
    print(f"p99 (pooled): handoff/nixl {REPORT['handoff_vs_nixl_ttft_p99']}, "
          f"push/nixl {REPORT['push_vs_nixl_ttft_p99']}")
    print("cores burnt by idle servers: " + ", ".join(f"{k} {v}" for k, v in b.idle.items())
          + "; cores used by other processes while measuring: "
          + ", ".join(f"{k} {v}" for k, v in b.other_load.items()))
    print(f"output mismatches vs single: {len(mismatches)}; errors: {len(b.errors)}; "
          f"wall {wall:.1f} s; " + ", ".join(f"{k} {v}" for k, v in b.phases.items())
          + f"; samples in {samples}")
    for path, scopes in phase_ms.items():
        for scope, row in scopes.items():
            print(f"{path} phases p50 ms ({scope} tokens): "
                  + ", ".join(f"{k} {v}" for k, v in row.items()))
    if phases_missing:
        print(f"  {phases_missing} measured requests had no complete timeline")
    for m in mismatches[:5]:
        print("  mismatch:", m)
    for e in b.errors[:10]:
        print("  error:", e)
