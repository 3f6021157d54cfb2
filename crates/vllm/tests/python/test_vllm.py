"""HandoffConnector in real vLLM (CPU): P prefills, D pulls the KV and decodes; the output equals
a single engine's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from datetime import datetime, timezone

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from test_router import check_vllm_behind_router

from conftest import (BLOCK_SIZE, CORRUPT_FILE, FENCE_GRACE_S, HANDOFF_BIN, HERE, HOLD_FILE,
                      INITIAL_LEASE_S, MAX_MODEL_LEN, REAL_MODEL_NAME, REPORT, TRACES,
                      check_proxy_decodes_like_single, disaggregated, fresh_usage, ignore_errors,
                      prompt, usage_back_to)


def digest_lines(cluster, what: str) -> int:
    """How many KV digests D checked with this result ("matched" or "mismatch"), from its log."""
    return sum(f"KV digest {what}" in line
               for line in cluster["d"].log_path.read_text().splitlines())


def token_logprobs(resp: dict) -> list[float]:
    return resp["choices"][0]["logprobs"]["token_logprobs"]


def test_the_real_model_answers_a_chat_question_with_its_known_answer(single):
    """The converted model (scripts/fetch-model) is the real SmolLM2-135M-Instruct: its greedy
    answer to a fixed chat question is the one its own weights give (a conversion that got the
    rotary permutation or the tokenizer wrong answers garbage in chat)."""
    r = single.chat([{"role": "user", "content": "What is the capital of France?"}], 20)
    c = r["choices"][0]
    assert c["message"]["content"] == "The capital of France is Paris.", c
    assert c["finish_reason"] == "stop", c


def test_chat_through_p_and_d_equals_a_single_engine(cluster):
    """A chat request, P then D as a router sends them: D's text and token ids equal the single
    engine's, and D checked the KV digest (the KV came from P)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write two sentences about the sea."}]
    want = cluster["single"].chat(messages, 24)["choices"][0]
    matched = digest_lines(cluster, "matched")
    p = cluster["p"].chat(messages, 1, kv_transfer_params={"do_remote_decode": True})
    params = p.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), p
    got = cluster["d"].chat(messages, 24, kv_transfer_params=params)["choices"][0]
    if (got["message"]["content"], got.get("token_ids")) != \
            (want["message"]["content"], want.get("token_ids")):
        REPORT["output_mismatches"] = REPORT.get("output_mismatches", 0) + 1
    assert got["message"]["content"] == want["message"]["content"], (got, want)
    assert got.get("token_ids") == want.get("token_ids"), (got, want)
    assert digest_lines(cluster, "matched") == matched + 1, "D computed the prompt itself"


def test_decode_from_pulled_kv_equals_a_single_engine(cluster):
    lengths = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 17, MAX_MODEL_LEN - 16]
    mismatches = []
    unchecked = []
    largest_logprob_diff = 0.0
    for i, n in enumerate(lengths):
        ids = prompt(n, seed=i)
        matched = digest_lines(cluster, "matched")
        # Without a tokenizer, vLLM gives logprobs only with tokens named by their ids.
        _, d = disaggregated(cluster, ids, max_tokens=8, logprobs=1,
                             return_tokens_as_token_ids=True)
        if digest_lines(cluster, "matched") != matched + 1:
            unchecked.append(n)
        single = cluster["single"].complete(ids, 8, logprobs=1, return_tokens_as_token_ids=True)
        d_ids = d["choices"][0]["token_ids"]
        s_ids = single["choices"][0]["token_ids"]
        if d_ids != s_ids:
            mismatches.append(f"prompt of {n} tokens: D {d_ids} vs single {s_ids}")
        else:
            # The same tokens: how far apart their log-probabilities are (D decoded from P's KV,
            # the single engine from its own).
            largest_logprob_diff = max(
                largest_logprob_diff,
                max(abs(a - b) for a, b in zip(token_logprobs(d), token_logprobs(single))))
    REPORT["prompts_compared"] = len(lengths)
    REPORT["largest_logprob_diff"] = largest_logprob_diff
    REPORT["output_mismatches"] = REPORT.get("output_mismatches", 0) + len(mismatches)
    REPORT["digest_mismatches"] = digest_lines(cluster, "mismatch")
    assert not mismatches, mismatches
    assert not unchecked, f"no matching KV digest on D for prompts of {unchecked} tokens"
    assert REPORT["digest_mismatches"] == 0


def handoff_samples(server) -> dict[str, list]:
    """The handoff_* samples of the server's /metrics, by name, parsed as Prometheus parses the
    page (a malformed line anywhere on it raises)."""
    text = requests.get(server.url + "/metrics", timeout=5).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("handoff_"):
                out.setdefault(sample.name, []).append(sample)
    return out


def test_vllm_s_metrics_page_carries_the_connector_s_own_metrics(cluster):
    """P's and D's /metrics (vLLM's own page, with ``handoff_vllm.HandoffOps``) carry the
    connector's metrics from EngineCore, what ``ops/``'s alerts and dashboard read: KV blocks
    held per state, handoffs ended by reason, bytes moved, digests checked, the compatibility
    key once. After one P/D request P counted its handoff's end and D the bytes it read; the
    page parses whole. (Before, vLLM exported the compatibility key alone.)"""
    p_before = handoff_samples(cluster["p"])
    assert "handoff_kv_blocks_held" in p_before, sorted(p_before)
    assert len(p_before.get("handoff_compat_info", [])) == 1, p_before.get("handoff_compat_info")

    def ended(samples) -> float:
        return sum(s.value for s in samples.get("handoff_handoffs_ended_total", []))

    def moved(samples) -> float:
        return sum(s.value for s in samples.get("handoff_transfer_bytes_total", []))

    d_before = handoff_samples(cluster["d"])
    disaggregated(cluster, prompt(200, seed=4242), 2)
    deadline = time.monotonic() + 5
    while ended(handoff_samples(cluster["p"])) <= ended(p_before):
        assert time.monotonic() < deadline, "P's handoff did not end on its /metrics within 5 s"
        time.sleep(0.2)
    d_after = handoff_samples(cluster["d"])
    assert moved(d_after) > moved(d_before), "D's /metrics counted no bytes read"
    assert "handoff_kv_digests_checked_total" in d_after, sorted(d_after)
    assert len(d_after.get("handoff_compat_info", [])) == 1


def test_check_ops_reads_every_dashboard_query_and_the_alerts_from_vllm_p_and_d(cluster):
    """``scripts/check-ops`` against this module's vLLM P and D (``--prefill``, ``--decode``)
    instead of reference engines: handoff's proxy in front, a real Prometheus scraping vLLM's
    /metrics pages with ``ops/``'s rules loaded, a bounded load and two injected faults (a
    transfer D cannot start, bytes that are no handshake on P's side channel). Every query of
    every dashboard panel returns data from vLLM (the engine panels through vLLM's own
    ``vllm:*`` series), a misspelled one returns none, every rule evaluates, the two faults'
    alerts go pending and no alert of a healthy cluster is active. Runs before the digest's
    negative control, whose mismatch would be such an alert."""
    env = dict(os.environ, HANDOFF_BIN=str(HANDOFF_BIN))
    if os.environ.get("HANDOFF_REQUIRE_VLLM") == "1":
        env["HANDOFF_REQUIRE_OPS"] = "1"  # CI: no Prometheus is a failure, never a skip
    out = subprocess.run(
        [str(HERE.parents[3] / "scripts" / "check-ops"), "--prefill", cluster["p"].url,
         "--decode", cluster["d"].url, "--model", cluster["p"].model,
         # Fewer than the reference check's 30 (a vLLM completion here takes about a second):
         # every series still appears and grows.
         "--requests", "12"],
        env=env, capture_output=True, text=True, timeout=360)
    said = [line for line in out.stderr.splitlines() if line.startswith("check-ops:")]
    assert out.returncode == 0, "\n".join(said[-30:]) or out.stderr[-4000:]
    if said and said[-1].startswith("check-ops: skipped"):
        pytest.skip(said[-1])
    assert "scraping running engines: all returned data" in said[-1], said[-1]
    REPORT["check_ops_vllm"] = said[-2].removeprefix("check-ops: ")


def test_handoff_s_own_proxy_drives_vllm_p_and_d_in_pull_mode(cluster):
    """`handoff proxy --mode pull` in front of vLLM's P and D: P's vLLM-shaped
    kv_transfer_params reach D through it, D reads the KV (one digest check) and its greedy
    output equals the single engine's."""
    check_proxy_decodes_like_single("pull", cluster, prompt(2 * BLOCK_SIZE + 21, seed=47))


def test_vllm_p_and_d_behind_vllm_router_answer_like_a_single_engine(cluster):
    """vllm-router (P/D mode, pull) in front of P and D: completions and chat, streamed and
    not, n=2 and a client that leaves mid-stream (see test_router.py)."""
    check_vllm_behind_router(cluster)


def test_negative_control_damaged_kv_fails_the_digest_and_is_never_decoded(cluster):
    """The digest check has power: with one byte of the landed KV changed on D (test-only
    switch), D's digest differs from P's and the request fails (policy "fail") instead of being
    decoded from the damaged KV."""
    ids = prompt(3 * BLOCK_SIZE, seed=99)
    single = cluster["single"].complete(ids, 8)["choices"][0]["token_ids"]
    before = digest_lines(cluster, "mismatch")
    CORRUPT_FILE.touch()
    try:
        p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
        body = {"model": REAL_MODEL_NAME, "prompt": ids, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True, "kv_transfer_params": p["kv_transfer_params"]}
        r = requests.post(cluster["d"].url + "/v1/completions", json=body, timeout=120)
    finally:
        CORRUPT_FILE.unlink()
    detected = digest_lines(cluster, "mismatch") == before + 1
    REPORT["negative_control_detected"] = detected
    assert detected, "damaged KV went unnoticed by the digest"
    choice = r.json()["choices"][0] if r.status_code == 200 else None
    decoded = choice is not None and choice.get("finish_reason") != "error"
    assert not decoded or choice["token_ids"] == single, \
        f"D decoded damaged KV: {r.status_code} {r.text[:300]}"
    # Without the switch the same prompt decodes like the single engine again.
    _, d = disaggregated(cluster, ids, max_tokens=8)
    assert d["choices"][0]["token_ids"] == single


def blocks_back_at(log: str, request_id: str) -> tuple[float, str] | None:
    """When P's connector gave `request_id`'s blocks back to vLLM, and why (from P's log)."""
    for line in log.splitlines():
        if "blocks back" in line and request_id in line:
            stamp = line.split()[0].rstrip("Z")
            reason = re.search(r"reason=(\S+)", line)
            t = datetime.fromisoformat(stamp[:26]).replace(tzinfo=timezone.utc).timestamp()
            return t, reason.group(1) if reason else "?"
    return None


def wait_blocks_back(cluster, request_id: str, limit_s: float) -> tuple[float, str] | None:
    deadline = time.time() + limit_s
    while time.time() < deadline:
        back = blocks_back_at(cluster["p"].log_path.read_text(), request_id)
        if back is not None:
            return back
        time.sleep(0.05)
    return None




def test_n2_on_d_is_one_transfer_both_choices_decoded_p_freed_once(cluster):
    """n=2 on D: vLLM fans the request out into two children with blocks of their own. The
    first child's READ brings the KV (one transfer, one digest check, P frees once); the second
    waits for it and finds the prompt in D's prefix cache. Both choices equal the single
    engine's greedy output."""
    ids = prompt(3 * BLOCK_SIZE + 40, seed=31)
    single = cluster["single"].complete(ids, 6)["choices"][0]["token_ids"]
    matched = digest_lines(cluster, "matched")
    p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = p["kv_transfer_params"]
    # vLLM refuses n>1 with greedy sampling; top_k=1 samples the greedy token all the same.
    d = cluster["d"].complete(ids, 6, n=2, temperature=1.0, top_k=1, kv_transfer_params=params)
    choices = [c["token_ids"] for c in d["choices"]]
    assert len(choices) == 2, d
    assert all(c == single for c in choices), f"D {choices} vs single {single}"
    assert digest_lines(cluster, "matched") == matched + 1, "one transfer, checked once"
    back = wait_blocks_back(cluster, params["remote_request_id"], 5)
    assert back is not None and back[1] == "done", back
    freed = sum(params["remote_request_id"] in line and "blocks back" in line
                for line in cluster["p"].log_path.read_text().splitlines())
    REPORT["n2_transfers"] = digest_lines(cluster, "matched") - matched
    assert freed == 1, f"P freed {freed} times"


def test_malformed_kv_transfer_params_get_an_answer_and_change_nothing_else(cluster):
    """What a client puts in kv_transfer_params never reaches vLLM's scheduler as an exception
    (that would stop the engine): D and P answer, computing the prompt themselves, and go on
    serving."""
    ids = prompt(BLOCK_SIZE + 7, seed=41)
    single = cluster["single"].complete(ids, 4)["choices"][0]["token_ids"]
    for bad in ({"do_remote_prefill": True, "handoff_id": "not-a-handoff"},
                {"do_remote_prefill": True, "handoff_id": "00000000000000000000000000000001",
                 "remote_port": "x", "remote_block_ids": "y"}):
        d = cluster["d"].complete(ids, 4, kv_transfer_params=bad)
        assert d["choices"][0]["token_ids"] == single, bad
    p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": "yes",
                                                          "tp_size": "many"})
    assert p["choices"][0]["token_ids"] == single[:1]
    assert not (p.get("kv_transfer_params") or {}).get("handoff_id"), p
    _, d = disaggregated(cluster, ids, max_tokens=4)
    assert d["choices"][0]["token_ids"] == single


def test_a_request_d_refuses_before_admission_frees_p_at_once(cluster):
    """D's API server refuses a prompt longer than D's max_model_len (400) before EngineCore,
    and so the connector, sees it. handoff_vllm.RefusalRelease names its params to D's
    connector, which tells P: P's blocks are back within 2 s, reason rejected (without it, at
    the initial lease + fence, 5.5 s here)."""
    idle = fresh_usage(cluster["p"])
    ids = prompt(MAX_MODEL_LEN + 100, seed=51)
    p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = p["kv_transfer_params"]
    body = {"model": REAL_MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": params}
    sent = time.time()
    r = requests.post(cluster["d"].url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, f"D took a prompt over its max_model_len: {r.status_code}"
    back = wait_blocks_back(cluster, params["remote_request_id"], INITIAL_LEASE_S + 5)
    assert back is not None and back[1] == "rejected", f"P freed for another reason: {back}"
    # From sending the request to D (the release may land before the client reads the 400).
    after = back[0] - sent
    REPORT["reclaim_after_refusal_s"] = round(after, 3)
    assert after < 2.0, f"P's blocks came back {after:.2f} s after the request went to D"
    assert usage_back_to(cluster["p"], idle, time.time(), 5) is not None
    # D still serves.
    short = ids[:BLOCK_SIZE]
    _, d = disaggregated(cluster, short, max_tokens=2)
    assert d["choices"][0]["token_ids"] == \
        cluster["single"].complete(short, 2)["choices"][0]["token_ids"]


def test_client_that_leaves_d_mid_read_frees_p_at_once(cluster):
    """A client leaves a streamed request while D reads its KV (the READ held by the test
    switch): vLLM aborts the request, D cancels the READ at once and, as soon as it has ended,
    tells P; P's KV cache usage on vLLM's /metrics is back to idle within 2 s, reason aborted
    (not the READ's deadline, ~4.5 s later, reason failed). D serves the next request."""
    idle = fresh_usage(cluster["p"])
    ids = prompt(2 * BLOCK_SIZE + 9, seed=21)
    HOLD_FILE.touch()
    try:
        p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
        params = p["kv_transfer_params"]
        body = {"model": REAL_MODEL_NAME, "prompt": ids, "max_tokens": 8, "temperature": 0,
                "stream": True, "kv_transfer_params": params}
        stream = requests.post(cluster["d"].url + "/v1/completions", json=body, stream=True,
                               timeout=30)
        # D has it: tracked, its READ started and held back.
        time.sleep(0.7)
        held = fresh_usage(cluster["p"])
        assert held > idle, f"P's KV usage {held} while holding the blocks, idle {idle}"
        left = time.time()
        stream.close()
        reclaim = usage_back_to(cluster["p"], idle, left, 10)
    finally:
        HOLD_FILE.unlink()
    back = wait_blocks_back(cluster, params["remote_request_id"], 5)
    REPORT["reclaim_after_client_left_s"] = round(reclaim, 3) if reclaim is not None else None
    assert back is not None and back[1] == "aborted", f"P freed for another reason: {back}"
    assert reclaim is not None and reclaim < 2.0, f"P's blocks back {reclaim} s after the client left"
    single = cluster["single"].complete(ids, 4)["choices"][0]["token_ids"]
    _, d = disaggregated(cluster, ids, max_tokens=4)
    assert d["choices"][0]["token_ids"] == single


def test_dead_decode_engine_frees_p_at_once(cluster):
    """SIGKILL D while the request waits on D for its KV: P notices (the side channel closes)
    and its KV cache usage on vLLM's /metrics is back to idle within 2 s, not after a lease.
    Runs after every test that needs D: it kills D."""
    idle = fresh_usage(cluster["p"])
    ids = prompt(2 * BLOCK_SIZE + 5, seed=7)
    HOLD_FILE.touch()
    try:
        p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
        params = p["kv_transfer_params"]
        waiting = threading.Thread(
            target=lambda: ignore_errors(cluster["d"].complete, ids, 4, kv_transfer_params=params),
            daemon=True,
        )
        waiting.start()
        # D has it: tracked, heartbeating, its READ held back (D gives up on a held READ at its
        # grant's end, ~4.5 s after it started: the kill comes well before).
        time.sleep(0.7)
        held = fresh_usage(cluster["p"])
        assert held > idle, f"P's KV usage {held} while holding the blocks, idle {idle}"
        killed = time.time()
        cluster["d"].kill()
    finally:
        HOLD_FILE.unlink()
    reclaim = usage_back_to(cluster["p"], idle, killed, 15)
    back = blocks_back_at(cluster["p"].log_path.read_text(), params["remote_request_id"])
    REPORT["reclaim_reason"] = back[1] if back else None
    assert back is not None and back[1] == "peer_dead", f"P freed for another reason: {back}"
    assert reclaim is not None, "P's KV usage is not back to idle 15 s after D died"
    REPORT["reclaim_after_kill_s"] = round(reclaim, 3)
    assert reclaim < 2.0, f"P's blocks came back {reclaim:.2f} s after D died"


def test_decode_engine_dead_before_it_hears_frees_p_after_the_initial_lease(cluster):
    """D is dead (the test above killed it) before it ever hears of this request: nobody claims
    P's handoff, and P's blocks are back when the initial lease and its fence end
    (INITIAL_LEASE_S + handoff's default fence grace of 1.5 s), not earlier, not much later."""
    idle = fresh_usage(cluster["p"])
    ids = prompt(BLOCK_SIZE + 3, seed=13)
    p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
    answered = time.time()
    back = wait_blocks_back(cluster, p["kv_transfer_params"]["remote_request_id"],
                            INITIAL_LEASE_S + 10)
    assert back is not None, "P never freed a handoff nobody claimed"
    after = back[0] - answered
    REPORT["reclaim_unclaimed_s"] = round(after, 3)
    assert back[1] == "expired", back
    assert INITIAL_LEASE_S + FENCE_GRACE_S - 0.5 <= after < INITIAL_LEASE_S + FENCE_GRACE_S + 1.5, \
        after
    assert usage_back_to(cluster["p"], idle, time.time(), 5) is not None


def test_the_recorded_traces_of_p_and_d_replay_to_the_same_outputs_with_every_rule_kept(cluster):
    """Runs last. P and D recorded every input of their connector cores (record_trace) through
    this module: the real model behind vLLM's router and handoff's proxy, n=2, the damaged-KV
    control, refusals, a client leaving mid-read, D SIGKILLed mid-read, a handoff nobody
    claimed. `handoff replay` feeds each trace through a fresh core: the same answers and
    batches, and no rule broken from that engine's view (D's trace ends at its kill)."""
    for name in ("p", "d"):
        out = subprocess.run([str(HANDOFF_BIN), "replay", str(TRACES / f"{name}.jsonl"), "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{name}: {out.stdout[-3000:]}\n{out.stderr[-2000:]}"
        report = json.loads(out.stdout)
        assert report["divergence"] is None and report["violations"] == [], report
        assert report["inputs"] > 50, f"{name}: a trace with the module's requests in it"
        REPORT[f"replayed_inputs_{name}"] = report["inputs"]
