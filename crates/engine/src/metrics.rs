//! The reference engine's own metrics (the connector registers its own beside them).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone)]
pub struct EngineMetrics {
    /// How long each phase of a request took here: `queued` (arrival to admission: blocks
    /// allocated), `prefill` (the forward pass; P and a monolithic engine), `kv_wait` (D:
    /// admission to the KV in place: claim, P's answer, grant, transfer), `first_token` (from
    /// the prompt's KV in place to the first token sent).
    pub phase: handoff_http::PhaseTimes,
    pub requests: Family<OutcomeLabels, Counter>,
    pub ttft: Histogram,
    pub blocks_free: Gauge,
    pub blocks_used: Gauge,
    pub waiting: Gauge,
    pub running: Gauge,
    pub awaiting_kv: Gauge,
}

impl EngineMetrics {
    pub fn new(registry: &mut Registry) -> Self {
        let r = registry.sub_registry_with_prefix("engine");
        let phase = handoff_http::PhaseTimes::register(
            r,
            "Time a request spent in each phase of its timeline on this engine",
        );
        let m = EngineMetrics {
            phase,
            requests: Family::default(),
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            blocks_free: Gauge::default(),
            blocks_used: Gauge::default(),
            waiting: Gauge::default(),
            running: Gauge::default(),
            awaiting_kv: Gauge::default(),
        };
        r.register("requests", "Requests per outcome", m.requests.clone());
        r.register(
            "time_to_first_token_seconds",
            "From arrival to first token",
            m.ttft.clone(),
        );
        r.register(
            "kv_blocks_free",
            "Free blocks in the KV pool",
            m.blocks_free.clone(),
        );
        r.register(
            "kv_blocks_used",
            "Blocks out of the KV pool",
            m.blocks_used.clone(),
        );
        r.register(
            "requests_waiting",
            "Requests waiting for blocks",
            m.waiting.clone(),
        );
        r.register(
            "sequences_running",
            "Sequences being decoded",
            m.running.clone(),
        );
        r.register(
            "requests_awaiting_kv",
            "Requests waiting for a KV transfer",
            m.awaiting_kv.clone(),
        );
        m
    }

    pub fn phase(&self, phase: &'static str, took: std::time::Duration) {
        self.phase.observe(phase, took);
    }

    pub fn outcome(&self, outcome: &'static str) {
        self.requests
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}
