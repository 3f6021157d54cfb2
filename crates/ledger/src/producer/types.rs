//! The producer's public vocabulary: its settings, its errors, the push writes and actions it
//! asks of the connector, and its counters.

use super::*;

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
    /// Push: start a WRITE only when the registration grant has at least this much left, plus
    /// the time its bytes take at `write_floor_rate`.
    pub write_margin: Duration,
    /// Push: the slowest rate, in bytes per second from one P rank to one D rank, at which a
    /// healthy WRITE is expected to move its bytes: a WRITE is started only while its grant
    /// has that time left for its bytes (beside `write_margin`), so that it lands inside the
    /// grant and D's write grace only covers a rate below the floor (0: `write_margin` alone).
    #[serde(default)]
    pub write_floor_rate: u64,
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
            write_floor_rate: 1_000_000_000,
            write_timeout: Duration::from_millis(400),
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

impl ProducerConfig {
    /// How much of its grant a WRITE of `bytes` needs left to start: the write margin plus the
    /// bytes' time at the floor rate.
    pub fn write_lead(&self, bytes: u64) -> Duration {
        if self.write_floor_rate == 0 {
            return self.write_margin;
        }
        let nanos = u128::from(bytes) * 1_000_000_000 / u128::from(self.write_floor_rate);
        self.write_margin + Duration::from_nanos(nanos.min(u128::from(u64::MAX)) as u64)
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
