//! A request's timeline as the benchmarks read it: the `*_phase_seconds` histograms of the
//! proxy and the engines, scraped before and after a case, give each phase's mean, p50 and p99
//! over that case's requests alone.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::cluster::label_value as label;

/// One phase histogram: cumulative counts per upper bound, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hist {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

/// Every `<name>{phase=...}` histogram in an OpenMetrics text, by phase.
pub fn parse(text: &str, name: &str) -> BTreeMap<String, Hist> {
    let mut out: BTreeMap<String, Hist> = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((head, value)) = l.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let Some((metric, labels)) = head.split_once('{') else {
            continue;
        };
        let Some(phase) = label(labels, "phase") else {
            continue;
        };
        let h = out.entry(phase.to_string()).or_default();
        match metric.strip_prefix(name) {
            Some("_bucket") => {
                let le = match label(labels, "le") {
                    Some("+Inf") => f64::INFINITY,
                    Some(le) => match le.parse() {
                        Ok(le) => le,
                        Err(_) => continue,
                    },
                    None => continue,
                };
                h.buckets.push((le, v));
            }
            Some("_sum") => h.sum = v,
            Some("_count") => h.count = v,
            _ => {}
        }
    }
    for h in out.values_mut() {
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

impl Hist {
    /// What was observed between `before` and `self`.
    pub fn since(&self, before: Option<&Hist>) -> Hist {
        let Some(b) = before else {
            return self.clone();
        };
        Hist {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| {
                    let was = b.buckets.iter().find(|x| x.0 == le).map_or(0.0, |x| x.1);
                    (le, c - was)
                })
                .collect(),
            sum: self.sum - b.sum,
            count: self.count - b.count,
        }
    }

    /// The `q` quantile, interpolated linearly inside its bucket (buckets are 25% apart, so
    /// this is within 25% of the true value).
    pub fn quantile(&self, q: f64) -> f64 {
        if self.count <= 0.0 {
            return f64::NAN;
        }
        let rank = q * self.count;
        let mut lower = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return lower.0;
                }
                let share = if c > lower.1 {
                    (rank - lower.1) / (c - lower.1)
                } else {
                    1.0
                };
                return lower.0 + (le - lower.0) * share.clamp(0.0, 1.0);
            }
            lower = (le, c);
        }
        lower.0
    }

    pub fn stats(&self) -> PhaseStats {
        PhaseStats {
            requests: self.count as u64,
            mean_ms: if self.count > 0.0 {
                self.sum / self.count * 1e3
            } else {
                f64::NAN
            },
            p50_ms: self.quantile(0.5) * 1e3,
            p99_ms: self.quantile(0.99) * 1e3,
        }
    }
}

/// One phase over one case's requests.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PhaseStats {
    pub requests: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// The phases each component observed between two scrapes, as `component.phase`.
pub fn phases_between(
    before: &BTreeMap<&'static str, String>,
    after: &BTreeMap<&'static str, String>,
) -> BTreeMap<String, PhaseStats> {
    let mut out = BTreeMap::new();
    for (component, text) in after {
        // (histogram, prefix of its phases): an engine's own phases, and its connector's
        // breakdown of the wait for the KV (`kv_wait.blocks_answer`, ...).
        let names: &[(&str, &str)] = if *component == "proxy" {
            &[("handoff_proxy_phase_seconds", "")]
        } else {
            &[
                ("engine_phase_seconds", ""),
                ("handoff_kv_wait_phase_seconds", "kv_wait."),
            ]
        };
        for (name, prefix) in names {
            let was = before
                .get(component)
                .map(|t| parse(t, name))
                .unwrap_or_default();
            for (phase, h) in parse(text, name) {
                let d = h.since(was.get(&phase));
                if d.count > 0.0 {
                    out.insert(format!("{component}.{prefix}{phase}"), d.stats());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE engine_phase_seconds histogram
engine_phase_seconds_sum{phase=\"prefill\"} 3.5
engine_phase_seconds_count{phase=\"prefill\"} 10
engine_phase_seconds_bucket{le=\"0.1\",phase=\"prefill\"} 0
engine_phase_seconds_bucket{le=\"0.2\",phase=\"prefill\"} 5
engine_phase_seconds_bucket{le=\"0.4\",phase=\"prefill\"} 9
engine_phase_seconds_bucket{le=\"0.8\",phase=\"prefill\"} 10
engine_phase_seconds_bucket{le=\"+Inf\",phase=\"prefill\"} 10
engine_requests_total{outcome=\"ok\"} 4
";

    #[test]
    fn histograms_are_read_and_differenced_per_phase() {
        let h = &parse(TEXT, "engine_phase_seconds")["prefill"];
        assert_eq!((h.sum, h.count, h.buckets.len()), (3.5, 10.0, 5));
        let s = h.stats();
        assert_eq!(s.requests, 10);
        assert!((s.mean_ms - 350.0).abs() < 1e-9);
        // The 5th of 10 is the top of the (0.1, 0.2] bucket; the 9.9th is 90% into (0.4, 0.8].
        assert!((s.p50_ms - 200.0).abs() < 1e-9, "{s:?}");
        assert!((s.p99_ms - 760.0).abs() < 1e-6, "{s:?}");
        // Only what came after `before` counts.
        let before = Hist {
            buckets: vec![
                (0.1, 0.0),
                (0.2, 5.0),
                (0.4, 5.0),
                (0.8, 5.0),
                (f64::INFINITY, 5.0),
            ],
            sum: 0.75,
            count: 5.0,
        };
        let d = h.since(Some(&before)).stats();
        assert_eq!(d.requests, 5);
        assert!((d.mean_ms - 550.0).abs() < 1e-9);
        assert!(d.p50_ms > 200.0 && d.p50_ms <= 400.0, "{d:?}");
        assert!(Hist::default().stats().p50_ms.is_nan());
    }
}
