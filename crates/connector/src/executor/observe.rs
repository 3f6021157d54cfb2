//! What the executor makes of the core's observations and the ledgers' counters: metrics, and
//! a warning per P engine and reason when requests fall back (never silent, never a flood).

use super::*;

/// Warns when requests fall back (recomputed or failed) because a transfer failed: at once the
/// first time for a P engine and reason, then at most once per [`FallbackLog::EVERY`] with the
/// count since, so a broken link is never silent and never a flood.
#[derive(Default)]
pub(super) struct FallbackLog {
    last: HashMap<(String, &'static str), (Instant, usize)>,
}

impl FallbackLog {
    const EVERY: Duration = Duration::from_secs(10);

    /// Counts a fallback; returns the warning when one is due now (and logs it).
    fn warn(
        &mut self,
        peer: &str,
        reason: &'static str,
        requests: usize,
        recomputed: bool,
    ) -> Option<String> {
        self.warn_at(Instant::now(), peer, reason, requests, recomputed)
    }

    fn warn_at(
        &mut self,
        now: Instant,
        peer: &str,
        reason: &'static str,
        requests: usize,
        recomputed: bool,
    ) -> Option<String> {
        let what = if recomputed {
            "recomputed locally"
        } else {
            "failed"
        };
        let msg = match self.last.get_mut(&(peer.to_string(), reason)) {
            Some((at, since)) if now.duration_since(*at) < Self::EVERY => {
                *since += requests;
                return None;
            }
            Some((at, since)) => {
                let msg = format!(
                    "KV transfers from P {peer} keep failing ({reason}): {} more request(s) {what} in the last {} s",
                    *since + requests,
                    now.duration_since(*at).as_secs()
                );
                *at = now;
                *since = 0;
                msg
            }
            None => {
                self.last.insert((peer.to_string(), reason), (now, 0));
                format!("KV transfer from P {peer} failed ({reason}): {requests} request(s) {what}")
            }
        };
        tracing::warn!("{msg}");
        Some(msg)
    }
}

impl Executor {
    pub(super) fn observe(&mut self, o: Observation) {
        let m = &self.metrics;
        match o {
            Observation::HeartbeatSent => {
                m.heartbeats
                    .get_or_create(&DirLabels { direction: "sent" })
                    .inc();
            }
            Observation::HeartbeatReceived => {
                m.heartbeats
                    .get_or_create(&DirLabels {
                        direction: "received",
                    })
                    .inc();
            }
            Observation::HandshakeRefused => {
                m.handshakes_refused.inc();
            }
            Observation::UnknownNotification => {
                m.unknown_notifications.inc();
            }
            Observation::AnonymousRefused => {
                m.anonymous_refused.inc();
            }
            Observation::TransportRefused(n) => {
                m.transport_refused.inc_by(n);
            }
            Observation::TransferRefused(n) => {
                m.transfers_refused.inc_by(n);
            }
            Observation::RejectOfTrackedHandoff => {
                m.rejects_of_tracked_handoffs.inc();
            }
            Observation::ReadStage => {
                m.read_stages.inc();
            }
            Observation::QueuedDropped => {
                m.queued_dropped.inc();
            }
            Observation::HandoffEnded { reason, held_for } => {
                m.handoffs_ended
                    .get_or_create(&ReasonLabels { reason })
                    .inc();
                m.lease_age_at_release.observe(held_for.as_secs_f64());
            }
            Observation::RequestFailed {
                reason,
                peer,
                requests,
                recomputed,
            } => {
                m.requests_failed
                    .get_or_create(&ReasonLabels { reason })
                    .inc_by(requests as u64);
                self.fallbacks.warn(&peer, reason, requests, recomputed);
            }
            Observation::Transfer {
                bytes,
                duration,
                descriptors,
            } => {
                m.transfer_bytes.inc_by(bytes);
                m.transfer_duration.observe(duration.as_secs_f64());
                m.transfer_descriptors.observe(descriptors as f64);
            }
            Observation::DigestChecked { matched } => {
                let matched = if matched { "true" } else { "false" };
                m.digests_checked
                    .get_or_create(&crate::metrics::MatchedLabels { matched })
                    .inc();
            }
            Observation::DigestNotCompared => {
                m.digests_checked
                    .get_or_create(&crate::metrics::MatchedLabels {
                        matched: "not_compared",
                    })
                    .inc();
            }
            Observation::KvWait(w) => {
                let observe = |phase: &'static str, t: Option<std::time::Duration>| {
                    if let Some(t) = t {
                        m.kv_wait
                            .get_or_create(&crate::metrics::PhaseLabels { phase })
                            .observe(t.as_secs_f64());
                    }
                };
                observe("blocks_answer", w.blocks_answer);
                observe("admission", Some(w.admission));
                observe("to_transfer", w.to_transfer);
                observe("transfer", Some(w.transfer));
            }
        }
    }

    pub(super) fn update_gauges(&mut self) {
        self.gauges_at = Some(Instant::now());
        // These are counted by the ledgers; the metrics follow their totals.
        let now = self.core.ledger_counters();
        let seen = std::mem::replace(&mut self.counters_seen, now);
        let m = &self.metrics;
        m.late_notifications
            .inc_by(now.late_notifications - seen.late_notifications);
        m.stale_epoch.inc_by(now.stale_epoch - seen.stale_epoch);
        m.read_retries.inc_by(now.read_retries - seen.read_retries);
        if now.client_blocks_replaced > seen.client_blocks_replaced {
            tracing::warn!(
                total = now.client_blocks_replaced,
                "remote_block_ids in a request differed from the blocks P named: read P's"
            );
        }
        m.client_blocks_replaced
            .inc_by(now.client_blocks_replaced - seen.client_blocks_replaced);
        m.blocks_refused
            .inc_by(now.blocks_refused - seen.blocks_refused);
        m.not_from_reader
            .inc_by(now.not_from_reader - seen.not_from_reader);
        m.staged_over_quota
            .inc_by(now.staged_over_quota - seen.staged_over_quota);
        let spec = self.core.spec();
        let block_bytes = spec.block_bytes() * spec.shape.num_layers as u64 * spec.tp as u64;
        let set = |side: &'static str, state: &'static str, blocks: usize| {
            let l = HeldLabels { side, state };
            self.metrics
                .blocks_held
                .get_or_create(&l)
                .set(blocks as i64);
            self.metrics
                .bytes_held
                .get_or_create(&l)
                .set((blocks as u64 * block_bytes) as i64);
        };
        if let Some((leased, fencing)) = self.core.producer_blocks_by_state() {
            set("prefill", "leased", leased);
            set("prefill", "fencing", fencing);
        }
        if self.core.consumer_stats().is_some() {
            set("decode", "waiting", self.core.held_blocks().1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallbacks_are_said_at_once_then_summed_per_interval() {
        let mut log = FallbackLog::default();
        let t0 = Instant::now();
        let first = log.warn_at(t0, "p at 10.0.0.1:7000", "peer_dead", 1, true);
        assert!(first.is_some_and(|m| m.contains("10.0.0.1:7000") && m.contains("peer_dead")));
        // Within the interval: counted, not said.
        assert_eq!(
            log.warn_at(
                t0 + Duration::from_secs(1),
                "p at 10.0.0.1:7000",
                "peer_dead",
                2,
                true
            ),
            None
        );
        // Another reason or peer is said at once.
        assert!(log
            .warn_at(
                t0 + Duration::from_secs(1),
                "p at 10.0.0.1:7000",
                "read_failed",
                1,
                true
            )
            .is_some());
        assert!(log
            .warn_at(t0 + Duration::from_secs(1), "q", "peer_dead", 1, false)
            .is_some());
        // After the interval: said with what was counted meanwhile.
        let later = log.warn_at(
            t0 + Duration::from_secs(11),
            "p at 10.0.0.1:7000",
            "peer_dead",
            1,
            true,
        );
        assert!(
            later
                .as_ref()
                .is_some_and(|m| m.contains("3 more request(s)")),
            "{later:?}"
        );
    }
}
