//! Drain: how an engine leaves a fleet without stranding a block or failing a request. Asked
//! for by SIGTERM or by an authenticated `POST /drain` on the admin listener (a Kubernetes
//! `preStop` hook), it goes through three phases:
//!
//! 1. **grace** (`drain_grace_ms`): readiness answers 503 while new requests are still taken,
//!    so that routers, which poll readiness, stop sending before anything is refused;
//! 2. **refusing**: new requests get 503 `draining` with `Retry-After` (a D refusing a remote
//!    prefill tells its P to release at once); what is queued, awaited or decoded goes on, and
//!    every handoff P holds is served until it ends (pulled, released, or its lease and fence
//!    over) — a push P finishes the writes it was granted;
//! 3. **done**: once nothing is in flight and every block is back in the pool, or when
//!    `drain_timeout_ms` (counted from the start) has passed; the engine then stops.
//!
//! The check is a poll of the scheduler and the connector, not a hook in either: draining
//! changes nothing in how a handoff ends, only whether new ones start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use handoff_connector::Connector;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::json;
use subtle::ConstantTimeEq;
use tokio::sync::{watch, Notify};

use crate::scheduler::Command;

/// What a finished drain says (logged, answered to `POST /drain?wait=true`, and read by tests
/// and `handoff demo --drain`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainReport {
    /// From the drain's start to its end.
    pub drain_s: f64,
    /// The deadline passed with work left: what is counted below was cut off.
    pub timed_out: bool,
    /// Blocks the connector still held for handoffs (P and D side) at the end.
    pub handoff_blocks_left: usize,
    /// Blocks still out of the engine's pool at the end (0 for a clean drain).
    pub pool_blocks_left: usize,
}

/// The drain state shared by the HTTP API, the admin listener, the signal handler and the drain
/// task.
pub(crate) struct Drain {
    begun: AtomicBool,
    /// Readiness is false from the start of the drain.
    refusing: AtomicBool,
    started: Mutex<Option<Instant>>,
    wake: Notify,
    report: watch::Sender<Option<DrainReport>>,
}

impl Drain {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Drain {
            begun: AtomicBool::new(false),
            refusing: AtomicBool::new(false),
            started: Mutex::new(None),
            wake: Notify::new(),
            report: watch::Sender::new(None),
        })
    }

    /// Starts the drain (a second call changes nothing).
    pub(crate) fn begin(&self, why: &str) {
        if !self.begun.swap(true, Ordering::SeqCst) {
            *self.started.lock() = Some(Instant::now());
            tracing::info!(%why, "draining: readiness is false, new requests will be refused");
            self.wake.notify_one();
        }
    }

    pub(crate) fn begun(&self) -> bool {
        self.begun.load(Ordering::SeqCst)
    }

    /// Whether new requests are refused. Read under the scheduler's lock by the API, and set
    /// under it by the drain, so no request slips in after the drain last looked.
    pub(crate) fn refusing(&self) -> bool {
        self.refusing.load(Ordering::SeqCst)
    }

    /// Resolves when a drain has been asked for.
    pub(crate) async fn requested(&self) {
        if !self.begun() {
            self.wake.notified().await;
        }
    }

    /// Resolves with the report once the drain is over.
    pub(crate) async fn finished(&self) -> DrainReport {
        let mut rx = self.report.subscribe();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return r;
            }
            if rx.changed().await.is_err() {
                // The sender lives in `self`: unreachable while `self` is borrowed.
                return DrainReport {
                    drain_s: 0.0,
                    timed_out: true,
                    handoff_blocks_left: 0,
                    pool_blocks_left: 0,
                };
            }
        }
    }

    fn status(&self) -> serde_json::Value {
        let elapsed = self.started.lock().map(|t| t.elapsed().as_secs_f64());
        json!({
            "draining": self.begun(),
            "refusing": self.refusing(),
            "elapsed_s": elapsed,
            "report": *self.report.borrow(),
        })
    }
}

/// What the drain task needs of the engine.
pub(crate) struct Engine {
    pub(crate) scheduler: Arc<Mutex<std::sync::mpsc::Sender<Command>>>,
    pub(crate) connector: Option<Arc<Connector>>,
    pub(crate) grace: Duration,
    pub(crate) timeout: Duration,
}

/// Waits for a drain to be asked for, then runs it (see the module doc) and publishes the report.
pub(crate) async fn run(drain: Arc<Drain>, e: Engine) {
    drain.requested().await;
    let start = (*drain.started.lock()).unwrap_or_else(Instant::now);
    let deadline = start + e.timeout;
    tokio::time::sleep_until((start + e.grace).into()).await;
    {
        let _queue = e.scheduler.lock();
        drain.refusing.store(true, Ordering::SeqCst);
    }
    tracing::info!("draining: new requests are refused; waiting for what is in flight");
    let report = loop {
        let (idle, pool_left) = scheduler_idle(&e.scheduler).await;
        // A stopped connector holds nothing any more: its executor ended every handoff.
        let (p, d) = e
            .connector
            .as_ref()
            .map_or(Ok((0, 0)), |c| c.held_blocks())
            .unwrap_or((0, 0));
        let handoff_left = p + d;
        let clean = idle && handoff_left == 0;
        if clean || Instant::now() >= deadline {
            break DrainReport {
                drain_s: start.elapsed().as_secs_f64(),
                timed_out: !clean,
                handoff_blocks_left: handoff_left,
                pool_blocks_left: pool_left,
            };
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if report.timed_out {
        tracing::warn!(
            drain_s = report.drain_s,
            handoff_blocks_left = report.handoff_blocks_left,
            pool_blocks_left = report.pool_blocks_left,
            "drain deadline passed with work left: stopping anyway (peers recompute or fail)"
        );
    } else {
        tracing::info!(drain_s = report.drain_s, "drained: nothing in flight");
    }
    drain.report.send_replace(Some(report));
}

/// The scheduler's answer, or "not idle" while it does not answer (a stopped scheduler has no
/// queue: it is idle, with nothing to tell).
async fn scheduler_idle(s: &Mutex<std::sync::mpsc::Sender<Command>>) -> (bool, usize) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if s.lock().send(Command::Idle(tx)).is_err() {
        return (true, 0);
    }
    match tokio::time::timeout(Duration::from_secs(1), rx).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => (true, 0),
        Err(_) => (false, 0),
    }
}

/// The admin listener's routes: `POST /drain[?wait=true]` and `GET /drain`, each with the
/// bearer token.
pub(crate) fn admin_router(drain: Arc<Drain>, token: String) -> Router {
    let state = Arc::new(Admin { drain, token });
    Router::new()
        .route("/drain", post(start_drain).get(drain_status))
        .with_state(state)
}

struct Admin {
    drain: Arc<Drain>,
    token: String,
}

impl Admin {
    /// Whether the call carries the token; compared in constant time.
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        !self.token.is_empty() && bool::from(given.as_bytes().ct_eq(self.token.as_bytes()))
    }
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(
            json!({"error": {"message": "an admin call needs `Authorization: Bearer <admin_token>`",
            "type": "unauthorized", "code": 401}}),
        ),
    )
        .into_response()
}

async fn start_drain(State(a): State<Arc<Admin>>, headers: HeaderMap, uri: Uri) -> Response {
    if !a.authorized(&headers) {
        return unauthorized();
    }
    a.drain.begin("admin call");
    // `?wait=true`: answer once drained (a preStop hook must not return before).
    let wait = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "wait=true" || kv == "wait=1"));
    if wait {
        let report = a.drain.finished().await;
        return Json(json!({"drained": !report.timed_out, "report": report})).into_response();
    }
    (StatusCode::ACCEPTED, Json(a.drain.status())).into_response()
}

async fn drain_status(State(a): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if !a.authorized(&headers) {
        return unauthorized();
    }
    Json(a.drain.status()).into_response()
}
