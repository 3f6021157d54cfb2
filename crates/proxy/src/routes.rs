//! HTTP endpoints and the pull flow (the push flow is in `push.rs`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::time::{timeout, timeout_at, Instant};

use crate::error::{chain, ProxyError};
use crate::metrics::{AdminOutcome, Outcome};
use crate::pool::{InFlight, Instance, Role};
use crate::relay::{relay, Marks};
use crate::{push, Shared, TransferMode};

pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// How much of an upstream error body is read to quote it to the client.
const ERROR_BODY_CAP: usize = 16 << 10;

/// The public listener's routes. Body limits and timeouts are the listener's
/// ([`handoff_http::serve`]).
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

/// The admin listener's routes, behind the bearer token when one is configured.
pub(crate) fn admin_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/admin/instances",
            get(admin_list).post(admin_add).delete(admin_remove),
        )
        .route_layer(middleware::from_fn_with_state(shared.clone(), admin_auth))
        .with_state(shared)
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(s, "/v1/completions", headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(s, "/v1/chat/completions", headers, body).await
}

/// Counts a request's outcome once; a request whose handler is dropped (the client went away
/// before the answer's head) counts as cancelled.
struct OutcomeTracker {
    shared: Arc<Shared>,
    done: bool,
}

impl OutcomeTracker {
    fn finish(&mut self, outcome: Outcome) {
        self.done = true;
        self.shared.metrics.outcome(outcome);
    }
}

impl Drop for OutcomeTracker {
    fn drop(&mut self) {
        if !self.done {
            self.shared.metrics.outcome(Outcome::Cancelled);
        }
    }
}

async fn handle(s: Arc<Shared>, path: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let received = Instant::now();
    let rid = request_id(&headers);
    let mut tracker = OutcomeTracker {
        shared: s.clone(),
        done: false,
    };
    let result = match parse_object(&body) {
        Err(e) => Err(e),
        // Each mode is its own flow.
        Ok(client) => match s.cfg.mode {
            TransferMode::Pull => pull(&s, path, &rid, &headers, client, received).await,
            TransferMode::Push => push::push(&s, path, &rid, &headers, client, received).await,
        },
    };
    let mut resp = match result {
        Ok(resp) => {
            tracker.finish(Outcome::Ok);
            resp
        }
        Err(mut e) => {
            tracker.finish(e.outcome);
            tracing::warn!(
                request_id = %rid,
                status = e.status.as_u16(),
                prefill_released = ?e.detail.prefill_released,
                "{}",
                e.message
            );
            e.detail.request_id = Some(rid.clone());
            e.into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert(X_REQUEST_ID, v);
    }
    resp
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ProxyError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ProxyError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ProxyError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// The client's own `X-Request-Id` when it is sane (short, visible ASCII: it ends up in engine
/// request ids and logs), else a fresh random uuid-like id.
fn request_id(headers: &HeaderMap) -> String {
    if let Some(v) = headers.get(X_REQUEST_ID).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()) {
            return v.to_string();
        }
    }
    let r: u128 = rand::random();
    // Formatted as a version-4 UUID.
    let r = (r & !(0xf << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62);
    let h = format!("{r:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Headers sent to both legs: the shared request id and the client's credentials (engines may
/// check an API key, as vLLM's `--api-key` does).
pub(crate) fn forward_headers(client: &HeaderMap, rid: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(rid) {
        h.insert(X_REQUEST_ID, v);
    }
    if let Some(auth) = client.get(AUTHORIZATION) {
        h.insert(AUTHORIZATION, auth.clone());
    }
    h
}

/// The `kv_transfer_params` of the P leg, exactly as vLLM's toy proxy sends them.
pub(crate) fn prefill_leg_params() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// The P leg's body: prefill only, one sequence, one token, no stream.
pub(crate) fn prefill_leg_body(client: &Map<String, Value>) -> Value {
    let mut b = client.clone();
    b.insert("stream".into(), Value::Bool(false));
    b.insert("max_tokens".into(), json!(1));
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), json!(1));
    }
    // Only meaningful for a stream, which the P leg is not.
    b.remove("stream_options");
    // min_tokens > 1 would contradict max_tokens 1.
    b.remove("min_tokens");
    // n>1 (and best_of, which generates several sequences to keep the best) fans out on D after
    // one pull: P must produce exactly one handoff per prompt.
    b.remove("best_of");
    b.insert("n".into(), json!(1));
    b.insert("kv_transfer_params".into(), prefill_leg_params());
    Value::Object(b)
}

/// A connection refused means the instance is down: stop sending it requests now rather than at
/// its next health check (which will bring it back once it answers). A timeout does not: a busy
/// instance is not a dead one.
pub(crate) fn mark_down_if_unreachable(inst: &Instance, err: &reqwest::Error) {
    if err.is_connect() && inst.set_healthy(false) {
        tracing::warn!(
            role = %inst.role,
            url = %inst.url,
            reason = %chain(err),
            "instance unreachable; unhealthy until its next passing health check"
        );
    }
}

/// Whether P can exchange KV with one of `decodes` (`pool::compatible`).
fn has_partner(p: &Instance, decodes: &[Arc<Instance>]) -> bool {
    decodes
        .iter()
        .any(|d| crate::pool::compatible(p, d).is_ok())
}

/// Why no healthy P has a healthy D to pair with (`decodes` are the healthy ones).
fn no_pair(s: &Shared, decodes: &[Arc<Instance>]) -> ProxyError {
    if decodes.is_empty() {
        return ProxyError::no_instance(Role::Decode);
    }
    let prefills = s.prefill.healthy();
    if prefills.is_empty() {
        return ProxyError::no_instance(Role::Prefill);
    }
    let why: Vec<String> = prefills
        .iter()
        .flat_map(|p| {
            decodes
                .iter()
                .filter_map(|d| crate::pool::compatible(p, d).err())
        })
        .collect();
    ProxyError::incompatible(why.join("; "))
}

/// Picks a healthy P that some healthy D can exchange KV with (`pool::compatible`); says why
/// when there is none. Nothing has been sent to either yet.
pub(crate) fn pick_prefill(s: &Shared) -> Result<InFlight, ProxyError> {
    let decodes = s.decode.healthy();
    s.prefill
        .pick_where(s.cfg.policy, |p| has_partner(p, &decodes))
        .ok_or_else(|| {
            let e = no_pair(s, &decodes);
            tracing::warn!(reason = %e.message, "no prefill instance to send the request to");
            e
        })
}

/// Picks a healthy D that can exchange KV with P (`pool::compatible`).
pub(crate) fn pick_decode_for(s: &Shared, p: &Instance) -> Result<InFlight, ProxyError> {
    s.decode
        .pick_where(s.cfg.policy, |d| crate::pool::compatible(p, d).is_ok())
        .ok_or_else(|| ProxyError::no_instance(Role::Decode))
}

async fn pull(
    s: &Arc<Shared>,
    path: &'static str,
    rid: &str,
    headers: &HeaderMap,
    client: Map<String, Value>,
    received: Instant,
) -> Result<Response, ProxyError> {
    // A P that answers 503 `draining` took nothing: the request goes to another P, once (the
    // drained one is marked unhealthy until its health check says otherwise).
    let mut refused_by_draining = false;
    let (p, params) = loop {
        // D is checked before P is called: a prefill that no D can decode only pins P's blocks.
        let p_guard = pick_prefill(s)?;
        let p = p_guard.instance().clone();
        // A P and a D that both take a layer-wise pull (their health checks read their info) get
        // both legs at once, as in push mode: D reads each layer while P's prefill runs.
        if let Some(info) = p.handoff_info().filter(|i| i.takes_layerwise_pull()) {
            let d_guard = pick_decode_for(s, &p)?;
            let d_takes = d_guard
                .instance()
                .handoff_info()
                .is_some_and(|i| i.takes_layerwise_pull());
            if d_takes {
                let legs = push::BothLegs {
                    path,
                    rid,
                    headers,
                    received,
                    mode: TransferMode::Pull,
                };
                return push::both_legs(s, legs, client, (p_guard, info), d_guard).await;
            }
            // Picked again once P answered, as for any classic pull: holding this one through the
            // prefill would count it busy meanwhile and miss it going down.
            drop(d_guard);
        }
        let answer = prefill_leg(
            s,
            &p,
            path,
            forward_headers(headers, rid),
            &prefill_leg_body(&client),
        )
        .await;
        match answer {
            Ok(params) => break (p, params),
            Err(e) if e.is_drain_refusal() && !refused_by_draining => {
                tracing::info!(request_id = %rid, prefill = %p.url,
                    "prefill instance is draining: sending the request to another");
                p.set_healthy(false);
                refused_by_draining = true;
            }
            Err(e) => return Err(e),
        }
    };

    // From here P holds blocks for this request: every way out until D accepts it releases them.
    let mut release = ReleaseGuard::new(s.clone(), p.clone(), params.clone(), rid);
    let Ok(d_guard) = pick_decode_for(s, &p) else {
        let mut e = ProxyError::no_instance(Role::Decode);
        e.detail.prefill_released = Some(release.release_now("no healthy decode instance").await);
        return Err(e);
    };
    let d = d_guard.instance().clone();
    let stream = client.get("stream").and_then(Value::as_bool) == Some(true);
    let mut d_body = client;
    d_body.insert("kv_transfer_params".into(), params);

    let t = s.cfg.request_timeout;
    let decode_sent = Instant::now();
    s.metrics.phase("to_decode", decode_sent - received);
    let deadline = decode_sent + t;
    let send = s
        .http
        .post(format!("{}{}", d.url, path))
        .headers(forward_headers(headers, rid))
        .json(&Value::Object(d_body))
        .send();
    let resp = match timeout_at(deadline, send).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(err)) => {
            mark_down_if_unreachable(&d, &err);
            let mut e = ProxyError::transport(Role::Decode, &d.url, &err);
            e.detail.prefill_released = Some(release.release_now(&e.message).await);
            return Err(e);
        }
        Err(_) => {
            let mut e = ProxyError::timeout(Role::Decode, &d.url, "no response head", t);
            e.detail.prefill_released = Some(release.release_now(&e.message).await);
            return Err(e);
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let body = read_capped(resp, deadline).await;
        let mut e = ProxyError::upstream_status(Role::Decode, &d.url, status, &body);
        e.detail.prefill_released = Some(release.release_now(&e.message).await);
        return Err(e);
    }
    // D has accepted the request: it owns the handoff now (its connector releases P after the
    // pull, or when the request ends early).
    release.disarm();
    s.metrics.phase("decode_head", decode_sent.elapsed());
    let marks = Marks {
        received,
        decode_sent,
    };

    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let mut builder = Response::builder().status(status);
    if let Some(ct) = &content_type {
        builder = builder.header(CONTENT_TYPE, ct.clone());
    }
    if stream {
        if let Some(cc) = resp.headers().get(CACHE_CONTROL) {
            builder = builder.header(CACHE_CONTROL, cc.clone());
        }
        let sse = content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let body = Body::from_stream(relay(resp, s.clone(), d_guard, rid, sse, None, marks));
        return builder.body(body).map_err(|e| internal(e.to_string()));
    }
    let bytes = match timeout_at(deadline, read_body(resp, s.cfg.max_upstream_body_bytes)).await {
        Ok(Ok(b)) => b,
        Ok(Err(err)) => return Err(err.into_error(s, Role::Decode, &d.url)),
        Err(_) => {
            return Err(ProxyError::timeout(
                Role::Decode,
                &d.url,
                "no complete response",
                t,
            ))
        }
    };
    drop(d_guard);
    builder
        .body(Body::from(bytes))
        .map_err(|e| internal(e.to_string()))
}

pub(crate) fn internal(msg: String) -> ProxyError {
    ProxyError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        Outcome::DecodeFailed,
        "internal_error",
        msg,
    )
}

/// Sends `req` to prefill instance `p` and reads its whole answer within `t`. An unreachable
/// instance is marked down at once; `missing` says what a timeout lacked.
pub(crate) async fn call_prefill(
    s: &Shared,
    p: &Instance,
    req: reqwest::RequestBuilder,
    t: Duration,
    missing: &str,
) -> Result<(reqwest::StatusCode, Bytes), ProxyError> {
    let call = async {
        let resp = req.send().await.map_err(BodyError::Http)?;
        let status = resp.status();
        let body = read_body(resp, s.cfg.max_upstream_body_bytes).await?;
        Ok::<_, BodyError>((status, body))
    };
    match timeout(t, call).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(err)) => {
            if let BodyError::Http(e) = &err {
                mark_down_if_unreachable(p, e);
            }
            Err(err.into_error(s, Role::Prefill, &p.url))
        }
        Err(_) => Err(ProxyError::timeout(Role::Prefill, &p.url, missing, t)),
    }
}

/// Why an upstream answer's body could not be had.
pub(crate) enum BodyError {
    Http(reqwest::Error),
    /// Longer than `max_upstream_body_bytes` (the cap).
    TooLarge(usize),
}

impl BodyError {
    /// The client's error (502 for a body over the cap, counted), naming the instance.
    pub(crate) fn into_error(self, s: &Shared, role: Role, url: &str) -> ProxyError {
        match self {
            BodyError::Http(e) => ProxyError::transport(role, url, &e),
            BodyError::TooLarge(cap) => {
                s.metrics.upstream_too_large(role.as_str());
                ProxyError::upstream(
                    role,
                    url,
                    StatusCode::BAD_GATEWAY,
                    "upstream_body_too_large",
                    format!(
                        "answered with a body over {cap} bytes (max_upstream_body_bytes); \
                         it was not read further"
                    ),
                )
            }
        }
    }
}

/// Reads an upstream answer's whole body, but never more than `cap` bytes: one that says (or
/// turns out) to be longer is dropped, closing the connection.
pub(crate) async fn read_body(mut resp: reqwest::Response, cap: usize) -> Result<Bytes, BodyError> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(BodyError::TooLarge(cap));
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(BodyError::Http)? {
        if out.len() + chunk.len() > cap {
            return Err(BodyError::TooLarge(cap));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

/// The P leg (pull's leg 1, push's concurrent leg): POSTs `body` to P within `request_timeout`
/// and returns P's `kv_transfer_params`.
pub(crate) async fn prefill_leg(
    s: &Shared,
    p: &Instance,
    path: &str,
    headers: HeaderMap,
    body: &Value,
) -> Result<Value, ProxyError> {
    let t = s.cfg.request_timeout;
    let started = Instant::now();
    let req = s
        .http
        .post(format!("{}{}", p.url, path))
        .headers(headers)
        .json(body);
    let (status, body) = call_prefill(s, p, req, t, "no complete response").await?;
    s.metrics.phase("prefill_leg", started.elapsed());
    if !status.is_success() {
        return Err(ProxyError::upstream_status(
            Role::Prefill,
            &p.url,
            status,
            &body,
        ));
    }
    let bad = |reason: String| {
        ProxyError::upstream(
            Role::Prefill,
            &p.url,
            StatusCode::BAD_GATEWAY,
            "bad_prefill_response",
            reason,
        )
    };
    let json: Value = serde_json::from_slice(&body)
        .map_err(|e| bad(format!("answered with invalid JSON: {e}")))?;
    match json.get("kv_transfer_params") {
        Some(params @ Value::Object(_)) => Ok(params.clone()),
        Some(Value::Null) | None => Err(bad(
            "answered without kv_transfer_params (it kept no KV for a remote decode)".into(),
        )),
        Some(other) => Err(bad(format!(
            "answered with kv_transfer_params that are not an object: {other}"
        ))),
    }
}

/// Reads at most [`ERROR_BODY_CAP`] bytes of an error answer, before `deadline`; best effort.
pub(crate) async fn read_capped(mut resp: reqwest::Response, deadline: Instant) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < ERROR_BODY_CAP {
        match timeout_at(deadline, resp.chunk()).await {
            Ok(Ok(Some(c))) => out.extend_from_slice(&c),
            _ => break,
        }
    }
    out.truncate(ERROR_BODY_CAP);
    out
}

/// Tells P to release a handoff that D never got. Armed from the moment P answered (pull) or the
/// legs were sent (push); disarmed once D accepted. On an error path the flow calls
/// [`ReleaseGuard::release_now`] and awaits it; the release runs in a task of its own, so a
/// client that goes away meanwhile (the handler future is dropped) does not cancel it. Dropped
/// while armed (the client left before D answered), it sends the release from a task.
pub(crate) struct ReleaseGuard {
    shared: Arc<Shared>,
    p: Arc<Instance>,
    params: Value,
    rid: String,
    armed: bool,
}

impl ReleaseGuard {
    pub(crate) fn new(shared: Arc<Shared>, p: Arc<Instance>, params: Value, rid: &str) -> Self {
        ReleaseGuard {
            shared,
            p,
            params,
            rid: rid.to_string(),
            armed: true,
        }
    }

    /// The params the release will carry (push: P's own, once it answered).
    pub(crate) fn set_params(&mut self, params: Value) {
        self.params = params;
    }

    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    pub(crate) async fn release_now(&mut self, reason: &str) -> bool {
        self.armed = false;
        release_detached(release(
            self.shared.clone(),
            self.p.clone(),
            self.params.clone(),
            self.rid.clone(),
            reason.to_string(),
        ))
        .await
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(release(
                self.shared.clone(),
                self.p.clone(),
                std::mem::take(&mut self.params),
                std::mem::take(&mut self.rid),
                "client went away before decode answered".into(),
            ));
        }
    }
}

/// Runs a release in a task of its own and waits for its answer. Once the flow has decided to
/// release, the client going away (the handler future dropped mid-call) must not cancel the
/// call: P would keep the blocks until its lease ran out.
pub(crate) async fn release_detached(call: impl Future<Output = bool> + Send + 'static) -> bool {
    tokio::spawn(call).await.unwrap_or(false)
}

/// POST `{P}/v1/handoff/release` with `{"kv_transfer_params": params}`, within `release_timeout`.
/// Returns whether P acknowledged it; a failure is logged and counted, nothing more can be done
/// (P's lease will reclaim the blocks).
pub(crate) async fn release(
    s: Arc<Shared>,
    p: Arc<Instance>,
    params: Value,
    rid: String,
    reason: String,
) -> bool {
    let handoff_id = params
        .get("handoff_id")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string();
    let t = s.cfg.release_timeout;
    let url = format!("{}/v1/handoff/release", p.url);
    let call = s
        .http
        .post(&url)
        .header(X_REQUEST_ID, rid.as_str())
        .json(&json!({ "kv_transfer_params": params }))
        .timeout(t)
        .send();
    let failure = match timeout(t, call).await {
        Ok(Ok(resp)) if resp.status().is_success() => None,
        Ok(Ok(resp)) => Some(format!("HTTP {}", resp.status())),
        Ok(Err(e)) => Some(chain(&e)),
        Err(_) => Some(format!("no answer within {t:?}")),
    };
    s.metrics.release(failure.is_none());
    match failure {
        None => {
            tracing::info!(request_id = %rid, prefill = %p.url, %handoff_id, %reason, "released prefill blocks");
            true
        }
        Some(why) => {
            tracing::error!(
                request_id = %rid, prefill = %p.url, %handoff_id, %reason, error = %why,
                "could not release prefill blocks; P's lease will reclaim them"
            );
            false
        }
    }
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    let Some(guard) = s.decode.pick(s.cfg.policy) else {
        return ProxyError::no_instance(Role::Decode).into_response();
    };
    let d = guard.instance();
    let t = s.cfg.request_timeout;
    let call = async {
        let resp = s
            .http
            .get(format!("{}/v1/models", d.url))
            .timeout(t)
            .send()
            .await
            .map_err(BodyError::Http)?;
        let status = resp.status();
        let ct = resp.headers().get(CONTENT_TYPE).cloned();
        let body = read_body(resp, s.cfg.max_upstream_body_bytes).await?;
        Ok::<_, BodyError>((status, ct, body))
    };
    match call.await {
        Ok((status, ct, body)) if status.is_success() => {
            let mut resp = (status, body).into_response();
            if let Some(ct) = ct {
                resp.headers_mut().insert(CONTENT_TYPE, ct);
            }
            resp
        }
        Ok((status, _, body)) => {
            ProxyError::upstream_status(Role::Decode, &d.url, status, &body).into_response()
        }
        Err(err) => {
            if let BodyError::Http(e) = &err {
                mark_down_if_unreachable(d, e);
            }
            err.into_error(&s, Role::Decode, &d.url).into_response()
        }
    }
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    let p = s.prefill.healthy_count();
    let d = s.decode.healthy_count();
    let ok = p > 0 && d > 0;
    let body = json!({
        "status": if ok { "ok" } else { "unavailable" },
        "prefill": {"healthy": p, "total": s.prefill.snapshot().len()},
        "decode": {"healthy": d, "total": s.decode.snapshot().len()},
    });
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

/// Readiness: the proxy can route a request now (a healthy, ready P with a healthy, ready D it
/// can exchange KV with). 503 says why not.
async fn ready(State(s): State<Arc<Shared>>) -> Response {
    // Asked, not picked: a probe must not move the round-robin or count a request in flight.
    let decodes = s.decode.healthy();
    if s.prefill.healthy().iter().any(|p| has_partner(p, &decodes)) {
        return (StatusCode::OK, Json(json!({"ready": true}))).into_response();
    }
    let e = no_pair(&s, &decodes);
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"ready": false, "reason": e.message})),
    )
        .into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct InstanceBody {
    role: Role,
    url: String,
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let v = headers.get(AUTHORIZATION)?.as_bytes();
    let (scheme, token) = v.split_at(v.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    Some(token.trim_ascii())
}

/// Lets an admin request through only with the configured bearer token (any request when none
/// is configured: the listener is then loopback only, see `start`).
async fn admin_auth(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    if let Some(token) = &s.cfg.admin_token {
        let why = match bearer(req.headers()) {
            None => Some("no Authorization: Bearer token"),
            Some(t) if !token.matches(t) => Some("a wrong bearer token"),
            Some(_) => None,
        };
        if let Some(why) = why {
            s.metrics.admin(AdminOutcome::Unauthorized);
            tracing::warn!(method = %req.method(), path = %req.uri().path(), "admin request refused: {why}");
            let mut e = ProxyError::bad_request(format!("admin request refused: {why}"));
            e.status = StatusCode::UNAUTHORIZED;
            e.kind = "unauthorized";
            let mut resp = e.into_response();
            resp.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"handoff-proxy-admin\""),
            );
            return resp;
        }
    }
    next.run(req).await
}

fn parse_instance(s: &Shared, body: &[u8]) -> Result<InstanceBody, ProxyError> {
    serde_json::from_slice(body).map_err(|e| {
        s.metrics.admin(AdminOutcome::BadRequest);
        ProxyError::bad_request(format!(
            "expected {{\"role\": \"prefill\"|\"decode\", \"url\": \"http://host:port\"}}: {e}"
        ))
    })
}

async fn admin_list(State(s): State<Arc<Shared>>) -> Response {
    s.metrics.admin(AdminOutcome::Ok);
    Json(json!({
        "prefill": s.instances(Role::Prefill),
        "decode": s.instances(Role::Decode),
        "policy": s.cfg.policy,
        "mode": s.cfg.mode,
    }))
    .into_response()
}

async fn admin_add(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let req = match parse_instance(&s, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match s.add_instance(req.role, &req.url).await {
        Ok((added, info)) => {
            s.metrics.admin(AdminOutcome::Ok);
            let status = if added {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            (status, Json(json!({"added": added, "instance": info}))).into_response()
        }
        Err(msg) => {
            s.metrics.admin(AdminOutcome::BadRequest);
            tracing::warn!(role = %req.role, "admin: instance refused: {msg}");
            ProxyError::bad_request(msg).into_response()
        }
    }
}

async fn admin_remove(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let req = match parse_instance(&s, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if s.remove_instance(req.role, &req.url) {
        s.metrics.admin(AdminOutcome::Ok);
        Json(json!({"removed": true})).into_response()
    } else {
        s.metrics.admin(AdminOutcome::NotFound);
        let mut e = ProxyError::bad_request(format!(
            "no {} instance {} to remove",
            req.role,
            req.url.trim()
        ));
        e.status = StatusCode::NOT_FOUND;
        e.kind = "not_found";
        e.into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_leg_body_transforms_the_request() {
        let client = json!({
            "model": "m", "prompt": "hi", "stream": true, "max_tokens": 50,
            "max_completion_tokens": 60, "stream_options": {"include_usage": true},
            "min_tokens": 5, "n": 3, "best_of": 4, "temperature": 0.5,
            "kv_transfer_params": {"do_remote_prefill": true}
        });
        let b = prefill_leg_body(client.as_object().unwrap());
        assert_eq!(
            b,
            json!({
                "model": "m", "prompt": "hi", "stream": false, "max_tokens": 1,
                "max_completion_tokens": 1, "n": 1, "temperature": 0.5,
                "kv_transfer_params": {
                    "do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null,
                    "remote_host": null, "remote_port": null
                }
            })
        );
        // max_completion_tokens only when the client used it.
        let b = prefill_leg_body(json!({"prompt": "x"}).as_object().unwrap());
        assert!(b.get("max_completion_tokens").is_none());
        assert_eq!(b["max_tokens"], 1);
    }

    #[test]
    fn request_ids() {
        let mut h = HeaderMap::new();
        let id = request_id(&h);
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert_ne!(id, request_id(&h));
        h.insert(X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(request_id(&h), "abc-123");
        h.insert(X_REQUEST_ID, HeaderValue::from_static("has space"));
        assert_ne!(request_id(&h), "has space");
    }
}
