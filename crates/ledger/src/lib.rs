//! The lifecycle ledgers of handoff: [`ProducerLedger`] on P and [`ConsumerLedger`] on D.
//! In the book (`docs/` in the repository): `docs/src/design/overview.md`.
//!
//! Both are sans-IO state machines in the style of quinn-proto: no sockets, no threads, no clock
//! reads. Every input is a method that takes `now`; every output is pulled by the caller
//! (`poll_message`, `poll_release`, `poll_action`/`poll_outcome`, `poll_timeout`). That is what
//! lets the tests drive them with generated event schedules and a simulated clock and check the
//! seven rules (`docs/src/design/overview.md`) on thousands of schedules per second.
//!
//! Where each rule is enforced:
//! - rule 1 (every block back exactly once): a handoff's blocks leave the ledger only through
//!   `finish` in [`producer`] and `end_handoff`/`release_local` in [`consumer`].
//! - rule 2 (P never reuses a block a READ may still touch): [`producer`]'s `Fencing` state; D's
//!   `read_deadline` in [`consumer`]; grants anchored at the heartbeat's send time.
//! - rule 3 (D never reuses a block a WRITE may still touch): [`consumer`]'s `Cancelling` state and
//!   [`producer`]'s write permit check.
//! - rule 4 (decode only from KV that landed inside its grant): [`consumer`]'s `read_done` and
//!   `push_done` checks.
//! - rules 5 and 6 (everything ends in bounded time): the deadlines armed in [`timer`].
//! - rule 7 (bounded memory, idempotent messages): [`staging`], epochs, and the duplicate checks.

#![forbid(unsafe_code)]

mod consumer;
mod heartbeat;
mod producer;
mod staging;
#[cfg(feature = "testing")]
pub mod testing;
mod timer;

pub use consumer::*;
pub use producer::*;

/// Monotonic time since an origin the caller picks (the connector uses its start instant, the
/// tests a simulated clock). Only differences matter.
pub type Time = std::time::Duration;

/// A peer engine as the connector numbers it (it maps engine ids and transport agents to these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// A KV block id in an engine's pool (the same id on every rank of that engine).
pub type BlockId = u32;

/// A request id on D, as the engine numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Why a handoff (P) or a transfer (D) ended. These are the labels of the "handoffs ended" metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndReason {
    /// Every consumer read it / every write landed.
    Done,
    /// The lease ran out (no sign of life from the peer).
    Expired,
    /// The transport reported the peer dead.
    PeerDead,
    /// D refused the request before admission.
    Rejected,
    /// The client went away.
    Aborted,
    /// The hard cap on a handoff's life was reached.
    Capped,
    /// The waiting side gave up (deadline, watchdog, cancel).
    Cancelled,
    /// A transfer failed.
    Failed,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Done => "done",
            EndReason::Expired => "expired",
            EndReason::PeerDead => "peer_dead",
            EndReason::Rejected => "rejected",
            EndReason::Aborted => "aborted",
            EndReason::Capped => "capped",
            EndReason::Cancelled => "cancelled",
            EndReason::Failed => "failed",
        }
    }

    pub const ALL: [EndReason; 8] = [
        EndReason::Done,
        EndReason::Expired,
        EndReason::PeerDead,
        EndReason::Rejected,
        EndReason::Aborted,
        EndReason::Capped,
        EndReason::Cancelled,
        EndReason::Failed,
    ];
}

impl From<handoff_proto::ReleaseReason> for EndReason {
    fn from(r: handoff_proto::ReleaseReason) -> Self {
        use handoff_proto::ReleaseReason as R;
        match r {
            R::Done => EndReason::Done,
            R::Rejected => EndReason::Rejected,
            R::Aborted => EndReason::Aborted,
            R::Cancelled => EndReason::Cancelled,
            R::Failed => EndReason::Failed,
        }
    }
}

/// Blocks a ledger hands back to the engine's pool. Each block id appears in exactly one
/// `BlockRelease` per allocation (rule 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRelease {
    pub handoff: handoff_proto::HandoffId,
    pub blocks: Vec<BlockId>,
    pub reason: EndReason,
    /// How long the blocks were held by the ledger.
    pub held_for: Time,
}

/// What a ledger keeps in memory beyond its live handoffs: everything here is bounded by a cap and
/// an expiry (rule 7), which the property tests check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUse {
    pub handoffs: usize,
    pub staged_messages: usize,
    pub tombstones: usize,
    pub timer_entries: usize,
    pub heartbeats_awaiting_reply: usize,
}
