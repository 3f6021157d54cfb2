//! A request's timeline as a service sees it: how long each phase took, one histogram per
//! phase (`<prefix>_phase_seconds{phase}`). The engine and the proxy keep one each, with the
//! same buckets, so `handoff bench ttft` reads both the same way.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

/// Time spent per phase of a request's timeline.
#[derive(Clone)]
pub struct PhaseTimes(Family<PhaseLabels, Histogram>);

impl PhaseTimes {
    /// Registers `phase_seconds` in `registry` (under its prefix), described by `help`.
    pub fn register(registry: &mut Registry, help: &str) -> Self {
        // 100 µs to ~127 s in steps of 25%: a phase is anything from a channel hop to a
        // deadline, and a quantile read from these buckets is within 25% of the truth.
        let family = Family::<PhaseLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0001, 1.25, 64))
        });
        registry.register("phase_seconds", help, family.clone());
        PhaseTimes(family)
    }

    pub fn observe(&self, phase: &'static str, took: Duration) {
        self.0
            .get_or_create(&PhaseLabels { phase })
            .observe(took.as_secs_f64());
    }
}
