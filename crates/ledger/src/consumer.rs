//! [`ConsumerLedger`]: the lifecycle of every remote-prefill request on a decode engine (D).
//!
//! D starts tracking a handoff the moment a request naming it arrives — while it still waits in
//! D's queue — and heartbeats its P from a timer of its own (never from the forward loop), batched
//! per P engine. Siblings (n>1) attach to one handoff: one transfer, one release.
//!
//! Pull: D reads only on a grant that is still valid minus a margin, and a read that ends after
//! `grant + read_grace` (or after the read timeout) is a failure (rules 2 and 4). Blocks a failed
//! read may still write into are quarantined until the transport confirms the read ended.
//! A layer-wise pull reads while P's prefill runs: P's block list says how many layers are saved
//! ([`handoff_proto::BlockList::layers`]), the read starts with those and goes on in stages as
//! more are (each posted only on a valid grant: [`ConsumerLedger::permit_read_more`]); it is
//! done when the stage with every layer landed.
//!
//! Push: D reserves blocks at once, registers them with P, and grants P a lease on the
//! registration through P's heartbeats. A registration P has not asked a grant on for
//! [`REGISTER_RESEND_HEARTBEATS`] heartbeat intervals is sent again (P may have dropped it: lost,
//! or staged longer than P's staging TTL while P's request queued), so D never waits its watchdog
//! out for a P that simply forgot. A watchdog cancels a registration P has not completed;
//! the blocks are freed only after P's cancel ack or after the last grant D issued + a write grace
//! (rule 3).
//!
//! | state        | event                          | next / effect                                  |
//! |--------------|--------------------------------|------------------------------------------------|
//! | `Waiting`    | blocks allocated (pull)        | `Admitted`                                     |
//! | `Waiting`    | blocks reserved (push)         | `Registered`, `PushRegister` to P              |
//! | `Admitted`   | valid grant                    | `Reading`, `StartRead`                         |
//! | `Reading`    | P saved more layers (layer-wise)| `ReadMore` (posted on a valid grant)           |
//! | `Reading`    | every rank done in time        | `Ready` outcome, handoff ends                  |
//! | `Reading`    | failure or read deadline       | outcome per policy, `Quarantine`               |
//! | `Reading`    | last request aborted/rejected  | `CancelRead`, `Quarantine`                     |
//! | `Quarantine` | every rank ended               | blocks back, `Release` to P                    |
//! | `Quarantine` | fence over                     | blocks back (P's lease ends it)                |
//! | `Registered` | every `PushDone` inside grant  | `Ready` outcome                                |
//! | `Registered` | P silent for 4 heartbeats      | `PushRegister` to P again                      |
//! | `Registered` | watchdog, failure, abort       | `Cancelling`, `PushCancel` to P                |
//! | `Cancelling` | ack, or grant + grace over     | blocks back                                    |
//! | any waiting  | reject / abort before transfer | `Release` to P at once                         |
//!
//! One file, over 800 lines (the flows' own steps are in `consumer/pull.rs` and
//! `consumer/push.rs`): what every flow shares — arrival, siblings, allocation, heartbeats,
//! deadlines, outcomes and the one release — is the lifecycle a reader follows here.

mod pull;
mod push;
mod types;

pub use types::*;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use handoff_proto::{
    split_grants, BlocksQuery, Epoch, Grant, GrantBatch, HandoffId, Heartbeat, HeartbeatEntry,
    Message, PullBlocks, PullDone, PushCancel, PushCancelAck, PushDone, PushFailed, PushRegister,
    Release, ReleaseReason, TransferMode, MAX_BATCH_ENTRIES,
};

use crate::heartbeat::HeartbeatSender;
use crate::producer::ms_floor;
use crate::staging::Tombstones;
use crate::timer::{TimerQueue, TimerSlot};
use crate::{BlockId, BlockRelease, EndReason, PeerId, RequestId, Time};
use handoff_plan::{rank_consumers, rank_pairs};

/// Push: P asks for a grant on every registration it holds at each of its heartbeats. When it
/// has not asked for this many of D's heartbeat intervals, D sends the registration again. Stale
/// or duplicate copies are harmless: P counts and ignores a registration it already has, and
/// answers one for a handoff it already ended with `PushFailed`.
pub const REGISTER_RESEND_HEARTBEATS: u32 = 4;

/// How many heartbeat intervals a heartbeat's send time is kept for its reply.
const ANCHOR_INTERVALS: u32 = 10;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Waiting,
    Admitted,
    Reading {
        deadline: Time,
        pending: Vec<u16>,
        failed: Option<FailReason>,
        /// When the latest stage was posted (the read timeout counts from it).
        posted: Time,
    },
    Quarantine {
        until: Time,
        pending: Vec<u16>,
        /// What P is told once every rank's read has ended.
        tell_p: ReleaseReason,
    },
    Registered {
        watchdog: Time,
        done: Vec<(u16, u16)>,
        /// When P last showed it holds the registration (a grant ask), or when D last sent it.
        last_heard: Time,
    },
    Cancelling {
        until: Time,
        /// Why the blocks go back once `until` passed.
        reason: EndReason,
    },
}

#[derive(Debug)]
struct Handoff {
    /// `info.epoch` is the current epoch: a retried read moves it on.
    info: IncomingHandoff,
    /// The epoch the handoff arrived with (what siblings' `kv_transfer_params` carry).
    first_epoch: Epoch,
    retries_left: u8,
    /// The KV digest P sent with its block list (pull) or its `PushDone`s (push).
    p_digest: Option<u64>,
    /// What only this handoff's flow tracks.
    flow: FlowState,
    requests: Vec<RequestId>,
    deadline: Time,
    local: Option<Vec<BlockId>>,
    /// D's blocks that already hold the prompt's first tokens (a prefix cache hit, shared with
    /// other requests). Never written, never released by this ledger.
    cached: Vec<BlockId>,
    arrived_at: Time,
    allocated_at: Time,
    /// Pull: when P's block list came.
    blocks_answer_at: Option<Time>,
    /// When the READ started (pull) or the registration left (push).
    transfer_at: Option<Time>,
    grant_until: Option<Time>,
    issued_until: Option<Time>,
    state: State,
    timer: TimerSlot,
}

/// What a consumer tracks of a handoff that only one flow has.
#[derive(Debug)]
enum FlowState {
    /// Pull, classic or layer-wise: what P said of its blocks.
    Pull(PullState),
    /// Push: nothing beyond the common state (D's registered blocks are `local`).
    Push,
}

#[derive(Debug, Default)]
struct PullState {
    /// `info.p_blocks` are P's own answer ([`PullBlocks`]), not the client's claim. No read
    /// starts before.
    blocks_from_p: bool,
    /// The layers P's latest list says are saved (`None`: every one; see
    /// [`handoff_proto::BlockList::layers`]).
    p_layers: Option<u32>,
    /// Layer-wise: a stage was refused for want of a valid grant; the next grant asks for it
    /// again.
    more_waiting: bool,
}

impl FlowState {
    fn new(mode: TransferMode) -> FlowState {
        match mode {
            TransferMode::Pull => FlowState::Pull(PullState::default()),
            TransferMode::Push => FlowState::Push,
        }
    }

    /// Pull: P named its blocks (a push never waits for that).
    fn blocks_from_p(&self) -> bool {
        matches!(
            self,
            FlowState::Pull(PullState {
                blocks_from_p: true,
                ..
            })
        )
    }

    /// Pull: the layers P said are saved (`None`: every one, or a push).
    fn p_layers(&self) -> Option<u32> {
        match self {
            FlowState::Pull(p) => p.p_layers,
            FlowState::Push => None,
        }
    }
}

impl Handoff {
    /// The wait's timeline, as the KV became ready at `now`.
    fn waited(&self, now: Time) -> WaitTimeline {
        let since = |t: Time| now.saturating_sub(t);
        let admission = self.allocated_at.saturating_sub(self.arrived_at);
        let transfer_at = self.transfer_at.unwrap_or(now);
        let blocks_answer = self
            .blocks_answer_at
            .map(|t| t.saturating_sub(self.arrived_at));
        WaitTimeline {
            blocks_answer,
            admission,
            to_transfer: self
                .blocks_answer_at
                .map(|b| transfer_at.saturating_sub(b.max(self.allocated_at))),
            transfer: since(transfer_at),
        }
    }

    /// Still asking P to keep its blocks.
    fn wants_heartbeat(&self) -> bool {
        matches!(
            self.state,
            State::Waiting | State::Admitted | State::Reading { .. } | State::Registered { .. }
        )
    }
}

/// When a read (or a layer-wise read's stage) of `blocks` blocks posted at `posted` has failed
/// if it has not ended (rules 2 and 4): after the read timeout plus its bytes' time at the floor
/// rate, after its grant + the read grace, and at the latest at the request's own deadline
/// (rule 6).
fn read_deadline(
    cfg: &ConsumerConfig,
    posted: Time,
    grant_until: Time,
    request: Time,
    blocks: usize,
) -> Time {
    (posted + cfg.read_timeout + bytes_time(cfg, blocks))
        .min(grant_until + cfg.read_grace)
        .min(request)
}

/// How long `blocks` blocks take on one D rank at the read floor rate.
fn bytes_time(cfg: &ConsumerConfig, blocks: usize) -> Duration {
    if cfg.read_floor_rate == 0 {
        return Duration::ZERO;
    }
    let bytes = u128::from(cfg.block_bytes) * blocks as u128;
    let nanos = bytes * 1_000_000_000 / u128::from(cfg.read_floor_rate);
    Duration::from_nanos(nanos.min(u128::from(u64::MAX)) as u64)
}

/// The D-side ledger. See the module docs.
#[derive(Debug)]
pub struct ConsumerLedger {
    cfg: ConsumerConfig,
    handoffs: HashMap<HandoffId, Handoff>,
    by_request: HashMap<RequestId, HandoffId>,
    // Ordered (as every collection this ledger iterates to emit): the same inputs give the
    // same messages in the same order, which a recorded trace's replay relies on.
    by_peer: BTreeMap<PeerId, BTreeSet<HandoffId>>,
    timers: TimerQueue<HandoffId>,
    /// Ended handoffs: `true` when the KV arrived in full (push: every `PushDone`).
    tombstones: Tombstones<bool>,
    heartbeats: HeartbeatSender,
    next_heartbeat: Option<Time>,
    urgent: BTreeMap<PeerId, BTreeSet<HandoffId>>,
    messages: VecDeque<(PeerId, Message)>,
    releases: VecDeque<BlockRelease>,
    outcomes: VecDeque<Outcome>,
    /// Pull: requests whose handoff P named its blocks for while they still waited for
    /// admission (see [`ConsumerLedger::poll_started`]).
    started: VecDeque<Vec<RequestId>>,
    actions: VecDeque<ConsumerAction>,
    last_now: Time,
    held_blocks: usize,
    stats: ConsumerStats,
}

impl ConsumerLedger {
    pub fn new(cfg: ConsumerConfig) -> Self {
        ConsumerLedger {
            tombstones: Tombstones::new(cfg.tombstone_capacity, cfg.tombstone_ttl),
            cfg,
            handoffs: HashMap::new(),
            by_request: HashMap::new(),
            by_peer: BTreeMap::new(),
            timers: TimerQueue::default(),
            heartbeats: HeartbeatSender::new(handoff_proto::TransferMode::Pull),
            next_heartbeat: None,
            urgent: BTreeMap::new(),
            messages: VecDeque::new(),
            releases: VecDeque::new(),
            outcomes: VecDeque::new(),
            started: VecDeque::new(),
            actions: VecDeque::new(),
            last_now: Time::ZERO,
            held_blocks: 0,
            stats: ConsumerStats::default(),
        }
    }

    pub fn config(&self) -> &ConsumerConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &ConsumerStats {
        &self.stats
    }

    /// Handoffs tracked (waiting, transferring or fencing).
    pub fn len(&self) -> usize {
        self.handoffs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handoffs.is_empty()
    }

    pub fn memory(&self) -> crate::MemoryUse {
        crate::MemoryUse {
            handoffs: self.handoffs.len(),
            staged_messages: 0,
            tombstones: self.tombstones.len(),
            timer_entries: self.timers.len(),
            heartbeats_awaiting_reply: self.heartbeats.awaiting(),
        }
    }

    /// D blocks the ledger holds for transfers not yet handed to the engine.
    pub fn held_blocks(&self) -> usize {
        self.held_blocks
    }

    /// Whether any live handoff or pending message names `peer` (the connector forgets a peer
    /// only when none does).
    pub fn uses_peer(&self, peer: PeerId) -> bool {
        self.by_peer.contains_key(&peer) || self.messages.iter().any(|(p, _)| *p == peer)
    }

    pub fn is_tracking(&self, req: RequestId) -> bool {
        self.by_request.contains_key(&req)
    }

    /// The handoff a tracked request waits for.
    pub fn handoff_of(&self, req: RequestId) -> Option<HandoffId> {
        self.by_request.get(&req).copied()
    }

    /// What D learned of a handoff it tracks.
    /// Whether this ledger tracks `id` or ended it recently (its tombstone is still kept).
    pub fn knows(&self, id: HandoffId) -> bool {
        self.handoffs.contains_key(&id) || self.tombstones.get(&id).is_some()
    }

    /// Push: whether `id`'s blocks are registered with P right now (held, not being cancelled).
    pub fn is_registered(&self, id: HandoffId) -> bool {
        self.handoffs
            .get(&id)
            .is_some_and(|h| matches!(h.state, State::Registered { .. }))
    }

    pub fn incoming(&self, id: HandoffId) -> Option<&IncomingHandoff> {
        self.handoffs.get(&id).map(|h| &h.info)
    }

    /// D refuses, before tracking it, a request for `inc` (bad prompt, full queue): P is told to
    /// release at once, unless this ledger tracks that handoff for another request (a retried
    /// request refused while the first one reads): then a release would let P free blocks
    /// under a read in flight (rule 2), and the tracked request's own end tells P. Returns
    /// whether P was told.
    pub fn refuse(&mut self, inc: &IncomingHandoff, reason: ReleaseReason, now: Time) -> bool {
        self.last_now = self.last_now.max(now);
        if self.handoffs.contains_key(&inc.handoff) {
            return false;
        }
        let msg = Release {
            handoff: inc.handoff,
            epoch: inc.epoch,
            reason,
        };
        self.messages.push_back((inc.peer, Message::Release(msg)));
        self.stats.releases_sent += 1;
        true
    }

    /// A request naming a remote handoff arrived (before admission): start tracking and
    /// heartbeating at once (the lease starts while the request still waits in D's queue).
    pub fn on_request_arrived(
        &mut self,
        req: RequestId,
        inc: IncomingHandoff,
        now: Time,
    ) -> Result<(), ArriveError> {
        self.last_now = self.last_now.max(now);
        if self.by_request.contains_key(&req) {
            return Err(ArriveError::DuplicateRequest(req));
        }
        if inc.p_tp == 0 {
            return Err(ArriveError::Invalid("P tp size is 0"));
        }
        if let Some(h) = self.handoffs.get_mut(&inc.handoff) {
            // n>1: a sibling joins the one transfer.
            if h.info.peer != inc.peer || h.first_epoch != inc.epoch || h.info.mode != inc.mode {
                return Err(ArriveError::Conflict(inc.handoff));
            }
            if !h.wants_heartbeat() {
                return Err(ArriveError::Ended(inc.handoff));
            }
            h.requests.push(req);
            self.by_request.insert(req, inc.handoff);
            if h.flow.blocks_from_p() {
                // P named its blocks before this sibling came: it is told as the first was.
                self.started.push_back(vec![req]);
            }
            return Ok(());
        }
        if self.tombstones.get(&inc.handoff).is_some() {
            return Err(ArriveError::Ended(inc.handoff));
        }
        let id = inc.handoff;
        let peer = inc.peer;
        let deadline = now + self.cfg.wait_deadline;
        let mut h = Handoff {
            first_epoch: inc.epoch,
            retries_left: self.cfg.read_retries,
            p_digest: None,
            flow: FlowState::new(inc.mode),
            info: inc,
            requests: vec![req],
            deadline,
            local: None,
            cached: Vec::new(),
            arrived_at: now,
            allocated_at: now,
            blocks_answer_at: None,
            transfer_at: None,
            grant_until: None,
            issued_until: None,
            state: State::Waiting,
            timer: TimerSlot::default(),
        };
        h.timer.arm(&mut self.timers, id, deadline);
        self.handoffs.insert(id, h);
        self.by_request.insert(req, id);
        self.by_peer.entry(peer).or_default().insert(id);
        self.urgent.entry(peer).or_default().insert(id);
        if self.next_heartbeat.is_none() {
            self.next_heartbeat = Some(now + self.cfg.heartbeat_interval);
        }
        self.stats.tracked += 1;
        Ok(())
    }

    /// The engine gave the handoff its destination blocks (pull: at admission; push: reserved on
    /// arrival). From now on the ledger owns them until it hands them back.
    pub fn on_blocks_allocated(
        &mut self,
        handoff: HandoffId,
        blocks: Vec<BlockId>,
        now: Time,
    ) -> Result<(), AllocError> {
        self.on_blocks_allocated_after_cached(handoff, Vec::new(), blocks, now)
    }

    /// [`ConsumerLedger::on_blocks_allocated`], on an engine with a prefix cache: the prompt's
    /// first blocks, `cached`, already hold its KV (computed here, and shared with other
    /// requests that may be reading them); `blocks` are the request's own for the rest. A pull
    /// reads, and a push registers, only the rest (`PushRegister::cached_blocks` tells P where
    /// it starts): no transfer writes a cached block, and only `blocks` come back to the
    /// engine.
    pub fn on_blocks_allocated_after_cached(
        &mut self,
        handoff: HandoffId,
        cached: Vec<BlockId>,
        blocks: Vec<BlockId>,
        now: Time,
    ) -> Result<(), AllocError> {
        self.last_now = self.last_now.max(now);
        let tp = self.cfg.tp.max(1);
        let push_deadline = self.cfg.push_deadline;
        let resend = self.register_resend();
        let h = self.handoffs.get_mut(&handoff).ok_or(AllocError::Unknown)?;
        if h.local.is_some() || h.state != State::Waiting {
            return Err(AllocError::AlreadyAllocated);
        }
        if blocks.is_empty() {
            return Err(AllocError::NoBlocks);
        }
        self.held_blocks += blocks.len();
        h.allocated_at = now;
        h.cached = cached;
        match h.info.mode {
            TransferMode::Pull => {
                h.local = Some(blocks);
                h.state = State::Admitted;
                self.try_start_read(handoff, now);
            }
            TransferMode::Push => {
                h.local = Some(blocks);
                h.transfer_at = Some(now);
                let watchdog = (now + push_deadline).min(h.deadline);
                h.state = State::Registered {
                    watchdog,
                    done: Vec::new(),
                    last_heard: now,
                };
                h.timer
                    .arm(&mut self.timers, handoff, watchdog.min(now + resend));
                self.send_registrations(handoff);
                self.stats.registrations_sent += u64::from(tp);
            }
        }
        Ok(())
    }

    /// The client went away (`Aborted`) or D refused the request before admission (`Rejected`).
    /// When no sibling still waits, P is told at once unless a transfer is in flight; then the
    /// transfer's end tells it.
    pub fn on_request_ended(&mut self, req: RequestId, reason: ReleaseReason, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(id) = self.by_request.remove(&req) else {
            return;
        };
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        h.requests.retain(|r| *r != req);
        if !h.requests.is_empty() {
            return;
        }
        let end = EndReason::from(reason);
        match h.state {
            State::Waiting | State::Admitted => {
                let msg = Release {
                    handoff: id,
                    epoch: h.info.epoch,
                    reason,
                };
                let peer = h.info.peer;
                self.messages.push_back((peer, Message::Release(msg)));
                self.stats.releases_sent += 1;
                self.release_local(id, end, now);
                self.end_handoff(id, now);
            }
            State::Registered { .. } => self.cancel_push(id, end, now),
            // Nobody wants this KV any more: stop the READ now rather than let it run to its
            // end, and tell P as soon as every rank's read has ended (P must not reuse its
            // blocks under a READ still in flight: rule 2). The client learns nothing more.
            State::Reading { ref pending, .. } => {
                let pending = pending.clone();
                self.actions
                    .push_back(ConsumerAction::CancelRead { handoff: id });
                self.quarantine(id, pending, reason, now);
            }
            State::Quarantine { .. } | State::Cancelling { .. } => {}
        }
    }

    /// Feeds one message from P engine `from`.
    pub fn handle_message(&mut self, from: PeerId, msg: Message, now: Time) {
        self.last_now = self.last_now.max(now);
        match msg {
            Message::GrantBatch(g) => self.on_grants(from, g, now),
            Message::Heartbeat(hb) => self.on_heartbeat(from, hb, now),
            Message::PushDone(d) => self.on_push_done(from, d, now),
            Message::PushFailed(f) => self.on_push_failed(from, f, now),
            Message::PushCancelAck(a) => self.on_cancel_ack(from, a, now),
            Message::PullBlocks(b) => self.on_pull_blocks(from, b, now),
            _ => self.stats.ignored += 1,
        }
    }

    /// The handoffs that use P engine `peer`, in a list the caller may change the ledger under.
    fn handoffs_of(&self, peer: PeerId) -> Vec<HandoffId> {
        self.by_peer
            .get(&peer)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The handshake with P engine `peer` was refused (by P or by us): the two cannot exchange
    /// KV. The handoffs that waited for it fail `incompatible` and end here, and the releases
    /// P must hear are returned, to go on the refused connection before it closes (P would
    /// otherwise hold their blocks until its lease ends). The caller then reports `peer` dead
    /// ([`Self::handle_peer_dead`]) for whatever else used it.
    pub fn handle_peer_refused(&mut self, peer: PeerId, now: Time) -> Vec<Release> {
        self.last_now = self.last_now.max(now);
        let mut releases = Vec::new();
        for id in self.handoffs_of(peer) {
            let Some(h) = self.handoffs.get(&id) else {
                continue;
            };
            if matches!(h.state, State::Waiting | State::Admitted) {
                releases.push(Release {
                    handoff: id,
                    epoch: h.info.epoch,
                    reason: ReleaseReason::Rejected,
                });
                self.stats.releases_sent += 1;
                self.fail_requests(id, FailReason::Incompatible);
                self.release_local(id, EndReason::Rejected, now);
                self.end_handoff(id, now);
            }
        }
        releases
    }

    /// The transport reports P engine `peer` dead.
    pub fn handle_peer_dead(&mut self, peer: PeerId, now: Time) {
        self.last_now = self.last_now.max(now);
        for id in self.handoffs_of(peer) {
            let Some(h) = self.handoffs.get_mut(&id) else {
                continue;
            };
            match &h.state {
                State::Waiting | State::Admitted => {
                    self.fail_requests(id, FailReason::PeerDead);
                    self.release_local(id, EndReason::PeerDead, now);
                    self.end_handoff(id, now);
                }
                State::Reading { pending, .. } => {
                    // Reads from a dead P fail; our blocks wait until the transport says so.
                    let pending = pending.clone();
                    self.fail_requests(id, FailReason::PeerDead);
                    self.actions
                        .push_back(ConsumerAction::CancelRead { handoff: id });
                    self.quarantine(id, pending, ReleaseReason::Failed, now);
                }
                // Dead to D is not dead to the wire: a WRITE P posted inside its grant may still
                // land (and a P that is only cut off may still be writing). The blocks wait out
                // the last grant D issued + the write grace (rule 3); no cancel goes to the dead.
                State::Registered { .. } => {
                    self.fail_requests(id, FailReason::PeerDead);
                    self.await_writes_end(id, EndReason::PeerDead, now);
                }
                // Its timer frees the blocks once no write can be in flight.
                State::Cancelling { .. } => {}
                State::Quarantine { .. } => {}
            }
        }
        self.urgent.remove(&peer);
    }

    pub fn handle_timeout(&mut self, now: Time) {
        self.last_now = self.last_now.max(now);
        while let Some(id) = self.timers.pop_live(now, |id, generation| {
            self.handoffs
                .get_mut(&id)
                .is_some_and(|h| h.timer.fired(generation))
        }) {
            self.evaluate(id, now);
        }
        self.tombstones.expire(now);
        // A reply to a heartbeat older than this anchors nothing any more: by then later
        // heartbeats (one per interval) have asked again, and their replies count. Keeping each
        // question for the whole wait deadline held one entry per request for 60 s.
        self.heartbeats
            .expire(now, self.cfg.heartbeat_interval * ANCHOR_INTERVALS);
        if self.next_heartbeat.is_some_and(|t| t <= now) {
            self.send_heartbeats(now);
        }
        self.flush_urgent(now);
    }

    pub fn poll_timeout(&self) -> Option<Time> {
        let mut t = self.timers.next_deadline();
        if let Some(hb) = self.next_heartbeat {
            t = Some(t.map_or(hb, |x| x.min(hb)));
        }
        if !self.urgent.is_empty() {
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

    /// Pull: requests still waiting for admission whose P now holds the handoff (P's block list
    /// came: in a layer-wise pull, P's prefill started). An engine that admits a layer-wise pull
    /// only then never holds blocks for a request P cannot start yet: with both engines' pools
    /// full, D holding blocks for some requests while P holds them for others, waiting on each
    /// other, is a deadlock.
    pub fn poll_started(&mut self) -> Option<Vec<RequestId>> {
        self.started.pop_front()
    }

    pub fn poll_outcome(&mut self) -> Option<Outcome> {
        self.outcomes.pop_front()
    }

    pub fn poll_action(&mut self) -> Option<ConsumerAction> {
        self.actions.pop_front()
    }

    // ----- message handlers -----

    // ----- transitions -----

    fn evaluate(&mut self, id: HandoffId, now: Time) {
        let resend = self.register_resend();
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        match h.state.clone() {
            State::Waiting | State::Admitted => {
                if now >= h.deadline {
                    let msg = Release {
                        handoff: id,
                        epoch: h.info.epoch,
                        reason: ReleaseReason::Cancelled,
                    };
                    let peer = h.info.peer;
                    self.messages.push_back((peer, Message::Release(msg)));
                    self.stats.releases_sent += 1;
                    self.fail_requests(id, FailReason::DeadlineExceeded);
                    self.release_local(id, EndReason::Cancelled, now);
                    self.end_handoff(id, now);
                } else {
                    let d = h.deadline;
                    h.timer.arm(&mut self.timers, id, d);
                }
            }
            State::Reading {
                deadline,
                pending,
                failed,
                ..
            } => {
                if now >= deadline {
                    // Requests of a read that failed and waited for a retry learn it now.
                    self.fail_requests(id, failed.unwrap_or(FailReason::ReadTimedOut));
                    self.actions
                        .push_back(ConsumerAction::CancelRead { handoff: id });
                    self.quarantine(id, pending, ReleaseReason::Failed, now);
                } else {
                    h.timer.arm(&mut self.timers, id, deadline);
                }
            }
            State::Quarantine { until, .. } => {
                if now >= until {
                    // The transport never confirmed the read ended; it has had far longer than
                    // any read may take. P is not told: its own lease and fence end it.
                    self.release_local(id, EndReason::Failed, now);
                    self.end_handoff(id, now);
                } else {
                    h.timer.arm(&mut self.timers, id, until);
                }
            }
            State::Registered {
                watchdog,
                last_heard,
                ..
            } => {
                if now >= watchdog {
                    self.fail_requests(id, FailReason::WatchdogExpired);
                    self.cancel_push(id, EndReason::Cancelled, now);
                    return;
                }
                let silent = now >= last_heard + resend;
                let heard = if silent { now } else { last_heard };
                if let State::Registered { last_heard, .. } = &mut h.state {
                    *last_heard = heard;
                }
                h.timer
                    .arm(&mut self.timers, id, watchdog.min(heard + resend));
                if silent {
                    self.send_registrations(id);
                    self.stats.registrations_resent += u64::from(self.cfg.tp.max(1));
                }
            }
            State::Cancelling { until, reason } => {
                if now >= until {
                    // Past every grant we issued + the write grace: no write can be in flight.
                    self.release_local(id, reason, now);
                    self.end_handoff(id, now);
                } else {
                    h.timer.arm(&mut self.timers, id, until);
                }
            }
        }
    }

    /// Reports the failure of every request still waiting on `id`, per policy (once).
    fn fail_requests(&mut self, id: HandoffId, reason: FailReason) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let requests = std::mem::take(&mut h.requests);
        if requests.is_empty() {
            return;
        }
        for r in &requests {
            self.by_request.remove(r);
        }
        *self.stats.failed.entry(reason.as_str()).or_default() += 1;
        let peer = h.info.peer;
        self.outcomes.push_back(match self.cfg.failure_policy {
            FailurePolicy::Recompute => Outcome::Recompute {
                handoff: id,
                requests,
                reason,
                peer,
            },
            FailurePolicy::Fail => Outcome::Failed {
                handoff: id,
                requests,
                reason,
                peer,
            },
        });
    }

    fn release_local(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if let Some(blocks) = h.local.take() {
            self.held_blocks -= blocks.len();
            self.releases.push_back(BlockRelease {
                handoff: id,
                blocks,
                reason,
                held_for: now.saturating_sub(h.allocated_at),
            });
        }
    }

    fn end_handoff(&mut self, id: HandoffId, now: Time) {
        let Some(h) = self.handoffs.remove(&id) else {
            return;
        };
        let handoffs = &self.handoffs;
        self.timers.compact_if_stale(handoffs.len(), |k, g| {
            handoffs.get(&k).is_some_and(|h| h.timer.is_live(g))
        });
        debug_assert!(
            h.local.is_none(),
            "blocks must be handed over or released first"
        );
        for r in &h.requests {
            self.by_request.remove(r);
        }
        if let Some(set) = self.by_peer.get_mut(&h.info.peer) {
            set.remove(&id);
            if set.is_empty() {
                self.by_peer.remove(&h.info.peer);
            }
        }
        if let Some(set) = self.urgent.get_mut(&h.info.peer) {
            set.remove(&id);
        }
        self.tombstones.insert(id, false, now);
    }

    fn flush_urgent(&mut self, now: Time) {
        for (peer, ids) in std::mem::take(&mut self.urgent) {
            let entries: Vec<HeartbeatEntry> = ids
                .into_iter()
                .filter_map(|id| {
                    self.handoffs.get(&id).and_then(|h| {
                        h.wants_heartbeat().then_some(HeartbeatEntry {
                            handoff: id,
                            epoch: h.info.epoch,
                        })
                    })
                })
                .collect();
            if !entries.is_empty() {
                self.stats.heartbeats_sent +=
                    self.heartbeats
                        .send(peer, &entries, now, &mut self.messages) as u64;
                self.ask_blocks(peer, entries.iter().map(|e| e.handoff));
            }
        }
        if self.next_heartbeat.is_none() && !self.by_peer.is_empty() {
            self.next_heartbeat = Some(now + self.cfg.heartbeat_interval);
        }
    }
}
