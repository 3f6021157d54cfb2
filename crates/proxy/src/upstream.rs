//! Calls to the engines, in one place: which P and D a request goes to, the P leg, D's leg,
//! the bodies and headers each gets, reading their answers within bounds, and the release that
//! tells P to give back blocks no D took. The pull flow (`routes.rs`) and the push flow
//! (`both_legs.rs`) are built from these; neither calls the other.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Map, Value};
use tokio::time::{timeout, timeout_at, Instant};

use crate::error::{chain, snippet, ErrorKind, ProxyError};
use crate::info::EngineInfo;
use crate::metrics::Outcome;
use crate::pool::{InFlight, Instance, Role};
use crate::Shared;

pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// How much of an upstream error body is read to quote it to the client.
const ERROR_BODY_CAP: usize = 16 << 10;

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
pub(crate) fn has_partner(p: &Instance, decodes: &[Arc<Instance>]) -> bool {
    decodes
        .iter()
        .any(|d| crate::pool::compatible(p, d).is_ok())
}

/// Why no healthy P has a healthy D to pair with (`decodes` are the healthy ones).
pub(crate) fn no_pair(s: &Shared, decodes: &[Arc<Instance>]) -> ProxyError {
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

pub(crate) fn internal(msg: String) -> ProxyError {
    ProxyError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        Outcome::DecodeFailed,
        ErrorKind::InternalError,
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
                    ErrorKind::UpstreamBodyTooLarge,
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
    let bad = |reason: String| ProxyError::bad_prefill_response(&p.url, reason);
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

/// GETs `{P}/v1/handoff/info` within `t` and checks that P can serve this proxy's mode.
pub(crate) async fn fetch_info(
    s: &Shared,
    p: &Instance,
    t: Duration,
) -> Result<EngineInfo, ProxyError> {
    let mode = s.cfg.mode;
    let req = s.http.get(format!("{}/v1/handoff/info", p.url)).timeout(t);
    let (status, body) = call_prefill(s, p, req, t, "no answer to GET /v1/handoff/info").await?;
    let bad = |reason: String| {
        ProxyError::upstream(
            Role::Prefill,
            &p.url,
            StatusCode::BAD_GATEWAY,
            ErrorKind::BadPrefillInfo,
            reason,
        )
    };
    if !status.is_success() {
        return Err(bad(format!(
            "answered GET /v1/handoff/info with HTTP {status}: {}",
            snippet(&body)
        )));
    }
    let info: EngineInfo = serde_json::from_slice(&body).map_err(|e| {
        bad(format!(
            "answered GET /v1/handoff/info with unusable JSON: {e}"
        ))
    })?;
    // Push and pull peers cannot pair (vLLM hashes the mode into its compatibility check too):
    // better to refuse here than to leave D waiting for writes that never come.
    if info.transfer_mode.is_some_and(|m| m != mode) {
        return Err(bad(format!(
            "is in {} mode and this proxy runs {}: push and pull engines cannot pair",
            info.transfer_mode.unwrap_or_default().as_str(),
            mode.as_str()
        )));
    }
    if info.role.as_deref() == Some("decode") {
        return Err(bad("is a decode-only engine: it cannot prefill".into()));
    }
    Ok(info)
}

/// Caches P's info, logging it when it is new or changed (a restarted P has a new engine id).
pub(crate) fn store_info(p: &Instance, info: EngineInfo) {
    let info = Arc::new(info);
    let old = p.set_handoff_info(Some(info.clone()));
    if old.as_deref() != Some(&*info) {
        tracing::info!(
            prefill = %p.url,
            engine_id = %info.engine_id,
            side_channel = %format!("{}:{}", info.remote_host, info.remote_port),
            tp_size = info.tp_size,
            block_size = ?info.block_size,
            role = ?info.role,
            layerwise_pull = info.takes_layerwise_pull(),
            "prefill handoff info"
        );
    }
}

/// D's leg: the client's request, with the handoff's params in it, POSTed to D. The caller
/// awaits the answer's head within its deadline (the push flow watches P's leg meanwhile).
pub(crate) fn send_decode(
    s: &Shared,
    d: &Instance,
    path: &str,
    headers: HeaderMap,
    body: Map<String, Value>,
) -> impl Future<Output = reqwest::Result<reqwest::Response>> {
    s.http
        .post(format!("{}{}", d.url, path))
        .headers(headers)
        .json(&Value::Object(body))
        .send()
}

/// The head of the client's answer from D's: its status and content type, and for a stream its
/// cache control; and whether D streams server-sent events (relayed event by event).
pub(crate) fn answer_head(
    resp: &reqwest::Response,
    stream: bool,
) -> (axum::http::response::Builder, bool) {
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let mut builder = Response::builder().status(resp.status());
    if let Some(ct) = &content_type {
        builder = builder.header(CONTENT_TYPE, ct.clone());
    }
    if stream {
        if let Some(cc) = resp.headers().get(CACHE_CONTROL) {
            builder = builder.header(CACHE_CONTROL, cc.clone());
        }
    }
    let sse = stream
        && content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
    (builder, sse)
}
