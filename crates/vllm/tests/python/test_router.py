"""handoff behind vLLM's own production router, vllm-router (PyPI, pinned in
scripts/install-router), run as a process on loopback in its P/D mode
(``--vllm-pd-disaggregation``): it sends P the client's body with ``max_tokens`` 1 and
null-valued ``kv_transfer_params`` (``n`` unchanged), then D the client's body with P's
``kv_transfer_params`` copied verbatim.

Two backends behind it, the same checks for each:
- vLLM P and D with ``HandoffConnector`` (pull) on the real model, against the session's single
  vLLM engine; P's KV usage is vLLM's own ``vllm:kv_cache_usage_perc`` read after a step that
  publishes it (``test_vllm.py`` runs these checks on its cluster);
- handoff's reference engines (prefill, decode), against a reference engine in role ``both``;
  P's KV usage is the blocks its connector holds (``/health``).

Completions (streamed and not), chat (streamed and not), ``n=2``, and a client that leaves
mid-stream: outputs equal the single engine's (text, and token ids where vLLM gives them), and
P's KV usage is back to idle within 2 s after each.

With reference engines only (they start in a second): a P drained under load behind the router
started as the docs say (health check on ``/ready``) fails no request, and a D of another model
shape that the router pairs with P anyway does not leave P holding the prompt's blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest
import requests

from conftest import (HANDOFF_BIN, LOGS, REPORT, back_to, free_port, fresh_usage, router,
                      wait_http_ok)

IDLE_LIMIT_S = 2.0
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type with an oil-based ink and a wooden press. ")


def count_mismatch() -> None:
    REPORT["router_output_mismatches"] = REPORT.get("router_output_mismatches", 0) + 1


class Backend:
    """What a check needs of one P/D pair behind the router."""

    def __init__(self, name: str, model: str, p_url: str, single_url: str, usage, token_ids: bool):
        self.name, self.model, self.p_url, self.single_url = name, model, p_url, single_url
        self.usage = usage  # () -> P's KV usage now
        self.token_ids = token_ids  # whether answers carry token ids

    def body(self, chat: bool, **extra) -> dict:
        b = {"model": self.model, "max_tokens": 12, "temperature": 0}
        if chat:
            b["messages"] = CHAT
        else:
            b["prompt"] = PROMPT
        if self.token_ids:
            b["return_token_ids"] = True
        b.update(extra)
        return b


def answer(url: str, chat: bool, body: dict) -> list[tuple[str, list | None]]:
    """(text, token ids) per choice of a request to `url`, streamed or not as `body` says."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        r = requests.post(url + path, json=body, timeout=180)
        assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:400]}"
        out = []
        for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
            text = c["message"]["content"] if chat else c["text"]
            out.append((text, c.get("token_ids")))
        return out
    texts: dict[int, str] = {}
    ids: dict[int, list] = {}
    with requests.post(url + path, json=body, stream=True, timeout=180) as r:
        assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:400]}"
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                i = c.get("index", 0)
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                texts[i] = texts.get(i, "") + (piece or "")
                if c.get("token_ids"):
                    ids.setdefault(i, []).extend(c["token_ids"])
    return [(texts[i], ids.get(i)) for i in sorted(texts)]



def check_like_single(b: Backend, url: str, chat: bool, stream: bool, **extra) -> float:
    """One request through the router equals the single engine's; returns how long after its
    answer P's KV usage was back to idle (asserted under IDLE_LIMIT_S)."""
    idle = b.usage()
    body = b.body(chat, stream=stream, **extra)
    want = answer(b.single_url, chat, body)
    got = answer(url, chat, body)
    done = time.time()
    if [t for t, _ in got] != [t for t, _ in want] or \
            (b.token_ids and [i for _, i in got] != [i for _, i in want]):
        count_mismatch()
    assert got == want, f"{b.name}, chat={chat}, stream={stream}, {extra}: {got} vs {want}"
    back = back_to(b.usage, idle, done, IDLE_LIMIT_S + 3)
    assert back is not None and back < IDLE_LIMIT_S, \
        f"{b.name}: P's KV usage back {back} s after the answer (chat={chat}, {extra})"
    return back


def check_client_leaves_mid_stream(b: Backend, url: str) -> None:
    idle = b.usage()
    body = b.body(False, stream=True, max_tokens=200)
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=180) as r:
        assert r.status_code == 200, r.text[:400]
        for line in r.iter_lines():
            if line.startswith(b"data: ") and b'"text"' in line:
                break
    left = time.time()
    back = back_to(b.usage, idle, left, IDLE_LIMIT_S + 3)
    assert back is not None and back < IDLE_LIMIT_S, \
        f"{b.name}: P's KV usage back {back} s after the client left"


def run_all_checks(b: Backend, url: str) -> dict:
    REPORT.setdefault("router_output_mismatches", 0)
    out = {}
    for chat in (False, True):
        for stream in (False, True):
            check_like_single(b, url, chat, stream)
    # vLLM refuses n>1 with greedy sampling; top_k 1 samples the greedy token all the same.
    n2 = {"n": 2, "temperature": 1.0, "top_k": 1} if b.token_ids else {"n": 2}
    out["n2_p_idle_after_s"] = round(check_like_single(b, url, False, False, **n2), 3)
    check_client_leaves_mid_stream(b, url)
    return out


# ------------------------------------------------------------------ vLLM behind vllm-router

def check_vllm_behind_router(cluster) -> None:
    """The checks with vLLM's P and D (test_vllm.py calls it, to share its cluster: the real
    model's servers are slow to start and only three fit in memory at once)."""
    p = cluster["p"]
    b = Backend("vllm", p.model, p.url, cluster["single"].url,
                usage=lambda: fresh_usage(p), token_ids=True)
    with router(p.url, cluster["d"].url, "vllm") as url:
        out = run_all_checks(b, url)
    REPORT["n2_p_idle_after_s"] = out["n2_p_idle_after_s"]
    REPORT["router"] = "vllm-router 0.1.17"


# ------------------------------------------------------------------ reference engines

@pytest.fixture(scope="module")
def reference():
    """handoff's reference engines on loopback: P, D and a monolithic one to compare with."""
    procs, urls = [], {}
    try:
        for role in ("prefill", "decode", "both"):
            port = free_port()
            LOGS.mkdir(parents=True, exist_ok=True)
            log = open(LOGS / f"router-ref-{role}.log", "w")
            procs.append(subprocess.Popen(
                [str(HANDOFF_BIN), "engine", "--role", role, "--host", "127.0.0.1",
                 "--port", str(port), "--engine-id", f"router-ref-{role}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, RUST_LOG="info")))
            urls[role] = f"http://127.0.0.1:{port}"
        for (role, url), proc in zip(urls.items(), procs):
            wait_http_ok(url + "/health", 30, f"reference engine {role}", proc)
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def held_by_p(url: str) -> float:
    return float(requests.get(url + "/health", timeout=5).json()["held_blocks"]["prefill"])


def test_reference_engines_behind_vllm_router_answer_like_a_monolithic_one(reference):
    b = Backend("reference", "handoff", reference["prefill"], reference["both"],
                usage=lambda: held_by_p(reference["prefill"]), token_ids=False)
    with router(reference["prefill"], reference["decode"], "reference") as url:
        out = run_all_checks(b, url)
    REPORT["reference_n2_p_idle_after_s"] = out["n2_p_idle_after_s"]


def reference_engine(role: str, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """One more reference engine on loopback; returns (process, URL) once it answers."""
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"router-{name}.log", "w")
    proc = subprocess.Popen(
        [str(HANDOFF_BIN), "engine", "--role", role, "--host", "127.0.0.1", "--port", str(port),
         "--engine-id", name, *args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, RUST_LOG="info"))
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", 30, f"reference engine {name}", proc)
    return proc, url


# As the docs say to start vllm-router in front of engines that drain (guides/vllm.md,
# ops/kubernetes/router.yaml).
READY_HEALTH = ["--health-check-endpoint", "/ready", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1"]


def drain_one_p_under_load(extra: list[str], name: str) -> tuple[int, int, int]:
    """Two reference P and one D behind vllm-router (`extra` flags), six clients; P a is
    SIGTERMed 2 s in (it drains: /ready 503 for its 5 s grace, serves what it holds, exits). The
    clients go on after it exited for at least 6 s and until 36 requests were sent since (at most
    30 s): on a loaded machine each request takes longer, and a window of fixed length once held
    too few of them for the control to show anything (34 after the SIGTERM, none failed).
    Returns (requests sent after the SIGTERM, how many of them failed, P a's exit status)."""
    procs = []
    try:
        pa, a_url = reference_engine("prefill", f"{name}-pa")
        procs.append(pa)
        pb, b_url = reference_engine("prefill", f"{name}-pb")
        procs.append(pb)
        d, d_url = reference_engine("decode", f"{name}-d")
        procs.append(d)
        results: list[tuple[float, int]] = []
        stop = threading.Event()

        def client(i: int):
            n = 0
            while not stop.is_set():
                n += 1
                sent = time.monotonic()
                try:
                    r = requests.post(url + "/v1/completions", timeout=30, json={
                        "model": "handoff", "prompt": f"client {i} request {n}: " + PROMPT,
                        "max_tokens": 4, "temperature": 0})
                    status = r.status_code
                except requests.RequestException:
                    status = 0
                results.append((sent, status))

        with router(a_url, d_url, name, extra=["--prefill", b_url, *extra]) as url:
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
            for t in threads:
                t.start()
            time.sleep(2)
            killed_at = time.monotonic()
            pa.terminate()
            try:
                status = pa.wait(timeout=30)
            finally:
                exited_at = time.monotonic()
                while time.monotonic() < exited_at + 30 and (
                        time.monotonic() < exited_at + 6
                        or sum(1 for t, _ in list(results) if t >= exited_at) < 36):
                    time.sleep(0.1)
                stop.set()
                for t in threads:
                    t.join(40)
        after = [s for t, s in results if t >= killed_at]
        return len(after), sum(1 for s in after if s != 200), status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_a_p_drained_behind_vllm_router_fails_no_request():
    """Scale-down behind vllm-router started as the docs say (its health check on /ready): one
    of two P engines is SIGTERMed under six clients' load; it drains and exits 0, and not one
    request sent after the SIGTERM fails. The negative control, the router's default health
    check, keeps sending to the P after it exited: requests fail (the issue that asked for this
    measured 189 of 461)."""
    sent, failed, status = drain_one_p_under_load(READY_HEALTH, "drain-ready")
    REPORT["router_drain_failed_after_sigterm"] = f"{failed} of {sent}"
    assert status == 0, f"the drained P exited {status}"
    assert sent > 20 and failed == 0, f"{failed} of {sent} requests after the SIGTERM failed"
    sent, failed, _ = drain_one_p_under_load([], "drain-default")
    REPORT["router_drain_failed_without_ready_check"] = f"{failed} of {sent}"
    assert failed > 0, f"control: none of {sent} failed with the default health check"


def test_an_incompatible_d_behind_vllm_router_frees_p_at_once():
    """vllm-router does not read the compatibility key, so it may pair P with a D of another
    model shape: D refuses the handshake and recomputes (the answer is right), and P holds the
    prompt's blocks for less than a second — the refused D sends its release on the refused
    connection — not until its initial lease ends (10 s)."""
    procs = []
    try:
        p, p_url = reference_engine("prefill", "incompat-p")
        procs.append(p)
        d, d_url = reference_engine("decode", "incompat-d", "--set", "num_layers=6")
        procs.append(d)
        with router(p_url, d_url, "incompat") as url:
            r = requests.post(url + "/v1/completions", timeout=60, json={
                "model": "handoff", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            done = time.time()
            assert r.status_code == 200, r.text[:400]
            back = back_to(lambda: held_by_p(p_url), 0.0, done, 5)
        REPORT["incompatible_d_p_idle_after_s"] = back
        assert back is not None and back < 1.0, f"P held the blocks {back} s after the answer"
        metrics = requests.get(d_url + "/metrics", timeout=5).text
        assert 'handoff_requests_failed_total{reason="incompatible"}' in metrics, metrics[-2000:]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
