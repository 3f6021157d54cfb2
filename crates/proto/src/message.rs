//! Every message P and D exchange. A message is one of [`Message`]'s variants; the module docs of
//! each struct say who sends it and what the receiver does with it.

use serde::{Deserialize, Serialize};

use crate::ids::{Epoch, HandoffId};
pub use crate::params::TransferMode;

/// Hard cap on one encoded message. Heartbeats and grant batches are split to stay under it
/// ([`crate::split_heartbeat`]), so a peer can size its receive buffer once.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Longest engine id, reason text or model name accepted from a peer.
pub const MAX_TEXT_BYTES: usize = 256;
/// Largest opaque blob (transport agent metadata, serialized layout) inside a handshake. Both
/// blobs and every text of a [`Hello`] at their limits must still fit in one message
/// ([`MAX_MESSAGE_BYTES`]): 2 x 31 KiB + about 800 bytes < 64 KiB.
pub const MAX_BLOB_BYTES: usize = 31 * 1024;
/// Most ranks one hello describes where KV lives for (with two blobs at their limit, a hello of
/// this many still fits one message).
pub const MAX_HELLO_RANKS: usize = 128;
/// Most block ids one push registration may carry (a 128k-token prompt at 16 tokens per block).
pub const MAX_REGISTERED_BLOCKS: usize = 8192;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    Hello(Hello),
    HelloReply(HelloReply),
    Heartbeat(Heartbeat),
    GrantBatch(GrantBatch),
    PullDone(PullDone),
    Release(Release),
    PushRegister(PushRegister),
    PushDone(PushDone),
    PushFailed(PushFailed),
    PushCancel(PushCancel),
    PushCancelAck(PushCancelAck),
    BlocksQuery(BlocksQuery),
    PullBlocks(PullBlocks),
}

impl Message {
    /// The handoff a message is about, if it is about exactly one.
    pub fn handoff(&self) -> Option<HandoffId> {
        match self {
            Message::PullDone(m) => Some(m.handoff),
            Message::Release(m) => Some(m.handoff),
            Message::PushRegister(m) => Some(m.handoff),
            Message::PushDone(m) => Some(m.handoff),
            Message::PushFailed(m) => Some(m.handoff),
            Message::PushCancel(m) => Some(m.handoff),
            Message::PushCancelAck(m) => Some(m.handoff),
            Message::Hello(_)
            | Message::BlocksQuery(_)
            | Message::PullBlocks(_)
            | Message::HelloReply(_)
            | Message::Heartbeat(_)
            | Message::GrantBatch(_) => None,
        }
    }

    /// Name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::HelloReply(_) => "hello_reply",
            Message::Heartbeat(_) => "heartbeat",
            Message::GrantBatch(_) => "grant_batch",
            Message::PullDone(_) => "pull_done",
            Message::Release(_) => "release",
            Message::PushRegister(_) => "push_register",
            Message::PushDone(_) => "push_done",
            Message::PushFailed(_) => "push_failed",
            Message::PushCancel(_) => "push_cancel",
            Message::PushCancelAck(_) => "push_cancel_ack",
            Message::BlocksQuery(_) => "blocks_query",
            Message::PullBlocks(_) => "pull_blocks",
        }
    }
}

/// What must be equal on both sides before anything else is looked at. TP size, block size and
/// block layout are deliberately absent: they may differ and the planner handles them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub protocol_version: u16,
    pub model: String,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub dtype: String,
    pub mode: TransferMode,
}

impl Fingerprint {
    /// Says in words why two fingerprints cannot pair, or `None` when they can.
    pub fn mismatch(&self, peer: &Fingerprint) -> Option<String> {
        let mut diffs = Vec::new();
        // A peer's hello is in the version its connection speaks: any this engine speaks, up
        // to its own (crate::versions).
        let oldest = u16::from(crate::versions::OLDEST_PROTOCOL_VERSION);
        if peer.protocol_version > self.protocol_version || peer.protocol_version < oldest {
            diffs.push(format!(
                "protocol version {} on the peer, this engine speaks {oldest} to {}",
                peer.protocol_version, self.protocol_version
            ));
        }
        if self.model != peer.model {
            diffs.push(format!(
                "model {:?} here, {:?} on the peer",
                self.model, peer.model
            ));
        }
        if self.num_layers != peer.num_layers {
            diffs.push(format!(
                "{} layers here, {} on the peer",
                self.num_layers, peer.num_layers
            ));
        }
        if self.num_kv_heads != peer.num_kv_heads {
            diffs.push(format!(
                "{} KV heads here, {} on the peer",
                self.num_kv_heads, peer.num_kv_heads
            ));
        }
        if self.head_dim != peer.head_dim {
            diffs.push(format!(
                "head dim {} here, {} on the peer",
                self.head_dim, peer.head_dim
            ));
        }
        if self.dtype != peer.dtype {
            diffs.push(format!(
                "dtype {} here, {} on the peer",
                self.dtype, peer.dtype
            ));
        }
        if self.mode != peer.mode {
            diffs.push(format!(
                "transfer mode {} here, {} on the peer",
                self.mode.as_str(),
                peer.mode.as_str()
            ));
        }
        if diffs.is_empty() {
            None
        } else {
            Some(format!("incompatible peer: {}", diffs.join("; ")))
        }
    }

    /// The compatibility key a router reads (`/v1/handoff/info`, `handoff_compat_info` on
    /// `/metrics`): 12 hex digits over everything a P and a D must agree on to exchange KV —
    /// this fingerprint, the block layout inside a block (`head-major` or `token-major`) and
    /// whether the KV digest is checked. Equal keys pair; TP size, block size and pool layout
    /// are left out, since the planner handles any of them. A stable hash (FNV-1a), not a
    /// secret: the same settings give the same key on every host and every build. It does not
    /// cover the protocol version (the handshake negotiates one both ends speak, or refuses):
    /// see [`COMPAT_KEY_VERSION`].
    pub fn compat_key(&self, block_layout: &str, kv_digest: bool) -> String {
        let canonical = format!(
            "handoff-compat|v{}|{}|{}|{}|{}|{}|{}|{}|digest={}",
            COMPAT_KEY_VERSION,
            self.model,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.mode.as_str(),
            block_layout,
            u8::from(kv_digest),
        );
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in canonical.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{:012x}", h >> 16)
    }
}

/// The protocol version written into every compatibility key. Up to version 7 the key covered
/// the engine's version; since 8 the handshake negotiates one both ends speak, and the key keeps
/// 7 so that the same settings give the same key in every release: routers pair old and new
/// engines during a rolling upgrade, and a pair that shares no version is refused at the
/// handshake.
const COMPAT_KEY_VERSION: u8 = 7;

/// First message on a side channel: who I am and what my KV looks like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub engine_id: String,
    pub rank: u16,
    pub tp: u16,
    pub fingerprint: Fingerprint,
    /// The rank's KV layout as the planner describes it, serialized by the connector.
    pub layout: Vec<u8>,
    /// Transport agent metadata (NIXL `get_local_md`, or the TCP data address).
    pub agent_metadata: Vec<u8>,
    /// Where each rank's KV lives, rank by rank (host or a GPU's memory).
    pub memory: Vec<crate::xfer::MemoryKind>,
}

/// Answer to [`Hello`]: the peer's own description, or why it refuses to pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    Accepted(Hello),
    Refused { reason: String },
}

/// One handoff named in a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeartbeatEntry {
    pub handoff: HandoffId,
    pub epoch: Epoch,
}

/// "I still want these": sent by the side that waits for blocks to the side that holds them
/// (D to P for pull leases, P to D for push registrations), batched per peer engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Echoed in the [`GrantBatch`] reply; the sender anchors the grants at its send time.
    pub seq: u64,
    /// The flow whose blocks these are, which says who holds them: `Pull` (P's leases, a
    /// layer-wise pull's too) or `Push` (D's registrations). An engine that runs both sides
    /// hands the heartbeat to that ledger, never guessing from the ids.
    pub mode: TransferMode,
    pub entries: Vec<HeartbeatEntry>,
}

/// A lease as the peer sees it: "you may touch these blocks for the next `lease_ms`".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Grant {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub lease_ms: u32,
}

/// Reply to a [`Heartbeat`]: the grants extended, and the handoffs the holder no longer has (so
/// the asker fails fast instead of waiting for a lease that will never come).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantBatch {
    pub seq: u64,
    pub grants: Vec<Grant>,
    pub gone: Vec<HeartbeatEntry>,
}

/// D to P, attached to a READ (delivered only after its bytes landed): consumer `consumer_rank`
/// of D has finished reading P rank `p_rank`'s part; P rank `p_rank` has `consumers` readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullDone {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub p_rank: u16,
    pub consumer_rank: u16,
    pub consumers: u16,
}

/// Why the side that waited gives a handoff up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReleaseReason {
    /// Nothing left to read (full local prefix hit, or everything already read).
    Done,
    /// D refused the request before admission.
    Rejected,
    /// The client went away.
    Aborted,
    /// D gave up (deadline, policy) after no transfer can be in flight any more.
    Cancelled,
    /// A transfer failed and none is in flight any more.
    Failed,
}

impl ReleaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Done => "done",
            ReleaseReason::Rejected => "rejected",
            ReleaseReason::Aborted => "aborted",
            ReleaseReason::Cancelled => "cancelled",
            ReleaseReason::Failed => "failed",
        }
    }
}

/// "Free it now": sent by D (or the proxy, when D never got the request) to P. The sender
/// promises that no READ of the handoff is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub reason: ReleaseReason,
}

/// Pull mode, D to P, with D's heartbeats until answered: "which blocks hold these handoffs'
/// KV?". D reads only the blocks P names in its [`PullBlocks`] answer, never those a client
/// wrote into `kv_transfer_params` (`remote_block_ids` may name another request's blocks).
/// At most [`crate::MAX_BATCH_ENTRIES`] entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlocksQuery {
    pub entries: Vec<HeartbeatEntry>,
}

/// One handoff's blocks, in token order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockList {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub blocks: Vec<u32>,
    /// The KV digest of these blocks summed over P's ranks (see the connector's `digest`
    /// module), when P computed one: D compares it with its own after the READ landed.
    pub digest: Option<u64>,
    /// Layer-wise pull: P's prefill is still running and only the first `n` layers of every
    /// block hold their KV (`Some(n)`); D may read those and waits for the next list. `None`:
    /// every layer is final (a classic pull, or the last list of a layer-wise one, which alone
    /// carries the digest).
    pub layers: Option<u32>,
}

/// Pull mode, P to the D that reads these handoffs (and no one else): the answer to its
/// [`BlocksQuery`], and in a layer-wise pull one more list each time P's prefill saved layers.
/// At most
/// [`MAX_LISTS_PER_MESSAGE`] lists and [`MAX_REGISTERED_BLOCKS`] blocks in all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullBlocks {
    pub lists: Vec<BlockList>,
}

/// Most block lists in one [`PullBlocks`] (with [`MAX_REGISTERED_BLOCKS`] blocks in all, it
/// stays under the message size cap).
pub const MAX_LISTS_PER_MESSAGE: usize = 512;

/// Push mode, D to every P rank that must write: the destination blocks D reserved for the
/// handoff. P writes only once a heartbeat round trip gave it a grant on this registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushRegister {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub d_rank: u16,
    pub d_tp: u16,
    pub num_tokens: u32,
    pub block_ids: Vec<u32>,
    /// D's prefix-cache hit: the prompt's first `cached_blocks` blocks (of D's block size) are
    /// already in D's own blocks, shared with other requests, and never written; `block_ids`
    /// hold the prompt from there on, and P writes from the same token of its own blocks.
    pub cached_blocks: u32,
}

/// Push mode, P to D, attached to the last WRITE of P rank `p_rank` into D rank `d_rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushDone {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub p_rank: u16,
    pub d_rank: u16,
    /// The KV digest of the handoff's blocks summed over P's ranks, when P computed one (see
    /// the connector's `digest`): D checks what landed against it.
    pub digest: Option<u64>,
}

/// Push mode, P to D: a WRITE failed and none is in flight any more; D may free at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushFailed {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub p_rank: u16,
    pub reason: String,
}

/// Push mode, D to P: stop; do not write into this registration any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCancel {
    pub handoff: HandoffId,
    pub epoch: Epoch,
}

/// Push mode, P to D: "no WRITE of mine into that registration is or will be in flight".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCancelAck {
    pub handoff: HandoffId,
    pub epoch: Epoch,
    pub p_rank: u16,
}
