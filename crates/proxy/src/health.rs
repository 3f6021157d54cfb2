//! Periodic health checks: GET `{url}/health` of every instance, and `{url}/v1/handoff/info`
//! of every P and D as well (its compatibility key; push mode: P must answer it; pull mode:
//! whether the engine takes a layer-wise pull).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;

use crate::error::chain;
use crate::pool::{Instance, Role};
use crate::{Shared, TransferMode};

/// Checks one instance and records the verdict (logging changes).
pub(crate) async fn check(shared: &Shared, inst: &Instance) {
    let url = format!("{}/health", inst.url);
    // Whether the check failed only for want of an answer in time, on a connection the
    // instance accepted: a host that does not even connect (down, partitioned) is no late one.
    let mut late = false;
    let limit = shared.cfg.health_timeout;
    // reqwest's own limit ends the request first; this one only bounds the call.
    let verdict = match tokio::time::timeout(
        limit + Duration::from_millis(250),
        shared.health_http.get(&url).timeout(limit).send(),
    )
    .await
    {
        Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
        Ok(Ok(resp)) => Err(format!("HTTP {}", resp.status())),
        Ok(Err(e)) if e.is_connect() => Err(chain(&e)),
        Ok(Err(e)) if e.is_timeout() => {
            late = true;
            Err(format!("no answer within {limit:?}"))
        }
        Ok(Err(e)) => Err(chain(&e)),
        Err(_) => {
            late = true;
            Err(format!("no answer within {limit:?}"))
        }
    };
    // A busy engine answers late (vLLM's API server on a loaded host can take seconds); a dead
    // one refuses at once. A healthy instance stays so through a few late answers in a row:
    // marking it unhealthy at the first would answer clients 503 while it serves fine.
    if let Err(reason) = &verdict {
        if late && inst.is_healthy() {
            let n = inst.late_check();
            if n < shared.cfg.health_timeouts_to_fail.max(1) {
                tracing::debug!(role = %inst.role, url = %inst.url, %reason, late = n, "late health answer: still healthy");
                return;
            }
        }
    }
    // Alive is not enough: an engine that says it is not ready (`/ready` 503) gets no new work.
    // One without a readiness endpoint (vLLM: 404) is judged by `/health` alone.
    let verdict = match verdict {
        Ok(()) => not_ready(shared, inst).await.map_or(Ok(()), Err),
        e => e,
    };
    // A push P is of use only with its side channel known and in push mode: one that cannot
    // say where it is, or says it pulls, gets no traffic (each request would only fail).
    let verdict = if shared.cfg.mode == TransferMode::Push && inst.role == Role::Prefill {
        let fetched = match verdict {
            Ok(()) => crate::upstream::fetch_info(shared, inst, shared.cfg.health_timeout)
                .await
                .map_err(|e| e.message),
            Err(reason) => Err(reason),
        };
        match fetched {
            Ok(info) => {
                crate::upstream::store_info(inst, info);
                Ok(())
            }
            Err(reason) => {
                inst.set_handoff_info(None);
                Err(reason)
            }
        }
    } else if inst.role == Role::Prefill && verdict.is_ok() {
        // A pull P: its info only says whether it takes a layer-wise pull. One without it (a
        // vLLM P) is as healthy, and pulled the classic way.
        match crate::upstream::fetch_info(shared, inst, shared.cfg.health_timeout).await {
            Ok(info) => crate::upstream::store_info(inst, info),
            Err(_) => {
                inst.set_handoff_info(None);
            }
        }
        verdict
    } else if inst.role == Role::Decode && verdict.is_ok() {
        // A D: its compatibility key, and in pull mode whether it takes a layer-wise pull (see
        // `EngineInfo::takes_layerwise_pull`).
        inst.set_handoff_info(decode_info(shared, inst).await.map(Arc::new));
        verdict
    } else {
        verdict
    };
    let healthy = verdict.is_ok();
    let was = inst.set_healthy(healthy);
    match verdict {
        Ok(()) if !was => {
            tracing::info!(role = %inst.role, url = %inst.url, "instance healthy")
        }
        Err(reason) if was => {
            tracing::warn!(role = %inst.role, url = %inst.url, %reason, "instance unhealthy")
        }
        _ => {}
    }
}

/// Why the instance is not ready, when its `GET /ready` answers 503; `None` for any other
/// answer or none (an engine without the endpoint).
async fn not_ready(shared: &Shared, inst: &Instance) -> Option<String> {
    let t = shared.cfg.health_timeout;
    let url = format!("{}/ready", inst.url);
    let resp = tokio::time::timeout(t, shared.http.get(&url).timeout(t).send())
        .await
        .ok()?
        .ok()?;
    (resp.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE).then(|| "not ready".to_string())
}

/// D's `GET /v1/handoff/info`, if it answers one that parses; nothing else is asked of it.
async fn decode_info(shared: &Shared, inst: &Instance) -> Option<crate::info::EngineInfo> {
    let t = shared.cfg.health_timeout;
    let url = format!("{}/v1/handoff/info", inst.url);
    let call = async {
        let resp = shared.http.get(&url).timeout(t).send().await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = crate::upstream::read_body(resp, 64 << 10).await.ok()?;
        serde_json::from_slice(&body).ok()
    };
    tokio::time::timeout(t, call).await.ok().flatten()
}

/// Checks every instance of both roles, concurrently (one slow instance must not delay the
/// verdict on the others).
pub(crate) async fn check_all(shared: &Shared) {
    let mut all = shared.prefill.snapshot();
    all.extend(shared.decode.snapshot());
    join_all(all.iter().map(|inst| check(shared, inst))).await;
}

pub(crate) async fn run(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(shared.cfg.health_interval);
    // A round slower than the interval delays the next one instead of firing a burst.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The first tick is immediate, and start() has just run a round.
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => check_all(&shared).await,
            // The guard wait_for returns is not Send: drop it inside the branch future.
            _ = async { drop(stop.wait_for(|s| *s).await) } => return,
        }
    }
}
