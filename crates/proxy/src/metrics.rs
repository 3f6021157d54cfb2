//! Prometheus metrics of the proxy (OpenMetrics text on GET /metrics).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct InstanceLabels {
    pub(crate) role: &'static str,
    pub(crate) url: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    pub(crate) outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReleaseLabels {
    pub(crate) result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RoleLabels {
    pub(crate) role: &'static str,
}

/// How an admin API request ended, as counted in `handoff_proxy_admin_requests_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AdminOutcome {
    Ok,
    /// No `Authorization: Bearer` token, or a wrong one (401).
    Unauthorized,
    /// A body that is not an instance, or an instance URL that is refused (400).
    BadRequest,
    /// Removing an instance that is not there (404).
    NotFound,
}

impl AdminOutcome {
    pub(crate) const ALL: [AdminOutcome; 4] = [
        AdminOutcome::Ok,
        AdminOutcome::Unauthorized,
        AdminOutcome::BadRequest,
        AdminOutcome::NotFound,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AdminOutcome::Ok => "ok",
            AdminOutcome::Unauthorized => "unauthorized",
            AdminOutcome::BadRequest => "bad_request",
            AdminOutcome::NotFound => "not_found",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StreamEndLabels {
    pub(crate) end: &'static str,
}

/// How a client request ended, as counted in `handoff_proxy_requests_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// D accepted the request and its answer (head) went to the client.
    Ok,
    BadRequest,
    NoPrefill,
    NoDecode,
    PrefillFailed,
    DecodeFailed,
    /// The client went away before the answer's head was sent.
    Cancelled,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::BadRequest => "bad_request",
            Outcome::NoPrefill => "no_prefill",
            Outcome::NoDecode => "no_decode",
            Outcome::PrefillFailed => "prefill_failed",
            Outcome::DecodeFailed => "decode_failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// How a relayed D stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamEnd {
    Complete,
    ClientDisconnect,
    UpstreamError,
    IdleTimeout,
    /// Push: P's leg failed while D was streaming, so D's stream was cut.
    PrefillFailed,
}

impl StreamEnd {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StreamEnd::Complete => "complete",
            StreamEnd::ClientDisconnect => "client_disconnect",
            StreamEnd::UpstreamError => "upstream_error",
            StreamEnd::IdleTimeout => "idle_timeout",
            StreamEnd::PrefillFailed => "prefill_failed",
        }
    }
}

pub(crate) struct Metrics {
    pub(crate) registry: Registry,
    pub(crate) requests: Family<OutcomeLabels, Counter>,
    pub(crate) in_flight: Family<InstanceLabels, Gauge>,
    pub(crate) instance_healthy: Family<InstanceLabels, Gauge>,
    pub(crate) releases: Family<ReleaseLabels, Counter>,
    pub(crate) stream_ends: Family<StreamEndLabels, Counter>,
    pub(crate) admin: Family<OutcomeLabels, Counter>,
    pub(crate) upstream_too_large: Family<RoleLabels, Counter>,
    /// Both listeners' limits (`listener="public"|"admin"`).
    pub(crate) http: handoff_http::HttpMetrics,
    /// A request's timeline as the proxy sees it (see [`Metrics::phase`]).
    pub(crate) phases: handoff_http::PhaseTimes,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("handoff_proxy");
        let requests = Family::<OutcomeLabels, Counter>::default();
        let in_flight = Family::<InstanceLabels, Gauge>::default();
        let instance_healthy = Family::<InstanceLabels, Gauge>::default();
        let releases = Family::<ReleaseLabels, Counter>::default();
        let stream_ends = Family::<StreamEndLabels, Counter>::default();
        registry.register(
            "requests",
            "Client completion requests by outcome",
            requests.clone(),
        );
        registry.register(
            "in_flight",
            "Requests this proxy has in flight to each instance",
            in_flight.clone(),
        );
        registry.register(
            "instance_healthy",
            "1 when the instance passed its last health check",
            instance_healthy.clone(),
        );
        registry.register(
            "releases",
            "Release requests sent to P because D never got a request (or, in push mode, a leg failed), by result",
            releases.clone(),
        );
        registry.register(
            "stream_ends",
            "How relayed decode streams ended",
            stream_ends.clone(),
        );
        let admin = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "admin_requests",
            "Admin API requests by outcome (unauthorized: no or a wrong bearer token)",
            admin.clone(),
        );
        for o in AdminOutcome::ALL {
            let _ = admin.get_or_create(&OutcomeLabels {
                outcome: o.as_str(),
            });
        }
        let upstream_too_large = Family::<RoleLabels, Counter>::default();
        registry.register(
            "upstream_body_too_large",
            "Upstream answers the proxy stopped reading because their body exceeded max_upstream_body_bytes (answered 502), by role",
            upstream_too_large.clone(),
        );
        for role in ["prefill", "decode"] {
            let _ = upstream_too_large.get_or_create(&RoleLabels { role });
        }
        let http = handoff_http::HttpMetrics::register(&mut registry);
        let phases = handoff_http::PhaseTimes::register(
            &mut registry,
            "A request's timeline at the proxy: to_decode (from the client's request to sending \
             it to D), prefill_leg (P's answer, pull and push), \
             decode_head (D's answer head, from sending to D), decode_first_chunk (D's first \
             body chunk, from sending to D), first_chunk (the first chunk relayed to the \
             client, from the client's request)",
        );
        Metrics {
            phases,
            registry,
            requests,
            in_flight,
            instance_healthy,
            releases,
            stream_ends,
            admin,
            upstream_too_large,
            http,
        }
    }

    pub(crate) fn outcome(&self, outcome: Outcome) {
        self.requests
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
    }

    pub(crate) fn release(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.releases.get_or_create(&ReleaseLabels { result }).inc();
    }

    pub(crate) fn phase(&self, phase: &'static str, took: std::time::Duration) {
        self.phases.observe(phase, took);
    }

    pub(crate) fn stream_end(&self, end: StreamEnd) {
        self.stream_ends
            .get_or_create(&StreamEndLabels { end: end.as_str() })
            .inc();
    }

    pub(crate) fn admin(&self, outcome: AdminOutcome) {
        self.admin
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
    }

    pub(crate) fn upstream_too_large(&self, role: &'static str) {
        self.upstream_too_large
            .get_or_create(&RoleLabels { role })
            .inc();
    }

    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
