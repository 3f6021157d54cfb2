//! Fake P and D engines: axum servers on 127.0.0.1:0 that record what they receive and answer
//! as configured.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// POSTs `body` to `url` with a client that hangs up after `after`; whether it did (no answer
/// came in time).
pub async fn post_giving_up(url: &str, body: &Value, after: Duration) -> bool {
    let c = reqwest::Client::builder()
        .no_proxy()
        .timeout(after)
        .build()
        .unwrap();
    c.post(url).json(body).send().await.is_err()
}

/// Events from every fake in the order they happened ("P1", "D2", ...).
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    pub fn events(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn push(&self, s: &str) {
        self.0.lock().unwrap().push(s.to_string());
    }
}

#[derive(Clone, Debug)]
pub struct Recorded {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Recorded {
    pub fn request_id(&self) -> String {
        self.headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Prefill,
    Decode,
}

pub struct FakeState {
    pub name: String,
    kind: Kind,
    log: Log,
    pub received: Mutex<Vec<Recorded>>,
    /// The kv_transfer_params this P handed out.
    pub issued: Mutex<Vec<Value>>,
    /// Bodies of release requests answered (a release whose caller hung up before the answer
    /// is not applied, as a real P's handler dropped with its connection would not).
    pub releases: Mutex<Vec<Value>>,
    /// Delay before a release is applied and answered.
    pub release_delay_ms: AtomicU64,
    /// Status of GET /health.
    pub health: AtomicU16,
    /// Status of GET /ready.
    pub ready: AtomicU16,
    /// Status of completion answers (200 = normal).
    pub status: AtomicU16,
    /// Completions are answered 503 `draining` (a P leaving the fleet, refusing new work).
    pub draining: AtomicBool,
    /// Delay before the response head of a completion.
    pub head_delay_ms: AtomicU64,
    /// Delay before the answer to GET /health (a busy engine).
    pub health_delay_ms: AtomicU64,
    /// GET /health requests received.
    pub health_checks: AtomicU64,
    /// Delay between SSE chunks.
    pub chunk_delay_ms: AtomicU64,
    /// SSE chunks before [DONE]; 0 = endless.
    pub chunks: AtomicU64,
    /// Set when a streamed answer sent its last chunk.
    pub stream_finished: AtomicBool,
    /// Set when a streamed answer was dropped before its end (the client went away).
    pub stream_dropped: AtomicBool,
    /// Set when a completion request was dropped before its answer's head (the caller closed
    /// the connection while the fake waited `head_delay_ms`).
    pub request_dropped: AtomicBool,
    /// The answer to GET /v1/handoff/info.
    pub info: Mutex<Value>,
    /// GET /v1/handoff/info requests received.
    pub info_requests: AtomicU64,
    /// When set, completions are answered 307 to this base URL (the same path).
    pub redirect_to: Mutex<Option<String>>,
    /// When set (with `redirect_to`), GET /health is redirected too.
    pub redirect_health: AtomicBool,
    /// When set, a completion is answered 200 with a JSON body that never ends.
    pub endless_body: AtomicBool,
    /// Bytes of endless bodies produced so far (the reader pulls them).
    pub endless_bytes: AtomicU64,
    /// Set when an endless body was dropped (its reader went away).
    pub endless_dropped: AtomicBool,
}

static NEXT_HANDOFF: AtomicU64 = AtomicU64::new(1);

pub struct Fake {
    pub url: String,
    pub state: Arc<FakeState>,
    server: Mutex<Option<JoinHandle<()>>>,
}

impl Fake {
    pub async fn start(name: &str, kind: Kind, log: &Log) -> Fake {
        let state = Arc::new(FakeState {
            name: name.to_string(),
            kind,
            log: log.clone(),
            received: Mutex::new(Vec::new()),
            issued: Mutex::new(Vec::new()),
            releases: Mutex::new(Vec::new()),
            health: AtomicU16::new(200),
            ready: AtomicU16::new(200),
            status: AtomicU16::new(200),
            draining: AtomicBool::new(false),
            head_delay_ms: AtomicU64::new(0),
            health_delay_ms: AtomicU64::new(0),
            health_checks: AtomicU64::new(0),
            release_delay_ms: AtomicU64::new(0),
            chunk_delay_ms: AtomicU64::new(20),
            chunks: AtomicU64::new(3),
            stream_finished: AtomicBool::new(false),
            stream_dropped: AtomicBool::new(false),
            request_dropped: AtomicBool::new(false),
            info: Mutex::new(json!({
                "engine_id": format!("engine-{name}"),
                "remote_host": "10.1.2.3",
                "remote_port": 7100,
                "tp_size": 2,
                "block_size": 16,
                "transfer_mode": "push",
                "role": if kind == Kind::Prefill { "prefill" } else { "decode" },
            })),
            info_requests: AtomicU64::new(0),
            redirect_to: Mutex::new(None),
            redirect_health: AtomicBool::new(false),
            endless_body: AtomicBool::new(false),
            endless_bytes: AtomicU64::new(0),
            endless_dropped: AtomicBool::new(false),
        });
        let app = Router::new()
            .route("/v1/completions", post(completion))
            .route("/v1/chat/completions", post(completion))
            .route("/v1/handoff/release", post(release))
            .route("/v1/handoff/info", get(info))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/ready", get(ready))
            // No keep-alive: once the server task is aborted nothing of it is left, so `kill`
            // makes the fake truly unreachable (connection refused).
            .layer(axum::middleware::map_response(
                |mut r: Response| async move {
                    r.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    r
                },
            ))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Fake {
            url,
            state,
            server: Mutex::new(Some(server)),
        }
    }

    pub async fn prefill(name: &str, log: &Log) -> Fake {
        Self::start(name, Kind::Prefill, log).await
    }

    pub async fn decode(name: &str, log: &Log) -> Fake {
        Self::start(name, Kind::Decode, log).await
    }

    /// Stops the server: later connections are refused.
    pub async fn kill(&self) {
        let server = self.server.lock().unwrap().take();
        if let Some(server) = server {
            server.abort();
            let _ = server.await;
        }
        // Let the runtime close the listener.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    pub fn received(&self) -> Vec<Recorded> {
        self.state.received.lock().unwrap().clone()
    }

    pub fn issued(&self) -> Vec<Value> {
        self.state.issued.lock().unwrap().clone()
    }

    pub fn set_info(&self, info: Value) {
        *self.state.info.lock().unwrap() = info;
    }

    pub fn info_requests(&self) -> u64 {
        self.state.info_requests.load(Ordering::SeqCst)
    }

    pub fn releases(&self) -> Vec<Value> {
        self.state.releases.lock().unwrap().clone()
    }

    pub fn set_health(&self, status: u16) {
        self.state.health.store(status, Ordering::SeqCst);
    }

    pub fn set_health_delay(&self, d: Duration) {
        self.state
            .health_delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn health_checks(&self) -> u64 {
        self.state.health_checks.load(Ordering::SeqCst)
    }

    pub fn set_ready(&self, status: u16) {
        self.state.ready.store(status, Ordering::SeqCst);
    }

    pub fn set_draining(&self) {
        self.state.draining.store(true, Ordering::SeqCst);
    }

    pub fn set_status(&self, status: u16) {
        self.state.status.store(status, Ordering::SeqCst);
    }

    pub fn set_release_delay(&self, d: Duration) {
        self.state
            .release_delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn set_head_delay(&self, d: Duration) {
        self.state
            .head_delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Answers completions (and with `health`, GET /health) with a 307 to `url`.
    pub fn redirect_to(&self, url: &str, health: bool) {
        *self.state.redirect_to.lock().unwrap() = Some(url.to_string());
        self.state.redirect_health.store(health, Ordering::SeqCst);
    }

    /// Answers completions with a body that never ends.
    pub fn set_endless_body(&self) {
        self.state.endless_body.store(true, Ordering::SeqCst);
    }

    pub fn set_stream(&self, chunks: u64, delay: Duration) {
        self.state.chunks.store(chunks, Ordering::SeqCst);
        self.state
            .chunk_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
    }
}

fn redirect(to: &str, path: &str) -> Response {
    Response::builder()
        .status(StatusCode::TEMPORARY_REDIRECT)
        .header(header::LOCATION, format!("{to}{path}"))
        .body(Body::empty())
        .unwrap()
}

async fn ready(State(s): State<Arc<FakeState>>) -> Response {
    StatusCode::from_u16(s.ready.load(Ordering::SeqCst))
        .unwrap()
        .into_response()
}

async fn health(State(s): State<Arc<FakeState>>) -> Response {
    s.health_checks.fetch_add(1, Ordering::SeqCst);
    let delay = s.health_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if s.redirect_health.load(Ordering::SeqCst) {
        if let Some(to) = s.redirect_to.lock().unwrap().clone() {
            return redirect(&to, "/health");
        }
    }
    StatusCode::from_u16(s.health.load(Ordering::SeqCst))
        .unwrap()
        .into_response()
}

/// Marks an endless body as dropped.
struct Endless {
    s: Arc<FakeState>,
}

impl Drop for Endless {
    fn drop(&mut self) {
        self.s.endless_dropped.store(true, Ordering::SeqCst);
    }
}

/// `{"choices": [` and then 64 KiB chunks of spaces forever (valid JSON so far, never ending).
fn endless(s: Arc<FakeState>) -> Response {
    let chunk = Bytes::from(vec![b' '; 64 << 10]);
    let stream = futures_util::stream::unfold((Endless { s }, true), move |(st, first)| {
        let chunk = chunk.clone();
        async move {
            let bytes = if first {
                Bytes::from_static(b"{\"choices\": [")
            } else {
                chunk
            };
            st.s.endless_bytes
                .fetch_add(bytes.len() as u64, Ordering::SeqCst);
            Some((Ok::<_, std::io::Error>(bytes), (st, false)))
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn models(State(s): State<Arc<FakeState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "fake-model", "owned_by": s.name}]}))
}

async fn info(State(s): State<Arc<FakeState>>) -> Json<Value> {
    s.info_requests.fetch_add(1, Ordering::SeqCst);
    Json(s.info.lock().unwrap().clone())
}

/// Marks the request as dropped unless the handler reached its answer.
struct Pending {
    s: Arc<FakeState>,
    answered: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.answered {
            self.s.request_dropped.store(true, Ordering::SeqCst);
            self.s.log.push(&format!("{}:dropped", self.s.name));
        }
    }
}

async fn release(State(s): State<Arc<FakeState>>, Json(body): Json<Value>) -> Json<Value> {
    let delay = s.release_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    s.log.push(&format!("{}:release", s.name));
    s.releases.lock().unwrap().push(body);
    Json(json!({"released": true}))
}

async fn completion(
    State(s): State<Arc<FakeState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(to) = s.redirect_to.lock().unwrap().clone() {
        return redirect(&to, uri.path());
    }
    let body: Value = serde_json::from_slice(&body).unwrap();
    s.log.push(&s.name);
    s.received.lock().unwrap().push(Recorded {
        path: uri.path().to_string(),
        headers,
        body: body.clone(),
    });
    let mut pending = Pending {
        s: s.clone(),
        answered: false,
    };
    let delay = s.head_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    pending.answered = true;
    s.log.push(&format!("{}:answer", s.name));
    if s.draining.load(Ordering::SeqCst) {
        let body = json!({"error": {"message": "draining", "type": "draining", "code": 503}});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    let status = StatusCode::from_u16(s.status.load(Ordering::SeqCst)).unwrap();
    if status != StatusCode::OK {
        let msg = if status == StatusCode::SERVICE_UNAVAILABLE {
            "pool full"
        } else {
            "engine error"
        };
        return (status, Json(json!({"error": {"message": msg}}))).into_response();
    }
    if s.endless_body.load(Ordering::SeqCst) {
        return endless(s.clone());
    }
    match s.kind {
        Kind::Prefill => {
            let asked = &body["kv_transfer_params"];
            let params = if asked["transfer_mode"] == "push" || asked["layerwise"] == true {
                // A push P, or a layer-wise pull's, answers under the proxy's handoff id and
                // mode, with its info.
                let info = s.info.lock().unwrap().clone();
                json!({
                    "do_remote_prefill": true,
                    "do_remote_decode": false,
                    "remote_engine_id": info["engine_id"],
                    "remote_request_id": "p-internal-1",
                    "remote_host": info["remote_host"],
                    "remote_port": info["remote_port"],
                    "tp_size": info["tp_size"],
                    "handoff_id": asked["handoff_id"],
                    "lease_ms": 30000,
                    "epoch": 1,
                    "transfer_mode": asked["transfer_mode"],
                })
            } else {
                let n = NEXT_HANDOFF.fetch_add(1, Ordering::SeqCst);
                json!({
                    "do_remote_prefill": true,
                    "do_remote_decode": false,
                    "remote_engine_id": format!("engine-{}", s.name),
                    "remote_request_id": "p-internal-1",
                    "remote_block_ids": [[1, 2, 3]],
                    "remote_host": "127.0.0.1",
                    "remote_port": 5600,
                    "tp_size": 1,
                    "handoff_id": format!("{n:032x}"),
                    "lease_ms": 30000,
                    "epoch": 1,
                    "transfer_mode": "pull",
                })
            };
            s.issued.lock().unwrap().push(params.clone());
            Json(json!({
                "id": "cmpl-p",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": params,
            }))
            .into_response()
        }
        Kind::Decode => {
            if body.get("stream").and_then(Value::as_bool) == Some(true) {
                sse(s.clone())
            } else {
                Json(json!({
                    "id": "cmpl-d",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "decoded", "finish_reason": "length"}],
                    "served_by": s.name,
                }))
                .into_response()
            }
        }
    }
}

/// Marks the fake's stream as dropped unless it reached its end.
struct StreamState {
    s: Arc<FakeState>,
    i: u64,
    done: bool,
}

impl Drop for StreamState {
    fn drop(&mut self) {
        if !self.done {
            self.s.stream_dropped.store(true, Ordering::SeqCst);
        }
    }
}

fn sse(s: Arc<FakeState>) -> Response {
    let state = StreamState {
        s,
        i: 0,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let chunks = st.s.chunks.load(Ordering::SeqCst);
        if st.i > 0 {
            let d = st.s.chunk_delay_ms.load(Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(d)).await;
        }
        let bytes = if chunks != 0 && st.i == chunks {
            st.done = true;
            st.s.stream_finished.store(true, Ordering::SeqCst);
            "data: [DONE]\n\n".to_string()
        } else {
            let ev = json!({"choices": [{"index": 0, "text": format!("tok{}", st.i)}]});
            format!("data: {ev}\n\n")
        };
        st.i += 1;
        Some((Ok::<_, std::io::Error>(Bytes::from(bytes)), st))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap()
}
