//! The errors the proxy answers a client with: an HTTP status and an OpenAI-style JSON body that
//! names the leg, the instance and the reason, so that an operator can tell from one response
//! which engine failed and how.

use std::error::Error as _;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::metrics::Outcome;
use crate::pool::Role;

/// What went wrong, as the `type` of the error body a client gets (stable strings: clients and
/// dashboards match on them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    BadPrefillInfo,
    BadPrefillResponse,
    InternalError,
    InvalidRequestError,
    NoCompatiblePair,
    NoHealthyInstance,
    UpstreamBodyTooLarge,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    Unauthorized,
    NotFound,
}

impl ErrorKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadPrefillInfo => "bad_prefill_info",
            ErrorKind::BadPrefillResponse => "bad_prefill_response",
            ErrorKind::InternalError => "internal_error",
            ErrorKind::InvalidRequestError => "invalid_request_error",
            ErrorKind::NoCompatiblePair => "no_compatible_pair",
            ErrorKind::NoHealthyInstance => "no_healthy_instance",
            ErrorKind::UpstreamBodyTooLarge => "upstream_body_too_large",
            ErrorKind::UpstreamError => "upstream_error",
            ErrorKind::UpstreamStatus => "upstream_status",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::UpstreamUnreachable => "upstream_unreachable",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::NotFound => "not_found",
        }
    }
}

#[derive(Debug)]
pub(crate) struct ProxyError {
    pub(crate) status: StatusCode,
    pub(crate) outcome: Outcome,
    pub(crate) kind: ErrorKind,
    pub(crate) message: String,
    // Boxed: most errors carry few details, and a small error keeps every Result small.
    pub(crate) detail: Box<Detail>,
}

#[derive(Debug, Default)]
pub(crate) struct Detail {
    pub(crate) role: Option<Role>,
    pub(crate) instance: Option<String>,
    /// The upstream's own status and body, when it answered.
    pub(crate) upstream_status: Option<u16>,
    pub(crate) upstream_body: Option<Value>,
    /// Whether the proxy told P to release its blocks (only set on the decode leg).
    pub(crate) prefill_released: Option<bool>,
    pub(crate) request_id: Option<String>,
}

impl ProxyError {
    pub(crate) fn new(status: StatusCode, outcome: Outcome, kind: ErrorKind, msg: String) -> Self {
        ProxyError {
            status,
            outcome,
            kind,
            message: msg,
            detail: Box::default(),
        }
    }

    pub(crate) fn bad_request(msg: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            Outcome::BadRequest,
            ErrorKind::InvalidRequestError,
            msg.into(),
        )
    }

    pub(crate) fn no_instance(role: Role) -> Self {
        let outcome = match role {
            Role::Prefill => Outcome::NoPrefill,
            Role::Decode => Outcome::NoDecode,
        };
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            outcome,
            ErrorKind::NoHealthyInstance,
            format!("no healthy {role} instance"),
        );
        e.detail.role = Some(role);
        e
    }

    /// Healthy P and D exist, but no P has a D it can exchange KV with: their compatibility
    /// keys differ (`why` names them). Answered before anything is sent to either.
    pub(crate) fn incompatible(why: String) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            Outcome::NoDecode,
            ErrorKind::NoCompatiblePair,
            format!("no prefill and decode instance can exchange KV: {why}"),
        );
        e.detail.role = Some(Role::Decode);
        e
    }

    /// An upstream call failed; `reason` completes "{role} instance {url} ..." ("is unreachable: ...").
    pub(crate) fn upstream(
        role: Role,
        instance: &str,
        status: StatusCode,
        kind: ErrorKind,
        reason: String,
    ) -> Self {
        let outcome = match role {
            Role::Prefill => Outcome::PrefillFailed,
            Role::Decode => Outcome::DecodeFailed,
        };
        let mut e = Self::new(
            status,
            outcome,
            kind,
            format!("{role} instance {instance} {reason}"),
        );
        e.detail.role = Some(role);
        e.detail.instance = Some(instance.to_string());
        e
    }

    /// Maps a transport-level failure (no HTTP answer at all) to 502 or 504.
    pub(crate) fn transport(role: Role, instance: &str, err: &reqwest::Error) -> Self {
        if err.is_timeout() {
            Self::upstream(
                role,
                instance,
                StatusCode::GATEWAY_TIMEOUT,
                ErrorKind::UpstreamTimeout,
                format!("timed out: {}", chain(err)),
            )
        } else if err.is_connect() {
            Self::upstream(
                role,
                instance,
                StatusCode::BAD_GATEWAY,
                ErrorKind::UpstreamUnreachable,
                format!("is unreachable: {}", chain(err)),
            )
        } else {
            Self::upstream(
                role,
                instance,
                StatusCode::BAD_GATEWAY,
                ErrorKind::UpstreamError,
                format!("failed: {}", chain(err)),
            )
        }
    }

    pub(crate) fn timeout(role: Role, instance: &str, what: &str, after: Duration) -> Self {
        Self::upstream(
            role,
            instance,
            StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::UpstreamTimeout,
            format!("timed out: {what} within {after:?}"),
        )
    }

    /// The upstream answered with an error status. 503 (overloaded, pool full) stays 503 so that
    /// a client may retry; other 5xx become 502; a 4xx is the client's fault and keeps its status.
    /// P answered 200 with something the proxy cannot use (`reason` says what).
    pub(crate) fn bad_prefill_response(instance: &str, reason: String) -> Self {
        Self::upstream(
            Role::Prefill,
            instance,
            StatusCode::BAD_GATEWAY,
            ErrorKind::BadPrefillResponse,
            reason,
        )
    }

    /// The instance answered 503 `draining` (it is leaving the fleet, and took nothing of the
    /// request): another instance may take the request.
    pub(crate) fn is_drain_refusal(&self) -> bool {
        self.detail.upstream_status == Some(503)
            && self
                .detail
                .upstream_body
                .as_ref()
                .and_then(|b| b.pointer("/error/type"))
                .and_then(Value::as_str)
                == Some("draining")
    }

    pub(crate) fn upstream_status(
        role: Role,
        instance: &str,
        status: StatusCode,
        body: &[u8],
    ) -> Self {
        let ours = if status == StatusCode::SERVICE_UNAVAILABLE {
            StatusCode::SERVICE_UNAVAILABLE
        } else if status.is_server_error() {
            StatusCode::BAD_GATEWAY
        } else if status.is_client_error() {
            status
        } else {
            StatusCode::BAD_GATEWAY
        };
        let verb = if status.is_client_error() {
            "rejected the request"
        } else {
            "refused the request"
        };
        let mut e = Self::upstream(
            role,
            instance,
            ours,
            ErrorKind::UpstreamStatus,
            format!("{verb}: HTTP {status}: {}", snippet(body)),
        );
        e.detail.upstream_status = Some(status.as_u16());
        e.detail.upstream_body = Some(
            serde_json::from_slice(body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned())),
        );
        e
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let mut err = json!({
            "message": self.message,
            "type": self.kind.as_str(),
            "code": self.status.as_u16(),
        });
        let obj = err.as_object_mut().expect("object literal");
        if let Some(role) = self.detail.role {
            obj.insert("role".into(), json!(role));
        }
        if let Some(instance) = self.detail.instance {
            obj.insert("instance".into(), json!(instance));
        }
        if let Some(s) = self.detail.upstream_status {
            obj.insert("upstream_status".into(), json!(s));
        }
        if let Some(b) = self.detail.upstream_body {
            obj.insert("upstream_body".into(), b);
        }
        if let Some(r) = self.detail.prefill_released {
            obj.insert("prefill_released".into(), json!(r));
        }
        if let Some(id) = self.detail.request_id {
            obj.insert("request_id".into(), json!(id));
        }
        (self.status, axum::Json(json!({ "error": err }))).into_response()
    }
}

/// A reqwest error with its sources: reqwest's own message ("error sending request") hides the
/// useful part ("connection refused") in the chain.
pub(crate) fn chain(err: &reqwest::Error) -> String {
    let mut s = err.to_string();
    let mut src = err.source();
    while let Some(e) = src {
        let part = e.to_string();
        if !s.contains(&part) {
            s.push_str(": ");
            s.push_str(&part);
        }
        src = e.source();
    }
    s
}

/// The start of an upstream body, for error messages.
pub(crate) fn snippet(body: &[u8]) -> String {
    const MAX: usize = 300;
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.chars().count() <= MAX {
        text.to_string()
    } else {
        let cut: String = text.chars().take(MAX).collect();
        format!("{cut}...")
    }
}
