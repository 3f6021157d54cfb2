//! Prometheus metrics of one connector. The one nobody else has: KV blocks and bytes held per
//! state, so a dashboard shows memory stranded by peers as it happens.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CompatLabels {
    pub key: String,
}

/// Registers `handoff_compat_info{key="…"} 1`: the engine's compatibility key, for routers and
/// dashboards (a P and a D with different keys cannot exchange KV).
pub fn register_compat_key(registry: &mut Registry, key: &str) {
    let info = Family::<CompatLabels, Gauge>::default();
    info.get_or_create(&CompatLabels {
        key: key.to_string(),
    })
    .set(1);
    registry.sub_registry_with_prefix("handoff").register(
        "compat_info",
        "The engine's compatibility key (label key): a P and a D pair only when their keys are equal",
        info,
    );
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeldLabels {
    /// `prefill` (P's handoffs) or `decode` (D's destination blocks).
    pub side: &'static str,
    /// `leased`, `fencing` (P); `waiting` (D).
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirLabels {
    pub direction: &'static str,
}

#[derive(Clone)]
pub struct Metrics {
    pub blocks_held: Family<HeldLabels, Gauge>,
    pub bytes_held: Family<HeldLabels, Gauge>,
    pub handoffs_ended: Family<ReasonLabels, Counter>,
    pub requests_failed: Family<ReasonLabels, Counter>,
    pub lease_age_at_release: Histogram,
    pub transfer_bytes: Counter,
    pub transfer_duration: Histogram,
    pub transfer_descriptors: Histogram,
    pub heartbeats: Family<DirLabels, Counter>,
    pub late_notifications: Counter,
    pub stale_epoch: Counter,
    pub read_retries: Counter,
    pub client_blocks_replaced: Counter,
    pub blocks_refused: Counter,
    pub not_from_reader: Counter,
    pub staged_over_quota: Counter,
    pub unknown_notifications: Counter,
    pub handshakes_refused: Counter,
    pub anonymous_refused: Counter,
    pub side_refused: Family<ReasonLabels, Counter>,
    pub side_backpressured: Counter,
    pub transport_refused: Counter,
    pub transfers_refused: Counter,
    pub rejects_of_tracked_handoffs: Counter,
    pub read_stages: Counter,
    pub queued_dropped: Counter,
    pub send_queue_full: Counter,
    pub digests_checked: Family<MatchedLabels, Counter>,
    /// D: where each handoff's wait for its KV went (`handoff_ledger::WaitTimeline`).
    pub kv_wait: Family<PhaseLabels, Histogram>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MatchedLabels {
    pub matched: &'static str,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            blocks_held: Family::default(),
            bytes_held: Family::default(),
            handoffs_ended: Family::default(),
            requests_failed: Family::default(),
            lease_age_at_release: Histogram::new(exponential_buckets(0.001, 2.0, 18)),
            transfer_bytes: Counter::default(),
            transfer_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            transfer_descriptors: Histogram::new(exponential_buckets(1.0, 2.0, 16)),
            heartbeats: Family::default(),
            late_notifications: Counter::default(),
            stale_epoch: Counter::default(),
            read_retries: Counter::default(),
            client_blocks_replaced: Counter::default(),
            blocks_refused: Counter::default(),
            not_from_reader: Counter::default(),
            staged_over_quota: Counter::default(),
            unknown_notifications: Counter::default(),
            handshakes_refused: Counter::default(),
            anonymous_refused: Counter::default(),
            side_refused: Family::default(),
            side_backpressured: Counter::default(),
            transport_refused: Counter::default(),
            transfers_refused: Counter::default(),
            rejects_of_tracked_handoffs: Counter::default(),
            read_stages: Counter::default(),
            queued_dropped: Counter::default(),
            send_queue_full: Counter::default(),
            digests_checked: Family::default(),
            // The same buckets as the engines' and the proxy's phase histograms (100 µs to
            // ~127 s, 25% apart), so the benchmarks read them the same way.
            kv_wait: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 1.25, 64))
            }),
        };
        let r = registry.sub_registry_with_prefix("handoff");
        r.register(
            "kv_blocks_held",
            "KV blocks held by handoff, per side and state (held while waiting for a peer)",
            m.blocks_held.clone(),
        );
        r.register(
            "kv_bytes_held",
            "KV bytes held by handoff, per side and state",
            m.bytes_held.clone(),
        );
        r.register(
            "handoffs_ended",
            "Handoffs ended on P, per reason (done, expired, peer_dead, rejected, aborted, capped, cancelled, failed)",
            m.handoffs_ended.clone(),
        );
        r.register(
            "requests_failed",
            "Requests on D whose KV transfer failed, per reason",
            m.requests_failed.clone(),
        );
        r.register(
            "lease_age_at_release_seconds",
            "How long P held a handoff's blocks",
            m.lease_age_at_release.clone(),
        );
        r.register(
            "transfer_bytes",
            "KV bytes moved by transfers this engine posted",
            m.transfer_bytes.clone(),
        );
        r.register(
            "transfer_duration_seconds",
            "Duration of a transfer, from post to done (pull: a handoff's READs; push: the WRITEs \
             into one D rank)",
            m.transfer_duration.clone(),
        );
        r.register(
            "transfer_descriptors",
            "Descriptors per transfer (pull: a handoff's READs; push: the WRITEs into one D rank)",
            m.transfer_descriptors.clone(),
        );
        r.register(
            "heartbeats",
            "Heartbeat messages sent and received",
            m.heartbeats.clone(),
        );
        r.register(
            "late_notifications",
            "Notifications naming a handoff that already ended",
            m.late_notifications.clone(),
        );
        r.register(
            "stale_epoch_messages",
            "Messages about a live handoff under another epoch than its current one (ignored)",
            m.stale_epoch.clone(),
        );
        r.register(
            "read_retries",
            "Pull reads tried again under the next epoch after the transport reported them failed",
            m.read_retries.clone(),
        );
        r.register(
            "client_blocks_replaced",
            "D: requests whose remote_block_ids differed from the blocks P named for the handoff (P's were read)",
            m.client_blocks_replaced.clone(),
        );
        r.register(
            "blocks_queries_refused",
            "P: block queries from a peer other than the handoff's reader (unanswered)",
            m.blocks_refused.clone(),
        );
        r.register(
            "not_from_reader_refused",
            "P: completions and push registrations from a peer other than the handoff's reader (ignored)",
            m.not_from_reader.clone(),
        );
        r.register(
            "staged_over_quota",
            "P: messages for handoffs not created yet dropped because their sender had staging_per_peer of them staged",
            m.staged_over_quota.clone(),
        );
        r.register(
            "unknown_notifications",
            "Notifications that could not be decoded or came from an unknown agent",
            m.unknown_notifications.clone(),
        );
        r.register(
            "side_connections_refused",
            "Side-channel connections closed before their first frame, per reason (connection_cap, authentication, handshake)",
            m.side_refused.clone(),
        );
        r.register(
            "side_reader_backpressured",
            "Times a side-channel connection's reader stopped reading because 64 of its frames waited for the executor (a peer sending faster than this engine handles)",
            m.side_backpressured.clone(),
        );
        r.register(
            "transport_connections_refused",
            "Transport connections refused at their handshake (no or wrong proof of the cluster key, an unproven name)",
            m.transport_refused.clone(),
        );
        r.register(
            "transport_transfers_refused",
            "Inbound READs and WRITEs the transport refused because no live grant to that peer covered them",
            m.transfers_refused.clone(),
        );
        r.register(
            "handshakes_refused",
            "Handshakes refused for incompatibility",
            m.handshakes_refused.clone(),
        );
        r.register(
            "side_channel_anonymous_refused",
            "Side-channel connections refused because their first message was not a handshake",
            m.anonymous_refused.clone(),
        );
        r.register(
            "rejects_of_tracked_handoffs",
            "Requests D refused whose handoff it still tracks for another request (P not told)",
            m.rejects_of_tracked_handoffs.clone(),
        );
        r.register(
            "read_stages",
            "READ stages D posted: one per classic pull, more when a layer-wise pull reads layers \
             while P's prefill saves the next",
            m.read_stages.clone(),
        );
        r.register(
            "side_channel_queued_dropped",
            "Control messages dropped while waiting for a peer's connection (oldest first)",
            m.queued_dropped.clone(),
        );
        r.register(
            "side_channel_send_queue_full",
            "Connections closed because the peer stopped reading (its send queue filled)",
            m.send_queue_full.clone(),
        );
        r.register(
            "kv_digests_checked",
            "Handoffs whose landed KV digest D compared with P's, by result (matched=false: the transfer failed, never decoded; matched=not_compared: D's prefix cache held the prompt's first blocks, which P's digest covers)",
            m.digests_checked.clone(),
        );
        r.register(
            "kv_wait_phase_seconds",
            "D: where a handoff's wait for its KV went: blocks_answer (arrival to P's block list), admission (arrival to blocks from the engine), to_transfer (both to the READ starting), transfer (the READ, or push: registration to P's last write)",
            m.kv_wait.clone(),
        );
        m
    }
}
