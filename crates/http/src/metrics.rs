//! Prometheus metrics of bounded listeners.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    listener: &'static str,
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

/// A bound a listener enforced, as counted in `http_limit_hits_total{limit}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// A connection beyond `max_connections`, refused with 503.
    Connections,
    /// A request head not complete within `header_read_timeout` (408).
    HeaderTimeout,
    /// A request body not complete within `body_read_timeout` (408).
    BodyTimeout,
    /// A connection whose client stopped taking its answer, closed after `write_stall_timeout`.
    WriteStall,
    /// An idle connection closed after `idle_timeout`.
    IdleTimeout,
    /// A request body over `max_body_bytes` (413).
    BodyTooLarge,
    /// A request head over `max_header_bytes` (431).
    HeaderTooLarge,
    /// `accept` failed (out of file descriptors, ...).
    AcceptError,
}

impl Limit {
    pub const ALL: [Limit; 8] = [
        Limit::Connections,
        Limit::HeaderTimeout,
        Limit::BodyTimeout,
        Limit::WriteStall,
        Limit::IdleTimeout,
        Limit::BodyTooLarge,
        Limit::HeaderTooLarge,
        Limit::AcceptError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Connections => "connections",
            Limit::HeaderTimeout => "header_timeout",
            Limit::BodyTimeout => "body_timeout",
            Limit::IdleTimeout => "idle_timeout",
            Limit::WriteStall => "write_stall_timeout",
            Limit::BodyTooLarge => "body_too_large",
            Limit::HeaderTooLarge => "header_too_large",
            Limit::AcceptError => "accept_error",
        }
    }
}

/// The metric families of every bounded listener of one component, registered once.
#[derive(Clone)]
pub struct HttpMetrics {
    hits: Family<LimitLabels, Counter>,
    open: Family<ListenerLabels, Gauge>,
    accepted: Family<ListenerLabels, Counter>,
}

impl HttpMetrics {
    /// Registers `http_limit_hits_total{listener, limit}`, `http_connections_open{listener}` and
    /// `http_connections_accepted_total{listener}` (under the registry's prefix).
    pub fn register(registry: &mut Registry) -> Self {
        let m = HttpMetrics {
            hits: Family::default(),
            open: Family::default(),
            accepted: Family::default(),
        };
        registry.register(
            "http_limit_hits",
            "HTTP requests and connections refused or closed by a limit (connection cap, header/body/idle timeouts, body and header sizes), by listener",
            m.hits.clone(),
        );
        registry.register(
            "http_connections_open",
            "HTTP connections being served, by listener",
            m.open.clone(),
        );
        registry.register(
            "http_connections_accepted",
            "HTTP connections accepted (within the cap), by listener",
            m.accepted.clone(),
        );
        m
    }

    /// The counters of one listener (`listener` label), every limit's at 0 from the start.
    pub fn listener(&self, name: &'static str) -> ListenerMetrics {
        let hits = Limit::ALL.map(|l| {
            self.hits
                .get_or_create(&LimitLabels {
                    listener: name,
                    limit: l.as_str(),
                })
                .clone()
        });
        let labels = ListenerLabels { listener: name };
        ListenerMetrics {
            name,
            hits,
            open: self.open.get_or_create(&labels).clone(),
            accepted: self.accepted.get_or_create(&labels).clone(),
        }
    }
}

/// One listener's counters (cheap to clone: they share the registered ones).
#[derive(Clone, Debug)]
pub struct ListenerMetrics {
    name: &'static str,
    hits: [Counter; Limit::ALL.len()],
    open: Gauge,
    accepted: Counter,
}

impl ListenerMetrics {
    /// Counters registered nowhere (tests, or a listener whose metrics nobody reads).
    pub fn unregistered(name: &'static str) -> Self {
        HttpMetrics::register(&mut Registry::default()).listener(name)
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    fn index(limit: Limit) -> usize {
        Limit::ALL
            .iter()
            .position(|l| *l == limit)
            .expect("every limit is in ALL")
    }

    pub fn hit(&self, limit: Limit) {
        self.hits[Self::index(limit)].inc();
    }

    /// How often `limit` was hit.
    pub fn hits(&self, limit: Limit) -> u64 {
        self.hits[Self::index(limit)].get()
    }

    pub fn open_connections(&self) -> i64 {
        self.open.get()
    }

    pub(crate) fn accepted(&self) {
        self.accepted.inc();
    }

    pub(crate) fn open(&self) -> OpenGuard {
        self.open.inc();
        OpenGuard(self.open.clone())
    }
}

pub(crate) struct OpenGuard(Gauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
