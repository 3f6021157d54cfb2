//! HTTP endpoints and the pull flow (push and layer-wise pull, both legs at once, are in `both_legs.rs`).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::time::{timeout_at, Instant};

use crate::error::{ErrorKind, ProxyError};
use crate::metrics::{AdminOutcome, Outcome};
use crate::pool::Role;
use crate::relay::{relay, Marks};
use crate::upstream::{
    answer_head, forward_headers, has_partner, internal, mark_down_if_unreachable, no_pair,
    pick_decode_for, pick_prefill, prefill_leg, prefill_leg_body, read_body, read_capped,
    send_decode, BodyError, ReleaseGuard, X_REQUEST_ID,
};
use crate::{both_legs, Shared, TransferMode};

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
            TransferMode::Push => both_legs::push(&s, path, &rid, &headers, client, received).await,
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
                let legs = both_legs::BothLegs {
                    path,
                    rid,
                    headers,
                    received,
                    flow: handoff_proto::Flow::LayerwisePull,
                };
                return both_legs::both_legs(s, legs, client, (p_guard, info), d_guard).await;
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
    let send = send_decode(s, &d, path, forward_headers(headers, rid), d_body);
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

    let (builder, sse) = answer_head(&resp, stream);
    if stream {
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
            e.kind = ErrorKind::Unauthorized;
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
        Err(e) => {
            s.metrics.admin(AdminOutcome::BadRequest);
            tracing::warn!(role = %req.role, "admin: instance refused: {e}");
            ProxyError::bad_request(e.to_string()).into_response()
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
        e.kind = ErrorKind::NotFound;
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
