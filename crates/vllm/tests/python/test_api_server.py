"""The API-server middleware ``handoff_vllm.HandoffOps`` (readiness, the preStop drain route, the
connector's metrics on /metrics), driven as vLLM's API server drives it: an ASGI app behind it,
with the connector's answers and the process's signal stood in for. No server, no model.
The served suite runs it for real (the chaos module's P drains through it)."""

from __future__ import annotations

import asyncio
import json
import signal
import types

import pytest

from handoff_vllm import api_server
from handoff_vllm.api_server import HandoffOps

TOKEN = "a-token-of-32-characters-0123456"
# What EngineCore's connector answers `metrics` with (the Rust side's text format, no # EOF).
CONNECTOR_METRICS = (
    "# HELP handoff_compat_info What a P and a D must share.\n"
    "# TYPE handoff_compat_info gauge\n"
    'handoff_compat_info{key="0123abcd4567"} 1\n'
    "# HELP handoff_kv_blocks_held KV blocks held.\n"
    "# TYPE handoff_kv_blocks_held gauge\n"
    'handoff_kv_blocks_held{side="prefill",state="leased"} 7\n')


def fake_scope(path: str, method: str = "GET", headers: list | None = None) -> dict:
    ktc = types.SimpleNamespace(engine_id="vllm-x", kv_connector_extra_config={"engine_id": "p-1"})
    app = types.SimpleNamespace(state=types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(kv_transfer_config=ktc)))
    return {"type": "http", "path": path, "method": method, "headers": headers or [], "app": app}


async def vllm_app(scope, receive, send):
    """vLLM's own answer: its metrics page, or 404."""
    if scope["path"] == "/metrics":
        body = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"not found"})


def call(scope, app=vllm_app) -> tuple[int, dict, bytes]:
    """`scope` through HandoffOps in front of `app` (vLLM's stand-in by default)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(m):
        sent.append(m)

    asyncio.run(HandoffOps(app)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start.get("headers", [])), body


@pytest.fixture
def ops(monkeypatch):
    """A connector that answers, no drain yet, SIGTERM recorded instead of sent."""
    monkeypatch.setattr(HandoffOps, "draining", False)
    monkeypatch.setattr(api_server._native, "engine_info",
                        lambda engine: json.dumps({"engine_id": engine, "compat_key": "0123abcd4567"}))
    monkeypatch.setattr(api_server._native, "engine_metrics", lambda engine: CONNECTOR_METRICS)
    killed = []
    monkeypatch.setattr(api_server.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setenv("HANDOFF_DRAIN_GRACE_S", "0.05")
    monkeypatch.setenv("HANDOFF_ADMIN_TOKEN", TOKEN)
    return killed


def test_ready_while_the_connector_answers_and_not_when_it_does_not(ops, monkeypatch):
    status, _, body = call(fake_scope("/ready"))
    assert status == 200 and json.loads(body)["ready"] is True

    def unreachable(engine):
        raise OSError("no engine socket")

    monkeypatch.setattr(api_server._native, "engine_info", unreachable)
    status, _, body = call(fake_scope("/ready"))
    assert status == 503 and "unreachable" in json.loads(body)["connector"]


def test_the_drain_route_needs_the_token_then_turns_ready_false_and_signals(ops):
    for headers in ([], [(b"authorization", b"Bearer wrong-token-of-32-characters-00")],
                    [(b"authorization", TOKEN.encode())]):
        status, _, _ = call(fake_scope("/handoff/drain", "POST", headers))
        assert status == 401, headers
    assert not ops and call(fake_scope("/ready"))[0] == 200, "refused calls changed nothing"

    good = [(b"authorization", f"Bearer {TOKEN}".encode())]
    status, _, body = call(fake_scope("/handoff/drain", "POST", good))
    assert status == 202 and json.loads(body)["draining"] is True
    assert ops == [signal.SIGTERM], "vLLM's own drain is started by SIGTERM"
    status, _, body = call(fake_scope("/ready"))
    assert status == 503 and json.loads(body)["draining"] is True
    # A second call (a retried preStop hook) signals nothing more.
    call(fake_scope("/handoff/drain", "POST", good))
    assert ops == [signal.SIGTERM]


def test_no_token_configured_means_no_drain(ops, monkeypatch):
    monkeypatch.setenv("HANDOFF_ADMIN_TOKEN", "")
    status, _, _ = call(fake_scope("/handoff/drain", "POST", [(b"authorization", b"Bearer ")]))
    assert status == 401 and not ops


def test_metrics_carry_the_connectors_metrics(ops, monkeypatch):
    """/metrics is vLLM's page with the connector's metrics (from EngineCore's socket) after
    it, asked of vLLM uncompressed (a gzip page could not be appended to), its length right;
    without an answer from the connector, vLLM's page alone."""
    scope = fake_scope("/metrics", headers=[(b"accept-encoding", b"gzip")])
    seen = []

    async def app(scope, receive, send):
        seen.append(dict(scope["headers"]))
        await vllm_app(scope, receive, send)

    status, headers, body = call(scope, app)
    text = body.decode()
    assert status == 200
    assert "vllm:num_requests_running 0.0" in text, "vLLM's own metrics are kept"
    assert 'handoff_compat_info{key="0123abcd4567"} 1' in text
    assert 'handoff_kv_blocks_held{side="prefill",state="leased"} 7' in text
    assert int(headers[b"content-length"]) == len(body)
    assert b"accept-encoding" not in seen[0], "vLLM is asked for a page that can be appended to"

    # A connector that does not answer leaves vLLM's page as it is.
    def unreachable(engine):
        raise OSError("no engine socket")

    monkeypatch.setattr(api_server._native, "engine_metrics", unreachable)
    status, _, body = call(fake_scope("/metrics"))
    assert status == 200 and b"handoff_" not in body and b"vllm:num_requests_running" in body


def test_other_paths_pass_through(ops):
    assert call(fake_scope("/v1/models"))[0] == 404
