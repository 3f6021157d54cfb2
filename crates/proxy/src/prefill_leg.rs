//! P's leg of a push or a layer-wise pull, running on its own from the moment it is sent
//! (`PrefillLeg`): its params, the check of P's answer, and the release owed when it fails. The
//! push flow and the relay of D's answer both watch it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::http::HeaderMap;
use handoff_proto::{Flow, HandoffId};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use crate::error::{ErrorKind, ProxyError};
use crate::pool::{InFlight, Instance};
use crate::upstream::{internal, prefill_leg, release};
use crate::Shared;

/// `kv_transfer_params` of the P leg. Push: prefill, then write the KV into the blocks D
/// registers under this handoff id. Layer-wise pull: hold the KV under this handoff id from the
/// prefill's start, and let D read each layer once saved.
pub(crate) fn prefill_params(handoff: HandoffId, flow: Flow) -> Value {
    let mut v = serde_json::Map::new();
    v.insert("do_remote_decode".into(), json!(true));
    v.insert("do_remote_prefill".into(), json!(false));
    v.insert("handoff_id".into(), json!(handoff.to_string()));
    flow.write_into(&mut v);
    Value::Object(v)
}

/// What a release names when P has not answered (yet): the handoff and its first epoch.
pub(crate) fn release_params(handoff: HandoffId, flow: Flow) -> Value {
    let mut v = prefill_params(handoff, flow);
    v["epoch"] = json!(1);
    v
}

/// Why P's leg failed, with P's params when it answered (so that a release names what P holds).
pub(crate) struct PrefillFailure {
    pub(crate) error: ProxyError,
    pub(crate) params: Option<Value>,
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
    flow: Flow,
}

impl PrefillLeg {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn spawn(
        s: &Arc<Shared>,
        guard: InFlight,
        path: &'static str,
        headers: HeaderMap,
        body: Value,
        rid: &str,
        handoff: HandoffId,
        flow: Flow,
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
            match check_answer(p, &params, handoff, flow) {
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
            flow,
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
        if f.error.kind == ErrorKind::UpstreamUnreachable {
            return None;
        }
        let params = f
            .params
            .clone()
            .filter(|v| v.get("handoff_id").is_some_and(Value::is_string))
            .unwrap_or_else(|| release_params(self.handoff, self.flow));
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
pub(crate) fn check_answer(
    p: &Instance,
    params: &Value,
    handoff: HandoffId,
    flow: Flow,
) -> Result<(), ProxyError> {
    let bad = |reason: String| ProxyError::bad_prefill_response(&p.url, reason);
    let mode = flow.mode();
    match params.get("transfer_mode") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == mode.as_str() => {}
        Some(other) => {
            return Err(bad(format!(
                "answered a {} with transfer_mode {other}",
                flow.as_str()
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
