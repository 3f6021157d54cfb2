//! The OpenAI-compatible HTTP API, accepting and returning vLLM's `kv_transfer_params`.
// Handler helpers return `Result<_, Response>`: the error *is* the HTTP answer, and boxing it
// would only move the allocation.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use handoff_connector::{Connector, Hooks};
use handoff_proto::KvTransferParams;
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::model;
use crate::scheduler::{Command, Kind, SeqEvent, Submission};

pub struct ApiState {
    pub model: String,
    pub role: handoff_connector::Role,
    pub scheduler: Arc<Mutex<Sender<Command>>>,
    pub connector: Option<Arc<Connector>>,
    pub(crate) drain: Arc<crate::drain::Drain>,
    pub registry: Arc<Mutex<Registry>>,
    pub next_id: AtomicU64,
}

pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/handoff/release", post(release))
        .route("/v1/handoff/info", get(info))
        .with_state(state)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    (
        status,
        Json(json!({"error": {"message": message, "type": "handoff_error", "code": status.as_u16()}})),
    )
        .into_response()
}

/// 503 for a request that arrives while the engine drains: another instance takes it.
fn draining() -> Response {
    let body = json!({"error": {"message": "this engine is draining: send the request to another instance",
        "type": "draining", "code": 503}});
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [("retry-after", "1")],
        Json(body),
    )
        .into_response()
}

async fn models(State(s): State<Arc<ApiState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.model, "object": "model", "owned_by": "handoff"}]}),
    )
}

/// Readiness, as Kubernetes and routers mean it: this engine takes work now. It is not
/// draining, its scheduler thread takes commands and its connector (if it has one) runs;
/// `/health` only says the HTTP server answers.
async fn ready(State(s): State<Arc<ApiState>>) -> Response {
    let draining = s.drain.begun();
    let scheduler = s.scheduler.lock().send(Command::Wake).is_ok();
    let connector = s.connector.as_ref().map_or(true, |c| c.is_running());
    let ready = scheduler && connector && !draining;
    let body = json!({"ready": ready, "draining": draining, "scheduler": scheduler,
        "connector": connector});
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn health(State(s): State<Arc<ApiState>>) -> Response {
    let Some(c) = s.connector.as_ref() else {
        return Json(json!({
            "status": "ok",
            "held_blocks": null,
            "prefill_blocks_held_for": {},
            "staged_messages": null,
        }))
        .into_response();
    };
    let snapshot = (|| {
        Ok::<_, handoff_connector::ConnectorError>((
            c.held_blocks()?,
            c.held_blocks_by_engine()?,
            c.staged_messages()?,
        ))
    })();
    match snapshot {
        Ok(((p, d), by_engine, staged)) => {
            let by_engine: serde_json::Map<String, Value> =
                by_engine.into_iter().map(|(e, n)| (e, json!(n))).collect();
            Json(json!({
                "status": "ok",
                "held_blocks": {"prefill": p, "decode": d},
                "prefill_blocks_held_for": by_engine,
                "staged_messages": staged,
            }))
            .into_response()
        }
        // The thread that owns the connector's state is gone: nothing it held can be told.
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "connector stopped", "error": e.to_string()})),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<Arc<ApiState>>) -> Response {
    if let Some(c) = &s.connector {
        c.refresh_metrics();
    }
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &s.registry.lock()) {
        return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    }
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

async fn info(State(s): State<Arc<ApiState>>) -> Response {
    match &s.connector {
        Some(c) => Json(c.info()).into_response(),
        None => error(StatusCode::NOT_FOUND, "this engine has no connector"),
    }
}

async fn release(State(s): State<Arc<ApiState>>, body: Json<Value>) -> Response {
    let Some(c) = &s.connector else {
        return error(StatusCode::BAD_REQUEST, "this engine holds no handoffs");
    };
    let Some(v) = body.get("kv_transfer_params") else {
        return error(StatusCode::BAD_REQUEST, "missing kv_transfer_params");
    };
    let params = match KvTransferParams::from_json(v) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    match c.release_from_proxy(&params) {
        Ok(()) => Json(json!({"released": true})).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// The parts of a completion request the engine uses.
struct Parsed {
    prompt: Vec<u32>,
    max_tokens: u32,
    n: u32,
    stream: bool,
    kind: Kind,
    request_id: String,
}

fn parse(
    s: &ApiState,
    body: &Value,
    headers: &HeaderMap,
    prompt_text: String,
) -> Result<Parsed, Response> {
    let get_u32 = |k: &str, default: u32, max: u32| -> Result<u32, Response> {
        match body.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|x| *x >= 1 && *x <= max as u64)
                .map(|x| x as u32)
                .ok_or_else(|| {
                    error(
                        StatusCode::BAD_REQUEST,
                        format!("`{k}` must be an integer in 1..={max}"),
                    )
                }),
        }
    };
    let max_tokens = match body.get("max_completion_tokens") {
        Some(v) if !v.is_null() => get_u32("max_completion_tokens", 16, 1 << 20)?,
        _ => get_u32("max_tokens", 16, 1 << 20)?,
    };
    let n = get_u32("n", 1, 64)?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let params = match body.get("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            KvTransferParams::from_json(v)
                .map_err(|e| error(StatusCode::BAD_REQUEST, e.to_string()))?,
        ),
    };
    let kind = match params {
        Some(p) if p.do_remote_prefill => {
            if s.role == handoff_connector::Role::Prefill {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "a prefill engine cannot decode a remote prefill",
                ));
            }
            Kind::RemotePrefill(Box::new(p))
        }
        Some(p) if p.do_remote_decode => {
            if s.role == handoff_connector::Role::Decode {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "a decode engine cannot prefill for a remote decode",
                ));
            }
            // n>1 (vllm-router and vLLM's toy proxy pass the client's n to P unchanged): one
            // prefill, one handoff; the answer has n choices, and D fans out after one pull.
            Kind::RemoteDecode(Some(Box::new(p)))
        }
        _ => Kind::Local,
    };
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| format!("cmpl-{}", s.next_id.fetch_add(1, Ordering::Relaxed)));
    Ok(Parsed {
        prompt: model::tokenize(&prompt_text),
        max_tokens,
        n,
        stream,
        kind,
        request_id,
    })
}

fn prompt_of_completion(body: &Value) -> Result<String, Response> {
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(a[0].as_str().unwrap_or_default().to_string())
        }
        _ => Err(error(StatusCode::BAD_REQUEST, "`prompt` must be a string")),
    }
}

fn prompt_of_chat(body: &Value) -> Result<String, Response> {
    let Some(Value::Array(msgs)) = body.get("messages") else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "`messages` must be an array",
        ));
    };
    let mut text = String::new();
    for m in msgs {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(" "),
            _ => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "message `content` must be text",
                ))
            }
        };
        text.push_str(&format!("<{role}> {content} "));
    }
    Ok(text)
}

async fn completions(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let prompt = match prompt_of_completion(&body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    serve(s, headers, body, prompt, false).await
}

async fn chat_completions(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let prompt = match prompt_of_chat(&body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    serve(s, headers, body, prompt, true).await
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn serve(
    s: Arc<ApiState>,
    headers: HeaderMap,
    body: Value,
    prompt: String,
    chat: bool,
) -> Response {
    let p = match parse(&s, &body, &headers, prompt) {
        Ok(p) => p,
        Err(r) => {
            // Refused before admission: if this was a remote prefill, P must release now.
            if let (Some(c), Some(v)) = (&s.connector, body.get("kv_transfer_params")) {
                if v.get("do_remote_prefill").and_then(Value::as_bool) == Some(true) {
                    if let Some(target) = KvTransferParams::release_target(v) {
                        if let Err(e) = c.reject(&target) {
                            tracing::warn!(error = %e, "could not tell P of a refused remote prefill");
                        }
                    }
                }
            }
            return r;
        }
    };
    let (tx, rx) = unbounded_channel();
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let (n, stream_out, request_id) = (p.n, p.stream, p.request_id.clone());
    let sub = Submission {
        id,
        external_id: p.request_id,
        prompt: p.prompt,
        max_tokens: p.max_tokens,
        n: p.n,
        kind: p.kind,
        events: tx,
    };
    {
        // Under the queue's lock: a drain that has looked at the queue sees every request that
        // got past this check (`drain::run`).
        let queue = s.scheduler.lock();
        if s.drain.refusing() {
            drop(queue);
            if let (Some(c), Kind::RemotePrefill(params)) = (&s.connector, &sub.kind) {
                // D refuses before admission: P must not wait out a lease for it.
                if let Err(e) = c.reject(params) {
                    tracing::warn!(error = %e, "could not tell P of a refused remote prefill");
                }
            }
            return draining();
        }
        if queue.send(Command::Submit(sub)).is_err() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "engine is shutting down");
        }
    }
    let model = s.model.clone();
    if stream_out {
        stream_response(rx, model, request_id, chat).await
    } else {
        collect_response(rx, model, request_id, n, chat).await
    }
}

async fn collect_response(
    mut rx: UnboundedReceiver<SeqEvent>,
    model: String,
    id: String,
    n: u32,
    chat: bool,
) -> Response {
    let mut texts = vec![String::new(); n as usize];
    let mut finish = vec![Value::Null; n as usize];
    let mut params = None;
    let mut usage = json!(null);
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { choice, text } => {
                if let Some(t) = texts.get_mut(choice as usize) {
                    t.push_str(&text);
                }
            }
            SeqEvent::Finished { choice, reason } => {
                if let Some(f) = finish.get_mut(choice as usize) {
                    *f = json!(reason);
                }
            }
            SeqEvent::KvParams(p) => params = Some(p.to_json()),
            SeqEvent::Error { status, message } => {
                return error(
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    message,
                )
            }
            SeqEvent::Done {
                prompt_tokens,
                completion_tokens,
            } => {
                usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                break;
            }
        }
    }
    if usage.is_null() {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine dropped the request",
        );
    }
    let choices: Vec<Value> = texts
        .into_iter()
        .zip(finish)
        .enumerate()
        .map(|(i, (text, f))| {
            if chat {
                json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": f})
            } else {
                json!({"index": i, "text": text, "finish_reason": f, "logprobs": null})
            }
        })
        .collect();
    let mut out = json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": now_secs(),
        "model": model,
        "choices": choices,
        "usage": usage,
    });
    if let Some(p) = params {
        out["kv_transfer_params"] = p;
    }
    Json(out).into_response()
}

async fn stream_response(
    mut rx: UnboundedReceiver<SeqEvent>,
    model: String,
    id: String,
    chat: bool,
) -> Response {
    // An error before the first token is an HTTP error, not a stream (the proxy must see it).
    let first = match rx.recv().await {
        Some(SeqEvent::Error { status, message }) => {
            return error(
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                message,
            )
        }
        Some(ev) => ev,
        None => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine dropped the request",
            )
        }
    };
    let created = now_secs();
    let chunk = move |ev: &SeqEvent| -> Option<Value> {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let choice = match ev {
            SeqEvent::Token { choice, text } => {
                if chat {
                    json!({"index": choice, "delta": {"content": text}, "finish_reason": null})
                } else {
                    json!({"index": choice, "text": text, "finish_reason": null})
                }
            }
            SeqEvent::Finished { choice, reason } => {
                if chat {
                    json!({"index": choice, "delta": {}, "finish_reason": reason})
                } else {
                    json!({"index": choice, "text": "", "finish_reason": reason})
                }
            }
            // A streamed P leg: the handoff's params in a chunk of their own (no choice, as a
            // usage chunk), so whoever asked can hand them to D; left out, P's blocks would
            // wait out the lease for a D that never comes.
            SeqEvent::KvParams(p) => {
                return Some(json!({"id": id, "object": object, "created": created,
                    "model": model, "choices": [], "kv_transfer_params": p.to_json()}))
            }
            _ => return None,
        };
        Some(
            json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]}),
        )
    };
    let events = stream::unfold((Some(first), rx, false), move |(pending, mut rx, done)| {
        let chunk = chunk.clone();
        async move {
            if done {
                return None;
            }
            let mut ev = match pending {
                Some(e) => e,
                None => rx.recv().await?,
            };
            loop {
                match &ev {
                    SeqEvent::Done { .. } => {
                        return Some((
                            Ok::<Event, Infallible>(Event::default().data("[DONE]")),
                            (None, rx, true),
                        ))
                    }
                    SeqEvent::Error { message, .. } => {
                        let e = json!({"error": {"message": message}});
                        return Some((Ok(Event::default().data(e.to_string())), (None, rx, true)));
                    }
                    other => {
                        if let Some(v) = chunk(other) {
                            return Some((
                                Ok(Event::default().data(v.to_string())),
                                (None, rx, false),
                            ));
                        }
                    }
                }
                ev = rx.recv().await?;
            }
        }
    });
    sse(events)
}

fn sse(events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static) -> Response {
    Sse::new(events).into_response()
}
