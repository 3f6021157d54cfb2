"""Real vLLM servers (CPU build) for the connector tests.

Every output comparison runs on a real model: SmolLM2-135M-Instruct (30 layers, real weights,
its tokenizer and chat template), converted by ``scripts/fetch-model`` into ``.model-smollm2/``;
test_vllm_gemma.py runs Gemma 3 270M (``scripts/fetch-model gemma3``, ``.model-gemma3/``).
The tiny 2-layer model with dummy weights (``model/``) stays where a test compares no output
and wants speed (the hook-level tests).

One single reference engine (no connector) for the whole session; each module starts the P and
D it needs and stops them at its end, so that no more than three real-model servers (~3.7 GB
each) run at once. Every server binds 127.0.0.1 (or an address inside a network namespace the
test made) and is stopped (its whole process group) at the end, also when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

HERE = Path(__file__).resolve().parent
# handoff's own binary (its proxy drives vLLM P/D in both modes); scripts/test-vllm builds it.
HANDOFF_BIN = Path(os.environ.get("HANDOFF_BIN", HERE.parents[3] / "target" / "debug" / "handoff"))
MODEL = HERE / "model"
# The real model (scripts/fetch-model, run by scripts/test-vllm).
REAL_MODEL = Path(os.environ.get("HANDOFF_VLLM_REAL_MODEL", HERE.parents[3] / ".model-smollm2"))
REAL_MODEL_NAME = "smollm2"
LOGS = Path(os.environ.get("HANDOFF_VLLM_LOGS", "/tmp/handoff-vllm-logs"))
# The pull cluster's connector traces (engine setting record_trace), replayed by test_vllm.py.
TRACES = LOGS / "traces"
STARTUP_S = float(os.environ.get("HANDOFF_VLLM_STARTUP_S", "400"))
MAX_MODEL_LEN = 2048
P_MAX_MODEL_LEN = 4096  # the model's max_position_embeddings
# P's lease on a handoff before its D first heartbeats (handoff's default is longer).
# (8 s: with real-model servers on two cores, a D's first heartbeat once came later than 4 s.)
INITIAL_LEASE_S = 8.0
BLOCK_SIZE = 128  # vLLM's default on CPU
# handoff's default: after a lease ends, P waits this long before it frees (a READ granted
# just before the end may still be landing).
FENCE_GRACE_S = 1.5


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports handed out by free_port: none twice in a session (a server binds its port seconds after
# the test picked it, and vLLM's engine core binds its side channel after the model loaded).
_HANDED_OUT: set[int] = set()
_PORTS = random.Random(os.getpid())


def free_port() -> int:
    """A loopback TCP port free now, for a server that binds it later, drawn *below* the
    kernel's ephemeral range: a port the kernel picked (bind to 0) is back in that range once
    closed, where any socket that connects or binds to 0 meanwhile (a health poll, vLLM's own
    ZMQ ports) may take it. A CI run lost a P that way: its side channel's port was taken."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    for _ in range(1000):
        port = _PORTS.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}..{high}")


# While this file exists, every READ D's worker posts lands with one byte changed (a test-only
# switch of handoff_vllm, see `CORRUPT_SWITCH` in worker.rs): the digest's negative control.
CORRUPT_FILE = Path(f"/tmp/handoff-vllm-corrupt-{os.getpid()}")
# While this file exists, D's worker holds the transfers it is asked to post (test-only switch,
# `HOLD_SWITCH` in worker.rs): a request then waits on D for its KV as long as a test needs.
HOLD_FILE = Path(f"/tmp/handoff-vllm-hold-{os.getpid()}")
# The same switch for the push cluster's P: while it exists, P's worker holds its WRITEs.
HOLD_WRITES_FILE = Path(f"/tmp/handoff-vllm-hold-writes-{os.getpid()}")


class Server:
    # Every server started in this session: a failed test's report quotes their logs.
    started: list["Server"] = []

    def __init__(self, name: str, connector: dict | None, extra_args: list[str] | None = None,
                 env_extra: dict | None = None, log_stats: bool = False,
                 host: str = "127.0.0.1", netns: str | None = None, real: bool = True,
                 cpus: str | None = None, tiny_model: Path = MODEL,
                 real_model: tuple[Path, str] = (REAL_MODEL, REAL_MODEL_NAME)):
        """`netns`: run the server inside that network namespace, listening on `host`.
        `cpus`: run it on these CPUs only (taskset's list, "0" or "0-1"), as on a host of its own.
        `real`: a real model with its tokenizer, `real_model` (its folder and served name:
        SmolLM2 unless said); otherwise the tiny model `tiny_model` (a directory with its
        config, and dummy weights unless it holds a checkpoint), which has no tokenizer
        (token-id prompts only)."""
        Server.started.append(self)
        self.name = name
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log_path = LOGS / f"{name}.log"
        if real:
            folder, self.model = real_model
            assert (folder / "config.json").exists(), \
                f"no real model at {folder}: run scripts/fetch-model"
            model_args = ["--model", str(folder), "--served-model-name", self.model]
        else:
            self.model = "tiny"
            # Dummy weights, unless the directory holds a checkpoint of its own.
            dummy = [] if (tiny_model / "model.safetensors").exists() else [
                "--load-format", "dummy"]
            model_args = ["--model", str(tiny_model), "--served-model-name", self.model,
                          *dummy, "--skip-tokenizer-init"]
        args = ([] if netns is None else ["ip", "netns", "exec", netns]) + (
            [] if cpus is None else ["taskset", "-c", cpus]) + [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", *model_args,
            "--host", host, "--port", str(self.port), "--enforce-eager",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        ] + ([] if log_stats else ["--disable-log-stats"]) + (extra_args or [])
        if connector is not None:
            args += ["--kv-transfer-config", json.dumps(connector)]
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            RUST_LOG=env.get("RUST_LOG", "info"),
            # Three servers share this machine's few cores: vLLM's default pins every worker
            # to the same core and its OpenMP threads spin there, which stalls whole engine
            # steps for seconds. One passive OpenMP thread per server, unpinned.
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            OMP_WAIT_POLICY="PASSIVE",
        )
        env.update(env_extra or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.root_cause()}): see "
                                   f"{self.log_path}\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not healthy in time: see {self.log_path}\n{self.tail()}")

    def root_cause(self) -> str:
        """The exception that stopped the server: the last one its engine core logged (its
        traceback ends the engine core's lines; the API server's own, "Engine core
        initialization failed", only points at it), else the last one in the log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        exc = re.compile(r"\b(\w+(?:Error|Exception|Exit)\b:?.*)$")
        found = [m.group(1) for ln in lines if (m := exc.search(ln))]
        core = [m.group(1) for ln in lines if "EngineCore" in ln and (m := exc.search(ln))]
        return ((core or found) or ["no exception logged"])[-1][:300]

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def connector_lines(self, n: int = 40) -> str:
        """The last `n` lines of the log that come from handoff or say something went wrong:
        what a failed test's report needs to tell a flake from a bug (the log itself is gone
        once the next run starts)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = re.compile(r"handoff| ERROR |panicked")
        return "\n".join([ln for ln in lines if keep.search(ln)][-n:])

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()

    def stop(self, sig=signal.SIGKILL) -> None:
        """[`kill`], then waits until every process of the server is gone: the engine core
        outlives the API server by seconds while the kernel tears down its memory, and the next
        module's servers must not make their first transfers beside that (a CI run saw a first
        READ's peer fall silent for 1.5 s on these two cores). For fixtures' teardown; a test
        that times what follows a kill uses [`kill`]."""
        self.kill(sig)
        if self.gone_at(20) is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.gone_at(10)

    def gone_at(self, limit_s: float = 30.0) -> float | None:
        """Unix time at which no process of this server's group (the API server and its engine
        core) is alive any more, polled after a kill; None if one still is after `limit_s`. The
        kernel closes a process's sockets as it exits, so this is when a peer can first see the
        server gone: tearing down an engine's gigabytes of memory takes a second or more on a
        loaded machine, time that no connector can save."""
        deadline = time.time() + limit_s
        while time.time() < deadline:
            if not any(alive_in_group(self.proc.pid)):
                return time.time()
            time.sleep(0.01)
        return None

    def complete(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        body.update(extra)
        r = requests.post(self.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, f"{self.name}: {r.status_code} {r.text[:500]}"
        return r.json()

    def chat(self, messages: list[dict], max_tokens: int, **extra) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}
        body.update(extra)
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, f"{self.name}: {r.status_code} {r.text[:500]}"
        return r.json()

    def metric(self, name: str) -> float:
        text = requests.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


KV_USAGE = "vllm:kv_cache_usage_perc"


def settled_usage(server: Server, quiet_s: float = 0.5, limit_s: float = 5.0) -> float:
    """The server's KV cache usage once it has not changed for `quiet_s`: a free from the test
    before reaches /metrics only after the engine's next step and the API server's next stats
    update."""
    last, since = server.metric(KV_USAGE), time.time()
    deadline = since + limit_s
    while time.time() < deadline:
        time.sleep(0.05)
        now = server.metric(KV_USAGE)
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet_s:
            break
    return last


# A prompt no test uses (token ids above the tests' range): fresh_usage's local request.
STEP_PROMPT = [4001, 4002, 4003]


def alive_in_group(pgid: int):
    """The pids of the processes of group `pgid` that have not exited (zombies have: their
    sockets are closed)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            yield int(entry.name)


def fresh_usage(server: Server) -> float:
    """The server's KV cache usage as of now. vLLM publishes it with a step's outputs only, and
    an engine whose requests all wait for remote KV steps without publishing: a gauge read then
    can be seconds old (a test once read 0.0 while blocks waited for P). One short local request
    makes a step whose stats are current; its own block is free again when they are taken."""
    server.complete(STEP_PROMPT, 1)
    return settled_usage(server, quiet_s=0.2, limit_s=2.0)


def usage_back_to(server: Server, idle: float, since: float, limit_s: float) -> float | None:
    """Seconds from `since` until the server's KV cache usage, on vLLM's own /metrics, is back
    to `idle`; None if not within `limit_s`."""
    return back_to(lambda: server.metric(KV_USAGE), idle, since, limit_s)


def back_to(usage, idle: float, since: float, limit_s: float) -> float | None:
    """Seconds from `since` (unix time) until `usage()` is back to `idle`; None if not within
    `limit_s`."""
    while time.time() < since + limit_s:
        if usage() <= idle + 1e-9:
            return time.time() - since
        time.sleep(0.05)
    return None


# What the tests measured, written as one JSON object at the end (scripts/test-vllm prints it).
REPORT: dict = {}
# Each failed test's id → the line its failure ended on (the report's last key: CI shows the tail).
FAILURES: dict = {}


class StallMeter:
    """Whether the host itself stalled: a thread that sleeps 50 ms at a time and notes every
    wake-up that came more than 0.5 s late. A failed test's report lists those of its last three
    minutes, so a timeout can be told apart from a host that did not run anything meanwhile
    (this machine's two shared cores have gone 1-2 s without running a sleeping process)."""

    TICK_S = 0.05
    LATE_S = 0.5

    def __init__(self):
        self.stalls: list[tuple[float, float]] = []  # (wall time it ended, seconds late)
        threading.Thread(target=self._run, name="stall-meter", daemon=True).start()

    def _run(self):
        while True:
            before = time.monotonic()
            time.sleep(self.TICK_S)
            late = time.monotonic() - before - self.TICK_S
            if late > self.LATE_S:
                self.stalls.append((time.time(), late))

    def recent(self, window_s: float = 180.0) -> str:
        since = time.time() - window_s
        lines = [f"{time.strftime('%H:%M:%S', time.gmtime(t))}Z woke {late:.2f} s late"
                 for t, late in self.stalls if t >= since]
        return "\n".join(lines) or "none"

    def summary(self) -> dict:
        lates = [late for _, late in self.stalls]
        return {"over_0_5_s": len(lates), "over_1_s": sum(late > 1 for late in lates),
                "max_s": round(max(lates, default=0.0), 2)}


STALLS = StallMeter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the handoff lines of every server's log; why it failed
    goes into the JSON report (`failures`)."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    crash = getattr(rep.longrepr, "reprcrash", None)
    why = crash.message if crash is not None else (str(rep.longrepr).splitlines() or [""])[-1]
    FAILURES[f"{item.nodeid} ({rep.when})"] = why[:400]
    if rep.when == "call":
        rep.sections.append(("host stalls (UTC) in the last 3 minutes", STALLS.recent()))
        # The newest servers first: they are the failed test's own (CI shows the head).
        for s in reversed(Server.started):
            rep.sections.append((f"{s.name}'s log, handoff lines ({s.log_path})",
                                 s.connector_lines()))


def installed_vllm() -> str:
    """The installed vLLM's distribution and version (`vllm-cpu 0.32.0`, `vllm 0.33.0`)."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def pytest_sessionfinish(session, exitstatus):
    # The single engine started at collection, if no test took it (its fixture stops it).
    for s in _single:
        ignore_errors(s.stop, signal.SIGTERM)
    path = os.environ.get("HANDOFF_VLLM_REPORT")
    if path:
        Path(path).write_text(json.dumps(dict(
            REPORT, vllm=installed_vllm(), host_stalls=STALLS.summary(),
            tests_run=session.testscollected,
            tests_failed=session.testsfailed, failures=FAILURES)))


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def disaggregated(servers: dict, ids: list[int], max_tokens: int, **extra) -> tuple[dict, dict]:
    """P with do_remote_decode (max_tokens 1, not streamed), then D with P's params (and
    `extra` request fields); returns (P's params, D's answer)."""
    p = servers["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = p.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") and params.get("handoff_id"), p
    d = servers["d"].complete(ids, max_tokens, kv_transfer_params=params, **extra)
    return params, d


def ignore_errors(f, *a, **kw) -> None:
    """Calls f; a request to a server the test is killing may fail any way it likes."""
    try:
        f(*a, **kw)
    except Exception:
        pass


def wait_http_ok(url: str, limit_s: float, what: str, proc=None) -> None:
    """Polls GET `url` until it answers 200; fails naming `what` when `proc` (if given) exits
    first or `limit_s` passes."""
    deadline = time.monotonic() + limit_s
    while True:
        assert proc is None or proc.poll() is None, f"{what}: exited"
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"{what}: not ready within {limit_s} s"
        time.sleep(0.1)


# vLLM's production router (scripts/install-router).
ROUTER = Path(os.environ.get("HANDOFF_VLLM_ROUTER",
                             HERE.parents[3] / ".venv-router" / "bin" / "vllm-router"))

@contextlib.contextmanager
def router(prefill_url: str, decode_url: str, name: str, more_decode: list[str] = (),
           extra: list[str] = ()):
    """vllm-router in P/D mode in front of one P and one D (or more: `more_decode`; `extra`
    flags); yields its URL once it answers."""
    assert ROUTER.exists(), f"no vllm-router at {ROUTER}: run scripts/install-router"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"router-{name}.log"
    args = [str(ROUTER), "--vllm-pd-disaggregation", "--prefill", prefill_url,
            "--decode", decode_url, *[a for d in more_decode for a in ("--decode", d)],
            "--policy", "round_robin", "--host", "127.0.0.1",
            "--port", str(port), "--intra-node-data-parallel-size", "1",
            # Its metrics listener defaults to a fixed port: one of its own.
            "--prometheus-port", str(free_port()), *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_http_ok(url + "/health", 60, f"vllm-router (see {log_path})", proc)
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def handoff_proxy(mode: str, prefill: Server, decode: Server):
    """handoff's own proxy (`handoff proxy --mode MODE`) in front of one P and one D; yields its
    URL once it routes (both instances healthy; in push mode P's info fetched too)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(HANDOFF_BIN), "proxy", "--bind", f"127.0.0.1:{port}", "--prefill", prefill.url,
            "--decode", decode.url, "--mode", mode, "--admin-listen", "off",
            "--health-interval-ms", "200"]
    log_path = LOGS / f"proxy-{mode}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, RUST_LOG="info"), start_new_session=True)
        try:
            wait_http_ok(url + "/health", 30, f"handoff proxy (P and D healthy; {log_path})",
                         proc)
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def serving(servers: dict, warm: bool = False):
    """Waits for the `Server` values of `servers` to be healthy (other values ride along),
    with `warm` runs one short local request on each (a fresh server's first forward pass is
    slow once), yields `servers`, and stops every server at the end, also when a test failed."""
    try:
        deadline = time.monotonic() + STARTUP_S
        live = [s for s in servers.values() if isinstance(s, Server)]
        for s in live:
            s.wait_healthy(deadline)
        if warm:
            for s in live:
                s.complete([5, 6, 7], 1)
        yield servers
    finally:
        for s in servers.values():
            if isinstance(s, Server):
                s.stop()


def completion_via(url: str, prompt: list[int], max_tokens: int, model: str = REAL_MODEL_NAME,
                   timeout_s: float = 120) -> list[int]:
    """A client's greedy completion of `model` through a proxy at `url`: the generated token
    ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    r = requests.post(url + "/v1/completions", json=body, timeout=timeout_s)
    assert r.status_code == 200, f"proxy: {r.status_code} {r.text[:500]}"
    return r.json()["choices"][0]["token_ids"]


def matched_digests(server: Server) -> int:
    """How many KV digests `server` (a D) checked and found equal to P's, from its log."""
    return sum("KV digest matched" in line for line in server.log_path.read_text().splitlines())


def check_proxy_decodes_like_single(mode: str, servers: dict, prompt: list[int]) -> None:
    """A client's request through `handoff proxy --mode MODE` in front of servers' P and D:
    D's greedy tokens equal the single engine's, and D checked one KV digest (the KV came from
    P: D did not compute the prompt itself)."""
    want = servers["single"].complete(prompt, 6)["choices"][0]["token_ids"]
    with handoff_proxy(mode, servers["p"], servers["d"]) as url:
        matched = matched_digests(servers["d"])
        got = completion_via(url, prompt, 6)
    assert got == want, f"through handoff's proxy: {got} vs single {want}"
    assert matched_digests(servers["d"]) == matched + 1, "D computed the prompt itself"


def connector(engine_id: str, **extra) -> dict:
    return {
        "kv_connector": "HandoffConnector",
        "kv_connector_module_path": "handoff_vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"engine_id": engine_id, **extra},
    }


# A reference engine's engine core in its API server's process: one Python start fewer (about a
# minute on these two cores). It only computes the reference outputs, so how vLLM splits its
# processes does not matter there; the engines under test keep vLLM's default.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def start_single() -> Server:
    """The single reference engine (SmolLM2), its engine core in process (`IN_PROCESS`)."""
    return Server("single", None, env_extra=IN_PROCESS)


# Started as soon as the session knows a test needs it (see pytest_collection_modifyitems), so
# that it starts while the first module's P and D start: the two cores are busy either way.
_single: list[Server] = []


def pytest_collection_modifyitems(session, config, items):
    if any("single" in getattr(item, "fixturenames", ()) for item in items):
        _single.append(start_single())


@pytest.fixture(scope="session")
def single():
    """The single reference engine (no connector) every output is compared with."""
    s = _single[0] if _single else start_single()
    try:
        s.wait_healthy(time.monotonic() + STARTUP_S)
        # The first request that asks for logprobs is slow once (seconds): not in a test.
        s.complete(STEP_PROMPT, 1, logprobs=1)
        yield s
    finally:
        s.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def cluster(single):
    """A pull P and D with HandoffConnector, for one module (with the session's single)."""
    TRACES.mkdir(parents=True, exist_ok=True)
    servers = {
        # P logs when it gives blocks back (the dead-D test reads the time from it).
        # P publishes its KV cache usage on /metrics (the reclaim tests read it); a handoff no D
        # ever claims expires after INITIAL_LEASE_S.
        # P takes prompts D refuses (P_MAX_MODEL_LEN > D's): the refusal test needs one.
        # Both record their connector core's inputs (test_vllm.py replays the traces last).
        "p": Server("p", connector("vllm-p", kv_digest=True,
                                   initial_lease_ms=int(INITIAL_LEASE_S * 1000),
                                   record_trace=str(TRACES / "p.jsonl")),
                    extra_args=["--max-model-len", str(P_MAX_MODEL_LEN),
                                "--middleware", "handoff_vllm.HandoffOps"],
                    env_extra={"RUST_LOG": "info,handoff_vllm=debug"}, log_stats=True),
        # D logs each KV digest it checked (the tests count them).
        # D names requests its API server refuses to its connector (handoff_vllm.RefusalRelease).
        # Both append the connector's metrics to vLLM's /metrics (handoff_vllm.HandoffOps).
        "d": Server("d", connector("vllm-d", kv_digest=True,
                                   record_trace=str(TRACES / "d.jsonl")),
                    extra_args=["--middleware", "handoff_vllm.RefusalRelease",
                                "--middleware", "handoff_vllm.HandoffOps"],
                    env_extra={"HANDOFF_VLLM_TEST_CORRUPT_FILE": str(CORRUPT_FILE),
                               "HANDOFF_VLLM_TEST_HOLD_FILE": str(HOLD_FILE),
                               "RUST_LOG": "info,handoff_core::machine::transfers=debug"},
                    # vLLM's own gauges and histograms on /metrics (check-ops reads them).
                    log_stats=True),
    }
    try:
        deadline = time.monotonic() + STARTUP_S
        for s in servers.values():
            s.wait_healthy(deadline)
        for s in servers.values():
            s.complete(STEP_PROMPT, 1, logprobs=1)
        # One P/D transfer before any test. A CI run saw the first one of a fresh pair fail: D
        # found P silent past the tcp limit (1.5 s) on the new data connection, as the push
        # module's first push once did (not explained yet: see the closing note of 2026-11-29).
        # What a transfer does is asserted by every test after this one; this one is not.
        ignore_errors(disaggregated, servers, prompt(BLOCK_SIZE + 3, seed=4_242), 1)
        yield dict(servers, single=single)
    finally:
        for s in servers.values():
            s.stop(signal.SIGTERM)
