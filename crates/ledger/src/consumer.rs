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

/// What D does with a request whose KV could not be transferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum FailurePolicy {
    /// Prefill locally (slower, but the client gets an answer).
    #[default]
    Recompute,
    /// Fail the request with an explicit error.
    Fail,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ConsumerConfig {
    /// D's tensor-parallel size: a transfer is complete only when every D rank has its KV.
    pub tp: u16,
    pub heartbeat_interval: Duration,
    /// Start a read only while the grant has at least this much left.
    pub read_margin: Duration,
    /// A read that takes longer than this has failed.
    pub read_timeout: Duration,
    /// A read that ends more than this after its grant has failed. Must be below P's fence grace.
    pub read_grace: Duration,
    /// Longest quarantine of blocks under a failed read the transport never confirmed ended.
    pub read_fence: Duration,
    /// A read the transport reported failed (not one that timed out) is tried again this many
    /// times, each under the next epoch, while the request's wait deadline allows.
    pub read_retries: u8,
    /// From arrival to KV ready; past it the request is recomputed or failed.
    pub wait_deadline: Duration,
    pub failure_policy: FailurePolicy,
    /// Push: how long each grant D gives P on a registration lasts.
    pub registration_lease: Duration,
    /// Push: watchdog on a registration P has not completed.
    pub push_deadline: Duration,
    /// Push: time after the last grant before blocks are freed without P's cancel ack.
    pub write_grace: Duration,
    pub tombstone_capacity: usize,
    pub tombstone_ttl: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            tp: 1,
            heartbeat_interval: Duration::from_millis(500),
            read_margin: Duration::from_millis(200),
            read_timeout: Duration::from_secs(5),
            read_grace: Duration::from_millis(500),
            read_fence: Duration::from_secs(10),
            read_retries: 1,
            wait_deadline: Duration::from_secs(60),
            failure_policy: FailurePolicy::Recompute,
            registration_lease: Duration::from_secs(2),
            push_deadline: Duration::from_secs(30),
            write_grace: Duration::from_millis(1500),
            tombstone_capacity: 65536,
            tombstone_ttl: Duration::from_secs(300),
        }
    }
}

/// What D learned about a handoff from `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingHandoff {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    /// P's engine as the connector numbers it.
    pub peer: PeerId,
    pub p_tp: u16,
    pub mode: TransferMode,
    /// Pull: P's blocks as the client claimed them (empty for a layer-wise pull); only P's own
    /// answer is ever read. Push: empty.
    pub p_blocks: Vec<BlockId>,
    pub num_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArriveError {
    #[error("handoff {0} already ended on this engine")]
    Ended(HandoffId),
    #[error("handoff {0} is already tracked for another P engine or epoch")]
    Conflict(HandoffId),
    #[error("request {0:?} is already tracked")]
    DuplicateRequest(RequestId),
    #[error("invalid handoff: {0}")]
    Invalid(&'static str),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("unknown handoff")]
    Unknown,
    #[error("handoff already has blocks")]
    AlreadyAllocated,
    #[error("no block given")]
    NoBlocks,
}

/// Why a request's KV transfer did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailReason {
    DeadlineExceeded,
    ReadFailed,
    ReadTimedOut,
    /// The read ended after its grant + grace: its bytes may be another request's (rule 4).
    ReadAfterGrace,
    PeerDead,
    /// P no longer holds the handoff.
    HandoffGone,
    WriteFailed,
    WatchdogExpired,
    /// A push write completed after D's grant + grace.
    LateWrite,
    /// The KV that landed does not have the digest P computed over its blocks: never decoded.
    DigestMismatch,
}

impl FailReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::DeadlineExceeded => "deadline_exceeded",
            FailReason::ReadFailed => "read_failed",
            FailReason::ReadTimedOut => "read_timed_out",
            FailReason::ReadAfterGrace => "read_after_grace",
            FailReason::PeerDead => "peer_dead",
            FailReason::HandoffGone => "handoff_gone",
            FailReason::WriteFailed => "write_failed",
            FailReason::WatchdogExpired => "watchdog_expired",
            FailReason::LateWrite => "late_write",
            FailReason::DigestMismatch => "kv_digest_mismatch",
        }
    }
}

/// What happened to requests waiting for KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The KV is in `blocks`: decode may start for every request (siblings share the blocks,
    /// which now belong to the engine).
    Ready {
        handoff: HandoffId,
        requests: Vec<RequestId>,
        blocks: Vec<BlockId>,
        /// Where the wait for the KV went.
        waited: WaitTimeline,
        /// Push: P's KV digest, which what landed must still be checked against (a pull's was
        /// checked before its reads counted as done).
        p_digest: Option<u64>,
        /// The prompt tokens the KV covers.
        num_tokens: u32,
        /// The P engine the KV came from.
        peer: PeerId,
        /// D's prefix-cache blocks before `blocks` (not moved; a push digest covers them too).
        cached: Vec<BlockId>,
    },
    /// Prefill locally (policy `Recompute`). The blocks of the failed transfer come back through
    /// `poll_release`; the engine allocates fresh ones.
    Recompute {
        handoff: HandoffId,
        requests: Vec<RequestId>,
        reason: FailReason,
        /// The P engine the KV was to come from.
        peer: PeerId,
    },
    /// Fail with an explicit error (policy `Fail`).
    Failed {
        handoff: HandoffId,
        requests: Vec<RequestId>,
        reason: FailReason,
        peer: PeerId,
    },
}

/// Where a handoff's wait on D went, from the first request's arrival to the KV in its blocks
/// (what a request's `kv_wait` is made of).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WaitTimeline {
    /// Pull: arrival → P's own block list (the answer to D's first heartbeat).
    pub blocks_answer: Option<Time>,
    /// Arrival → the engine gave the handoff its blocks (D's own queue).
    pub admission: Time,
    /// Pull: the later of the two above → the READ started (on a grant valid past the margin).
    pub to_transfer: Option<Time>,
    /// Pull: the READ (posted → landed on every rank); push: registration → P's last write.
    pub transfer: Time,
}

/// Work the connector must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerAction {
    /// Read P's blocks into ours. Each (D rank, P rank) pair's READ carries its `PullDone` as
    /// notification. Each D rank reports its end with [`ConsumerLedger::on_read_done`].
    StartRead(StartRead),
    /// Abort the reads of a handoff (deadline passed); still report their end.
    CancelRead { handoff: HandoffId },
    /// Layer-wise pull: P saved more layers of a handoff being read (`layers`: how many, `None`
    /// when every one). The next stage may be posted once the one in flight ended, each only
    /// after [`ConsumerLedger::permit_read_more`] said yes.
    ReadMore {
        handoff: HandoffId,
        layers: Option<u32>,
        p_digest: Option<u64>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartRead {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub p_peer: PeerId,
    pub p_tp: u16,
    pub src_blocks: Vec<BlockId>,
    pub dst_blocks: Vec<BlockId>,
    /// D's blocks that already hold the prompt's first tokens (a prefix cache hit): the READ
    /// moves only the tokens after them into `dst_blocks`, and never writes these.
    pub cached_blocks: Vec<BlockId>,
    /// The prompt's tokens, cached ones included.
    pub num_tokens: u32,
    /// The read has failed if not done by then.
    pub deadline: Time,
    pub done: Vec<PullDone>,
    /// The KV digest P sent with its block list, if any: what the landed KV must have.
    pub p_digest: Option<u64>,
    /// Layer-wise pull: only the first `n` layers are saved yet (`Some(n)`, n > 0); more follow
    /// as [`ConsumerAction::ReadMore`]. `None`: every layer.
    pub layers: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    pub tracked: u64,
    pub reads_started: u64,
    pub ready: u64,
    pub failed: HashMap<&'static str, u64>,
    pub heartbeats_sent: u64,
    pub grants_received: u64,
    pub releases_sent: u64,
    pub registrations_sent: u64,
    /// Registrations sent again because P stopped asking for grants on them.
    pub registrations_resent: u64,
    pub cancels_sent: u64,
    pub late_notifications: u64,
    pub ignored: u64,
    /// Reads tried again under a new epoch after the transport reported them failed.
    pub read_retries: u64,
    /// Pull handoffs whose client-supplied `remote_block_ids` differed from P's answer (P's
    /// were read).
    pub client_blocks_replaced: u64,
    /// Messages about a handoff we track that carried another epoch than its current one.
    pub stale_epoch: u64,
}

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
    /// Pull: `info.p_blocks` are P's own answer ([`PullBlocks`]), not the client's claim. No
    /// read starts before.
    blocks_from_p: bool,
    /// The KV digest P sent with its block list (pull) or its `PushDone`s (push).
    p_digest: Option<u64>,
    /// Pull: the layers P's latest list says are saved (`None`: every one; see
    /// [`handoff_proto::BlockList::layers`]).
    p_layers: Option<u32>,
    /// P's first block list said the prefill was still running: the read goes in stages.
    layerwise: bool,
    /// Layer-wise pull: a stage was refused for want of a valid grant; the next grant asks for
    /// it again.
    more_waiting: bool,
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

/// When a read (or a layer-wise read's stage) posted at `posted` has failed if it has not ended
/// (rules 2 and 4): after the read timeout, after its grant + the read grace, and at the latest
/// at the request's own deadline (rule 6).
fn read_deadline(cfg: &ConsumerConfig, posted: Time, grant_until: Time, request: Time) -> Time {
    (posted + cfg.read_timeout)
        .min(grant_until + cfg.read_grace)
        .min(request)
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
            if h.blocks_from_p {
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
            blocks_from_p: false,
            p_digest: None,
            p_layers: None,
            layerwise: false,
            more_waiting: false,
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

    /// Layer-wise pull: may the next stage of `handoff`'s read be posted now? Only while it is
    /// read and nothing failed, before the request's deadline, and on a grant still valid minus
    /// the margin (rule 2); the read's deadline then counts from now. Refused for want of a
    /// grant, the next grant brings the `ReadMore` again.
    pub fn permit_read_more(&mut self, handoff: HandoffId, now: Time) -> bool {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&handoff) else {
            return false;
        };
        let State::Reading {
            failed: None,
            deadline,
            posted,
            ..
        } = &mut h.state
        else {
            return false;
        };
        if now >= h.deadline {
            return false;
        }
        let Some(grant_until) = h.grant_until.filter(|g| *g > now + self.cfg.read_margin) else {
            h.more_waiting = true;
            return false;
        };
        *posted = now;
        *deadline = read_deadline(&self.cfg, now, grant_until, h.deadline);
        let d = *deadline;
        h.timer.arm(&mut self.timers, handoff, d);
        true
    }

    /// One D rank's reads of `handoff` ended (`ok`: every byte landed).
    /// Like [`Self::on_read_done`] with `ok` false, for a read whose bytes landed but whose KV
    /// digest differs from P's: the handoff fails with [`FailReason::DigestMismatch`] (not
    /// retried: P's blocks would give the same bytes) and its requests never see the KV.
    pub fn on_read_mismatch(&mut self, handoff: HandoffId, d_rank: u16, now: Time) {
        if let Some(Handoff {
            state: State::Reading { failed, .. },
            ..
        }) = self.handoffs.get_mut(&handoff)
        {
            if failed.is_none() {
                *failed = Some(FailReason::DigestMismatch);
                self.fail_requests(handoff, FailReason::DigestMismatch);
            }
        }
        self.on_read_done(handoff, d_rank, false, now);
    }

    pub fn on_read_done(&mut self, handoff: HandoffId, d_rank: u16, ok: bool, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&handoff) else {
            return;
        };
        match &mut h.state {
            State::Reading {
                deadline,
                pending,
                failed,
                ..
            } => {
                let Some(pos) = pending.iter().position(|r| *r == d_rank) else {
                    return;
                };
                pending.remove(pos);
                if failed.is_none() {
                    if !ok {
                        *failed = Some(FailReason::ReadFailed);
                    } else if now > *deadline {
                        *failed = Some(FailReason::ReadAfterGrace);
                    }
                    // A failed read that may be tried again keeps its requests until every
                    // rank's read ended; otherwise they learn at once.
                    let retry = *failed == Some(FailReason::ReadFailed) && h.retries_left > 0;
                    if let (Some(reason), false) = (*failed, retry) {
                        self.fail_requests(handoff, reason);
                    }
                }
                let Some(h) = self.handoffs.get_mut(&handoff) else {
                    return;
                };
                let State::Reading {
                    pending, failed, ..
                } = &h.state
                else {
                    return;
                };
                if !pending.is_empty() {
                    return;
                }
                match *failed {
                    None => {
                        let blocks = h.local.take().unwrap_or_default();
                        self.held_blocks -= blocks.len();
                        // Never empty here: a read whose last request went away was cancelled
                        // and its handoff quarantined (`on_request_ended`).
                        let requests = std::mem::take(&mut h.requests);
                        for r in &requests {
                            self.by_request.remove(r);
                        }
                        self.stats.ready += 1;
                        let waited = h.waited(now);
                        self.outcomes.push_back(Outcome::Ready {
                            handoff,
                            requests,
                            blocks,
                            waited,
                            p_digest: None,
                            num_tokens: h.info.num_tokens,
                            peer: h.info.peer,
                            cached: h.cached.clone(),
                        });
                        self.end_handoff(handoff, now);
                    }
                    Some(reason) => {
                        if reason == FailReason::ReadFailed && self.retry_read(handoff, now) {
                            return;
                        }
                        self.fail_requests(handoff, reason);
                        self.after_read_ended(handoff, ReleaseReason::Failed, now);
                    }
                }
            }
            State::Quarantine {
                pending, tell_p, ..
            } => {
                let tell_p = *tell_p;
                pending.retain(|r| *r != d_rank);
                if pending.is_empty() {
                    self.after_read_ended(handoff, tell_p, now);
                }
            }
            _ => {}
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

    /// The transport reports P engine `peer` dead.
    pub fn handle_peer_dead(&mut self, peer: PeerId, now: Time) {
        self.last_now = self.last_now.max(now);
        let ids: Vec<HandoffId> = self
            .by_peer
            .get(&peer)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        for id in ids {
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

    fn on_grants(&mut self, from: PeerId, g: GrantBatch, now: Time) {
        let Some(sent_at) = self.heartbeats.anchor(g.seq, from) else {
            self.stats.ignored += 1;
            return;
        };
        for grant in g.grants {
            self.stats.grants_received += 1;
            let Some(h) = self.handoffs.get_mut(&grant.handoff) else {
                continue;
            };
            if h.info.peer != from {
                continue;
            }
            if h.info.epoch != grant.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            // Anchored at the moment the heartbeat left: P's lease began no earlier, so this
            // end is never later than P's (rule 2), however late the reply arrived.
            let until = sent_at + Duration::from_millis(grant.lease_ms as u64);
            let grant_until = h.grant_until.map_or(until, |u| u.max(until));
            h.grant_until = Some(grant_until);
            match &mut h.state {
                State::Admitted => self.try_start_read(grant.handoff, now),
                // A layer-wise read spans P's prefill: a stage in flight may run until this
                // later grant's end + the grace (P's lease covers it), and a stage refused for
                // want of a grant may go now.
                State::Reading {
                    failed: None,
                    deadline,
                    posted,
                    ..
                } if h.layerwise => {
                    *deadline =
                        read_deadline(&self.cfg, *posted, grant_until, h.deadline).max(*deadline);
                    let d = *deadline;
                    h.timer.arm(&mut self.timers, grant.handoff, d);
                    if std::mem::take(&mut h.more_waiting) {
                        self.actions.push_back(ConsumerAction::ReadMore {
                            handoff: grant.handoff,
                            layers: h.p_layers,
                            p_digest: h.p_digest,
                        });
                    }
                }
                _ => {}
            }
        }
        for e in g.gone {
            let Some(h) = self.handoffs.get(&e.handoff) else {
                continue;
            };
            if h.info.peer != from {
                continue;
            }
            if h.info.epoch != e.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            match h.state {
                State::Waiting | State::Admitted => {
                    self.fail_requests(e.handoff, FailReason::HandoffGone);
                    self.release_local(e.handoff, EndReason::Cancelled, now);
                    self.end_handoff(e.handoff, now);
                }
                // P is ending it and may still be writing: cancel and wait for the ack.
                State::Registered { .. } => {
                    self.fail_requests(e.handoff, FailReason::HandoffGone);
                    self.cancel_push(e.handoff, EndReason::Cancelled, now);
                }
                // A layer-wise read whose layers will never all come (P's prefill failed, or P
                // ended the handoff): stop the stage in flight, and P hears once it ended.
                State::Reading { ref pending, .. } if h.p_layers.is_some() => {
                    let pending = pending.clone();
                    self.fail_requests(e.handoff, FailReason::HandoffGone);
                    self.actions
                        .push_back(ConsumerAction::CancelRead { handoff: e.handoff });
                    self.quarantine(e.handoff, pending, ReleaseReason::Failed, now);
                }
                // A read in flight ends by its own deadline, which P's fence outlasts.
                _ => {}
            }
        }
    }

    /// Push: P asks for grants on the registrations it waits to write into.
    fn on_heartbeat(&mut self, from: PeerId, hb: Heartbeat, now: Time) {
        let mut grants = Vec::new();
        let mut gone = Vec::new();
        for e in hb.entries {
            match self.handoffs.get_mut(&e.handoff) {
                Some(h) if h.info.peer == from && h.info.epoch == e.epoch => match h.state {
                    State::Registered {
                        watchdog,
                        ref mut last_heard,
                        ..
                    } if now < watchdog => {
                        *last_heard = now;
                        let until = (now + self.cfg.registration_lease).min(watchdog);
                        h.issued_until = Some(h.issued_until.map_or(until, |u| u.max(until)));
                        grants.push(Grant {
                            handoff: e.handoff,
                            epoch: e.epoch,
                            lease_ms: ms_floor(until - now),
                        });
                    }
                    // Not registered yet: nothing to grant, nothing to declare gone.
                    State::Waiting => {}
                    _ => gone.push(e),
                },
                Some(_) => self.stats.ignored += 1,
                // Every write landed: P learns that from its own transfers' completion, which
                // may trail this heartbeat. "Gone" would race it and make P abort writes that
                // succeeded (and hold its blocks until its lease ran out). Say nothing.
                None if self.tombstones.get(&e.handoff) == Some(&true) => {}
                None => gone.push(e),
            }
        }
        for batch in split_grants(hb.seq, grants, gone) {
            self.messages.push_back((from, Message::GrantBatch(batch)));
        }
    }

    /// P names the blocks to read: they replace whatever the client claimed.
    fn on_pull_blocks(&mut self, from: PeerId, b: PullBlocks, now: Time) {
        for list in b.lists {
            let Some(h) = self.handoffs.get_mut(&list.handoff) else {
                self.stats.late_notifications += 1;
                continue;
            };
            if h.info.peer != from || h.info.mode != TransferMode::Pull {
                self.stats.ignored += 1;
                continue;
            }
            if h.info.epoch != list.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            if h.blocks_from_p {
                // Only a layer-wise pull's next list: the same blocks, more layers saved.
                let more = match (h.p_layers, list.layers) {
                    (Some(had), Some(now)) => now > had,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                if !more || list.blocks != h.info.p_blocks {
                    self.stats.ignored += 1;
                    continue;
                }
                h.p_layers = list.layers;
                h.p_digest = list.digest;
                match h.state {
                    State::Admitted => self.try_start_read(list.handoff, now),
                    State::Reading { failed: None, .. } => {
                        self.actions.push_back(ConsumerAction::ReadMore {
                            handoff: list.handoff,
                            layers: list.layers,
                            p_digest: list.digest,
                        })
                    }
                    _ => {}
                }
                continue;
            }
            if list.blocks.is_empty() {
                self.stats.ignored += 1;
                continue;
            }
            if h.info.p_blocks != list.blocks {
                // Counted (the connector's metrics and logs follow the counter), unless the
                // client named none (a layer-wise pull's D leg leaves before P has blocks).
                if !h.info.p_blocks.is_empty() {
                    self.stats.client_blocks_replaced += 1;
                }
                h.info.p_blocks = list.blocks;
            }
            h.blocks_from_p = true;
            h.blocks_answer_at = Some(now);
            h.p_digest = list.digest;
            h.p_layers = list.layers;
            h.layerwise = list.layers.is_some();
            if h.state == State::Waiting {
                self.started.push_back(h.requests.clone());
            }
            if h.state == State::Admitted {
                self.try_start_read(list.handoff, now);
            }
        }
    }

    fn on_push_done(&mut self, from: PeerId, d: PushDone, now: Time) {
        let write_grace = self.cfg.write_grace;
        let Some(h) = self.handoffs.get_mut(&d.handoff) else {
            self.stats.late_notifications += 1;
            return;
        };
        if h.info.peer != from || h.info.epoch != d.epoch {
            self.stats.ignored += 1;
            return;
        }
        let p_tp = h.info.p_tp;
        let tp = self.cfg.tp.max(1);
        let issued_until = h.issued_until;
        let State::Registered { done, .. } = &mut h.state else {
            self.stats.late_notifications += 1;
            return;
        };
        // Rule 4: the write must have landed inside a grant we issued (+ grace).
        let in_grant = issued_until.is_some_and(|u| now <= u + write_grace);
        if !in_grant {
            self.fail_requests(d.handoff, FailReason::LateWrite);
            self.cancel_push(d.handoff, EndReason::Failed, now);
            return;
        }
        let pair = (d.d_rank, d.p_rank);
        if !done.contains(&pair) {
            done.push(pair);
        }
        if h.p_digest.is_none() {
            h.p_digest = d.digest;
        }
        let all = rank_pairs(p_tp, tp);
        if all.iter().all(|p| done.contains(p)) {
            let blocks = h.local.take().unwrap_or_default();
            self.held_blocks -= blocks.len();
            let requests = std::mem::take(&mut h.requests);
            for r in &requests {
                self.by_request.remove(r);
            }
            if requests.is_empty() {
                h.local = Some(blocks);
                self.held_blocks += h.local.as_ref().map_or(0, Vec::len);
                self.release_local(d.handoff, EndReason::Aborted, now);
            } else {
                self.stats.ready += 1;
                let waited = h.waited(now);
                self.outcomes.push_back(Outcome::Ready {
                    handoff: d.handoff,
                    requests,
                    blocks,
                    waited,
                    p_digest: h.p_digest,
                    num_tokens: h.info.num_tokens,
                    peer: h.info.peer,
                    cached: h.cached.clone(),
                });
            }
            self.end_handoff(d.handoff, now);
            self.tombstones.insert(d.handoff, true, now);
        }
    }

    fn on_push_failed(&mut self, from: PeerId, f: PushFailed, now: Time) {
        let Some(h) = self.handoffs.get(&f.handoff) else {
            self.stats.late_notifications += 1;
            return;
        };
        if h.info.peer != from || h.info.epoch != f.epoch {
            self.stats.ignored += 1;
            return;
        }
        if let State::Registered { .. } = h.state {
            self.fail_requests(f.handoff, FailReason::WriteFailed);
            // Other P ranks may still be writing: cancel and wait for the ack or the grace.
            self.cancel_push(f.handoff, EndReason::Failed, now);
        }
    }

    fn on_cancel_ack(&mut self, from: PeerId, a: PushCancelAck, now: Time) {
        let Some(h) = self.handoffs.get(&a.handoff) else {
            return;
        };
        if h.info.peer != from || h.info.epoch != a.epoch {
            return;
        }
        if let State::Cancelling { .. } = h.state {
            // P promised no write is or will be in flight: the blocks are safe to reuse (rule 3).
            self.release_local(a.handoff, EndReason::Cancelled, now);
            self.end_handoff(a.handoff, now);
        }
    }

    // ----- transitions -----

    fn try_start_read(&mut self, id: HandoffId, now: Time) {
        let tp = self.cfg.tp.max(1);
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        // A layer-wise pull starts once P saved a layer.
        if h.state != State::Admitted || !h.blocks_from_p || h.p_layers == Some(0) {
            return;
        }
        let Some(grant_until) = h.grant_until else {
            return;
        };
        // Rule 2: start only on a grant still valid minus a safety margin.
        if grant_until <= now + self.cfg.read_margin {
            return;
        }
        // Rule 6: a read started late in the request's wait is cut at the request's deadline,
        // so the request gets its outcome in time however late it was admitted.
        if now >= h.deadline {
            return; // the deadline timer ends it
        }
        let deadline = read_deadline(&self.cfg, now, grant_until, h.deadline);
        let p_tp = h.info.p_tp;
        let done = rank_pairs(p_tp, tp)
            .into_iter()
            .map(|(d, p)| PullDone {
                handoff: id,
                epoch: h.info.epoch,
                p_rank: p,
                consumer_rank: d,
                consumers: rank_consumers(p_tp, tp, p),
            })
            .collect();
        self.actions.push_back(ConsumerAction::StartRead(StartRead {
            handoff: id,
            epoch: h.info.epoch,
            p_peer: h.info.peer,
            p_tp,
            src_blocks: h.info.p_blocks.clone(),
            dst_blocks: h.local.clone().unwrap_or_default(),
            cached_blocks: h.cached.clone(),
            num_tokens: h.info.num_tokens,
            deadline,
            done,
            p_digest: h.p_digest,
            layers: h.p_layers,
        }));
        h.state = State::Reading {
            deadline,
            pending: (0..tp).collect(),
            failed: None,
            posted: now,
        };
        h.transfer_at = Some(now);
        h.timer.arm(&mut self.timers, id, deadline);
        self.stats.reads_started += 1;
    }

    /// How long P may stay silent about a registration before D sends it again.
    fn register_resend(&self) -> Duration {
        self.cfg.heartbeat_interval * REGISTER_RESEND_HEARTBEATS
    }

    /// One `PushRegister` per D rank for the blocks reserved for push handoff `id`.
    fn send_registrations(&mut self, id: HandoffId) {
        let Some(h) = self.handoffs.get(&id) else {
            return;
        };
        let Some(blocks) = &h.local else {
            return;
        };
        let tp = self.cfg.tp.max(1);
        for d_rank in 0..tp {
            self.messages.push_back((
                h.info.peer,
                Message::PushRegister(PushRegister {
                    handoff: id,
                    epoch: h.info.epoch,
                    d_rank,
                    d_tp: tp,
                    num_tokens: h.info.num_tokens,
                    block_ids: blocks.clone(),
                    cached_blocks: h.cached.len() as u32,
                }),
            ));
        }
    }

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

    /// Every rank's read of `id` ended and one failed: try again if a retry is left and the
    /// request may still wait. The retry runs under the next epoch, so nothing the first attempt
    /// left on its way (a `PullDone` riding a READ that landed, a grant for the old epoch) can
    /// count for the new one; it starts only on a grant P issued for the new epoch.
    fn retry_read(&mut self, id: HandoffId, now: Time) -> bool {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return false;
        };
        if h.retries_left == 0 || h.requests.is_empty() || now >= h.deadline {
            return false;
        }
        h.retries_left -= 1;
        h.info.epoch = h.info.epoch.next();
        h.grant_until = None;
        h.state = State::Admitted;
        let deadline = h.deadline;
        h.timer.arm(&mut self.timers, id, deadline);
        self.urgent.entry(h.info.peer).or_default().insert(id);
        self.stats.read_retries += 1;
        true
    }

    /// Every rank's read of a handoff that did not become ready (failed, cancelled, or every
    /// request gone) has ended: nothing is in flight, P may free at once.
    fn after_read_ended(&mut self, id: HandoffId, reason: ReleaseReason, now: Time) {
        let Some(h) = self.handoffs.get(&id) else {
            return;
        };
        let msg = Release {
            handoff: id,
            epoch: h.info.epoch,
            reason,
        };
        self.messages
            .push_back((h.info.peer, Message::Release(msg)));
        self.stats.releases_sent += 1;
        self.release_local(id, EndReason::from(reason), now);
        self.end_handoff(id, now);
    }

    /// Holds a read's blocks until every rank in `pending` reported its read ended (or the fence
    /// is over); then P is told `tell_p`.
    fn quarantine(&mut self, id: HandoffId, pending: Vec<u16>, tell_p: ReleaseReason, now: Time) {
        let fence = self.cfg.read_fence;
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if pending.is_empty() {
            self.after_read_ended(id, tell_p, now);
            return;
        }
        let until = now + fence;
        h.state = State::Quarantine {
            until,
            pending,
            tell_p,
        };
        h.timer.arm(&mut self.timers, id, until);
    }

    /// Push: stop P from writing, then free once that is certain.
    fn cancel_push(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let peer = h.info.peer;
        self.messages.push_back((
            peer,
            Message::PushCancel(PushCancel {
                handoff: id,
                epoch: h.info.epoch,
            }),
        ));
        self.stats.cancels_sent += 1;
        self.await_writes_end(id, reason, now);
    }

    /// Frees `id`'s blocks once no WRITE of P's can land in them any more: at once if P never
    /// got a grant (it writes only on one), else after the last grant D issued + the write grace.
    fn await_writes_end(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let write_grace = self.cfg.write_grace;
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        match h.issued_until {
            None => {
                self.release_local(id, reason, now);
                self.end_handoff(id, now);
            }
            Some(issued) => {
                let until = (issued + write_grace).max(now);
                h.state = State::Cancelling { until, reason };
                h.timer.arm(&mut self.timers, id, until);
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

    fn send_heartbeats(&mut self, now: Time) {
        let mut any = false;
        let peers: Vec<PeerId> = self.by_peer.keys().copied().collect();
        for peer in peers {
            let entries: Vec<HeartbeatEntry> = self.by_peer[&peer]
                .iter()
                .filter_map(|id| {
                    let h = &self.handoffs[id];
                    h.wants_heartbeat().then_some(HeartbeatEntry {
                        handoff: *id,
                        epoch: h.info.epoch,
                    })
                })
                .collect();
            if entries.is_empty() {
                continue;
            }
            any = true;
            self.stats.heartbeats_sent +=
                self.heartbeats
                    .send(peer, &entries, now, &mut self.messages) as u64;
            self.ask_blocks(peer, entries.iter().map(|e| e.handoff));
        }
        self.urgent.clear();
        self.next_heartbeat = any.then(|| now + self.cfg.heartbeat_interval);
    }

    /// With each heartbeat, asks P for the blocks of every pull handoff it has not named yet
    /// (usually once: the answer comes back within a round trip).
    fn ask_blocks(&mut self, peer: PeerId, ids: impl Iterator<Item = HandoffId>) {
        let entries: Vec<HeartbeatEntry> = ids
            .filter_map(|id| {
                let h = self.handoffs.get(&id)?;
                (h.info.mode == TransferMode::Pull && !h.blocks_from_p).then_some(HeartbeatEntry {
                    handoff: id,
                    epoch: h.info.epoch,
                })
            })
            .collect();
        for chunk in entries.chunks(MAX_BATCH_ENTRIES) {
            let q = BlocksQuery {
                entries: chunk.to_vec(),
            };
            self.messages.push_back((peer, Message::BlocksQuery(q)));
        }
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
