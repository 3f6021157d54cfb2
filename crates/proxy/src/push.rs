//! The push flow (see the crate docs): one fresh handoff id, P's side channel from its
//! `/v1/handoff/info`, both legs sent at once, D's answer relayed while P's leg is watched.
//! A layer-wise pull (a pull-mode P whose info says `layerwise_pull`) runs the same flow: only
//! the mode in both legs' params differs, and D reads where P would have written.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use handoff_proto::HandoffId;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::task::JoinHandle;
use tokio::time::{timeout, timeout_at, Instant};

use crate::error::{snippet, ProxyError};
use crate::pool::{InFlight, Instance, Role};
use crate::relay::{relay, Marks};
use crate::routes::{
    forward_headers, internal, mark_down_if_unreachable, prefill_leg, prefill_leg_body, read_body,
    read_capped, release, release_detached, ReleaseGuard,
};
use crate::{Shared, TransferMode};

/// What an engine says about itself on `GET /v1/handoff/info`. The proxy needs P's to tell D
/// where to register its blocks: in push mode P's `kv_transfer_params` come too late for D.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(crate) struct EngineInfo {
    pub(crate) engine_id: String,
    pub(crate) remote_host: String,
    pub(crate) remote_port: u16,
    pub(crate) tp_size: u16,
    #[serde(default)]
    pub(crate) block_size: Option<u32>,
    #[serde(default)]
    pub(crate) transfer_mode: Option<TransferMode>,
    #[serde(default)]
    pub(crate) role: Option<String>,
    /// A pull-mode P that takes a layer-wise pull (both legs at once).
    #[serde(default)]
    pub(crate) layerwise_pull: Option<bool>,
    /// What a P and a D must share to exchange KV (see `pool::compatible`).
    #[serde(default)]
    pub(crate) compat_key: Option<String>,
}

impl EngineInfo {
    /// Whether this engine takes part in a layer-wise pull: as P, it prefills one; as D, it
    /// admits one only once P's prefill started (D holding blocks for requests P cannot start
    /// while P's pool waits on D's reads would deadlock the two).
    pub(crate) fn takes_layerwise_pull(&self) -> bool {
        self.layerwise_pull == Some(true) && self.transfer_mode != Some(TransferMode::Push)
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
    let (status, body) =
        crate::routes::call_prefill(s, p, req, t, "no answer to GET /v1/handoff/info").await?;
    let bad = |reason: String| {
        ProxyError::upstream(
            Role::Prefill,
            &p.url,
            StatusCode::BAD_GATEWAY,
            "bad_prefill_info",
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

/// P's info: cached, or fetched now (within `request_timeout`).
async fn prefill_info(s: &Shared, p: &Instance) -> Result<Arc<EngineInfo>, ProxyError> {
    if let Some(info) = p.handoff_info() {
        return Ok(info);
    }
    let info = fetch_info(s, p, s.cfg.request_timeout).await?;
    store_info(p, info);
    p.handoff_info()
        .ok_or_else(|| internal(format!("prefill instance {} info vanished", p.url)))
}

/// `kv_transfer_params` of the P leg. Push: prefill, then write the KV into the blocks D
/// registers under this handoff id. Layer-wise pull: hold the KV under this handoff id from the
/// prefill's start, and let D read each layer once saved.
pub(crate) fn prefill_params(handoff: HandoffId, mode: TransferMode) -> Value {
    let mut v = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "transfer_mode": mode.as_str(),
        "handoff_id": handoff.to_string(),
    });
    if mode == TransferMode::Pull {
        v["layerwise"] = json!(true);
    }
    v
}

/// `kv_transfer_params` of the D leg. Push: reserve blocks now, register them with P (found by
/// its info), decode once P's writes land. Layer-wise pull: ask P (found by its info) for the
/// blocks at once and read the layers as P saves them. No `remote_block_ids`: D learns P's
/// from P.
pub(crate) fn decode_params(handoff: HandoffId, p: &EngineInfo, mode: TransferMode) -> Value {
    let mut v = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "transfer_mode": mode.as_str(),
        "handoff_id": handoff.to_string(),
        "remote_engine_id": p.engine_id,
        "remote_host": p.remote_host,
        "remote_port": p.remote_port,
        "tp_size": p.tp_size,
    });
    if mode == TransferMode::Pull {
        v["layerwise"] = json!(true);
    }
    v
}

/// What a release names when P has not answered (yet): the handoff and its first epoch.
fn release_params(handoff: HandoffId, mode: TransferMode) -> Value {
    let mut v = prefill_params(handoff, mode);
    v["epoch"] = json!(1);
    v
}

/// Why P's leg failed, with P's params when it answered (so that a release names what P holds).
pub(crate) struct PrefillFailure {
    pub(crate) error: ProxyError,
    params: Option<Value>,
}

/// P's leg, running in a task of its own from the moment it is sent, so that it progresses
/// whatever the client-facing side waits on. Resolves to P's `kv_transfer_params`. Dropping it
/// aborts the task, which closes the connection to P (P aborts the prefill).
pub(crate) struct PrefillLeg {
    task: Option<JoinHandle<Result<Value, PrefillFailure>>>,
    shared: Arc<Shared>,
    p: Arc<Instance>,
    rid: String,
    handoff: HandoffId,
    mode: TransferMode,
}

impl PrefillLeg {
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        s: &Arc<Shared>,
        guard: InFlight,
        path: &'static str,
        headers: HeaderMap,
        body: Value,
        rid: &str,
        handoff: HandoffId,
        mode: TransferMode,
    ) -> Self {
        let p = guard.instance().clone();
        let shared = s.clone();
        let task = tokio::spawn(async move {
            // The guard counts the request in flight to P until P's leg ends.
            let p = guard.instance();
            let params = prefill_leg(&shared, p, path, headers, &body)
                .await
                .map_err(|error| PrefillFailure {
                    error,
                    params: None,
                })?;
            match check_answer(p, &params, handoff, mode) {
                Ok(()) => Ok(params),
                Err(error) => Err(PrefillFailure {
                    error,
                    params: Some(params),
                }),
            }
        });
        PrefillLeg {
            task: Some(task),
            shared: s.clone(),
            p,
            rid: rid.to_string(),
            handoff,
            mode,
        }
    }

    /// Whether P's answer is still to come.
    pub(crate) fn pending(&self) -> bool {
        self.task.is_some()
    }

    pub(crate) fn url(&self) -> &str {
        &self.p.url
    }

    /// After a failure of this leg: forgets P's info unless P only rejected the request (4xx: P
    /// may have restarted with another engine id), and returns the release to send unless P
    /// never got the request (unreachable). P may have prefilled, be still at it, or hold blocks
    /// for a handoff no D will take: releasing is idempotent and an early release is staged by
    /// P, so it is always safe.
    pub(crate) fn after_failure(
        &self,
        f: &PrefillFailure,
    ) -> Option<impl Future<Output = bool> + Send + 'static> {
        if !f.error.status.is_client_error() {
            self.p.set_handoff_info(None);
        }
        if f.error.kind == "upstream_unreachable" {
            return None;
        }
        let params = f
            .params
            .clone()
            .filter(|v| v.get("handoff_id").is_some_and(Value::is_string))
            .unwrap_or_else(|| release_params(self.handoff, self.mode));
        Some(release(
            self.shared.clone(),
            self.p.clone(),
            params,
            self.rid.clone(),
            f.error.message.clone(),
        ))
    }

    /// D's answer is complete: P's answer, if still to come, changes nothing. It is awaited in
    /// the background (closing P's connection now could abort a request that did its job), and a
    /// failure is logged.
    pub(crate) fn detach(mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        let (p, rid) = (self.p.clone(), self.rid.clone());
        tokio::spawn(async move {
            if let Ok(Err(f)) = task.await {
                if !f.error.status.is_client_error() {
                    p.set_handoff_info(None);
                }
                tracing::warn!(
                    request_id = %rid,
                    "prefill leg failed after decode answered: {}",
                    f.error.message
                );
            }
        });
    }
}

impl Future for PrefillLeg {
    type Output = Result<Value, PrefillFailure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(task) = self.task.as_mut() else {
            return Poll::Ready(Err(PrefillFailure {
                error: internal("prefill leg polled after it ended".into()),
                params: None,
            }));
        };
        let out = ready!(Pin::new(task).poll(cx));
        self.task = None;
        Poll::Ready(match out {
            Ok(r) => r,
            Err(e) => Err(PrefillFailure {
                error: internal(format!("prefill leg task failed: {e}")),
                params: None,
            }),
        })
    }
}

impl Drop for PrefillLeg {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// P answered 200 with params: they must be for this handoff and mode (an engine that ignored
/// a push would keep its KV for a pull no D will make, and D would wait for writes that never
/// come; one that ignored a layer-wise pull holds its KV under an id no D knows).
fn check_answer(
    p: &Instance,
    params: &Value,
    handoff: HandoffId,
    mode: TransferMode,
) -> Result<(), ProxyError> {
    let bad = |reason: String| {
        ProxyError::upstream(
            Role::Prefill,
            &p.url,
            StatusCode::BAD_GATEWAY,
            "bad_prefill_response",
            reason,
        )
    };
    match params.get("transfer_mode") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == mode.as_str() => {}
        Some(other) => {
            return Err(bad(format!(
                "answered a {} with transfer_mode {other}",
                mode.as_str()
            )))
        }
    }
    match params.get("handoff_id") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(h)) if h.parse::<HandoffId>().ok() == Some(handoff) => Ok(()),
        Some(other) => Err(bad(format!(
            "answered for handoff {other} instead of {handoff}"
        ))),
    }
}

/// Awaits `fut` (a step of the D leg) while watching P's leg: P's params, when they come, go to
/// the release guard; P's failure ends the wait at once (dropping `fut`, and with it D's
/// request). D's output wins a tie: a complete D answer was decoded from KV that landed.
async fn watch_prefill<F: Future>(
    fut: F,
    leg: &mut PrefillLeg,
    release: &mut ReleaseGuard,
) -> Result<F::Output, PrefillFailure> {
    tokio::pin!(fut);
    loop {
        if !leg.pending() {
            return Ok(fut.await);
        }
        tokio::select! {
            biased;
            out = &mut fut => return Ok(out),
            r = &mut *leg => match r {
                Ok(params) => release.set_params(params),
                Err(f) => return Err(f),
            },
        }
    }
}

/// P failed before D's answer was complete; D's request is already dropped. The client's error
/// names P, says D was cut, and whether P acknowledged a release.
async fn prefill_failed(
    f: PrefillFailure,
    leg: &PrefillLeg,
    release: &mut ReleaseGuard,
    d: &Instance,
) -> ProxyError {
    release.disarm();
    let released = match leg.after_failure(&f) {
        Some(r) => Some(release_detached(r).await),
        None => None,
    };
    let mut e = f.error;
    e.message
        .push_str(&format!("; the decode leg to {} was cancelled", d.url));
    e.detail.prefill_released = released;
    e
}

/// D did not take the request: nobody will decode this prefill. P's leg is cancelled (closing
/// its connection) and P is told to release at once, even while it is still prefilling (an
/// early release is staged on P until the handoff exists).
async fn decode_failed(
    mut e: ProxyError,
    leg: PrefillLeg,
    release: &mut ReleaseGuard,
) -> ProxyError {
    drop(leg);
    e.detail.prefill_released = Some(release.release_now(&e.message).await);
    e
}

pub(crate) async fn push(
    s: &Arc<Shared>,
    path: &'static str,
    rid: &str,
    headers: &HeaderMap,
    client: Map<String, Value>,
    received: Instant,
) -> Result<Response, ProxyError> {
    let p_guard = crate::routes::pick_prefill(s)?;
    let legs = BothLegs {
        path,
        rid,
        headers,
        received,
        mode: TransferMode::Push,
    };
    let d_guard = crate::routes::pick_decode_for(s, p_guard.instance())?;
    // Nothing is sent before P's side channel is known: D could not register without it.
    let info = prefill_info(s, p_guard.instance()).await?;
    both_legs(s, legs, client, (p_guard, info), d_guard).await
}

/// What a request sent to both engines at once needs besides the client's body.
pub(crate) struct BothLegs<'a> {
    pub(crate) path: &'static str,
    pub(crate) rid: &'a str,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) received: Instant,
    pub(crate) mode: TransferMode,
}

/// Both legs at once (push, or a layer-wise pull) to P (`p_guard`, whose side channel `info`
/// names) and D (`d_guard`).
pub(crate) async fn both_legs(
    s: &Arc<Shared>,
    legs: BothLegs<'_>,
    client: Map<String, Value>,
    (p_guard, info): (InFlight, Arc<EngineInfo>),
    d_guard: InFlight,
) -> Result<Response, ProxyError> {
    let BothLegs {
        path,
        rid,
        headers,
        received,
        mode,
    } = legs;
    let p = p_guard.instance().clone();
    let d = d_guard.instance().clone();
    // 128 random bits: the id is a capability, unguessable by anyone but the two legs.
    let handoff = HandoffId::from_bytes(rand::random());
    let stream = client.get("stream").and_then(Value::as_bool) == Some(true);
    let mut p_body = prefill_leg_body(&client);
    p_body["kv_transfer_params"] = prefill_params(handoff, mode);
    let mut d_body = client;
    d_body.insert(
        "kv_transfer_params".into(),
        decode_params(handoff, &info, mode),
    );
    tracing::debug!(
        request_id = %rid, handoff_id = %handoff, prefill = %p.url, decode = %d.url,
        mode = mode.as_str(), "sending both legs"
    );

    // From here P may hold blocks for this handoff: every way out until D accepts releases them.
    let mut release = ReleaseGuard::new(s.clone(), p.clone(), release_params(handoff, mode), rid);
    let mut leg = PrefillLeg::spawn(
        s,
        p_guard,
        path,
        forward_headers(headers, rid),
        p_body,
        rid,
        handoff,
        mode,
    );

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
    let head = match watch_prefill(timeout_at(deadline, send), &mut leg, &mut release).await {
        Ok(head) => head,
        Err(f) => return Err(prefill_failed(f, &leg, &mut release, &d).await),
    };
    let resp = match head {
        Ok(Ok(resp)) => resp,
        Ok(Err(err)) => {
            mark_down_if_unreachable(&d, &err);
            let e = ProxyError::transport(Role::Decode, &d.url, &err);
            return Err(decode_failed(e, leg, &mut release).await);
        }
        Err(_) => {
            // D waits for P's writes, so a D that is silent while P is too is most likely P's
            // fault. P's own timeout started before D's, so its verdict is due: hear it first
            // (bounded all the same), and name P if it failed.
            if leg.pending() {
                match timeout(Duration::from_secs(1), &mut leg).await {
                    Ok(Err(f)) => return Err(prefill_failed(f, &leg, &mut release, &d).await),
                    Ok(Ok(params)) => release.set_params(params),
                    Err(_) => {}
                }
            }
            let e = ProxyError::timeout(Role::Decode, &d.url, "no response head", t);
            return Err(decode_failed(e, leg, &mut release).await);
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let body = read_capped(resp, deadline).await;
        let e = ProxyError::upstream_status(Role::Decode, &d.url, status, &body);
        return Err(decode_failed(e, leg, &mut release).await);
    }
    // D has accepted the request: it owns its side of the handoff now (it cancels its
    // registration with P if it ends early). P's leg is still watched until D's answer is done.
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
        let leg = leg.pending().then_some(leg);
        let body = Body::from_stream(relay(resp, s.clone(), d_guard, rid, sse, leg, marks));
        return builder.body(body).map_err(|e| internal(e.to_string()));
    }
    let read = read_body(resp, s.cfg.max_upstream_body_bytes);
    let bytes = match watch_prefill(timeout_at(deadline, read), &mut leg, &mut release).await {
        Err(f) => return Err(prefill_failed(f, &leg, &mut release, &d).await),
        Ok(Ok(Ok(b))) => b,
        Ok(Ok(Err(err))) => return Err(err.into_error(s, Role::Decode, &d.url)),
        Ok(Err(_)) => {
            return Err(ProxyError::timeout(
                Role::Decode,
                &d.url,
                "no complete response",
                t,
            ))
        }
    };
    leg.detach();
    drop(d_guard);
    builder
        .body(Body::from(bytes))
        .map_err(|e| internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leg_params() {
        let h: HandoffId = "0123456789abcdef0123456789abcdef".parse().unwrap();
        assert_eq!(
            prefill_params(h, TransferMode::Push),
            json!({
                "do_remote_decode": true, "do_remote_prefill": false,
                "transfer_mode": "push", "handoff_id": "0123456789abcdef0123456789abcdef"
            })
        );
        let info: EngineInfo = serde_json::from_value(json!({
            "engine_id": "p-1", "remote_host": "10.0.0.2", "remote_port": 5601, "tp_size": 2,
            "block_size": 16, "transfer_mode": "push", "role": "prefill"
        }))
        .unwrap();
        assert_eq!(
            decode_params(h, &info, TransferMode::Push),
            json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "transfer_mode": "push", "handoff_id": "0123456789abcdef0123456789abcdef",
                "remote_engine_id": "p-1", "remote_host": "10.0.0.2", "remote_port": 5601,
                "tp_size": 2
            })
        );
        assert_eq!(release_params(h, TransferMode::Push)["epoch"], 1);
        assert!(info.transfer_mode == Some(TransferMode::Push));
        assert!(!info.takes_layerwise_pull());
        // A layer-wise pull: the same legs, in pull mode, each saying it is layer-wise.
        assert_eq!(prefill_params(h, TransferMode::Pull)["layerwise"], true);
        assert_eq!(
            prefill_params(h, TransferMode::Pull)["transfer_mode"],
            "pull"
        );
        let d = decode_params(h, &info, TransferMode::Pull);
        assert_eq!(
            (d["layerwise"].clone(), d["transfer_mode"].clone()),
            (json!(true), json!("pull"))
        );
        assert!(d.get("remote_block_ids").is_none());
        assert!(prefill_params(h, TransferMode::Push)
            .get("layerwise")
            .is_none());
        let pull_p: EngineInfo = serde_json::from_value(json!({
            "engine_id": "p-1", "remote_host": "10.0.0.2", "remote_port": 5601, "tp_size": 1,
            "transfer_mode": "pull", "layerwise_pull": true
        }))
        .unwrap();
        assert!(pull_p.takes_layerwise_pull());
        assert_eq!(
            release_params(h, TransferMode::Push)["handoff_id"],
            "0123456789abcdef0123456789abcdef"
        );
    }

    #[test]
    fn a_prefill_answer_must_be_for_this_push() {
        let m = crate::metrics::Metrics::new();
        let pool = crate::pool::Pool::new(Role::Prefill);
        let p = pool.add("http://p:1".into(), &m).unwrap();
        let h = HandoffId::from_bytes(u128::to_le_bytes(0xabc));
        let ok = json!({"handoff_id": h.to_string(), "transfer_mode": "push", "epoch": 1});
        let push = TransferMode::Push;
        assert!(check_answer(&p, &ok, h, push).is_ok());
        // Keys left out are not held against P.
        assert!(check_answer(&p, &json!({"epoch": 1}), h, push).is_ok());
        let other = json!({"handoff_id": HandoffId::from_bytes(u128::to_le_bytes(7)).to_string(), "transfer_mode": "push"});
        let e = check_answer(&p, &other, h, push).unwrap_err();
        assert_eq!(e.kind, "bad_prefill_response");
        assert!(e.message.contains("http://p:1"), "{}", e.message);
        let pulled = json!({"handoff_id": h.to_string(), "transfer_mode": "pull"});
        assert!(check_answer(&p, &pulled, h, push).is_err());
        assert!(check_answer(&p, &json!({"handoff_id": 5}), h, push).is_err());
        // A layer-wise pull's answer must be a pull's, for the same handoff.
        assert!(check_answer(&p, &pulled, h, TransferMode::Pull).is_ok());
        assert!(check_answer(&p, &ok, h, TransferMode::Pull).is_err());
        assert!(check_answer(&p, &other, h, TransferMode::Pull).is_err());
    }
}
