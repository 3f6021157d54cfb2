//! The push flow (see the crate docs): one fresh handoff id, P's side channel from its
//! `/v1/handoff/info`, both legs sent at once, D's answer relayed while P's leg is watched.
//! A layer-wise pull (a pull-mode P whose info says `layerwise_pull`) runs the same flow: only
//! the mode in both legs' params differs, and D reads where P would have written.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::Response;
use handoff_proto::HandoffId;
use serde_json::{json, Map, Value};
use tokio::time::{timeout, timeout_at, Instant};

use crate::error::ProxyError;
use crate::info::EngineInfo;
use crate::pool::{InFlight, Instance, Role};
use crate::prefill_leg::{prefill_params, release_params, PrefillFailure, PrefillLeg};
use crate::relay::{relay, Marks};
use crate::upstream::{
    answer_head, fetch_info, forward_headers, internal, mark_down_if_unreachable, pick_decode_for,
    pick_prefill, prefill_leg_body, read_body, read_capped, release_detached, send_decode,
    store_info, ReleaseGuard,
};
use crate::Shared;
use handoff_proto::Flow;

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

/// `kv_transfer_params` of the D leg. Push: reserve blocks now, register them with P (found by
/// its info), decode once P's writes land. Layer-wise pull: ask P (found by its info) for the
/// blocks at once and read the layers as P saves them. No `remote_block_ids`: D learns P's
/// from P.
pub(crate) fn decode_params(handoff: HandoffId, p: &EngineInfo, flow: Flow) -> Value {
    let mut v = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "handoff_id": handoff.to_string(),
        "remote_engine_id": p.engine_id,
        "remote_host": p.remote_host,
        "remote_port": p.remote_port,
        "tp_size": p.tp_size,
    });
    if let Some(m) = v.as_object_mut() {
        flow.write_into(m);
    }
    v
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
    let p_guard = pick_prefill(s)?;
    let legs = BothLegs {
        path,
        rid,
        headers,
        received,
        flow: Flow::Push,
    };
    let d_guard = pick_decode_for(s, p_guard.instance())?;
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
    /// Push or a layer-wise pull.
    pub(crate) flow: Flow,
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
        flow,
    } = legs;
    let p = p_guard.instance().clone();
    let d = d_guard.instance().clone();
    // 128 random bits: the id is a capability, unguessable by anyone but the two legs.
    let handoff = HandoffId::from_bytes(rand::random());
    let stream = client.get("stream").and_then(Value::as_bool) == Some(true);
    let mut p_body = prefill_leg_body(&client);
    p_body["kv_transfer_params"] = prefill_params(handoff, flow);
    let mut d_body = client;
    d_body.insert(
        "kv_transfer_params".into(),
        decode_params(handoff, &info, flow),
    );
    tracing::debug!(
        request_id = %rid, handoff_id = %handoff, prefill = %p.url, decode = %d.url,
        flow = flow.as_str(), "sending both legs"
    );

    // From here P may hold blocks for this handoff: every way out until D accepts releases them.
    let mut release = ReleaseGuard::new(s.clone(), p.clone(), release_params(handoff, flow), rid);
    let mut leg = PrefillLeg::spawn(
        s,
        p_guard,
        path,
        forward_headers(headers, rid),
        p_body,
        rid,
        handoff,
        flow,
    );

    let t = s.cfg.request_timeout;
    let decode_sent = Instant::now();
    s.metrics.phase("to_decode", decode_sent - received);
    let deadline = decode_sent + t;
    let send = send_decode(s, &d, path, forward_headers(headers, rid), d_body);
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

    let (builder, sse) = answer_head(&resp, stream);
    if stream {
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
    use crate::error::ErrorKind;
    use crate::prefill_leg::check_answer;

    #[test]
    fn leg_params() {
        let h: HandoffId = "0123456789abcdef0123456789abcdef".parse().unwrap();
        assert_eq!(
            prefill_params(h, Flow::Push),
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
            decode_params(h, &info, Flow::Push),
            json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "transfer_mode": "push", "handoff_id": "0123456789abcdef0123456789abcdef",
                "remote_engine_id": "p-1", "remote_host": "10.0.0.2", "remote_port": 5601,
                "tp_size": 2
            })
        );
        assert_eq!(release_params(h, Flow::Push)["epoch"], 1);
        assert!(info.transfer_mode == Some(crate::TransferMode::Push));
        assert!(!info.takes_layerwise_pull());
        // A layer-wise pull: the same legs, in pull mode, each saying it is layer-wise.
        assert_eq!(prefill_params(h, Flow::LayerwisePull)["layerwise"], true);
        assert_eq!(
            prefill_params(h, Flow::LayerwisePull)["transfer_mode"],
            "pull"
        );
        let d = decode_params(h, &info, Flow::LayerwisePull);
        assert_eq!(
            (d["layerwise"].clone(), d["transfer_mode"].clone()),
            (json!(true), json!("pull"))
        );
        assert!(d.get("remote_block_ids").is_none());
        assert!(prefill_params(h, Flow::Push).get("layerwise").is_none());
        let pull_p: EngineInfo = serde_json::from_value(json!({
            "engine_id": "p-1", "remote_host": "10.0.0.2", "remote_port": 5601, "tp_size": 1,
            "transfer_mode": "pull", "layerwise_pull": true
        }))
        .unwrap();
        assert!(pull_p.takes_layerwise_pull());
        assert_eq!(
            release_params(h, Flow::Push)["handoff_id"],
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
        let push = Flow::Push;
        assert!(check_answer(&p, &ok, h, push).is_ok());
        // Keys left out are not held against P.
        assert!(check_answer(&p, &json!({"epoch": 1}), h, push).is_ok());
        let other = json!({"handoff_id": HandoffId::from_bytes(u128::to_le_bytes(7)).to_string(), "transfer_mode": "push"});
        let e = check_answer(&p, &other, h, push).unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadPrefillResponse);
        assert!(e.message.contains("http://p:1"), "{}", e.message);
        let pulled = json!({"handoff_id": h.to_string(), "transfer_mode": "pull"});
        assert!(check_answer(&p, &pulled, h, push).is_err());
        assert!(check_answer(&p, &json!({"handoff_id": 5}), h, push).is_err());
        // A layer-wise pull's answer must be a pull's, for the same handoff.
        assert!(check_answer(&p, &pulled, h, Flow::LayerwisePull).is_ok());
        assert!(check_answer(&p, &ok, h, Flow::LayerwisePull).is_err());
        assert!(check_answer(&p, &other, h, Flow::LayerwisePull).is_err());
    }
}
