//! handoff's P/D router: an OpenAI-compatible HTTP front that sends each completion request to a
//! prefill engine (P) and a decode engine (D) — one after the other in pull mode, both at once in
//! push mode and in a layer-wise pull — carrying the KV handoff between them in
//! `kv_transfer_params`.
//! In the book (`docs/` in the repository): `docs/src/reference/http.md`.
//!
//! # The pull flow
//!
//! It follows vLLM's toy proxy (`toy_proxy_server.py`), so vLLM engines and handoff engines can
//! sit behind it alike:
//!
//! 1. The client's POST to `/v1/completions` or `/v1/chat/completions` gets one request id: its
//!    own `X-Request-Id` header if it sent a sane one, else a fresh uuid-like id. The same id goes
//!    to both legs in `X-Request-Id`, so P's and D's logs of one request can be joined.
//! 2. **Leg 1, P.** The client's JSON with `stream: false`, `max_tokens: 1` (and
//!    `max_completion_tokens: 1` when the client used it), `stream_options`, `min_tokens` and
//!    `best_of` removed, `n: 1` (n>1 fans out on D after one pull, never on P: P must hold one
//!    handoff per prompt), and `kv_transfer_params` =
//!    `{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
//!    "remote_block_ids": null, "remote_host": null, "remote_port": null}`.
//!    P prefills, keeps the blocks under a lease and answers with its `kv_transfer_params`.
//! 3. **Leg 2, D.** The client's original JSON, unchanged but for `kv_transfer_params` = P's.
//!    D pulls the KV from P and decodes. Its answer goes back to the client as it comes: an SSE
//!    stream is relayed chunk by chunk without buffering; a JSON answer is returned whole.
//!
//! P and D are picked per request among the *healthy* instances of each role
//! ([`Policy::RoundRobin`] or [`Policy::LeastLoaded`], the latter counting the requests this proxy
//! has in flight to each instance, a D stream until it ends). Any number of Ps and Ds (xPyD).
//!
//! # The push flow
//!
//! With [`ProxyConfig::mode`] = [`TransferMode::Push`], P writes the KV into blocks D reserved,
//! so D need not wait for P's answer to learn where the KV is: both legs go out **at once**.
//!
//! 1. P and D are picked up front (same policies), and the request gets one request id (as in
//!    pull, the same `X-Request-Id` on both legs) and a fresh **handoff id**: 128 random bits,
//!    32 hex digits in JSON, a capability only the two legs know.
//! 2. P's side channel comes from its `GET /v1/handoff/info`
//!    (`{"engine_id", "remote_host", "remote_port", "tp_size", "block_size", "transfer_mode",
//!    "role"}`), cached per instance: fetched by every health check (a P that does not answer it,
//!    or says it is in pull mode or decode-only, is unhealthy: push and pull engines cannot
//!    pair), fetched on demand when not cached, and forgotten when a request through that P fails
//!    (it may have restarted with another engine id). If it cannot be had, the request fails
//!    naming P before either leg is sent.
//! 3. **P leg**, sent in a task of its own: the pull P leg's body with `kv_transfer_params` =
//!    `{"do_remote_decode": true, "do_remote_prefill": false, "transfer_mode": "push",
//!    "handoff_id": H}`. P prefills, writes the KV into D's registered blocks and answers one
//!    token plus its `kv_transfer_params` (which must not name another handoff or mode).
//! 4. **D leg**, at the same time: the client's JSON with `kv_transfer_params` =
//!    `{"do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "push",
//!    "handoff_id": H, "remote_engine_id", "remote_host", "remote_port", "tp_size"}` (P's, from
//!    its info; no `remote_block_ids`). D reserves blocks at once, registers them with P and
//!    answers once the writes land; its answer is relayed to the client exactly as in pull.
//!
//! Which of P's write and D's registration comes first does not matter to the engines; the
//! proxy only makes sure neither leg waits on the other.
//!
//! # The layer-wise pull flow
//!
//! In pull mode, when the picked P and D both say `"layerwise_pull": true` in their cached info
//! (read by every health check; an engine that does not answer `GET /v1/handoff/info`, or does
//! not say it, as vLLM's, stays healthy and is pulled as above), they get the push flow's two
//! legs at once, in pull mode (a D that says it admits such a request only once P's prefill
//! started, so that the two engines never wait on each other's blocks): both legs'
//! `kv_transfer_params` say `"transfer_mode": "pull", "layerwise": true` with the fresh handoff
//! id. P creates the handoff when its prefill starts, D asks P for the blocks at once and reads
//! each layer once P saved it: the READ runs beside P's prefill instead of after it. P's answer
//! must be a pull's for the same handoff; failures and releases are the push flow's.
//!
//! # Failure policy: fail loudly, release at once
//!
//! A disaggregated request has two engines and one handoff between them; when one leg fails the
//! worst answers are a hang (the client waits forever, P's blocks stay pinned) and a silent
//! fallback (D recomputes the prompt or answers from garbage while the client believes all is
//! well, and the fault stays hidden). So:
//!
//! - **No healthy P or no healthy D**: 503 at once, before any engine is called (a prefill that
//!   no D can decode would only pin P's blocks until its lease runs out).
//! - **P fails** (unreachable → 502, timeout → 504, 503 → 503, other 5xx → 502, 4xx → the same
//!   4xx, 200 without `kv_transfer_params` → 502): the client gets that status and a JSON error
//!   that names the P instance and the reason. In pull mode D is never called.
//! - **D cannot take the request** (unreachable, any error status such as 503 "pool full", or no
//!   response head within `request_timeout`): the client gets an error naming D, **and the proxy
//!   tells P to release the handoff at once**: `POST {P}/v1/handoff/release` with
//!   `{"kv_transfer_params": <P's params>}`, awaited for at most `release_timeout`, failures
//!   logged and counted. Without it P's blocks would stay pinned until the lease expires, which
//!   under load is what fills a pool. Releases are idempotent on P (an unknown or already
//!   released handoff does nothing), so releasing when D did see the request is harmless. The
//!   same release is sent if the client goes away after P answered and before D's answer began.
//!   The error body says `prefill_released: true|false`.
//! - There is **never** a decode-only fallback: D is always called with P's params (push: with
//!   P's side channel and the handoff id P writes under).
//! - **Nothing hangs**: every upstream call has a connect timeout (`connect_timeout`) and either an
//!   overall timeout (P leg, non-streaming D, `/v1/models`, health checks, releases) or a
//!   first-byte timeout (`request_timeout` until the head of a streamed D answer), and a relayed
//!   stream is cut after `stream_idle_timeout` without a chunk.
//! - Once D's answer has begun, D owns the handoff (its connector releases P when it has pulled,
//!   or aborts). A D stream that breaks or stalls is not hidden: an SSE client gets a final
//!   `data: {"error": {...}}` event naming D (and no `[DONE]`), as vLLM reports mid-stream errors;
//!   any other body is aborted, so the client sees a truncated answer rather than a short one.
//! - **Client disconnect**: dropping the client's stream drops the upstream D response at once,
//!   which closes the connection to D, so D sees the disconnect and aborts the request (and its
//!   connector gives the handoff back). The proxy never keeps reading D for nobody.
//! - An instance that refuses connections is marked unhealthy at once (it is down; waiting for
//!   the next health check would fail more requests); a timeout does not (it may just be busy).
//!
//! That is the pull flow, where D is called only once P has answered. In push mode both legs run
//! at once, so each watches the other (timeouts, the never-hang rule, statuses and mid-stream
//! errors as above):
//!
//! - **D cannot take the request** (unreachable, error status such as 503 "pool full", no head
//!   within `request_timeout`): error naming D, P's leg is cancelled (its connection closed, so
//!   P aborts the prefill), and P is told to release at once, with P's params if it already
//!   answered, else `{"do_remote_decode": true, "do_remote_prefill": false, "transfer_mode":
//!   "push", "handoff_id": H, "epoch": 1}`. The release is sent even while P is still
//!   prefilling: P stages an early release until the handoff exists.
//! - **P fails** (unreachable, timeout, error status, or an answer that is not for this push)
//!   at any time before D's answer is complete: the client gets P's error (statuses as in pull,
//!   the message saying D's leg was cancelled) and D's request is dropped, closing the connection
//!   to D, so D aborts and cancels its registration: D is never left waiting for KV that will
//!   not come (D has its own watchdog; the proxy does not rely on it). If D's stream had begun, an
//!   SSE client gets a final `error` event naming P (a non-SSE body is aborted). P is also told
//!   to release unless it was unreachable (it may have prefilled or be prefilling still).
//! - **D's answer completes first**: P's answer, if still to come, is awaited in the background
//!   and only logged (D decoded from KV that landed).
//! - **Client disconnect**: both legs are dropped (both connections closed) and, if D had not
//!   answered yet, P is told to release.
//!
//! # Admin API
//!
//! Instances can be added and removed while the proxy runs, on the **admin listener**
//! ([`ProxyConfig::admin_bind`], loopback by default), never on the public one (which answers
//! `/admin` with 404):
//!
//! - `POST /admin/instances` with `{"role": "prefill"|"decode", "url": "http://host:port"}` adds one
//!   (201; 200 with `"added": false` when already there). It is health-checked before the answer,
//!   which reports whether it is healthy; it takes traffic only once healthy.
//! - `DELETE /admin/instances` with the same body removes one (200, or 404 when unknown); requests
//!   already in flight to it run to their end.
//! - `GET /admin/instances` lists `{"prefill": [...], "decode": [...]}` with `url`, `healthy` and
//!   `in_flight` for each.
//!
//! With [`ProxyConfig::admin_token`] set, every admin request needs `Authorization: Bearer
//! <token>` (compared in constant time; 401 and `WWW-Authenticate: Bearer` otherwise). Without
//! one the admin API is open to whoever reaches the admin listener, so [`start`] refuses an
//! `admin_bind` that is not a loopback address. An instance URL must be `http://host:port` and
//! nothing more ([`normalize_url`]: no https, user info, path, query or fragment); anything else
//! is answered 400 naming the problem. The proxy's HTTP client follows no redirects: an engine
//! answering 3xx fails the leg (or its health check). Admin requests are counted in
//! `handoff_proxy_admin_requests_total{outcome}`.
//!
//! # Bounded serving
//!
//! Both listeners are served by [`handoff_http::serve`] within [`ProxyConfig::http`] and
//! [`ProxyConfig::admin_http`] ([`HttpLimits`]: header read, whole-body read and idle timeouts,
//! a connection cap, body and head size limits; 408, 413, 503 and 431 when hit), each hit
//! counted in `handoff_proxy_http_limit_hits_total{listener, limit}`. Upstream answers the proxy
//! reads whole (P's answer and handoff info, a non-streamed D answer, `/v1/models`) are read up
//! to [`ProxyConfig::max_upstream_body_bytes`]: a longer one is dropped (its connection closed)
//! and the client gets 502, counted in `handoff_proxy_upstream_body_too_large_total{role}`.
//!
//! # Health
//!
//! Every `health_interval` the proxy GETs `{url}/health` of every instance (timeout
//! `health_timeout`); a success status makes it healthy, anything else unhealthy, except that a
//! healthy instance stays so until `health_timeouts_to_fail` checks in a row got no answer in
//! time (a busy engine answers late; a dead one refuses at once). Instances start
//! unhealthy: [`start`] runs one round of checks before it returns, and an added instance is
//! checked before the admin answer, so traffic never goes to an instance no check has seen.
//! In push mode a P must also answer `GET {url}/v1/handoff/info` as a push-capable prefill engine
//! to be healthy (the answer is cached for the push flow).
//!
//! # Other endpoints
//!
//! `GET /v1/models` is forwarded to a healthy D; `GET /health` is 200 when at least one P and one
//! D are healthy, else 503; `GET /metrics` is Prometheus/OpenMetrics text: requests by outcome,
//! in-flight and health per instance, releases sent by result, how relayed streams ended.

#![forbid(unsafe_code)]

mod both_legs;
mod error;
mod health;
mod info;
mod metrics;
mod pool;
mod prefill_leg;
mod relay;
mod routes;
mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use handoff_http::Limits as HttpLimits;
pub use handoff_proto::TransferMode;
pub use pool::{normalize_url, BadInstanceUrl, InstanceInfo, Policy, Role};

/// Why the admin API did not add an instance.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AddInstanceError {
    #[error(transparent)]
    Url(#[from] BadInstanceUrl),
    /// Another admin call removed it between the add and the look-up of its state.
    #[error("{role} instance {url} vanished while being added")]
    Vanished { role: Role, url: String },
}

use metrics::Metrics;
use pool::Pool;

/// Everything the proxy needs to run. [`ProxyConfig::default`] gives sensible timeouts and limits.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Address of the public listener (completions, models, health, metrics); port 0 picks a
    /// free one ([`RunningProxy::local_addr`] tells which).
    pub bind: SocketAddr,
    /// Address of the admin listener (`/admin/instances`); `None`: no admin listener (instances
    /// can still be changed in-process, [`RunningProxy::add_instance`]). Default
    /// `127.0.0.1:0` (a free loopback port, [`RunningProxy::admin_addr`] tells which). A
    /// non-loopback address needs an [`admin_token`](Self::admin_token).
    pub admin_bind: Option<SocketAddr>,
    /// The bearer token every admin request must carry (`Authorization: Bearer <token>`).
    /// `None`: the admin API is open to whoever reaches `admin_bind`, which must then be loopback.
    pub admin_token: Option<AdminToken>,
    /// Base URLs of the prefill instances at start (`http://host:port`).
    pub prefill: Vec<String>,
    /// Base URLs of the decode instances at start.
    pub decode: Vec<String>,
    pub policy: Policy,
    /// Pull (P first, then D with P's params) or push (both legs at once); see the crate docs.
    pub mode: TransferMode,
    /// Time between two health checks of every instance.
    pub health_interval: Duration,
    /// Overall limit of one health check.
    pub health_timeout: Duration,
    /// A healthy instance turns unhealthy after this many health checks in a row got no answer
    /// within `health_timeout` on a connection it accepted (a busy engine answers late). Any
    /// other failure (no connection: refused, or not made within half of `health_timeout`, as
    /// for a host down or cut off; an error status; `/ready` 503) turns it unhealthy at once.
    pub health_timeouts_to_fail: u32,
    /// Limit for opening a TCP connection to any instance.
    pub connect_timeout: Duration,
    /// Overall limit of the P leg and of a non-streaming D leg; for a streaming D leg, the limit
    /// until D's response head.
    pub request_timeout: Duration,
    /// A relayed D stream that sends nothing for this long is cut (and the client told).
    pub stream_idle_timeout: Duration,
    /// Overall limit of one release request to P.
    pub release_timeout: Duration,
    /// Limits of the public listener: timeouts, connection cap, largest client request body.
    pub http: handoff_http::Limits,
    /// Limits of the admin listener.
    pub admin_http: handoff_http::Limits,
    /// Largest upstream answer the proxy reads whole (P's answer, P's handoff info, a
    /// non-streaming D answer, `/v1/models`); a longer one is cut off and answered 502.
    /// Streamed D answers are relayed chunk by chunk, never buffered, and not bound by it.
    pub max_upstream_body_bytes: usize,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 8000)),
            admin_bind: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            admin_token: None,
            prefill: Vec::new(),
            decode: Vec::new(),
            policy: Policy::RoundRobin,
            mode: TransferMode::Pull,
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            health_timeouts_to_fail: 3,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(120),
            stream_idle_timeout: Duration::from_secs(60),
            release_timeout: Duration::from_secs(2),
            http: handoff_http::Limits::default(),
            admin_http: handoff_http::Limits {
                max_connections: 32,
                max_body_bytes: 64 << 10,
                ..handoff_http::Limits::default()
            },
            max_upstream_body_bytes: 4 << 20,
        }
    }
}

/// The admin API's bearer token: at least [`AdminToken::MIN_LEN`] visible ASCII characters.
/// Its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl AdminToken {
    /// The shortest token accepted.
    pub const MIN_LEN: usize = 16;

    /// Checks a token (surrounding whitespace, such as a file's final newline, is dropped).
    pub fn new(token: &str) -> anyhow::Result<Self> {
        let t = token.trim();
        if t.len() < Self::MIN_LEN {
            bail!(
                "the admin token must be at least {} characters long (it has {})",
                Self::MIN_LEN,
                t.len()
            );
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("the admin token must be visible ASCII characters only (no spaces)");
        }
        Ok(AdminToken(t.to_string()))
    }

    /// Reads a token from a file (its whole content, trimmed).
    pub fn from_file(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the admin token from {}", path.display()))?;
        Self::new(&text).with_context(|| format!("admin token file {}", path.display()))
    }

    /// The token, to put in an `Authorization: Bearer` header.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that does not depend on where they differ.
    pub(crate) fn matches(&self, presented: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), presented)
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

/// Compares two byte strings in time that depends on their lengths only (so a wrong token
/// tells nothing about how much of it was right).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

pub(crate) struct Shared {
    pub(crate) cfg: ProxyConfig,
    pub(crate) http: reqwest::Client,
    /// Health checks' own client: a new connection per check (a pooled one would hide a host
    /// that stopped answering behind a mere late answer), connecting within half the check's
    /// limit, so that an unreachable host fails at connect and counts as down at once.
    pub(crate) health_http: reqwest::Client,
    pub(crate) prefill: Pool,
    pub(crate) decode: Pool,
    pub(crate) metrics: Metrics,
}

impl Shared {
    pub(crate) fn pool(&self, role: Role) -> &Pool {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// Adds an instance and health-checks it at once. `Ok((added, info))`.
    pub(crate) async fn add_instance(
        &self,
        role: Role,
        url: &str,
    ) -> Result<(bool, InstanceInfo), AddInstanceError> {
        let url = normalize_url(url)?;
        match self.pool(role).add(url.clone(), &self.metrics) {
            Some(inst) => {
                health::check(self, &inst).await;
                tracing::info!(%role, url = %inst.url, healthy = inst.is_healthy(), "instance added");
                Ok((true, inst.info()))
            }
            None => {
                let info = self
                    .pool(role)
                    .snapshot()
                    .into_iter()
                    .find(|i| i.url == url)
                    .map(|i| i.info())
                    .ok_or(AddInstanceError::Vanished { role, url })?;
                Ok((false, info))
            }
        }
    }

    pub(crate) fn remove_instance(&self, role: Role, url: &str) -> bool {
        let url = url.trim().trim_end_matches('/');
        let removed = self.pool(role).remove(url, &self.metrics);
        if removed {
            tracing::info!(%role, url, "instance removed");
        }
        removed
    }

    pub(crate) fn instances(&self, role: Role) -> Vec<InstanceInfo> {
        self.pool(role)
            .snapshot()
            .iter()
            .map(|i| i.info())
            .collect()
    }
}

/// A proxy running in this process (see [`start`]). Dropping it stops it, as
/// [`RunningProxy::shutdown`] does but without waiting.
pub struct RunningProxy {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    server: Option<JoinHandle<std::io::Result<()>>>,
    admin: Option<JoinHandle<std::io::Result<()>>>,
    health: Option<JoinHandle<()>>,
}

impl RunningProxy {
    /// The address of the public listener.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://{local_addr}`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address of the admin listener, if there is one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// `http://{admin_addr}`, if there is an admin listener.
    pub fn admin_url(&self) -> Option<String> {
        self.admin_addr.map(|a| format!("http://{a}"))
    }

    /// Adds an instance (as `POST /admin/instances`): returns whether it was new and how it
    /// stands after its first health check.
    pub async fn add_instance(
        &self,
        role: Role,
        url: &str,
    ) -> anyhow::Result<(bool, InstanceInfo)> {
        self.shared
            .add_instance(role, url)
            .await
            .map_err(anyhow::Error::msg)
    }

    /// Removes an instance (as `DELETE /admin/instances`): returns whether it was there.
    pub fn remove_instance(&self, role: Role, url: &str) -> bool {
        self.shared.remove_instance(role, url)
    }

    /// Every instance of both roles with its health and in-flight count.
    pub fn instances(&self) -> Vec<InstanceInfo> {
        let mut v = self.shared.instances(Role::Prefill);
        v.extend(self.shared.instances(Role::Decode));
        v
    }

    /// Runs until the public server stops (it stops only on a shutdown).
    pub async fn wait(mut self) -> anyhow::Result<()> {
        let server = self.server.take().context("proxy already stopped")?;
        server.await.context("proxy server task")??;
        Ok(())
    }

    /// Stops accepting, lets requests in flight finish for up to 10 s, then stops the rest.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        let _ = self.shutdown.send(true);
        if let Some(h) = self.health.take() {
            h.abort();
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut result = Ok(());
        for (name, server) in [("proxy", self.server.take()), ("admin", self.admin.take())] {
            let Some(mut server) = server else { continue };
            match tokio::time::timeout_at(deadline, &mut server).await {
                Ok(res) => {
                    if let Err(e) = res
                        .with_context(|| format!("{name} server task"))
                        .and_then(|r| r.with_context(|| format!("{name} server")))
                    {
                        result = result.and(Err(e));
                    }
                }
                Err(_) => {
                    tracing::warn!(
                        "{name} shutdown: requests still in flight after 10 s, stopping"
                    );
                    server.abort();
                }
            }
        }
        result
    }
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(h) = self.health.take() {
            h.abort();
        }
    }
}

/// Checks what [`start`] cannot fix later: limits, and that an admin listener reachable from
/// elsewhere has a token.
fn validate(cfg: &ProxyConfig) -> anyhow::Result<()> {
    if cfg.health_interval.is_zero() {
        bail!("health_interval must be greater than zero");
    }
    cfg.http
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid public listener limit (http): {e}"))?;
    cfg.admin_http
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid admin listener limit (admin_http): {e}"))?;
    if cfg.max_upstream_body_bytes == 0 {
        bail!("max_upstream_body_bytes must be at least 1");
    }
    if let Some(admin) = cfg.admin_bind {
        if cfg.admin_token.is_none() && !admin.ip().is_loopback() {
            bail!(
                "the admin listener {admin} is not a loopback address and no admin token is set: \
                 anyone who reaches it could add and remove instances. Set a token \
                 (--admin-token-file or HANDOFF_ADMIN_TOKEN) or bind it to loopback"
            );
        }
        if admin == cfg.bind && admin.port() != 0 {
            bail!("the admin listener and the public listener cannot share {admin}");
        }
    }
    Ok(())
}

/// Starts the proxy in this runtime and returns once it listens and has health-checked its
/// instances once.
pub async fn start(cfg: ProxyConfig) -> anyhow::Result<RunningProxy> {
    validate(&cfg)?;
    let client = || {
        reqwest::Client::builder()
            // Engines are reached directly: an HTTP(S)_PROXY in the environment must not
            // divert (or break) traffic between the proxy and its engines.
            .no_proxy()
            // An instance is the URL it was added with: a redirect would send the client's
            // request (and its Authorization header) somewhere nobody vetted.
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
    };
    let http = client()
        .connect_timeout(cfg.connect_timeout)
        // Under the keep-alive of the servers in front of which the proxy runs (vLLM's API
        // server, uvicorn: 5 s): a connection idle that long is being closed by the server, and
        // a request sent on it just then is reset (a check-ops run against vLLM lost a prefill
        // leg so, after a 5 s pause in its load).
        .pool_idle_timeout(Duration::from_secs(3))
        .build()
        .context("building the HTTP client")?;
    let health_http = client()
        .connect_timeout(cfg.connect_timeout.min(cfg.health_timeout / 2))
        .pool_max_idle_per_host(0)
        .build()
        .context("building the health checks' HTTP client")?;
    let shared = Arc::new(Shared {
        http,
        health_http,
        prefill: Pool::new(Role::Prefill),
        decode: Pool::new(Role::Decode),
        metrics: Metrics::new(),
        cfg: cfg.clone(),
    });
    for (role, urls) in [(Role::Prefill, &cfg.prefill), (Role::Decode, &cfg.decode)] {
        for url in urls {
            let url = normalize_url(url)?;
            shared.pool(role).add(url, &shared.metrics);
        }
    }
    health::check_all(&shared).await;

    let listener = tokio::net::TcpListener::bind(cfg.bind)
        .await
        .with_context(|| format!("binding the proxy to {}", cfg.bind))?;
    let addr = listener.local_addr()?;
    let admin_listener = match cfg.admin_bind {
        Some(at) => Some(
            tokio::net::TcpListener::bind(at)
                .await
                .with_context(|| format!("binding the proxy's admin listener to {at}"))?,
        ),
        None => None,
    };
    let admin_addr = admin_listener
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?;
    let (tx, rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let server = tokio::spawn(handoff_http::serve(
        listener,
        routes::router(shared.clone()),
        cfg.http.clone(),
        shared.metrics.http.listener("public"),
        stopped(rx.clone()),
    ));
    let admin = admin_listener.map(|l| {
        tokio::spawn(handoff_http::serve(
            l,
            routes::admin_router(shared.clone()),
            cfg.admin_http.clone(),
            shared.metrics.http.listener("admin"),
            stopped(rx.clone()),
        ))
    });
    let health = tokio::spawn(health::run(shared.clone(), tx.subscribe()));
    tracing::info!(
        %addr,
        admin = %admin_addr.map(|a| a.to_string()).unwrap_or_else(|| "none".into()),
        admin_auth = if cfg.admin_token.is_some() { "bearer token" } else { "none (loopback only)" },
        prefill = shared.prefill.healthy_count(),
        decode = shared.decode.healthy_count(),
        policy = cfg.policy.as_str(),
        mode = cfg.mode.as_str(),
        "proxy listening (healthy prefill/decode instances)"
    );
    Ok(RunningProxy {
        addr,
        admin_addr,
        shared,
        shutdown: tx,
        server: Some(server),
        admin,
        health: Some(health),
    })
}

/// Runs the proxy until its server stops.
pub async fn serve(cfg: ProxyConfig) -> anyhow::Result<()> {
    start(cfg).await?.wait().await
}

/// Runs the proxy until `signal` completes (for example `tokio::signal::ctrl_c()`), then shuts it
/// down as [`RunningProxy::shutdown`] does.
pub async fn serve_with_shutdown<F>(cfg: ProxyConfig, signal: F) -> anyhow::Result<()>
where
    F: Future<Output = ()>,
{
    let mut proxy = start(cfg).await?;
    tokio::pin!(signal);
    let mut handle = proxy.server.take().context("proxy already stopped")?;
    tokio::select! {
        res = &mut handle => {
            res.context("proxy server task")??;
            Ok(())
        }
        _ = &mut signal => {
            proxy.server = Some(handle);
            proxy.shutdown().await
        }
    }
}
