//! Bounded HTTP/1 serving, shared by handoff's engine and proxy: an axum [`Router`] served so
//! that no client can hold the server's resources for long or without limit.
//! In the book (`docs/` in the repository): `docs/src/reference/proxy-admin-and-http-limits.md`.
//!
//! [`serve`] replaces `axum::serve` and enforces [`Limits`]:
//!
//! | limit | default | when hit |
//! | --- | --- | --- |
//! | `header_read_timeout` | 10 s | from a request's first byte to the end of its headers; the connection gets a 408 and is closed (slowloris) |
//! | `body_read_timeout` | 30 s | from the end of the headers to the end of the body, whole; 408, connection closed |
//! | `idle_timeout` | 60 s | a connection with no request in progress and no byte of a next one is closed |
//! | `write_stall_timeout` | 30 s | an answer the client has not taken a byte of for this long (it stopped reading a stream) is cut: the connection is closed |
//! | `max_connections` | 1024 | a connection beyond it is answered 503 at once and closed, without reading it |
//! | `max_body_bytes` | 4 MiB | 413 (at once when `Content-Length` says so, else when the body grows past it); connection closed |
//! | `max_header_bytes` | 64 KiB | hyper answers 431 and closes |
//!
//! Every hit is counted in `http_limit_hits_total{listener, limit}` ([`HttpMetrics`]); open and
//! accepted connections are counted too. A request body is read whole, within its limits, before
//! the router sees it (handoff's handlers buffer JSON bodies anyway), so a handler never waits on
//! a slow client. A response that streams (SSE) is not bounded in length here (a request in
//! progress, from its headers to the end of its answer, is the handler's to bound), but a client
//! that stops reading it loses the connection after `write_stall_timeout`.

#![forbid(unsafe_code)]

mod metrics;
/// Hostile-client probes for the limit tests (feature `testing`; not API).
#[cfg(any(test, feature = "testing"))]
pub mod probe;
mod timeline;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
use axum::http::header::{CONNECTION, CONTENT_TYPE};
use axum::http::{HeaderValue, Request, Response, StatusCode};
use axum::Router;
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

pub use metrics::{HttpMetrics, Limit, ListenerMetrics};
pub use timeline::PhaseTimes;

/// The bounds one listener enforces (see the crate docs for what each does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// From a request's first byte to the end of its headers.
    pub header_read_timeout: Duration,
    /// From the end of a request's headers to the end of its body.
    pub body_read_timeout: Duration,
    /// A connection with no request in progress and no byte of a next one is closed after this.
    pub idle_timeout: Duration,
    /// A connection whose client has taken no byte of the answer for this long (its socket
    /// buffers full: it stopped reading) is closed, and the request with it.
    pub write_stall_timeout: Duration,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers); at least 8 KiB.
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            write_stall_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_body_bytes: 4 << 20,
            max_header_bytes: 64 << 10,
        }
    }
}

/// The most connections one listener may be configured for.
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// A [`Limits`] field out of its bounds: which one, and what it must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} must be {must}")]
pub struct LimitError {
    /// The field's name in [`Limits`].
    pub field: &'static str,
    /// Its bounds, in words.
    pub must: String,
}

impl Limits {
    /// Checks every bound; the error names the field.
    pub fn validate(&self) -> Result<(), LimitError> {
        let bad = |field, must: &str| {
            Err(LimitError {
                field,
                must: must.to_string(),
            })
        };
        for (field, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("body_read_timeout", self.body_read_timeout),
            ("idle_timeout", self.idle_timeout),
            ("write_stall_timeout", self.write_stall_timeout),
        ] {
            if d.is_zero() {
                return bad(field, "greater than zero");
            }
        }
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS {
            return bad("max_connections", &format!("1..={MAX_CONNECTIONS}"));
        }
        if self.max_body_bytes == 0 {
            return bad("max_body_bytes", "at least 1");
        }
        if !(8 << 10..=16 << 20).contains(&self.max_header_bytes) {
            return bad("max_header_bytes", "8 KiB..=16 MiB");
        }
        Ok(())
    }
}

/// A JSON error answer in the OpenAI shape handoff uses everywhere, with `Connection: close`
/// (the request it answers may not have been read to its end).
pub fn error_response(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({"error": {
        "message": message, "type": kind, "code": status.as_u16(),
    }});
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The same answer as raw HTTP/1.1 bytes, for a connection no HTTP machinery serves.
fn raw_error(status: StatusCode, kind: &str, message: &str) -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "message": message, "type": kind, "code": status.as_u16(),
    }})
    .to_string();
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes; then stops
/// accepting, lets requests in progress finish (idle connections close at once) and returns
/// when every connection has closed. Accepted sockets get `TCP_NODELAY` (SSE chunks are small).
pub async fn serve<F>(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    metrics: ListenerMetrics,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    limits
        .validate()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // Handlers' own extractors must not cut below (or above) the listener's limit.
    let router = router.layer(DefaultBodyLimit::max(limits.max_body_bytes));
    let limits = Arc::new(limits);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let refusal = raw_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        &format!(
            "this server serves at most {} connections at once; retry later",
            limits.max_connections
        ),
    );
    let mut last_warn: Option<Instant> = None;
    let mut warn_now = move || {
        let now = Instant::now();
        let due = last_warn.map_or(true, |t| now.duration_since(t) >= Duration::from_secs(10));
        if due {
            last_warn = Some(now);
        }
        due
    };
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    metrics.hit(Limit::AcceptError);
                    if warn_now() {
                        tracing::warn!(listener = metrics.name(), error = %e, "accept failed");
                    }
                    // Out of file descriptors and the like: do not spin.
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionRefused
                    ) {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.hit(Limit::Connections);
            if warn_now() {
                tracing::warn!(
                    listener = metrics.name(),
                    max_connections = limits.max_connections,
                    "connection cap reached: refusing connections (503)"
                );
            }
            // Best effort and never blocking: a fresh socket's send buffer takes it whole.
            let _ = stream.try_write(&refusal);
            continue;
        };
        metrics.accepted();
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_conn(
            stream,
            router.clone(),
            limits.clone(),
            metrics.clone(),
            stop_rx.clone(),
            permit,
        ));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection holds a permit until it closes.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
    Ok(())
}

/// What one connection is doing, shared by its task, its socket wrapper and its service.
struct ConnState {
    base: Instant,
    /// Requests in progress: from the end of their headers to the end of their answer.
    active: AtomicUsize,
    /// Nanoseconds after `base` when the connection last became idle.
    idle_since: AtomicU64,
    /// 1 + nanoseconds after `base` of the first byte read while idle (a request head begun);
    /// 0 when none.
    head_started: AtomicU64,
    /// 1 + nanoseconds after `base` since when a write has waited for the client to take bytes
    /// (the socket's buffers full); 0 while writes go through.
    write_blocked: AtomicU64,
    /// Wakes the connection's task when the above change.
    notify: Notify,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Header,
    /// The client stopped taking the answer's bytes.
    WriteStall,
}

impl ConnState {
    fn new() -> Self {
        ConnState {
            base: Instant::now(),
            active: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            head_started: AtomicU64::new(0),
            write_blocked: AtomicU64::new(0),
            notify: Notify::new(),
        }
    }

    fn nanos(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1)
    }

    fn bytes_read(&self) {
        if self.active.load(Ordering::SeqCst) == 0 && self.head_started.load(Ordering::SeqCst) == 0
        {
            self.head_started.store(self.nanos() + 1, Ordering::SeqCst);
            self.notify.notify_one();
        }
    }

    /// A write could not go through (`blocked`) or went through.
    fn write_blocked(&self, blocked: bool) {
        if !blocked {
            self.write_blocked.store(0, Ordering::SeqCst);
        } else if self.write_blocked.load(Ordering::SeqCst) == 0 {
            self.write_blocked.store(self.nanos() + 1, Ordering::SeqCst);
            self.notify.notify_one();
        }
    }

    /// When the connection's current phase ends and which it is; `None` while a request is in
    /// progress and its answer's bytes go out.
    fn deadline(&self, limits: &Limits) -> Option<(Instant, Phase)> {
        if let w @ 1.. = self.write_blocked.load(Ordering::SeqCst) {
            let since = Duration::from_nanos(w - 1);
            return Some((
                self.base + since + limits.write_stall_timeout,
                Phase::WriteStall,
            ));
        }
        if self.active.load(Ordering::SeqCst) > 0 {
            return None;
        }
        match self.head_started.load(Ordering::SeqCst) {
            0 => {
                let since = Duration::from_nanos(self.idle_since.load(Ordering::SeqCst));
                Some((self.base + since + limits.idle_timeout, Phase::Idle))
            }
            h => {
                let since = Duration::from_nanos(h - 1);
                Some((
                    self.base + since + limits.header_read_timeout,
                    Phase::Header,
                ))
            }
        }
    }
}

/// Counts a request in progress from its headers until its answer's body is dropped (sent, or
/// the connection gone).
struct ActiveGuard(Arc<ConnState>);

impl ActiveGuard {
    fn new(state: Arc<ConnState>) -> Self {
        state.active.fetch_add(1, Ordering::SeqCst);
        state.head_started.store(0, Ordering::SeqCst);
        state.notify.notify_one();
        ActiveGuard(state)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        let s = &self.0;
        s.idle_since.store(s.nanos(), Ordering::SeqCst);
        s.head_started.store(0, Ordering::SeqCst);
        s.active.fetch_sub(1, Ordering::SeqCst);
        s.notify.notify_one();
    }
}

/// The socket, telling the connection's state when a byte arrives while it is idle.
struct Watched {
    inner: TcpStream,
    state: Arc<ConnState>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.state.bytes_read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.state.write_blocked(r.is_pending());
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.state.write_blocked(r.is_pending());
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The answer's body, holding the request's [`ActiveGuard`].
struct Tracked {
    body: Body,
    _active: ActiveGuard,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[derive(Clone)]
struct Svc {
    router: Router,
    state: Arc<ConnState>,
    limits: Arc<Limits>,
    metrics: ListenerMetrics,
}

type SvcFuture = Pin<Box<dyn Future<Output = Result<Response<Tracked>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Svc {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = SvcFuture;

    fn call(&self, req: Request<Incoming>) -> SvcFuture {
        let active = ActiveGuard::new(self.state.clone());
        let this = self.clone();
        Box::pin(async move {
            let resp = match this.read_body(req).await {
                Ok(req) => match this.router.oneshot(req).await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                },
                Err(resp) => resp,
            };
            Ok(resp.map(|body| Tracked {
                body,
                _active: active,
            }))
        })
    }
}

impl Svc {
    /// Reads the whole body within `max_body_bytes` and `body_read_timeout`.
    async fn read_body(&self, req: Request<Incoming>) -> Result<Request<Body>, Response<Body>> {
        use http_body::Body as _;
        let (parts, body) = req.into_parts();
        if body.is_end_stream() {
            return Ok(Request::from_parts(parts, Body::empty()));
        }
        let max = self.limits.max_body_bytes;
        let too_large = || {
            self.metrics.hit(Limit::BodyTooLarge);
            error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("the request body exceeds this server's limit of {max} bytes"),
            )
        };
        if body.size_hint().lower() > max as u64 {
            return Err(too_large());
        }
        let t = self.limits.body_read_timeout;
        match tokio::time::timeout(t, Limited::new(body, max).collect()).await {
            Ok(Ok(c)) => Ok(Request::from_parts(parts, Body::from(c.to_bytes()))),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
            Ok(Err(e)) => Err(error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!("could not read the request body: {e}"),
            )),
            Err(_) => {
                self.metrics.hit(Limit::BodyTimeout);
                Err(error_response(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    &format!("the request body did not arrive whole within {t:?}"),
                ))
            }
        }
    }
}

enum End {
    Closed(Result<(), hyper::Error>),
    Expired(Phase),
}

async fn serve_conn(
    stream: TcpStream,
    router: Router,
    limits: Arc<Limits>,
    metrics: ListenerMetrics,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    let _open = metrics.open();
    let state = Arc::new(ConnState::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        state: state.clone(),
    });
    let svc = Svc {
        router,
        state: state.clone(),
        limits: limits.clone(),
        metrics: metrics.clone(),
    };
    let mut conn = hyper::server::conn::http1::Builder::new()
        // Our own header timeout (below) starts at a request's first byte, not when the
        // connection goes idle, and answers 408.
        .header_read_timeout(None)
        .max_buf_size(limits.max_header_bytes)
        .keep_alive(true)
        .serve_connection(io, svc);
    let mut draining = false;
    let far = Duration::from_secs(365 * 86_400);
    let end = loop {
        let deadline = state.deadline(&limits);
        let wake = deadline.map_or_else(|| Instant::now() + far, |(at, _)| at);
        let notified = state.notify.notified();
        tokio::select! {
            r = &mut conn => break End::Closed(r),
            _ = notified => {}
            _ = tokio::time::sleep_until(wake), if deadline.is_some() => {
                if let Some((at, phase)) = state.deadline(&limits) {
                    if at <= Instant::now() {
                        break End::Expired(phase);
                    }
                }
            }
            // The guard wait_for returns is not Send: drop it inside the branch future.
            _ = async { drop(stop.wait_for(|s| *s).await) }, if !draining => {
                draining = true;
                Pin::new(&mut conn).graceful_shutdown();
            }
        }
    };
    match end {
        End::Closed(Ok(())) => {}
        End::Closed(Err(e)) => {
            if e.is_parse_too_large() {
                metrics.hit(Limit::HeaderTooLarge);
            }
            tracing::debug!(listener = metrics.name(), error = %e, "connection ended with an error");
        }
        End::Expired(Phase::Idle) => metrics.hit(Limit::IdleTimeout),
        // Dropping the connection closes the socket and ends the answer's body: the handler
        // sees its client gone (an engine aborts the request, the proxy its legs).
        End::Expired(Phase::WriteStall) => {
            metrics.hit(Limit::WriteStall);
            tracing::debug!(
                listener = metrics.name(),
                "the client took no byte of its answer for {:?}: closing",
                limits.write_stall_timeout
            );
        }
        End::Expired(Phase::Header) => {
            metrics.hit(Limit::HeaderTimeout);
            tracing::debug!(
                listener = metrics.name(),
                "request headers incomplete after {:?}: closing",
                limits.header_read_timeout
            );
            let stream = conn.into_parts().io.into_inner().inner;
            let _ = stream.try_write(&raw_error(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                &format!(
                    "the request headers did not arrive whole within {:?}",
                    limits.header_read_timeout
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests;
