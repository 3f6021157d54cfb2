//! The consumer's public vocabulary: its settings, what it learns of a handoff, its errors, and
//! what it tells the connector (outcomes, actions, reads to start, counters).

use super::*;

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
    /// A read that takes longer than this, plus the time its bytes take at `read_floor_rate`,
    /// has failed. (However long it may take, a read still fails once its grant + the read
    /// grace are over: P stopped renewing it.)
    pub read_timeout: Duration,
    /// The slowest rate, in bytes per second on one D rank, at which a healthy read is expected
    /// to move its bytes: a read of a long prompt gets that time on top of `read_timeout`, so
    /// it is not failed for its size (0: `read_timeout` alone).
    #[serde(default)]
    pub read_floor_rate: u64,
    /// Bytes of one block on one D rank, every layer (the connector sets it from its layout;
    /// 0: unknown, no time for bytes).
    #[serde(default)]
    pub block_bytes: u64,
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
    /// Push: time after the last grant before blocks are freed without P's cancel ack. P
    /// starts a WRITE only while the grant has its bytes' time left (at its floor rate) and
    /// aborts one still running its write timeout past the grant: this covers that timeout and
    /// the abort reaching the wire, so it must exceed P's write timeout (rule 3).
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
            read_floor_rate: 1_000_000_000,
            block_bytes: 0,
            read_grace: Duration::from_millis(500),
            read_fence: Duration::from_secs(10),
            read_retries: 1,
            wait_deadline: Duration::from_secs(60),
            failure_policy: FailurePolicy::Recompute,
            registration_lease: Duration::from_millis(1500),
            push_deadline: Duration::from_secs(30),
            write_grace: Duration::from_millis(800),
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
    /// P and D cannot exchange KV (the handshake was refused: another model, dtype, layout,
    /// protocol version or mode).
    Incompatible,
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
            FailReason::Incompatible => "incompatible",
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
