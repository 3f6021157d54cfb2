"""ASGI middlewares for vLLM's API server, which runs in another process than the connector
(EngineCore). Each asks the connector over EngineCore's local socket (a Unix socket only this user
can open; see the Rust ``engine_socket`` module).

``RefusalRelease``, for D's API server (``--middleware handoff_vllm.RefusalRelease``): vLLM's
API server refuses some requests itself (a prompt longer than ``max_model_len``, bad
sampling parameters) and answers 4xx before EngineCore, and so the connector, ever sees them.
For a request that carries a remote prefill's ``kv_transfer_params``, P would keep the prompt's
blocks until its lease ends. This middleware watches the answer's status and, on a 4xx, names
the params to this engine's connector, which tells P to release at once through its ledger.
It reads the request body once (at most ``MAX_BODY`` bytes; larger bodies pass through
unwatched) and replays it to vLLM unchanged.

``HandoffInfo``, for P's API server in push mode (``--middleware handoff_vllm.HandoffInfo``):
answers ``GET /v1/handoff/info`` with what a push proxy (handoff's own, ``--mode push``) needs to
tell D where to register its blocks: P's engine id, side channel, tp size, block size and mode.

``HandoffOps``, for any API server of a fleet (``--middleware handoff_vllm.HandoffOps``):
``GET /ready`` (200 while the connector answers and no drain was asked for, else 503 naming
why: what Kubernetes' readiness probe and a router's health check should read; vLLM's own
``/health`` stays the liveness probe); ``POST /handoff/drain``, the ``preStop`` route: with
``Authorization: Bearer $HANDOFF_ADMIN_TOKEN`` it turns ``/ready`` false, waits
``HANDOFF_DRAIN_GRACE_S`` (5) so routers stop sending, then sends this API server SIGTERM,
which starts vLLM's own drain (it serves the reads of every handoff the connector holds when
vLLM runs with ``--shutdown-timeout``), and answers; and ``/metrics`` with the connector's own
metrics appended (``handoff_*``, the families ``ops/`` alerts and draws on: KV blocks held per
state, reclaims by reason, transfers, leases; and ``handoff_compat_info{key="..."} 1``, the
compatibility key routers pair P and D by). The connector's registry lives in EngineCore, the
page is served here: each scrape asks EngineCore for the metrics' text. When the connector does
not answer, vLLM's page goes out as it is.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal

from handoff_vllm import _native

logger = logging.getLogger("handoff_vllm")

MAX_BODY = 16 * 1024 * 1024
_WATCHED = ("/v1/completions", "/v1/chat/completions")


def engine_id(vllm_config) -> str:
    """The engine id the connector runs under (``HandoffConnector`` reads the same)."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    return str(extra.get("engine_id") or ktc.engine_id)


def _remote_prefill_params(body: bytes) -> dict | None:
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    if isinstance(params, dict) and params.get("do_remote_prefill") and params.get("handoff_id"):
        return params
    return None


class RefusalRelease:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" \
                or scope.get("path") not in _WATCHED:
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            m = await receive()
            messages.append(m)
            if m.get("type") != "http.request":
                break
            size += len(m.get("body", b""))
            if not m.get("more_body") or size > MAX_BODY:
                break
        params = None
        if size <= MAX_BODY and messages[-1].get("type") == "http.request" \
                and not messages[-1].get("more_body"):
            params = _remote_prefill_params(b"".join(m.get("body", b"") for m in messages))
        queued = list(messages)

        async def replay():
            return queued.pop(0) if queued else await receive()

        if params is None:
            return await self.app(scope, replay, send)
        status = None

        async def watch(m):
            nonlocal status
            if m.get("type") == "http.response.start":
                status = m.get("status")
            await send(m)

        await self.app(scope, replay, watch)
        if status is not None and 400 <= status < 500:
            await asyncio.to_thread(self._tell, scope, params, status)

    @staticmethod
    def _tell(scope, params: dict, status: int) -> None:
        try:
            config = scope["app"].state.vllm_config
            answer = _native.tell_refusal(engine_id(config), json.dumps(params))
        except Exception as e:  # the client already has its answer; nothing else may break
            logger.warning("handoff: could not pass on a refused request (%s): %s", status, e)
            return
        if answer != "ok":
            logger.warning("handoff: refused request (%s) not passed on: %s", status, answer)


class HandoffInfo:
    PATH = "/v1/handoff/info"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("path") != self.PATH:
            return await self.app(scope, receive, send)
        if scope.get("method") != "GET":
            return await _answer(send, 405, {"error": f"{self.PATH} answers GET only"})
        try:
            config = scope["app"].state.vllm_config
            info = await asyncio.to_thread(_native.engine_info, engine_id(config))
        except Exception as e:  # no connector (yet): the proxy retries at its next health check
            return await _answer(send, 503, {"error": f"handoff connector unreachable: {e}"})
        if info.startswith("error: "):
            return await _answer(send, 503, {"error": info[len("error: "):]})
        await _answer(send, 200, info.encode())


async def _answer(send, status: int, body) -> None:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _connector_metrics(scope) -> str:
    """This engine's connector metrics in Prometheus' text format; raises when the connector
    does not answer."""
    text = _native.engine_metrics(engine_id(scope["app"].state.vllm_config))
    if text.startswith("error: "):
        raise RuntimeError(text[len("error: "):])
    return text


def _connector_info(scope) -> dict:
    """This engine's connector info (``GET /v1/handoff/info``'s body); raises when the
    connector does not answer."""
    config = scope["app"].state.vllm_config
    info = _native.engine_info(engine_id(config))
    if info.startswith("error: "):
        raise RuntimeError(info[len("error: "):])
    return json.loads(info)


class HandoffOps:
    READY = "/ready"
    DRAIN = "/handoff/drain"
    METRICS = "/metrics"
    # Set once a drain was asked for: the API server is one process, so is the flag.
    draining = False

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path")
        if scope.get("type") != "http" or path not in (self.READY, self.DRAIN, self.METRICS):
            return await self.app(scope, receive, send)
        if path == self.READY:
            return await self._ready(scope, send)
        if path == self.DRAIN:
            return await self._drain(scope, send)
        return await self._metrics(scope, receive, send)

    async def _ready(self, scope, send):
        if HandoffOps.draining:
            return await _answer(send, 503, {"ready": False, "draining": True})
        try:
            await asyncio.to_thread(_connector_info, scope)
        except Exception as e:
            return await _answer(send, 503, {"ready": False, "draining": False,
                                             "connector": f"unreachable: {e}"})
        await _answer(send, 200, {"ready": True, "draining": False, "connector": "ok"})

    async def _drain(self, scope, send):
        if scope.get("method") != "POST":
            return await _answer(send, 405, {"error": f"{self.DRAIN} answers POST only"})
        token = os.environ.get("HANDOFF_ADMIN_TOKEN", "")
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if len(token) < 16 or not hmac.compare_digest(given, f"Bearer {token}".encode()):
            # Nothing changes: a drain stops the engine, only its operator may ask for one.
            return await _answer(send, 401, {"error": "a drain needs Authorization: Bearer "
                                                      "<HANDOFF_ADMIN_TOKEN> (at least 16 "
                                                      "characters, set in the server's environment)"})
        grace = float(os.environ.get("HANDOFF_DRAIN_GRACE_S", "5"))
        first = not HandoffOps.draining
        HandoffOps.draining = True
        if first:
            logger.warning("handoff: drain asked for: /ready is 503; SIGTERM in %.1f s", grace)
            await asyncio.sleep(grace)
            os.kill(os.getpid(), signal.SIGTERM)
        await _answer(send, 202, {"draining": True, "sigterm_after_s": grace if first else 0})

    async def _metrics(self, scope, receive, send):
        if scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        try:
            ours = await asyncio.to_thread(_connector_metrics, scope)
        except Exception as e:
            logger.debug("handoff: no connector metrics for /metrics: %s", e)
            return await self.app(scope, receive, send)
        ours = (ours if ours.endswith("\n") else ours + "\n").encode()
        # vLLM's page compressed (Prometheus asks for gzip) could not be appended to: ask for it
        # plain. A scrape is small and local; the page still goes out whole.
        scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers") or []
                                     if k.lower() != b"accept-encoding"])
        start, chunks = None, []

        async def collect(m):
            nonlocal start
            if m.get("type") == "http.response.start":
                start = m
            elif m.get("type") == "http.response.body":
                chunks.append(m.get("body", b""))
                if not m.get("more_body"):
                    body = b"".join(chunks)
                    encoded = start is not None and any(
                        k.lower() == b"content-encoding" for k, _ in start.get("headers", []))
                    if start is not None and start.get("status") == 200 and not encoded:
                        if body and not body.endswith(b"\n"):
                            body += b"\n"
                        body += ours
                    headers = [(k, v) for k, v in start.get("headers", [])
                               if k.lower() != b"content-length"]
                    headers.append((b"content-length", str(len(body)).encode()))
                    await send(dict(start, headers=headers))
                    await send({"type": "http.response.body", "body": body})
            else:
                await send(m)

        await self.app(scope, receive, collect)
