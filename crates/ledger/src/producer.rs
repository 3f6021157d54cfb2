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

mod pull;
mod push;
mod types;

pub use types::*;

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
    blocks: Vec<BlockId>,
    created: Time,
    lease_end: Time,
    cap_end: Time,
    phase: Phase,
    reader: Option<PeerId>,
    parts: Vec<Part>,
    /// What only this handoff's flow tracks.
    flow: ProducerFlow,
    /// Created when its prefill started (layer-wise pull, push): P's forward pass still writes
    /// the blocks, so they cannot go back before [`ProducerLedger::prefill_ended`] (rule 2).
    filling: Option<Filling>,
    timer: TimerSlot,
}

/// What a producer tracks of a handoff that only one flow has.
#[derive(Debug)]
enum ProducerFlow {
    /// Pull, classic or layer-wise.
    Pull {
        /// The reader asked for the block list (and gets every later one of a layer-wise
        /// pull).
        asked: bool,
    },
    Push {
        registrations: Vec<Registration>,
        /// P told D (`PushCancelAck`) that no write into its blocks is or will be in flight: D
        /// may free them at once. From then on no write to that D starts, whatever
        /// registration or grant arrives late (rule 3).
        cancel_acked: bool,
    },
}

/// The prefill of a handoff created at its start (layer-wise pull, push), still running.
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
            layers: self.filling().map(|f| f.layers),
        }
    }

    /// The reader retries a failed read under the next epoch: completions of the first attempt
    /// still on their way must not count for the retry, so every rank's count starts again.
    /// Only the reader may do it, only while leased, one epoch at a time, a bounded number of
    /// times.
    fn adopt_epoch(&mut self, from: PeerId, epoch: Epoch) -> bool {
        let adopt = self.is_pull()
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

    fn is_pull(&self) -> bool {
        matches!(self.flow, ProducerFlow::Pull { .. })
    }

    /// Pull: the reader asked for the block list.
    fn asked(&self) -> bool {
        matches!(self.flow, ProducerFlow::Pull { asked: true, .. })
    }

    /// The prefill still running (a handoff created at its start).
    fn filling(&self) -> Option<&Filling> {
        self.filling.as_ref()
    }

    /// Push: D's registrations (none for a pull).
    fn registrations(&self) -> &[Registration] {
        match &self.flow {
            ProducerFlow::Push { registrations, .. } => registrations,
            ProducerFlow::Pull { .. } => &[],
        }
    }

    fn registrations_mut(&mut self) -> &mut [Registration] {
        match &mut self.flow {
            ProducerFlow::Push { registrations, .. } => registrations,
            ProducerFlow::Pull { .. } => &mut [],
        }
    }

    /// Push: P told D no write is or will be in flight.
    fn cancel_acked(&self) -> bool {
        matches!(
            self.flow,
            ProducerFlow::Push {
                cancel_acked: true,
                ..
            }
        )
    }

    fn writes_in_flight(&self) -> bool {
        self.registrations()
            .iter()
            .any(|r| matches!(r.state, RegState::Writing | RegState::CancelPending))
    }

    fn all_written(&self) -> bool {
        let Some(d_tp) = self.registrations().first().map(|r| r.d_tp) else {
            return false;
        };
        (0..d_tp).all(|rank| {
            self.registrations()
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
            blocks,
            created: now,
            lease_end,
            cap_end,
            phase: Phase::Leased,
            reader: None,
            parts: vec![Part::default(); self.cfg.tp.max(1) as usize],
            flow: match mode {
                TransferMode::Pull => ProducerFlow::Pull { asked: false },
                TransferMode::Push => ProducerFlow::Push {
                    registrations: Vec::new(),
                    cancel_acked: false,
                },
            },
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

    // ----- message handlers -----

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

    /// Ends a handoff for `reason`: at once unless a push write of ours is in flight.
    fn begin_end(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if h.writes_in_flight() {
            for r in h.registrations_mut().iter_mut() {
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
                if !h.is_pull() && h.all_written() {
                    self.release_now(id, EndReason::Done, now);
                    return;
                }
                // Rule 3: a write may not outlive its grant by more than the write timeout.
                let mut next_write_deadline: Option<Time> = None;
                for r in h.registrations_mut().iter_mut() {
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
                    for r in h.registrations_mut().iter_mut() {
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
            if let Some(f) = &mut h.filling {
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
        for r in h.registrations() {
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
