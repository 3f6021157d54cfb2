"""HandoffConnector in push mode in real vLLM (CPU): the proxy sends D's leg and P's leg at once
under one fresh handoff id; D reserves blocks and registers them with P, P writes its KV into
them once its prefill ended, and D decodes. A P and a D of their own (an engine runs one mode),
the session's single engine as the reference."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import (BLOCK_SIZE, HOLD_WRITES_FILE, MAX_MODEL_LEN, REPORT, STARTUP_S, Server,
                      check_proxy_decodes_like_single, connector, free_port, fresh_usage,
                      usage_back_to)

# A grant D gives P on its registration lasts REGISTRATION_LEASE_S (handoff's default: D's
# connector does not set it), renewed by P's heartbeats every HEARTBEAT_S, during P's forward
# pass too; D frees its blocks WRITE_GRACE_S after the last grant ended when P cannot confirm
# that no WRITE is in flight.
REGISTRATION_LEASE_S = 1.5
HEARTBEAT_S = 0.5
WRITE_GRACE_S = 0.8


@pytest.fixture(scope="module")
def push(single):
    side_port = free_port()
    servers = {
        # P's side channel on a known port: the proxy tells D where to register.
        # P logs each write its worker sends as the forward pass saves the layer.
        # P answers GET /v1/handoff/info (handoff_vllm.HandoffInfo) for handoff's proxy.
        "p": Server("push-p", connector("vllm-push-p", mode="push", kv_digest=True,
                                        side_channel_port=side_port),
                    extra_args=["--middleware", "handoff_vllm.HandoffInfo"],
                    env_extra={"HANDOFF_VLLM_TEST_HOLD_FILE": str(HOLD_WRITES_FILE),
                               "RUST_LOG": "info,handoff_connector::forward_gate=debug"}),
        # D logs each KV digest it checked; its KV usage on /metrics shows its reserved blocks.
        # The registration grant is the default although the real model prefills 2,000 tokens
        # here for seconds: D's renewals reach P's worker during the forward (the grant line).
        "d": Server("push-d", connector("vllm-push-d", mode="push", kv_digest=True),
                    env_extra={"RUST_LOG": "info,handoff_core::machine::push_digest=debug"},
                    log_stats=True),
    }
    try:
        deadline = time.monotonic() + STARTUP_S
        for s in servers.values():
            s.wait_healthy(deadline)
        # One local request each first: the first forward pass of a fresh server (and the rest
        # of its start, on this machine's two cores) once starved its transport past the tcp
        # silence limit (1.5 s) in the first push.
        for s in servers.values():
            s.complete([5, 6, 7], 1)
        yield dict(servers, single=single, side_port=side_port)
    finally:
        for s in servers.values():
            s.stop()


def legs(push) -> tuple[dict, dict]:
    """What a push proxy sends: (P's request body, D's request body), one fresh handoff id."""
    handoff = secrets.token_hex(16)
    p_params = {"do_remote_decode": True, "transfer_mode": "push", "handoff_id": handoff}
    d_params = {"do_remote_prefill": True, "transfer_mode": "push", "handoff_id": handoff,
                "remote_engine_id": "vllm-push-p", "remote_host": "127.0.0.1",
                "remote_port": push["side_port"], "tp_size": 1, "epoch": 1}
    return p_params, d_params


def pushed(push, ids: list[int], max_tokens: int, **extra) -> tuple[dict, dict]:
    """Both legs at once, as handoff's proxy sends them; returns (P's answer, D's answer)."""
    p_params, d_params = legs(push)
    with ThreadPoolExecutor(1) as ex:
        d = ex.submit(push["d"].complete, ids, max_tokens, kv_transfer_params=d_params, **extra)
        p = push["p"].complete(ids, 1, kv_transfer_params=p_params)
        return p, d.result()


def digest_lines(push, what: str) -> int:
    return sum(f"KV digest {what}" in line
               for line in push["d"].log_path.read_text().splitlines())


def test_decode_from_pushed_kv_equals_a_single_engine(push):
    lengths = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 17, MAX_MODEL_LEN - 16]
    mismatches, unchecked = [], []
    for i, n in enumerate(lengths):
        ids = [(7 * i + 13 * j) % 3990 + 5 for j in range(n)]
        matched = digest_lines(push, "matched")
        _, d = pushed(push, ids, 8)
        if digest_lines(push, "matched") != matched + 1:
            unchecked.append(n)
        want = push["single"].complete(ids, 8)["choices"][0]["token_ids"]
        got = d["choices"][0]["token_ids"]
        if got != want:
            mismatches.append(f"prompt of {n} tokens: D {got} vs single {want}")
    REPORT["push_output_mismatches"] = len(mismatches)
    REPORT["push_digest_mismatches"] = digest_lines(push, "mismatch")
    REPORT["output_mismatches"] = REPORT.get("output_mismatches", 0) + len(mismatches)
    REPORT["digest_mismatches"] = REPORT.get("digest_mismatches", 0) + \
        REPORT["push_digest_mismatches"]
    assert not mismatches, mismatches
    assert not unchecked, f"no matching KV digest on D for prompts of {unchecked} tokens"
    assert REPORT["push_digest_mismatches"] == 0
    # A forward pass longer than D's grant (the longest prompt's) kept every write inside a
    # renewed grant: none failed unposted (D would have recomputed, or answered 500).
    assert _log_count(push["p"], "push write not posted") == 0


def _streamed(push, ids: list[int]) -> tuple[int, list[int], float]:
    """D's leg first, so that its registration is at P before P schedules the prefill: the step
    that completes P's prompt plans the writes, and P's worker sends each layer from vLLM's
    save_kv_layer during the forward pass. Returns (writes that left from save_kv_layer, D's
    tokens, seconds P took to answer)."""
    idle = fresh_usage(push["d"])
    streamed = _log_count(push["p"], "push write leaves as its layer is saved")
    p_params, d_params = legs(push)
    with ThreadPoolExecutor(1) as ex:
        d = ex.submit(push["d"].complete, ids, 8, kv_transfer_params=d_params)
        deadline = time.monotonic() + 10
        while fresh_usage(push["d"]) <= idle:
            assert time.monotonic() < deadline, "D never reserved blocks for the request"
        time.sleep(0.3)  # D's registration crosses the side channel
        t = time.monotonic()
        push["p"].complete(ids, 1, kv_transfer_params=p_params)
        p_s = time.monotonic() - t
        got = d.result()["choices"][0]["token_ids"]
    return _log_count(push["p"], "push write leaves as its layer is saved") - streamed, got, p_s


def test_each_layer_leaves_p_while_its_forward_pass_computes_the_next(push):
    """P's worker sends layer 0 from vLLM's save_kv_layer, during the forward pass (the last
    layer follows once the earlier ones landed and the digest is known). D's output and digest
    still match."""
    ids = [(5 * j) % 3990 + 5 for j in range(3 * BLOCK_SIZE + 5)]
    matched = digest_lines(push, "matched")
    streamed, got, _ = _streamed(push, ids)
    assert streamed > 0, "no layer left P from save_kv_layer"
    assert digest_lines(push, "matched") == matched + 1
    assert got == push["single"].complete(ids, 8)["choices"][0]["token_ids"]


def test_a_forward_pass_longer_than_d_s_grant_streams_every_layer(push):
    """The longest prompt's forward pass lasts several of D's 2 s registration grants on this
    machine; D renews them on P's heartbeats and P's worker hears of each renewal on the grant
    line, so every layer but the last (which goes once the others landed) leaves from
    save_kv_layer and none fails unposted. With the grant the step was planned on, the late
    layers' writes failed and D answered 500."""
    ids = [(11 * j) % 3990 + 5 for j in range(MAX_MODEL_LEN - 16)]
    matched = digest_lines(push, "matched")
    not_posted = _log_count(push["p"], "push write not posted")
    streamed, got, p_s = _streamed(push, ids)
    REPORT["push_long_forward_s"] = round(p_s, 2)
    REPORT["push_long_forward_layers_streamed"] = streamed
    assert p_s > REGISTRATION_LEASE_S, \
        f"P answered in {p_s:.2f} s: the forward must outlast D's grant for this test to say anything"
    assert _log_count(push["p"], "push write not posted") == not_posted
    assert streamed >= 2, f"{streamed} layers left P from save_kv_layer"
    assert digest_lines(push, "matched") == matched + 1
    assert got == push["single"].complete(ids, 8)["choices"][0]["token_ids"]


def test_handoff_s_own_proxy_drives_vllm_p_and_d_in_push_mode(push):
    """P's API server answers GET /v1/handoff/info (handoff_vllm.HandoffInfo) with the side
    channel its connector listens on, so `handoff proxy --mode push` can send both legs at once
    with no configuration of P's side channel: D's output equals the single engine's, its
    digest matched P's."""
    info = requests.get(push["p"].url + "/v1/handoff/info", timeout=5).json()
    assert (info["engine_id"], info["remote_port"], info["transfer_mode"]) == \
        ("vllm-push-p", push["side_port"], "push"), info
    # D runs no HandoffInfo: its API server answers the path as vLLM does (not found).
    assert requests.get(push["d"].url + "/v1/handoff/info", timeout=5).status_code == 404
    check_proxy_decodes_like_single("push", push,
                                    [(3 * j + 1) % 3990 + 5 for j in range(BLOCK_SIZE + 40)])


def _log_count(server: Server, what: str) -> int:
    return sum(what in line for line in server.log_path.read_text().splitlines())


def test_p_dead_mid_write_frees_d_s_blocks_after_grant_and_grace_never_earlier(push):
    """SIGKILL P while its WRITEs into D's registered blocks are held back (test-only switch):
    D learns of the death at once, but a WRITE P posted inside its grant could still land, so
    D's blocks go back to vLLM (its KV cache usage on /metrics back to idle) only once the last
    grant it gave P and the write grace are over — not earlier, not much later. Runs last: it
    kills P."""
    idle = fresh_usage(push["d"])
    ids = [(11 * j) % 3990 + 5 for j in range(2 * BLOCK_SIZE + 9)]
    p_params, d_params = legs(push)
    HOLD_WRITES_FILE.touch()
    try:
        answered: list = []
        d_leg = threading.Thread(
            target=lambda: answered.append(_status(push["d"], ids, 4, d_params)), daemon=True)
        d_leg.start()
        push["p"].complete(ids, 1, kv_transfer_params=p_params)
        # D reserved and registered its blocks; P's prefill ended and its WRITEs are held.
        time.sleep(0.7)
        held = fresh_usage(push["d"])
        assert held > idle, f"D's KV usage {held} while its blocks wait for P, idle {idle}"
        killed = time.time()
        push["p"].kill()
    finally:
        HOLD_WRITES_FILE.unlink()
    back = usage_back_to(push["d"], idle, killed, 15)
    assert back is not None, "D's reserved blocks are not back 15 s after P died"
    REPORT["push_reclaim_after_p_kill_s"] = round(back, 3)
    # P's last heartbeat (one every HEARTBEAT_S) got a grant of REGISTRATION_LEASE_S: the last
    # grant ends between lease - heartbeat and lease after the kill, then the write grace.
    earliest = REGISTRATION_LEASE_S - HEARTBEAT_S + WRITE_GRACE_S
    latest = REGISTRATION_LEASE_S + WRITE_GRACE_S
    assert earliest - 0.3 <= back <= latest + 0.5, \
        f"D's blocks back {back:.2f} s after P died; expected {earliest}..{latest} s"
    d_leg.join(timeout=10)
    assert answered and answered[0] != 200, f"D answered {answered} without P's KV"


def _status(server: Server, ids: list[int], max_tokens: int, params: dict) -> int:
    body = {"model": server.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "kv_transfer_params": params}
    try:
        r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    except requests.RequestException:
        return -1
    if r.status_code == 200 and r.json()["choices"][0].get("finish_reason") == "error":
        return 500
    return r.status_code
