//! [`ProducerLedger`]: the lifecycle of every handoff on a prefill engine (P).
//!
//! A handoff is created when a prompt's prefill ends (pull) or when P takes the request (push) and
//! holds P's blocks under a lease. It ends — and its blocks go back to the pool exactly once —
//! when every consumer has read it, when D releases it, when the transport says D is dead, or when
//! its lease (renewed by D's heartbeats, never past the hard cap) and then a fence grace have run
//! out. The fence grace is what makes an expiry safe: it is longer than the time D may still
//! finish a read it started on a valid grant (rule 2).
//!
//! States (a transition is a `match` arm in `evaluate`):
//!
//! | state      | event                              | next / effect                               |
//! |------------|------------------------------------|---------------------------------------------|
//! | `Leased`   | heartbeat                          | lease extended, grant replied               |
//! | `Leased`   | last pull-done / release           | released now                                |
//! | `Leased`   | lease or cap reached               | `Fencing` until lease end + fence grace     |
//! | `Leased`   | peer dead                          | released now (a dead reader is not harmed)  |
//! | `Fencing`  | fence end / pull-done / release    | released                                    |
//! | `Draining` | push write ended or fence end      | released (never under an in-flight WRITE)   |
//!
//! A layer-wise pull's handoff is created when P's prefill starts ([`ProducerLedger::create_filling_handoff`]):
//! its reader gets one more block list each time layers are saved, and whatever would end it
//! while the prefill runs only takes effect when the prefill ends — P's forward pass still writes
//! those blocks ([`ProducerLedger::prefill_ended`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use handoff_proto::{
    split_block_lists, split_grants, BlockList, BlocksQuery, Epoch, Grant, GrantBatch, HandoffId,
    Heartbeat, HeartbeatEntry, Message, PullBlocks, PullDone, PushCancel, PushCancelAck, PushDone,
    PushFailed, PushRegister, Release, TransferMode, MAX_REGISTERED_BLOCKS,
};

use crate::heartbeat::HeartbeatSender;
use crate::staging::{Staging, Tombstones};
use crate::timer::{TimerQueue, TimerSlot};
use crate::{BlockId, BlockRelease, EndReason, PeerId, Time};
use handoff_plan::rank_pairs;

/// Settings of a [`ProducerLedger`]. The defaults suit a P/D pair on one network: a dead D is
/// usually reported by the transport at once; the lease only matters for a D that hangs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ProducerConfig {
    /// P's tensor-parallel size: a handoff is read only when every P rank's part is.
    pub tp: u16,
    /// Lease a handoff starts with: covers the proxy forwarding the request to D.
    pub initial_lease: Duration,
    /// How far a heartbeat pushes the lease (from the moment it is handled).
    pub heartbeat_extension: Duration,
    /// Time after a lease's end before its blocks are reused; must exceed D's read grace.
    pub fence_grace: Duration,
    /// No handoff lives longer than this, heartbeats or not.
    pub hard_cap: Duration,
    /// Push: start a WRITE only when the registration grant has at least this much left.
    pub write_margin: Duration,
    /// Push: a WRITE still running this long after its registration grant ended is aborted and
    /// counts as failed. D's write grace must exceed it (rule 3).
    pub write_timeout: Duration,
    /// Push: how often P heartbeats the registrations it waits to write into.
    pub heartbeat_interval: Duration,
    /// Most messages kept for handoffs not created yet (rule 7).
    pub staging_capacity: usize,
    pub staging_per_handoff: usize,
    /// Most of those from one sender: past it that sender's new ones are dropped (and counted),
    /// so one peer's flood of made-up ids cannot evict another peer's early messages.
    pub staging_per_peer: usize,
    pub staging_ttl: Duration,
    pub tombstone_capacity: usize,
    pub tombstone_ttl: Duration,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        ProducerConfig {
            tp: 1,
            initial_lease: Duration::from_secs(10),
            heartbeat_extension: Duration::from_secs(3),
            fence_grace: Duration::from_millis(1500),
            hard_cap: Duration::from_secs(120),
            write_margin: Duration::from_millis(200),
            write_timeout: Duration::from_millis(500),
            heartbeat_interval: Duration::from_millis(500),
            staging_capacity: 4096,
            staging_per_handoff: 16,
            staging_per_peer: 1024,
            staging_ttl: Duration::from_secs(10),
            tombstone_capacity: 65536,
            tombstone_ttl: Duration::from_secs(300),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreateError {
    #[error("handoff {0} already exists or ended recently")]
    Duplicate(HandoffId),
    #[error("handoff {0} has no blocks")]
    NoBlocks(HandoffId),
    #[error("handoff {0} has {1} blocks, more than a peer accepts in one message")]
    TooManyBlocks(HandoffId, usize),
}

/// Why P may not write into a registration now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WriteRefused {
    #[error("unknown handoff")]
    UnknownHandoff,
    #[error("D has not registered that rank")]
    NotRegistered,
    #[error("no valid registration grant (expired or never granted)")]
    GrantExpired,
    #[error("the registration was cancelled or the handoff is ending")]
    Cancelled,
}

/// Work the connector must do for a push handoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProducerAction {
    /// Write P's blocks of `handoff` into D rank `d_rank`'s registered blocks. Each P rank in
    /// `p_ranks` attaches its `PushDone` to its last WRITE. Nothing may be posted after
    /// `grant_until`; re-check with [`ProducerLedger::write_permit`] before each layer.
    PushWrite(PushWrite),
    /// Stop the writes of that registration (cancelled, expired, peer gone) and report the end
    /// with [`ProducerLedger::on_push_write_done`].
    AbortWrite { handoff: HandoffId, d_rank: u16 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushWrite {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub d_peer: PeerId,
    pub d_rank: u16,
    pub d_tp: u16,
    pub src_blocks: Vec<BlockId>,
    pub dst_blocks: Vec<BlockId>,
    pub num_tokens: u32,
    /// D holds the prompt's first `cached_blocks` blocks (D's block size) already: `dst_blocks`
    /// take the prompt from there on, written from the same token of `src_blocks`.
    pub cached_blocks: u32,
    pub grant_until: Time,
    pub done: Vec<PushDone>,
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProducerStats {
    pub created: u64,
    pub ended: HashMap<&'static str, u64>,
    pub heartbeats_received: u64,
    pub grants_sent: u64,
    /// Notifications naming a handoff that already ended (vLLM logs these as "potentially invalid
    /// KV blocks"; here the fence makes them harmless).
    pub late_notifications: u64,
    pub duplicate_notifications: u64,
    pub stale_epoch: u64,
    pub staged: u64,
    pub ignored: u64,
    /// Block queries from a peer other than the D that reads the handoff: refused, unanswered.
    pub blocks_refused: u64,
    /// Completions (`PullDone`) and push registrations from a peer other than the D that reads
    /// the handoff: ignored (another peer's completion must not free blocks under the reader's
    /// READ, nor its registration make P write KV to it).
    pub not_from_reader: u64,
    /// Early messages dropped because their sender had `staging_per_peer` staged already.
    pub staged_over_quota: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Leased,
    /// Lease (or cap) over: no more grants; blocks back at `until` unless every read ends first.
    Fencing {
        until: Time,
        reason: EndReason,
    },
    /// Ending for `reason`, waiting only for push writes in flight (at most until `until`).
    Draining {
        until: Time,
        reason: EndReason,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegState {
    /// Known; waiting for a grant or for a write slot.
    Waiting,
    Writing,
    /// D asked to cancel while a write was in flight: ack when it ends.
    CancelPending,
    Written,
    Cancelled,
    Failed,
}

#[derive(Debug, Clone)]
struct Registration {
    peer: PeerId,
    d_rank: u16,
    d_tp: u16,
    epoch: Epoch,
    blocks: Vec<BlockId>,
    num_tokens: u32,
    /// D's prefix-cache hit, in D's blocks: `blocks` start after it.
    cached_blocks: u32,
    grant_until: Option<Time>,
    state: RegState,
    /// The write ran past its grant + write timeout and was aborted: it cannot count as landed.
    timed_out: bool,
}

#[derive(Debug, Clone, Default)]
struct Part {
    expected: u16,
    done: Vec<u16>,
}

/// How many times one handoff's reader may move it to a new epoch (a retried read each). A
/// bound, so a reader cannot keep a handoff's completions resetting forever.
const MAX_EPOCH_MOVES: u8 = 4;

#[derive(Debug)]
struct Handoff {
    epoch: Epoch,
    /// Epoch moves still allowed (see [`MAX_EPOCH_MOVES`]).
    epoch_moves_left: u8,
    mode: TransferMode,
    blocks: Vec<BlockId>,
    created: Time,
    lease_end: Time,
    cap_end: Time,
    phase: Phase,
    reader: Option<PeerId>,
    parts: Vec<Part>,
    registrations: Vec<Registration>,
    /// P told D (`PushCancelAck`) that no write into its blocks is or will be in flight: D may
    /// free them at once. From then on no write to that D starts, whatever registration or
    /// grant arrives late (rule 3).
    cancel_acked: bool,
    /// Pull: the reader asked for the block list (and gets every later one of a layer-wise pull).
    asked: bool,
    /// Layer-wise pull: P's prefill still writes the blocks.
    filling: Option<Filling>,
    timer: TimerSlot,
}

/// A layer-wise pull's prefill, still running.
#[derive(Debug, Clone, Copy, Default)]
struct Filling {
    /// Layers whose KV is in the blocks.
    layers: u32,
    /// Why the handoff ended meanwhile: its blocks go back once the prefill ends.
    ended: Option<EndReason>,
}

impl Handoff {
    /// The block list alone in a message, for the reader.
    fn block_list_message(&self, id: HandoffId) -> Message {
        Message::PullBlocks(PullBlocks {
            lists: vec![self.block_list(id)],
        })
    }

    /// The block list as the reader is told it: every layer saved, or so far.
    fn block_list(&self, id: HandoffId) -> BlockList {
        BlockList {
            handoff: id,
            epoch: self.epoch,
            blocks: self.blocks.clone(),
            // Filled in by the connector once its workers computed it.
            digest: None,
            layers: self.filling.map(|f| f.layers),
        }
    }

    /// The reader retries a failed read under the next epoch: completions of the first attempt
    /// still on their way must not count for the retry, so every rank's count starts again.
    /// Only the reader may do it, only while leased, one epoch at a time, a bounded number of
    /// times.
    fn adopt_epoch(&mut self, from: PeerId, epoch: Epoch) -> bool {
        let adopt = self.mode == TransferMode::Pull
            && self.phase == Phase::Leased
            && self.reader == Some(from)
            && epoch == self.epoch.next()
            && self.epoch_moves_left > 0;
        if adopt {
            self.epoch = epoch;
            self.epoch_moves_left -= 1;
            for part in &mut self.parts {
                part.done.clear();
            }
        }
        adopt
    }

    fn all_read(&self) -> bool {
        self.parts
            .iter()
            .all(|p| p.expected > 0 && p.done.len() >= p.expected as usize)
    }

    fn writes_in_flight(&self) -> bool {
        self.registrations
            .iter()
            .any(|r| matches!(r.state, RegState::Writing | RegState::CancelPending))
    }

    fn all_written(&self) -> bool {
        let Some(d_tp) = self.registrations.first().map(|r| r.d_tp) else {
            return false;
        };
        (0..d_tp).all(|rank| {
            self.registrations
                .iter()
                .any(|r| r.d_rank == rank && r.state == RegState::Written)
        })
    }
}

/// The P-side ledger. See the module docs for its states.
#[derive(Debug)]
pub struct ProducerLedger {
    cfg: ProducerConfig,
    handoffs: HashMap<HandoffId, Handoff>,
    timers: TimerQueue<HandoffId>,
    // Ordered (as every collection this ledger iterates to emit): the same inputs give the
    // same messages and releases in the same order, which a recorded trace's replay relies on.
    by_peer: BTreeMap<PeerId, BTreeSet<HandoffId>>,
    staging: Staging<Message>,
    tombstones: Tombstones<EndReason>,
    messages: VecDeque<(PeerId, Message)>,
    releases: VecDeque<BlockRelease>,
    actions: VecDeque<ProducerAction>,
    // Push: P heartbeats D's registrations so that its write grants are anchored on its own clock.
    heartbeats: HeartbeatSender,
    push_waiting: BTreeMap<PeerId, BTreeSet<HandoffId>>,
    urgent: BTreeMap<PeerId, BTreeSet<HandoffId>>,
    /// Push: registrations staged before their handoff exists, to ask D's grant for at once,
    /// so that the grant is in hand when the handoff is created (an engine that plans the
    /// writes as it schedules the forward pass that produces the KV needs it then). Emptied at
    /// every flush.
    early_asks: BTreeMap<PeerId, Vec<HeartbeatEntry>>,
    next_push_heartbeat: Option<Time>,
    last_now: Time,
    held_blocks: usize,
    stats: ProducerStats,
}

impl ProducerLedger {
    pub fn new(cfg: ProducerConfig) -> Self {
        ProducerLedger {
            staging: Staging::new(
                cfg.staging_capacity,
                cfg.staging_per_handoff,
                cfg.staging_per_peer,
                cfg.staging_ttl,
            ),
            tombstones: Tombstones::new(cfg.tombstone_capacity, cfg.tombstone_ttl),
            cfg,
            handoffs: HashMap::new(),
            timers: TimerQueue::default(),
            by_peer: BTreeMap::new(),
            messages: VecDeque::new(),
            releases: VecDeque::new(),
            actions: VecDeque::new(),
            heartbeats: HeartbeatSender::new(handoff_proto::TransferMode::Push),
            push_waiting: BTreeMap::new(),
            urgent: BTreeMap::new(),
            early_asks: BTreeMap::new(),
            next_push_heartbeat: None,
            last_now: Time::ZERO,
            held_blocks: 0,
            stats: ProducerStats::default(),
        }
    }

    pub fn config(&self) -> &ProducerConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &ProducerStats {
        &self.stats
    }

    /// Handoffs not yet ended (their blocks are still out of the pool).
    pub fn len(&self) -> usize {
        self.handoffs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handoffs.is_empty()
    }

    pub fn memory(&self) -> crate::MemoryUse {
        crate::MemoryUse {
            handoffs: self.handoffs.len(),
            staged_messages: self.staging.len(),
            tombstones: self.tombstones.len(),
            timer_entries: self.timers.len(),
            heartbeats_awaiting_reply: self.heartbeats.awaiting(),
        }
    }

    /// Blocks held by handoffs, whatever their state.
    pub fn held_blocks(&self) -> usize {
        self.held_blocks
    }

    /// Blocks held per state: (leased, fencing or draining).
    pub fn held_blocks_by_state(&self) -> (usize, usize) {
        let mut out = (0, 0);
        for h in self.handoffs.values() {
            match h.phase {
                Phase::Leased => out.0 += h.blocks.len(),
                _ => out.1 += h.blocks.len(),
            }
        }
        out
    }

    /// Blocks held by handoffs that `peer` reads (or registered for).
    /// Whether any live handoff or pending work names `peer` (the connector forgets a peer only
    /// when none does).
    pub fn uses_peer(&self, peer: PeerId) -> bool {
        self.by_peer.contains_key(&peer)
            || self.push_waiting.contains_key(&peer)
            || self.messages.iter().any(|(p, _)| *p == peer)
    }

    pub fn held_blocks_for(&self, peer: PeerId) -> usize {
        self.by_peer.get(&peer).map_or(0, |ids| {
            ids.iter()
                .filter_map(|id| self.handoffs.get(id))
                .map(|h| h.blocks.len())
                .sum()
        })
    }

    /// Messages kept for handoffs not created yet (bounded by the staging capacity).
    pub fn staged_messages(&self) -> usize {
        self.staging.len()
    }

    pub fn contains(&self, id: HandoffId) -> bool {
        self.handoffs.contains_key(&id)
    }

    /// Creates a handoff holding `blocks` and returns the grant to hand out in
    /// `kv_transfer_params`. Messages that arrived for it earlier are applied now.
    pub fn create_handoff(
        &mut self,
        id: HandoffId,
        blocks: Vec<BlockId>,
        mode: TransferMode,
        now: Time,
    ) -> Result<Grant, CreateError> {
        self.create(id, blocks, mode, None, now)
    }

    /// Layer-wise pull: P's prefill into `blocks` starts now under `id` (the proxy's, sent to D
    /// at the same time). D's heartbeats and block query may be staged already; its reader is
    /// told of each layer saved ([`Self::layers_saved`]), and the handoff cannot end before
    /// [`Self::prefill_ended`].
    pub fn create_filling_handoff(
        &mut self,
        id: HandoffId,
        blocks: Vec<BlockId>,
        now: Time,
    ) -> Result<Grant, CreateError> {
        self.create(
            id,
            blocks,
            TransferMode::Pull,
            Some(Filling::default()),
            now,
        )
    }

    /// Layer-wise pull: the first `layers` layers of the handoff's blocks hold their KV. The
    /// reader, once it asked, gets the list again with that count.
    pub fn layers_saved(&mut self, id: HandoffId, layers: u32) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let Some(f) = h.filling.as_mut().filter(|f| layers > f.layers) else {
            return;
        };
        f.layers = layers;
        if let (true, Phase::Leased, Some(reader)) = (h.asked, h.phase, h.reader) {
            self.messages.push_back((reader, h.block_list_message(id)));
        }
    }

    /// Layer-wise pull: P's prefill ended (`ok`: every layer is saved). The reader gets the
    /// final list; an end that came meanwhile takes effect now. A failed prefill ends the
    /// handoff: at once when no reader was told where the blocks are, else under the fence (it
    /// may be reading the layers saved so far, rule 2).
    pub fn prefill_ended(&mut self, id: HandoffId, ok: bool, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let Some(f) = h.filling.take() else {
            return;
        };
        if let Some(reason) = f.ended {
            self.release_now(id, reason, now);
        } else if !ok && h.asked {
            // Already fencing (the lease ran out, the proxy released): that fence, armed, ends it.
            if h.phase == Phase::Leased {
                let until = h.lease_end.max(now) + self.cfg.fence_grace;
                h.phase = Phase::Fencing {
                    until,
                    reason: EndReason::Failed,
                };
                h.timer.arm(&mut self.timers, id, until);
            }
        } else if !ok {
            self.begin_end(id, EndReason::Failed, now);
        } else if let (true, Phase::Leased, Some(reader)) = (h.asked, h.phase, h.reader) {
            self.messages.push_back((reader, h.block_list_message(id)));
        }
    }

    fn create(
        &mut self,
        id: HandoffId,
        blocks: Vec<BlockId>,
        mode: TransferMode,
        filling: Option<Filling>,
        now: Time,
    ) -> Result<Grant, CreateError> {
        self.last_now = self.last_now.max(now);
        if self.handoffs.contains_key(&id) || self.tombstones.get(&id).is_some() {
            return Err(CreateError::Duplicate(id));
        }
        if blocks.is_empty() {
            return Err(CreateError::NoBlocks(id));
        }
        if blocks.len() > MAX_REGISTERED_BLOCKS {
            return Err(CreateError::TooManyBlocks(id, blocks.len()));
        }
        let cap_end = now + self.cfg.hard_cap;
        let lease_end = (now + self.cfg.initial_lease).min(cap_end);
        self.held_blocks += blocks.len();
        let mut h = Handoff {
            epoch: Epoch::FIRST,
            epoch_moves_left: MAX_EPOCH_MOVES,
            mode,
            blocks,
            created: now,
            lease_end,
            cap_end,
            phase: Phase::Leased,
            reader: None,
            parts: vec![Part::default(); self.cfg.tp.max(1) as usize],
            registrations: Vec::new(),
            cancel_acked: false,
            asked: false,
            filling,
            timer: TimerSlot::default(),
        };
        h.timer.arm(&mut self.timers, id, lease_end);
        self.handoffs.insert(id, h);
        self.stats.created += 1;
        for (from, msg) in self.staging.take(id, now) {
            match (from, msg) {
                (Some(from), msg) => self.handle_message(from, msg, now),
                (None, Message::Release(r)) => self.on_release(None, r, now),
                (None, _) => self.stats.ignored += 1,
            }
        }
        let lease_ms = self
            .handoffs
            .get(&id)
            .map(|h| ms_floor(h.lease_end.saturating_sub(now)))
            .unwrap_or(0);
        Ok(Grant {
            handoff: id,
            epoch: Epoch::FIRST,
            lease_ms,
        })
    }

    /// Feeds one message received from `from`. Unknown, late, duplicate and stale messages change
    /// nothing but counters (rule 7).
    pub fn handle_message(&mut self, from: PeerId, msg: Message, now: Time) {
        self.last_now = self.last_now.max(now);
        match msg {
            Message::Heartbeat(hb) => self.on_heartbeat(from, hb, now),
            Message::PullDone(pd) => self.on_pull_done(from, pd, now),
            Message::Release(r) => self.on_release(Some(from), r, now),
            Message::PushRegister(r) => self.on_push_register(from, r, now),
            Message::PushCancel(c) => self.on_push_cancel(from, c, now),
            Message::GrantBatch(g) => self.on_grants(from, g, now),
            Message::BlocksQuery(q) => self.on_blocks_query(from, q, now),
            Message::Hello(_)
            | Message::HelloReply(_)
            | Message::PushDone(_)
            | Message::PushFailed(_)
            | Message::PushCancelAck(_)
            | Message::PullBlocks(_) => self.stats.ignored += 1,
        }
    }

    /// A release from outside the cluster's peers: the proxy, when it believes D never got the
    /// request. It never makes its sender a reader. When no D claimed the handoff, it ends now;
    /// when one did, it cannot promise that no READ is in flight, so it only ends the lease and
    /// the fence protects a read that may still run (rule 2). Before the handoff exists it is
    /// staged like any early message.
    pub fn release_unclaimed(&mut self, r: Release, now: Time) {
        self.last_now = self.last_now.max(now);
        self.on_release(None, r, now);
    }

    /// The transport reports `peer` dead: every handoff it was reading or registered for ends now.
    /// A dead reader cannot be harmed by reuse (rule 5: "at once").
    pub fn handle_peer_dead(&mut self, peer: PeerId, now: Time) {
        self.last_now = self.last_now.max(now);
        let ids: Vec<HandoffId> = self
            .by_peer
            .remove(&peer)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default();
        for id in ids {
            if self.handoffs.contains_key(&id) {
                self.release_now(id, EndReason::PeerDead, now);
            }
        }
        self.push_waiting.remove(&peer);
        self.urgent.remove(&peer);
        self.early_asks.remove(&peer);
    }

    /// Advances time: expires leases, ends fences, sends push heartbeats.
    pub fn handle_timeout(&mut self, now: Time) {
        self.last_now = self.last_now.max(now);
        while let Some(id) = self.timers.pop_live(now, |id, generation| {
            self.handoffs
                .get_mut(&id)
                .is_some_and(|h| h.timer.fired(generation))
        }) {
            self.evaluate(id, now);
        }
        self.staging.expire(now);
        self.tombstones.expire(now);
        self.heartbeats.expire(now, self.cfg.hard_cap);
        if self.next_push_heartbeat.is_some_and(|t| t <= now) {
            self.send_push_heartbeats(now);
        }
        self.flush_urgent(now);
    }

    /// When [`Self::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Time> {
        let mut t = self.timers.next_deadline();
        if let Some(hb) = self.next_push_heartbeat {
            t = Some(t.map_or(hb, |x| x.min(hb)));
        }
        if !self.urgent.is_empty() || !self.early_asks.is_empty() {
            t = Some(self.last_now);
        }
        t
    }

    pub fn poll_message(&mut self) -> Option<(PeerId, Message)> {
        self.messages.pop_front()
    }

    pub fn poll_release(&mut self) -> Option<BlockRelease> {
        self.releases.pop_front()
    }

    pub fn poll_action(&mut self) -> Option<ProducerAction> {
        self.actions.pop_front()
    }

    /// Push: may P post a WRITE into D rank `d_rank` of `handoff` now? Returns the end of the
    /// grant; nothing may be posted after it (rule 3).
    pub fn write_permit(
        &self,
        handoff: HandoffId,
        d_rank: u16,
        now: Time,
    ) -> Result<Time, WriteRefused> {
        let h = self
            .handoffs
            .get(&handoff)
            .ok_or(WriteRefused::UnknownHandoff)?;
        if h.phase != Phase::Leased || h.cancel_acked {
            return Err(WriteRefused::Cancelled);
        }
        let r = h
            .registrations
            .iter()
            .find(|r| r.d_rank == d_rank && r.epoch == h.epoch)
            .ok_or(WriteRefused::NotRegistered)?;
        match r.state {
            RegState::Waiting | RegState::Writing => {}
            _ => return Err(WriteRefused::Cancelled),
        }
        match r.grant_until {
            Some(until) if until > now + self.cfg.write_margin => Ok(until),
            _ => Err(WriteRefused::GrantExpired),
        }
    }

    /// Push: every WRITE of `handoff` into D rank `d_rank` has ended (`ok` = all landed, with
    /// their `PushDone` notifications). A failure is reported to D at once.
    pub fn on_push_write_done(&mut self, handoff: HandoffId, d_rank: u16, ok: bool, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&handoff) else {
            return;
        };
        let epoch = h.epoch;
        let Some(r) = h.registrations.iter_mut().find(|r| {
            r.d_rank == d_rank && matches!(r.state, RegState::Writing | RegState::CancelPending)
        }) else {
            return;
        };
        let peer = r.peer;
        match r.state {
            RegState::CancelPending => {
                r.state = RegState::Cancelled;
                // The ack promises that *no* write into any of D's ranks is in flight.
                let still_writing = h.registrations.iter().any(|x| {
                    x.peer == peer && matches!(x.state, RegState::Writing | RegState::CancelPending)
                });
                if !still_writing {
                    h.cancel_acked = true;
                    self.messages.push_back((
                        peer,
                        Message::PushCancelAck(PushCancelAck {
                            handoff,
                            epoch,
                            p_rank: 0,
                        }),
                    ));
                }
            }
            _ if ok && !r.timed_out => r.state = RegState::Written,
            _ => {
                r.state = RegState::Failed;
                self.messages.push_back((
                    peer,
                    Message::PushFailed(PushFailed {
                        handoff,
                        epoch,
                        p_rank: 0,
                        reason: "write failed".into(),
                    }),
                ));
                if h.phase == Phase::Leased {
                    self.begin_end(handoff, EndReason::Failed, now);
                }
            }
        }
        self.evaluate(handoff, now);
    }

    // ----- message handlers -----

    fn on_heartbeat(&mut self, from: PeerId, hb: Heartbeat, now: Time) {
        self.stats.heartbeats_received += 1;
        let mut grants = Vec::new();
        let mut gone = Vec::new();
        for e in hb.entries {
            if let Some(h) = self.handoffs.get_mut(&e.handoff) {
                if h.epoch != e.epoch && h.adopt_epoch(from, e.epoch) && h.asked {
                    // The retry reads under the new epoch: a list it ignored as stale (a
                    // layer-wise pull's last, sent before the move) is sent again under it.
                    self.messages
                        .push_back((from, h.block_list_message(e.handoff)));
                } else if h.epoch != e.epoch {
                    // The reader moved on to an epoch we cannot follow (fencing, or out of
                    // moves): tell it at once rather than let it wait out its deadline.
                    if e.epoch > h.epoch && h.reader == Some(from) {
                        gone.push(e);
                    } else {
                        self.stats.stale_epoch += 1;
                    }
                    continue;
                }
            }
            match self.handoffs.get_mut(&e.handoff) {
                Some(h) if h.phase == Phase::Leased => {
                    let extended = (now + self.cfg.heartbeat_extension).min(h.cap_end);
                    h.lease_end = h.lease_end.max(extended);
                    grants.push(Grant {
                        handoff: e.handoff,
                        epoch: h.epoch,
                        lease_ms: ms_floor(h.lease_end.saturating_sub(now)),
                    });
                    if h.reader.is_none() {
                        h.reader = Some(from);
                        self.by_peer.entry(from).or_default().insert(e.handoff);
                    }
                }
                // Fencing or draining: the lease is over, no new grant (rule 2).
                Some(_) => gone.push(e),
                // Ended well: its completions may still be on their way to D (they ride on the
                // transfers, not on this channel), so "gone" would race them. Say nothing --
                // unless D is retrying a read (a later epoch): nothing of the retry is in
                // flight, and it must not wait for a grant that will never come.
                None if self.tombstones.get(&e.handoff) == Some(&EndReason::Done)
                    && e.epoch == Epoch::FIRST => {}
                None if self.tombstones.get(&e.handoff).is_some() => gone.push(e),
                None => {
                    let single = Heartbeat {
                        seq: hb.seq,
                        mode: hb.mode,
                        entries: vec![e],
                    };
                    self.stage_once(from, Message::Heartbeat(single), e.handoff, now);
                }
            }
        }
        self.stats.grants_sent += grants.len() as u64;
        for batch in split_grants(hb.seq, grants, gone) {
            self.messages.push_back((from, Message::GrantBatch(batch)));
        }
    }

    /// D asks which blocks to read. Only a handoff's reader (the first D that heartbeats or
    /// asks for it) is answered: a client that names a handoff id learns nothing through another
    /// D, and D never reads the block ids a client wrote into its request.
    fn on_blocks_query(&mut self, from: PeerId, q: BlocksQuery, now: Time) {
        let mut lists = Vec::new();
        for e in q.entries {
            let Some(h) = self.handoffs.get_mut(&e.handoff) else {
                // Not created yet (a layer-wise pull's D asks as P's prefill is about to start):
                // answered at creation. Ended: D hears "gone" in the grant reply.
                let single = BlocksQuery { entries: vec![e] };
                self.stage_once(from, Message::BlocksQuery(single), e.handoff, now);
                continue;
            };
            if h.epoch != e.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            if h.mode != TransferMode::Pull || h.phase != Phase::Leased {
                self.stats.ignored += 1;
                continue;
            }
            match h.reader {
                Some(reader) if reader != from => {
                    self.stats.blocks_refused += 1;
                    continue;
                }
                Some(_) => {}
                None => {
                    h.reader = Some(from);
                    self.by_peer.entry(from).or_default().insert(e.handoff);
                }
            }
            h.asked = true;
            lists.push(h.block_list(e.handoff));
        }
        // A handoff too long to name in one message was refused at creation (see
        // `create_handoff`), so nothing is left over here.
        let (answers, _too_long) = split_block_lists(lists);
        for a in answers {
            self.messages.push_back((from, Message::PullBlocks(a)));
        }
    }

    fn on_pull_done(&mut self, from: PeerId, pd: PullDone, now: Time) {
        let Some(h) = self.handoffs.get_mut(&pd.handoff) else {
            self.unknown(pd.handoff, Some(from), Message::PullDone(pd), now);
            return;
        };
        if h.epoch != pd.epoch {
            self.stats.stale_epoch += 1;
            return;
        }
        // A push handoff ends on P's own writes (and their grants), never on a reader's word
        // that it read: freeing now would free blocks under P's WRITE.
        if h.mode != TransferMode::Pull {
            self.stats.ignored += 1;
            return;
        }
        // Only the reader was told where the blocks are (PullBlocks goes to it alone), so only
        // the reader can have read them.
        if h.reader != Some(from) {
            self.stats.not_from_reader += 1;
            return;
        }
        let Some(part) = h.parts.get_mut(pd.p_rank as usize) else {
            self.stats.ignored += 1;
            return;
        };
        part.expected = part.expected.max(pd.consumers.max(1));
        if part.done.contains(&pd.consumer_rank) {
            self.stats.duplicate_notifications += 1;
            return;
        }
        part.done.push(pd.consumer_rank);
        if h.all_read() {
            // The notification rides on the READ and is delivered after its bytes: nothing is in
            // flight any more, so the blocks go back now, whatever the phase.
            let reason = match h.phase {
                Phase::Leased => EndReason::Done,
                Phase::Fencing { reason, .. } | Phase::Draining { reason, .. } => reason,
            };
            self.release_now(pd.handoff, reason, now);
        }
    }

    fn on_release(&mut self, from: Option<PeerId>, r: Release, now: Time) {
        let Some(h) = self.handoffs.get(&r.handoff) else {
            if self.tombstones.get(&r.handoff).is_some() {
                self.stats.duplicate_notifications += 1;
            } else {
                self.unknown(r.handoff, from, Message::Release(r), now);
            }
            return;
        };
        // The reader may release under an epoch we never heard of (its retry's heartbeat was
        // lost): it moved on from ours, and its release still promises no READ is in flight.
        let newer_from_reader = r.epoch > h.epoch && from.is_some() && h.reader == from;
        if h.epoch != r.epoch && !newer_from_reader {
            self.stats.stale_epoch += 1;
            return;
        }
        // A release from someone other than the D that reads the handoff (the proxy, when it
        // believes D never got the request) cannot promise that no READ is in flight: it only
        // stops the lease from being renewed. The reader may hold a grant up to the lease's
        // current end and read until that grant + its read grace, so the fence runs from the
        // lease's end, not from now (rule 2).
        if h.reader.is_some_and(|reader| Some(reader) != from) {
            if h.phase == Phase::Leased {
                let until = h.lease_end.max(now) + self.cfg.fence_grace;
                let h = self.handoffs.get_mut(&r.handoff).expect("checked above");
                h.phase = Phase::Fencing {
                    until,
                    reason: r.reason.into(),
                };
                h.timer.arm(&mut self.timers, r.handoff, until);
            }
            return;
        }
        // The reader promises no READ is in flight; push writes of ours are waited for.
        let reason = match h.phase {
            Phase::Leased => r.reason.into(),
            Phase::Fencing { reason, .. } | Phase::Draining { reason, .. } => reason,
        };
        self.begin_end(r.handoff, reason, now);
    }

    fn on_push_register(&mut self, from: PeerId, r: PushRegister, now: Time) {
        let Some(h) = self.handoffs.get_mut(&r.handoff) else {
            if self.tombstones.get(&r.handoff).is_some() {
                // Tell D at once that nothing will be written, so it frees and moves on.
                self.messages.push_back((
                    from,
                    Message::PushFailed(PushFailed {
                        handoff: r.handoff,
                        epoch: r.epoch,
                        p_rank: 0,
                        reason: "handoff already ended on P".into(),
                    }),
                ));
            } else {
                let ask = HeartbeatEntry {
                    handoff: r.handoff,
                    epoch: r.epoch,
                };
                // Asked early only when staged: a registration the bounded staging dropped is
                // not asked about, so a flood of made-up ids costs P no more asks than its
                // staging quota.
                if self.unknown(r.handoff, Some(from), Message::PushRegister(r), now) {
                    self.early_asks.entry(from).or_default().push(ask);
                }
            }
            return;
        };
        if h.epoch != r.epoch {
            self.stats.stale_epoch += 1;
            return;
        }
        if h.mode != TransferMode::Push || r.d_tp == 0 || r.d_rank >= r.d_tp {
            self.stats.ignored += 1;
            return;
        }
        if h.reader.is_some_and(|reader| reader != from) {
            self.stats.not_from_reader += 1;
            return;
        }
        if h.registrations.iter().any(|x| x.d_rank == r.d_rank) {
            self.stats.duplicate_notifications += 1;
            return;
        }
        if h.phase != Phase::Leased || h.cancel_acked {
            self.stats.late_notifications += 1;
            return;
        }
        h.registrations.push(Registration {
            peer: from,
            d_rank: r.d_rank,
            d_tp: r.d_tp,
            epoch: r.epoch,
            blocks: r.block_ids,
            num_tokens: r.num_tokens,
            cached_blocks: r.cached_blocks,
            grant_until: None,
            state: RegState::Waiting,
            timed_out: false,
        });
        if h.reader.is_none() {
            h.reader = Some(from);
            self.by_peer.entry(from).or_default().insert(r.handoff);
        }
        self.push_waiting.entry(from).or_default().insert(r.handoff);
        // Ask for a grant at once rather than at the next heartbeat tick.
        self.urgent.entry(from).or_default().insert(r.handoff);
        if self.next_push_heartbeat.is_none() {
            self.next_push_heartbeat = Some(now + self.cfg.heartbeat_interval);
        }
    }

    fn on_push_cancel(&mut self, from: PeerId, c: PushCancel, now: Time) {
        let ack = Message::PushCancelAck(PushCancelAck {
            handoff: c.handoff,
            epoch: c.epoch,
            p_rank: 0,
        });
        let Some(h) = self.handoffs.get_mut(&c.handoff) else {
            if self.tombstones.get(&c.handoff).is_none() {
                // The ack below promises D that no write will start: the registration and any
                // early grant staged for it must not come back when the handoff is created.
                let epoch = c.epoch;
                self.staging.discard(c.handoff, |f, m| {
                    f == Some(from)
                        && match m {
                            Message::PushRegister(r) => r.epoch == epoch,
                            Message::GrantBatch(g) => g.grants.iter().all(|x| x.epoch == epoch),
                            _ => false,
                        }
                });
                // Early cancel: keep it so a later create ends the handoff at once.
                self.unknown(c.handoff, Some(from), Message::PushCancel(c), now);
            }
            // No write can be in flight for a handoff P does not hold, and none will start: a
            // write needs a grant D no longer gives for a cancelled registration.
            self.messages.push_back((from, ack));
            return;
        };
        if h.epoch != c.epoch {
            self.stats.stale_epoch += 1;
            return;
        }
        // A cancel ends the handoff without a fence: only the D whose registration it cancels
        // may send it, and only for a push. From anyone else (or for a pull, whose reader may be
        // mid-READ) it would free blocks under a transfer it cannot promise is over.
        if h.mode != TransferMode::Push {
            self.stats.ignored += 1;
            return;
        }
        if h.reader.is_some_and(|reader| reader != from) {
            self.stats.not_from_reader += 1;
            return;
        }
        let mut pending = false;
        for r in h.registrations.iter_mut().filter(|r| r.peer == from) {
            match r.state {
                RegState::Writing => {
                    r.state = RegState::CancelPending;
                    pending = true;
                    self.actions.push_back(ProducerAction::AbortWrite {
                        handoff: c.handoff,
                        d_rank: r.d_rank,
                    });
                }
                RegState::CancelPending => pending = true,
                RegState::Waiting => r.state = RegState::Cancelled,
                _ => {}
            }
        }
        if !pending {
            h.cancel_acked = true;
            self.messages.push_back((from, ack));
        }
        self.begin_end(c.handoff, EndReason::Cancelled, now);
    }

    fn on_grants(&mut self, from: PeerId, g: GrantBatch, now: Time) {
        let Some(sent_at) = self.heartbeats.anchor(g.seq, from) else {
            self.stats.ignored += 1;
            return;
        };
        for grant in g.grants {
            let Some(h) = self.handoffs.get_mut(&grant.handoff) else {
                if self.tombstones.get(&grant.handoff).is_none() {
                    // The answer to an early ask: staged with its registration, it is replayed
                    // when the handoff is created, still anchored at our ask's send time.
                    let early = GrantBatch {
                        seq: g.seq,
                        grants: vec![grant],
                        gone: Vec::new(),
                    };
                    self.unknown(grant.handoff, Some(from), Message::GrantBatch(early), now);
                }
                continue;
            };
            if h.phase != Phase::Leased {
                continue;
            }
            for r in h.registrations.iter_mut() {
                if r.peer == from
                    && r.epoch == grant.epoch
                    && matches!(r.state, RegState::Waiting | RegState::Writing)
                {
                    // Anchored at our send time: D's grant started no earlier (rule 3).
                    let until = sent_at + Duration::from_millis(grant.lease_ms as u64);
                    r.grant_until = Some(r.grant_until.map_or(until, |u| u.max(until)));
                }
            }
            self.start_writes(grant.handoff, now);
        }
        for e in g.gone {
            let Some(h) = self.handoffs.get_mut(&e.handoff) else {
                continue;
            };
            for r in h.registrations.iter_mut() {
                if r.peer == from && r.epoch == e.epoch {
                    match r.state {
                        RegState::Waiting => r.state = RegState::Cancelled,
                        RegState::Writing => {
                            r.state = RegState::CancelPending;
                            self.actions.push_back(ProducerAction::AbortWrite {
                                handoff: e.handoff,
                                d_rank: r.d_rank,
                            });
                        }
                        _ => {}
                    }
                }
            }
            // D dropped the handoff: nothing more will be written, so end it now (after any
            // aborted write drains) instead of holding the blocks until the lease runs out.
            let nothing_left = h.registrations.iter().all(|r| {
                matches!(
                    r.state,
                    RegState::Cancelled | RegState::CancelPending | RegState::Failed
                )
            });
            if nothing_left && !h.registrations.is_empty() && h.phase == Phase::Leased {
                self.begin_end(e.handoff, EndReason::Cancelled, now);
            }
        }
    }

    /// Stages a message about a handoff P does not hold (yet); whether it was staged.
    fn unknown(&mut self, id: HandoffId, from: Option<PeerId>, msg: Message, now: Time) -> bool {
        if self.tombstones.get(&id).is_some() {
            self.stats.late_notifications += 1;
            false
        } else {
            // A notification that arrives before the handoff exists is staged, never dropped
            // (unless the bounded staging is full or it expires). At its sender's quota, one of
            // the heartbeats or block queries it staged (a layer-wise pull's D repeats them
            // while P's request queues) makes room: those come again, a release does not.
            self.stats.staged += 1;
            self.staging.make_room(from, |m| {
                matches!(m, Message::Heartbeat(_) | Message::BlocksQuery(_))
            });
            let staged = self.staging.stage(id, from, msg, now);
            self.stats.staged_over_quota = self.staging.over_quota;
            staged
        }
    }

    /// Stages a heartbeat or block query for a handoff not created yet, replacing the one of its
    /// kind `from` staged before: D repeats both every heartbeat interval while P's request
    /// queues, and only the latest matters (its heartbeat is the freshest anchor for the grant
    /// it gets at creation). Keeps the staging's per-handoff room for what must not be lost (an
    /// early release).
    fn stage_once(&mut self, from: PeerId, msg: Message, id: HandoffId, now: Time) {
        if self.tombstones.get(&id).is_some() {
            self.stats.ignored += 1;
            return;
        }
        let kind = msg.kind();
        self.staging
            .discard(id, |f, m| f == Some(from) && m.kind() == kind);
        self.stats.staged += 1;
        self.staging.stage(id, Some(from), msg, now);
        self.stats.staged_over_quota = self.staging.over_quota;
    }

    // ----- transitions -----

    fn start_writes(&mut self, id: HandoffId, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if h.phase != Phase::Leased || h.cancel_acked {
            return;
        }
        let p_tp = self.cfg.tp.max(1);
        for r in h.registrations.iter_mut() {
            let valid = r
                .grant_until
                .is_some_and(|u| u > now + self.cfg.write_margin);
            if r.state == RegState::Waiting && valid {
                r.state = RegState::Writing;
                let done = rank_pairs(p_tp, r.d_tp)
                    .into_iter()
                    .filter(|(d, _)| *d == r.d_rank)
                    .map(|(d, p)| PushDone {
                        digest: None,
                        handoff: id,
                        epoch: r.epoch,
                        p_rank: p,
                        d_rank: d,
                    })
                    .collect();
                self.actions.push_back(ProducerAction::PushWrite(PushWrite {
                    handoff: id,
                    epoch: r.epoch,
                    d_peer: r.peer,
                    d_rank: r.d_rank,
                    d_tp: r.d_tp,
                    src_blocks: h.blocks.clone(),
                    dst_blocks: r.blocks.clone(),
                    num_tokens: r.num_tokens,
                    cached_blocks: r.cached_blocks,
                    grant_until: r.grant_until.unwrap_or(now),
                    done,
                }));
                let deadline = r.grant_until.unwrap_or(now) + self.cfg.write_timeout;
                h.timer.arm(&mut self.timers, id, deadline);
            }
        }
    }

    /// Ends a handoff for `reason`: at once unless a push write of ours is in flight.
    fn begin_end(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if h.writes_in_flight() {
            for r in h.registrations.iter_mut() {
                if r.state == RegState::Writing {
                    self.actions.push_back(ProducerAction::AbortWrite {
                        handoff: id,
                        d_rank: r.d_rank,
                    });
                }
            }
            let until = match h.phase {
                Phase::Fencing { until, .. } | Phase::Draining { until, .. } => until,
                Phase::Leased => now + self.cfg.fence_grace,
            };
            h.phase = Phase::Draining { until, reason };
            h.timer.arm(&mut self.timers, id, until);
        } else {
            self.release_now(id, reason, now);
        }
    }

    /// Looks at a handoff after a timer fired or a write ended and moves it on.
    fn evaluate(&mut self, id: HandoffId, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        match h.phase {
            Phase::Leased => {
                if h.mode == TransferMode::Push && h.all_written() {
                    self.release_now(id, EndReason::Done, now);
                    return;
                }
                // Rule 3: a write may not outlive its grant by more than the write timeout.
                let mut next_write_deadline: Option<Time> = None;
                for r in h.registrations.iter_mut() {
                    if r.state != RegState::Writing || r.timed_out {
                        continue;
                    }
                    let wd = r.grant_until.unwrap_or(now) + self.cfg.write_timeout;
                    if now >= wd {
                        r.timed_out = true;
                        self.actions.push_back(ProducerAction::AbortWrite {
                            handoff: id,
                            d_rank: r.d_rank,
                        });
                    } else {
                        next_write_deadline = Some(next_write_deadline.map_or(wd, |x| x.min(wd)));
                    }
                }
                let deadline = h.lease_end.min(h.cap_end);
                if let Some(wd) = next_write_deadline {
                    h.timer.arm(&mut self.timers, id, wd.min(deadline));
                }
                if now >= deadline {
                    let reason = if h.cap_end <= h.lease_end {
                        EndReason::Capped
                    } else {
                        EndReason::Expired
                    };
                    let until = deadline + self.cfg.fence_grace;
                    h.phase = Phase::Fencing { until, reason };
                    h.timer.arm(&mut self.timers, id, until);
                    for r in h.registrations.iter_mut() {
                        if r.state == RegState::Writing {
                            self.actions.push_back(ProducerAction::AbortWrite {
                                handoff: id,
                                d_rank: r.d_rank,
                            });
                        }
                    }
                } else {
                    h.timer.arm(&mut self.timers, id, deadline);
                }
            }
            Phase::Fencing { until, reason } | Phase::Draining { until, reason } => {
                if now >= until
                    || (matches!(h.phase, Phase::Draining { .. }) && !h.writes_in_flight())
                {
                    self.release_now(id, reason, now);
                } else {
                    h.timer.arm(&mut self.timers, id, until);
                }
            }
        }
    }

    fn release_now(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        if let Some(h) = self.handoffs.get_mut(&id) {
            if let Some(f) = h.filling.as_mut() {
                // P's forward pass still writes these blocks: they go back when it ends
                // (`prefill_ended`). Meanwhile the handoff is over for everyone else.
                f.ended = Some(f.ended.unwrap_or(reason));
                h.phase = Phase::Draining { until: now, reason };
                return;
            }
        }
        let Some(h) = self.handoffs.remove(&id) else {
            return;
        };
        let handoffs = &self.handoffs;
        self.timers.compact_if_stale(handoffs.len(), |k, g| {
            handoffs.get(&k).is_some_and(|h| h.timer.is_live(g))
        });
        for r in &h.registrations {
            if matches!(r.state, RegState::Writing | RegState::CancelPending) {
                self.actions.push_back(ProducerAction::AbortWrite {
                    handoff: id,
                    d_rank: r.d_rank,
                });
            }
        }
        if let Some(peer) = h.reader {
            if let Some(set) = self.by_peer.get_mut(&peer) {
                set.remove(&id);
                if set.is_empty() {
                    self.by_peer.remove(&peer);
                }
            }
        }
        self.held_blocks -= h.blocks.len();
        *self.stats.ended.entry(reason.as_str()).or_default() += 1;
        self.tombstones.insert(id, reason, now);
        self.releases.push_back(BlockRelease {
            handoff: id,
            blocks: h.blocks,
            reason,
            held_for: now.saturating_sub(h.created),
        });
    }

    fn send_push_heartbeats(&mut self, now: Time) {
        let mut any = false;
        let peers: Vec<PeerId> = self.push_waiting.keys().copied().collect();
        for peer in peers {
            let Some(ids) = self.push_waiting.get_mut(&peer) else {
                continue;
            };
            let handoffs = &self.handoffs;
            ids.retain(|id| {
                handoffs.get(id).is_some_and(|h| {
                    h.phase == Phase::Leased
                        && h.registrations.iter().any(|r| {
                            r.peer == peer
                                && matches!(r.state, RegState::Waiting | RegState::Writing)
                        })
                })
            });
            let entries: Vec<HeartbeatEntry> = ids
                .iter()
                .map(|id| HeartbeatEntry {
                    handoff: *id,
                    epoch: handoffs[id].epoch,
                })
                .collect();
            if entries.is_empty() {
                self.push_waiting.remove(&peer);
                continue;
            }
            any = true;
            self.heartbeats
                .send(peer, &entries, now, &mut self.messages);
        }
        self.next_push_heartbeat = any.then(|| now + self.cfg.heartbeat_interval);
    }

    fn flush_urgent(&mut self, now: Time) {
        for (peer, entries) in std::mem::take(&mut self.early_asks) {
            self.heartbeats
                .send(peer, &entries, now, &mut self.messages);
        }
        let urgent = std::mem::take(&mut self.urgent);
        for (peer, ids) in urgent {
            let entries: Vec<HeartbeatEntry> = ids
                .into_iter()
                .filter_map(|id| {
                    self.handoffs.get(&id).map(|h| HeartbeatEntry {
                        handoff: id,
                        epoch: h.epoch,
                    })
                })
                .collect();
            if !entries.is_empty() {
                self.heartbeats
                    .send(peer, &entries, now, &mut self.messages);
            }
        }
    }
}

/// Whole milliseconds, rounded down: a grant on the wire is never longer than the lease.
pub(crate) fn ms_floor(d: Duration) -> u32 {
    d.as_millis().min(u32::MAX as u128) as u32
}
