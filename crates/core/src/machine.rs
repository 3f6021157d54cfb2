//! [`ConnectorCore`]: the whole connector logic of one engine, sans-IO.
//!
//! It owns both ledgers, the peer table and the transfers in flight. Every input is a
//! `handle_*`/`on_*` call that takes `now` (scheduler hooks, side-channel frames, connect
//! outcomes, worker reports, timeouts); every output is pulled as one [`Ready`] batch (messages
//! to send, connections to open or close, transfer jobs to post or abort, events for the
//! engine's scheduler), then given back with [`ConnectorCore::advance`], as raft-rs's `RawNode`
//! does. [`ConnectorCore::poll_timeout`] says when to call [`ConnectorCore::handle_timeout`].
//! No clock read, socket, thread or lock lives here: the executor (`crate::executor`) does the
//! I/O, and tests drive this same code with a simulated clock.
//!
//! Every path that frees a block or sends a message goes through a ledger: there are no side
//! tables of requests or handoffs here that a ledger does not bound.
//!
//! One file, over 800 lines (each flow's steps are in `machine/`): the core's state, its config
//! and its one batch of outputs, which every flow shares.

mod decode;
mod grants;
mod peers;
mod prefill;
mod push_digest;
mod refusal;
mod runs;
mod side_channel;
#[cfg(test)]
mod tests;
mod transfers;

use std::collections::{BTreeSet, HashMap};

use handoff_ledger::{
    BlockRelease, ConsumerAction, ConsumerConfig, ConsumerLedger, ConsumerStats, IncomingHandoff,
    MemoryUse, Outcome, PeerId, ProducerAction, ProducerConfig, ProducerLedger, ProducerStats,
    RequestId, Time, WaitTimeline,
};
use handoff_plan::KvSpec;
use handoff_proto::{
    versions, Epoch, Fingerprint, HandoffId, Hello, KvTransferParams, Message, ReleaseReason,
    TransferMode, PROTOCOL_VERSION,
};

use grants::{Grants, Opens};
pub use peers::ConnId;
use peers::PeerTable;
pub use refusal::HandshakeRefusal;
use transfers::Transfers;

use crate::worker_protocol::{Digested, JobId, TransferJob, WorkerHello, WorkerOp, WorkerReport};
use crate::{ConnectorEvent, CoreError, Role};

/// What the core needs to know of its engine.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CoreConfig {
    pub engine_id: String,
    pub role: Role,
    pub mode: TransferMode,
    /// Model name and dtype for the compatibility fingerprint.
    pub model: String,
    pub dtype: String,
    /// Host peers dial (in `kv_transfer_params.remote_host`).
    pub advertise_host: String,
    /// Port of the side channel peers dial.
    pub side_channel_port: u16,
    pub producer: ProducerConfig,
    pub consumer: ConsumerConfig,
    /// The engine's KV blocks are opaque pages (vLLM's attention kernels decide what is where
    /// inside a block): transfers move whole blocks, never touch a block's tail, and only pair
    /// with engines of exactly the same KV spec (TP size, block size, layout).
    pub opaque_blocks: bool,
    /// Check every pulled handoff's KV digest (see [`crate::digest`]): as P, compute it before
    /// answering the reader's block query and send it along; as D, compare it with the digest
    /// of what landed, failing the transfer on a mismatch.
    pub kv_digest: bool,
    /// D dials a P only at these hosts (`remote_host` as `kv_transfer_params` name it: host
    /// names or IP addresses, compared exactly); empty: any. A request naming another host is
    /// refused before anything is dialled, so a client that reaches D directly cannot make it
    /// dial elsewhere (and use up its connection slots).
    pub peer_hosts: Vec<String>,
    /// The newest protocol version this engine speaks ([`handoff_proto::versions`]): its own
    /// by default, the previous one to pin an upgraded engine to what the rest of its fleet
    /// speaks. Its hello's fingerprint says it; a peer's hello may be in any version from the
    /// oldest this build speaks up to it.
    #[serde(default = "newest_protocol_version")]
    pub protocol_version: u8,
    /// P: serve layer-wise pulls (the engine reports each layer as it is saved, and says so in
    /// its info, which is what makes a router ask for one). Off, a request asking for one is
    /// refused.
    #[serde(default)]
    pub layerwise_pull: bool,
    /// P: what the engine's [`crate::Input::LayersSaved`] means.
    #[serde(default)]
    pub layer_reports: crate::LayerReports,
}

fn newest_protocol_version() -> u8 {
    PROTOCOL_VERSION
}

/// A connection to open: dial `addr`, send `hello`, report the outcome under `attempt`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Connect {
    pub engine: String,
    pub attempt: u64,
    pub addr: String,
    pub hello: Message,
}

/// Something worth counting or timing; the executor turns these into metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    HeartbeatSent,
    HeartbeatReceived,
    HandshakeRefused,
    /// A notification from an unknown agent, or one that does not decode.
    UnknownNotification,
    /// A message on a connection that never said hello, other than a release.
    AnonymousRefused,
    /// Transport connections a worker refused at their handshake.
    TransportRefused(u64),
    /// Transfers a worker's transport refused because no grant covered them.
    TransferRefused(u64),
    /// A reject for a handoff this engine is itself still tracking (a retried request): P is
    /// not told, the live request's transfer owns the handoff.
    RejectOfTrackedHandoff,
    /// Messages dropped for a peer whose connection is not up (oldest first).
    QueuedDropped,
    HandoffEnded {
        reason: &'static str,
        held_for: Time,
    },
    /// Requests whose KV transfer from P engine `peer` failed: recomputed locally (policy
    /// `recompute`) or failed.
    RequestFailed {
        reason: &'static str,
        peer: String,
        requests: usize,
        recomputed: bool,
    },
    Transfer {
        bytes: u64,
        duration: Time,
        descriptors: usize,
    },
    /// D posted a READ stage (see `transfers`).
    ReadStage,
    /// D compared a landed handoff's KV digest with P's.
    DigestChecked {
        matched: bool,
    },
    /// D did not compare a landed handoff's KV digest with P's: its prefix cache held the
    /// prompt's first blocks (see `digest_comparable`).
    DigestNotCompared,
    /// D: a handoff's KV is ready; where its wait went.
    KvWait(handoff_ledger::WaitTimeline),
}

/// Everything the core asks its executor to do now. Worker work is applied per rank in this
/// order: `worker_ops`, then `transfers_to_post`, then `transfers_to_abort`. A trace records
/// every field but the observations (which only feed metrics).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Ready {
    /// Side-channel messages, in order per connection.
    pub messages: Vec<(ConnId, Message)>,
    /// Connections to close (after their messages above were sent).
    pub closes: Vec<ConnId>,
    pub connects: Vec<Connect>,
    /// Per worker rank: other work (agents to load or forget, block tails to zero).
    pub worker_ops: Vec<(u16, WorkerOp)>,
    pub transfers_to_post: Vec<(u16, TransferJob)>,
    pub transfers_to_abort: Vec<(u16, JobId)>,
    /// For the engine's scheduler.
    pub events: Vec<ConnectorEvent>,
    #[serde(skip)]
    pub observations: Vec<Observation>,
}

impl Ready {
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
            && self.closes.is_empty()
            && self.connects.is_empty()
            && self.worker_ops.is_empty()
            && self.transfers_to_post.is_empty()
            && self.transfers_to_abort.is_empty()
            && self.events.is_empty()
            && self.observations.is_empty()
    }

    fn clear(&mut self) {
        self.messages.clear();
        self.closes.clear();
        self.connects.clear();
        self.worker_ops.clear();
        self.transfers_to_post.clear();
        self.transfers_to_abort.clear();
        self.events.clear();
        self.observations.clear();
    }
}

/// The sans-IO connector of one engine. See the module docs.
pub struct ConnectorCore {
    cfg: CoreConfig,
    spec: KvSpec,
    /// The model's KV cache groups (its workers'; a peer must have the same).
    groups: handoff_plan::KvGroups,
    ranks: Vec<WorkerHello>,
    hello: Hello,
    fingerprint: Fingerprint,
    producer: Option<ProducerLedger>,
    consumer: Option<ConsumerLedger>,
    peers: PeerTable,
    transfers: Transfers,
    grants: Grants,
    /// D, push, with `kv_digest`: handoffs whose writes all landed, held until D's ranks
    /// digested what landed (one entry per handoff, gone once every rank reported).
    push_checks: HashMap<HandoffId, push_digest::Check>,
    /// D: pushes whose tail the workers zero on each `PushDone` (forgotten when they end).
    push_tails: BTreeSet<HandoffId>,
    /// P, pull, with `kv_digest`: each live handoff's prompt length (its digest covers those
    /// tokens). Emptied when the handoff's blocks are released.
    prompt_tokens: HashMap<HandoffId, u32>,
    /// P: prefills for a remote decode between their start and their end, by request id (one
    /// per prompt the engine is prefilling for a D).
    prefills: HashMap<String, prefill::Prefill>,
    /// Peer table size at which the next new peer first prunes forgotten ones.
    prune_at: usize,
    out: Ready,
    /// A `Ready` given back by `advance`, reused for its capacity.
    spare: Option<Ready>,
    /// A fixed bug put back by a test (feature `testing`).
    #[cfg(feature = "testing")]
    bug: Option<crate::KnownBug>,
}

impl ConnectorCore {
    /// A core for an engine whose workers said `ranks` (one per rank, in rank order).
    pub fn new(cfg: CoreConfig, ranks: Vec<WorkerHello>) -> Result<Self, CoreError> {
        let first = ranks.first().ok_or(CoreError::NoRanks)?;
        let spec = first.layout.spec;
        spec.validate().map_err(CoreError::Spec)?;
        if ranks.len() != spec.tp as usize {
            return Err(CoreError::RankCount {
                ranks: ranks.len(),
                tp: spec.tp,
            });
        }
        for (i, r) in ranks.iter().enumerate() {
            r.layout.validate().map_err(CoreError::Layout)?;
            if r.rank as usize != i || r.layout.rank as usize != i || r.layout.spec != spec {
                return Err(CoreError::RankMismatch { rank: i as u16 });
            }
            if r.groups != first.groups {
                return Err(CoreError::RankGroups { rank: i as u16 });
            }
        }
        let groups = first.groups.clone();
        groups
            .validate(spec.shape.num_layers)
            .map_err(CoreError::Groups)?;
        if !handoff_proto::versions::speaks(cfg.protocol_version) {
            return Err(CoreError::ProtocolVersion {
                version: cfg.protocol_version,
            });
        }
        let described = |r: &&WorkerHello| versions::describes(cfg.protocol_version, r.memory);
        if let Some(r) = ranks.iter().find(|r| !described(r)) {
            return Err(CoreError::VersionMemory {
                version: cfg.protocol_version,
                rank: r.rank,
                memory: r.memory,
            });
        }
        let fingerprint = Fingerprint {
            protocol_version: u16::from(cfg.protocol_version),
            model: cfg.model.clone(),
            num_layers: spec.shape.num_layers,
            num_kv_heads: spec.shape.num_kv_heads,
            head_dim: spec.shape.head_dim,
            dtype: cfg.dtype.clone(),
            mode: cfg.mode,
        };
        let hello = side_channel::own_hello(&cfg, &fingerprint, &ranks)?;
        let mut producer_cfg = cfg.producer.clone();
        producer_cfg.tp = spec.tp as u16;
        let mut consumer_cfg = cfg.consumer.clone();
        consumer_cfg.tp = spec.tp as u16;
        // A read is given time for its bytes: one block of this rank, every layer.
        consumer_cfg.block_bytes = spec
            .block_bytes()
            .saturating_mul(u64::from(spec.shape.num_layers));
        Ok(ConnectorCore {
            producer: matches!(cfg.role, Role::Prefill | Role::Both)
                .then(|| ProducerLedger::new(producer_cfg)),
            consumer: matches!(cfg.role, Role::Decode | Role::Both)
                .then(|| ConsumerLedger::new(consumer_cfg)),
            cfg,
            spec,
            groups,
            ranks,
            hello,
            fingerprint,
            peers: PeerTable::default(),
            transfers: Transfers::default(),
            push_checks: HashMap::new(),
            push_tails: BTreeSet::new(),
            grants: Grants::default(),
            prompt_tokens: HashMap::new(),
            prefills: HashMap::new(),
            prune_at: MIN_PRUNE_AT,
            out: Ready::default(),
            spare: None,
            #[cfg(feature = "testing")]
            bug: None,
        })
    }

    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// What each worker said when it started, in rank order (what a trace needs, with the
    /// config, to build this core again).
    pub fn ranks(&self) -> &[WorkerHello] {
        &self.ranks
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    /// The key a router pairs engines by (`Fingerprint::compat_key`): equal on a P and a D that
    /// can exchange KV.
    pub fn compat_key(&self) -> String {
        // By the order of a block's rows only: K and V interleaved or not, such engines pair.
        let block_layout = match self.spec.block_layout.order() {
            handoff_plan::BlockLayout::TokenMajor => "token-major",
            handoff_plan::BlockLayout::Latent => "latent",
            _ => "head-major",
        };
        self.fingerprint
            .compat_key(block_layout, self.cfg.kv_digest)
    }

    /// Puts a fixed bug back, so a test can show that a replay catches it.
    #[cfg(feature = "testing")]
    pub fn reinsert(&mut self, bug: crate::KnownBug) {
        self.bug = Some(bug);
    }

    // ----- outputs -----

    /// Everything to do now. Give it back with [`Self::advance`] once done.
    pub fn ready(&mut self) -> Ready {
        let next = self.spare.take().unwrap_or_default();
        std::mem::replace(&mut self.out, next)
    }

    /// Hands a processed batch back (its buffers are reused).
    pub fn advance(&mut self, mut done: Ready) {
        done.clear();
        self.spare = Some(done);
    }

    pub fn has_ready(&self) -> bool {
        !self.out.is_empty()
    }

    /// When [`Self::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Time> {
        [
            self.producer.as_ref().and_then(|p| p.poll_timeout()),
            self.consumer.as_ref().and_then(|c| c.poll_timeout()),
            self.next_push_check_deadline(),
            self.peers.next_refused_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    pub(crate) fn handle_timeout(&mut self, now: Time) {
        if let Some(p) = self.producer.as_mut() {
            if p.poll_timeout().is_some_and(|t| t <= now) {
                p.handle_timeout(now);
            }
        }
        if let Some(c) = self.consumer.as_mut() {
            if c.poll_timeout().is_some_and(|t| t <= now) {
                c.handle_timeout(now);
            }
        }
        self.expire_push_checks(now);
        self.expire_refused(now);
        self.pump(now);
    }

    // ----- P: scheduler hooks -----

    // ----- D: scheduler hooks -----

    // ----- workers -----

    /// What a worker reports: jobs that ended, notifications, dead agents, failed loads.
    pub(crate) fn handle_worker_report(&mut self, report: WorkerReport, now: Time) {
        if report.refused_connections > 0 {
            self.out
                .observations
                .push(Observation::TransportRefused(report.refused_connections));
        }
        if report.refused_transfers > 0 {
            self.out
                .observations
                .push(Observation::TransferRefused(report.refused_transfers));
        }
        // Digests first: each belongs to a grant or job reported below.
        for (what, share) in report.digests {
            match what {
                Digested::Grant(id) => self.grants.add_digest_share(id, share),
                Digested::Job(job) => self.transfers.add_digest_share(job, share),
                Digested::Handoff(h) => self.push_digest_share(h, Some(share), now),
            }
        }
        for h in report.undigested {
            self.push_digest_share(h, None, now);
        }
        for (grant, ok) in report.granted {
            self.grant_confirmed(report.rank, grant, ok);
        }
        for (agent, error) in report.load_failed {
            if let Some(peer) = self.peers.by_agent(&agent) {
                self.fail_peer(peer, format!("cannot load agent {agent:?}: {error}"), now);
            }
        }
        for (job, ok) in report.ended {
            self.job_ended(job, ok, now);
        }
        for (from, bytes) in report.notifications {
            let Some(peer) = self.peers.by_agent(&from) else {
                self.out.observations.push(Observation::UnknownNotification);
                continue;
            };
            match handoff_proto::decode_up_to(&bytes, self.cfg.protocol_version) {
                // Only what rides on a transfer may come this way: a completion.
                Ok((msg @ (Message::PullDone(_) | Message::PushDone(_)), _)) => {
                    self.deliver(peer, msg, now)
                }
                Ok(_) | Err(_) => self.out.observations.push(Observation::UnknownNotification),
            }
        }
        for agent in report.dead_agents {
            if let Some(peer) = self.peers.by_agent(&agent) {
                tracing::info!(agent, "transport reports peer dead");
                self.peer_dead(peer, now);
            }
        }
        self.pump(now);
    }

    // ----- the ledgers' outputs -----

    /// Moves every ledger output to where it goes, until none is left.
    fn pump(&mut self, now: Time) {
        loop {
            let mut progressed = false;
            while let Some((peer, msg)) = self.producer.as_mut().and_then(|p| p.poll_message()) {
                progressed = true;
                self.send(peer, msg);
            }
            while let Some(rel) = self.producer.as_mut().and_then(|p| p.poll_release()) {
                progressed = true;
                self.producer_released(rel);
            }
            while let Some(a) = self.producer.as_mut().and_then(|p| p.poll_action()) {
                progressed = true;
                match a {
                    ProducerAction::PushWrite(w) => {
                        let (handoff, d_rank) = (w.handoff, w.d_rank);
                        if self.transfers.add_write(w, now) {
                            self.advance_push(handoff, now);
                        } else if let Some(p) = self.producer.as_mut() {
                            p.on_push_write_done(handoff, d_rank, false, now);
                        }
                    }
                    ProducerAction::AbortWrite { handoff, d_rank } => {
                        self.abort_write(handoff, d_rank, now)
                    }
                }
            }
            while let Some((peer, msg)) = self.consumer.as_mut().and_then(|c| c.poll_message()) {
                progressed = true;
                self.send(peer, msg);
            }
            while let Some(rel) = self.consumer.as_mut().and_then(|c| c.poll_release()) {
                progressed = true;
                self.revoke(Opens::Writes, rel.handoff);
                self.blocks_back(rel.handoff, rel.blocks, rel.reason.as_str());
            }
            while let Some(requests) = self.consumer.as_mut().and_then(|c| c.poll_started()) {
                progressed = true;
                let requests = requests.into_iter().map(|r| r.0).collect();
                self.out
                    .events
                    .push(ConnectorEvent::RemoteStarted { requests });
            }
            progressed |= self.take_outcomes(None, now);
            while let Some(a) = self.consumer.as_mut().and_then(|c| c.poll_action()) {
                progressed = true;
                match a {
                    ConsumerAction::StartRead(r) => self.start_read(r, now),
                    ConsumerAction::CancelRead { handoff } => self.cancel_read(handoff, now),
                    ConsumerAction::ReadMore {
                        handoff,
                        layers,
                        p_digest,
                    } => self.read_more(handoff, layers, p_digest, now),
                }
            }
            if !progressed {
                break;
            }
        }
    }

    fn producer_released(&mut self, rel: BlockRelease) {
        self.out.observations.push(Observation::HandoffEnded {
            reason: rel.reason.as_str(),
            held_for: rel.held_for,
        });
        self.revoke(Opens::Reads, rel.handoff);
        self.prompt_tokens.remove(&rel.handoff);
        // Writes still posted are aborted: the ledger only releases after they ended or were
        // fenced, so this only cleans up.
        for (rank, job) in self.transfers.end_push(rel.handoff) {
            self.out.transfers_to_abort.push((rank, job));
        }
        self.blocks_back(rel.handoff, rel.blocks, rel.reason.as_str());
    }

    /// Tells the engine that `handoff`'s `blocks` are its pool's again.
    pub(super) fn blocks_back(&mut self, handoff: HandoffId, blocks: Vec<u32>, reason: &str) {
        self.out.events.push(ConnectorEvent::BlocksReleased {
            handoff,
            blocks,
            reason: reason.into(),
        });
    }

    /// Turns the consumer's outcomes into events; `refusal` explains failures (the reason a P
    /// refused or could not be reached). Returns whether there were any.
    fn take_outcomes(&mut self, refusal: Option<&str>, now: Time) -> bool {
        let mut any = false;
        while let Some(o) = self.consumer.as_mut().and_then(|c| c.poll_outcome()) {
            any = true;
            // The transfer is over: no WRITE may land in these blocks any more.
            let handoff = match &o {
                Outcome::Ready { handoff, .. }
                | Outcome::Recompute { handoff, .. }
                | Outcome::Failed { handoff, .. } => *handoff,
            };
            self.revoke(Opens::Writes, handoff);
            if self.push_tails.remove(&handoff) {
                for rank in 0..self.spec.tp as u16 {
                    self.out
                        .worker_ops
                        .push((rank, WorkerOp::ForgetPushTail { handoff }));
                }
            }
            match o {
                Outcome::Ready {
                    requests,
                    blocks,
                    waited,
                    p_digest,
                    num_tokens,
                    peer,
                    cached,
                    ..
                } => match p_digest.filter(|_| self.cfg.kv_digest) {
                    // Push: what landed is digested before anyone decodes it.
                    Some(p_digest) => self.check_push(
                        handoff,
                        push_digest::Landed {
                            p_digest,
                            num_tokens,
                            requests,
                            blocks,
                            cached,
                            waited,
                            peer,
                        },
                        now,
                    ),
                    None => self.kv_ready(requests, blocks, waited),
                },
                Outcome::Recompute {
                    requests,
                    reason,
                    peer,
                    ..
                } => self.failed(requests, reason.as_str(), peer, true, refusal),
                Outcome::Failed {
                    requests,
                    reason,
                    peer,
                    ..
                } => self.failed(requests, reason.as_str(), peer, false, refusal),
            }
        }
        any
    }

    /// D: the KV of `requests` is in `blocks`.
    fn kv_ready(&mut self, requests: Vec<RequestId>, blocks: Vec<u32>, waited: WaitTimeline) {
        self.out.observations.push(Observation::KvWait(waited));
        self.out.events.push(ConnectorEvent::Ready {
            requests: requests.iter().map(|r| r.0).collect(),
            blocks,
        });
    }

    /// D: the KV of `requests` will not come from P engine `peer`; `refusal` explains why (the
    /// reason P refused or could not be reached).
    fn failed(
        &mut self,
        requests: Vec<RequestId>,
        reason: &'static str,
        peer: PeerId,
        recomputed: bool,
        refusal: Option<&str>,
    ) {
        self.out.observations.push(Observation::RequestFailed {
            reason,
            peer: self.peer_name(peer),
            requests: requests.len(),
            recomputed,
        });
        let requests = requests.iter().map(|r| r.0).collect();
        let reason = match refusal {
            Some(r) => format!("{reason}: {r}"),
            None => reason.to_string(),
        };
        self.out.events.push(if recomputed {
            ConnectorEvent::Recompute { requests, reason }
        } else {
            ConnectorEvent::Failed { requests, reason }
        });
    }

    /// A peer's engine id, with the address dialled when there is one (for logs).
    fn peer_name(&self, peer: handoff_ledger::PeerId) -> String {
        match self.peers.get(peer) {
            Some(p) => match &p.addr {
                Some(a) => format!("{} at {a}", p.engine),
                None => p.engine.clone(),
            },
            None => format!("{peer:?}"),
        }
    }

    /// Tells the producer again that every peer whose connection is gone is dead: a handoff
    /// created after the death may have bound such a peer through a staged message.
    fn redeclare_dead(&mut self, now: Time) {
        let down = self.peers.down();
        if let Some(p) = self.producer.as_mut() {
            for peer in down {
                if p.held_blocks_for(peer) > 0 {
                    p.handle_peer_dead(peer, now);
                }
            }
        }
    }

    // ----- snapshots -----

    /// Blocks the ledgers hold: (P's handoffs, D's transfers).
    pub fn held_blocks(&self) -> (usize, usize) {
        (
            self.producer.as_ref().map_or(0, |p| p.held_blocks()),
            self.consumer.as_ref().map_or(0, |c| c.held_blocks()),
        )
    }

    /// P's held blocks as (leased, fencing).
    pub fn producer_blocks_by_state(&self) -> Option<(usize, usize)> {
        self.producer.as_ref().map(|p| p.held_blocks_by_state())
    }

    /// Messages P keeps for handoffs its prefill has not created yet.
    pub fn staged_messages(&self) -> usize {
        self.producer.as_ref().map_or(0, |p| p.staged_messages())
    }

    /// Blocks P holds per D engine that reads them.
    pub fn held_blocks_by_engine(&self) -> Vec<(String, usize)> {
        let Some(p) = self.producer.as_ref() else {
            return Vec::new();
        };
        self.peers
            .engines()
            .map(|(engine, peer)| (engine.to_string(), p.held_blocks_for(peer)))
            .collect()
    }

    pub fn producer_stats(&self) -> Option<(usize, &ProducerStats)> {
        self.producer.as_ref().map(|p| (p.len(), p.stats()))
    }

    pub fn consumer_stats(&self) -> Option<&ConsumerStats> {
        self.consumer.as_ref().map(|c| c.stats())
    }

    /// Counters both ledgers keep that the metrics follow (totals since start).
    pub fn ledger_counters(&self) -> LedgerCounters {
        let p = self.producer.as_ref().map(|p| p.stats());
        let c = self.consumer.as_ref().map(|c| c.stats());
        LedgerCounters {
            late_notifications: p.map_or(0, |p| p.late_notifications)
                + c.map_or(0, |c| c.late_notifications),
            stale_epoch: p.map_or(0, |p| p.stale_epoch) + c.map_or(0, |c| c.stale_epoch),
            read_retries: c.map_or(0, |c| c.read_retries),
            client_blocks_replaced: c.map_or(0, |c| c.client_blocks_replaced),
            blocks_refused: p.map_or(0, |p| p.blocks_refused),
            not_from_reader: p.map_or(0, |p| p.not_from_reader),
            staged_over_quota: p.map_or(0, |p| p.staged_over_quota),
        }
    }

    /// The peer for `engine` (created if new). Peers accumulate as requests name engines (a
    /// client may name any), so once the table has grown past twice its size after the last
    /// pruning, peers that are down and that no ledger or grant names any more are forgotten,
    /// with their agents on every worker.
    pub(super) fn peer_named(&mut self, engine: &str) -> PeerId {
        if self.peers.by_engine(engine).is_none() && self.peers.len() >= self.prune_at {
            for id in self.peers.forgettable() {
                let used = self.producer.as_ref().is_some_and(|p| p.uses_peer(id))
                    || self.consumer.as_ref().is_some_and(|c| c.uses_peer(id))
                    || self.grants.uses_peer(id);
                if used {
                    continue;
                }
                for agent in self.peers.remove(id) {
                    for rank in 0..self.ranks.len() as u16 {
                        self.out.worker_ops.push((
                            rank,
                            WorkerOp::ForgetRemote {
                                agent: agent.clone(),
                            },
                        ));
                    }
                }
            }
            self.prune_at = (2 * self.peers.len()).max(MIN_PRUNE_AT);
        }
        self.peers.peer_for(engine)
    }

    /// What the core keeps in memory: every entry is bounded or ends with its request.
    pub fn memory(&self) -> CoreMemory {
        CoreMemory {
            producer: self
                .producer
                .as_ref()
                .map(|p| p.memory())
                .unwrap_or_default(),
            consumer: self
                .consumer
                .as_ref()
                .map(|c| c.memory())
                .unwrap_or_default(),
            peers: self.peers.len(),
            reads: self.transfers.reads_len(),
            pushes: self.transfers.pushes_len(),
            jobs: self.transfers.jobs_len(),
            grants: self.grants.len(),
            prompt_tokens: self.prompt_tokens.len(),
            prefills: self.prefills.len(),
        }
    }
}

/// The peer table is never pruned below this size.
const MIN_PRUNE_AT: usize = 64;

/// `host:port` to dial, with an IPv6 address in brackets.
fn dial_addr(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Sizes of what a [`ConnectorCore`] holds (tests and the soak benchmark watch them).
/// Totals of the ledgers' counters (see [`ConnectorCore::ledger_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerCounters {
    /// Notifications naming a handoff that already ended.
    pub late_notifications: u64,
    /// Messages about a live handoff that carried another epoch than its current one.
    pub stale_epoch: u64,
    /// Reads tried again under a new epoch.
    pub read_retries: u64,
    /// D: requests whose `remote_block_ids` differed from the blocks P named (P's were read).
    pub client_blocks_replaced: u64,
    /// P: block queries from a peer other than the handoff's reader (unanswered).
    pub blocks_refused: u64,
    /// P: completions and push registrations from a peer other than the handoff's reader
    /// (ignored).
    pub not_from_reader: u64,
    /// P: early messages dropped because their sender was over its staging quota.
    pub staged_over_quota: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreMemory {
    pub producer: MemoryUse,
    pub consumer: MemoryUse,
    pub peers: usize,
    pub reads: usize,
    pub pushes: usize,
    pub jobs: usize,
    /// Transport grants in force or being put in force (one per live handoff at most).
    pub grants: usize,
    /// P's prompt lengths kept for the KV digest (one per live pull handoff at most).
    pub prompt_tokens: usize,
    /// P's prefills for a remote decode between their start and their end.
    pub prefills: usize,
}

/// The proxy's handoff id of a layer-wise pull's P leg.
fn layerwise_handoff(params: &KvTransferParams) -> Result<HandoffId, CoreError> {
    if !params.is_layerwise_pull() {
        return Err(CoreError::BadParams("not a layer-wise pull"));
    }
    params
        .handoff_id
        .ok_or(CoreError::BadParams("a layer-wise pull needs handoff_id"))
}

/// The handoff a push request names: its proxy picked the id for both legs.
fn push_handoff(params: &KvTransferParams) -> Result<HandoffId, CoreError> {
    params
        .handoff_id
        .ok_or(CoreError::BadParams("push without handoff_id"))
}
