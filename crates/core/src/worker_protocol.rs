//! The step metadata between the scheduler side and the worker sides of a connector.
//!
//! As in vLLM (`build_connector_meta` on the scheduler, `start_load_kv` / `get_finished` on each
//! worker), the two sides share nothing but these plain values: the scheduler side tells a
//! worker which transfers to post or abort and which peer agents to load ([`WorkerStep`]); the
//! worker tells the scheduler side what ended, what arrived and who died ([`WorkerReport`]).
//! Everything here is serialisable, so a worker may live in another process.

use handoff_plan::RankLayout;
use handoff_proto::HandoffId;

use crate::digest::DigestOf;
use handoff_proto::xfer::{GrantId, MemoryKind, XferDesc, XferOp};
use serde::{Deserialize, Serialize};

/// One transfer job, numbered by the scheduler side. A job is what one worker posts for one
/// purpose (one D rank's reads of a handoff; one layer's writes from one P rank into one D rank)
/// and ends once, as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub u64);

/// What a worker tells the scheduler side about itself when it starts (vLLM: the handshake
/// metadata a worker publishes after `register_kv_caches`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerHello {
    pub rank: u16,
    pub layout: RankLayout,
    /// The transport agent's name, as peers address it.
    pub agent: String,
    /// What a peer needs to reach that agent (opaque).
    pub metadata: Vec<u8>,
    /// Where the rank's KV lives (host or a GPU's memory).
    pub memory: MemoryKind,
    /// The model's KV cache groups (the same on every rank; one full group unless the engine
    /// keeps a hybrid model's layers in groups of their own).
    #[serde(default)]
    pub groups: handoff_plan::KvGroups,
}

/// Work for one worker, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStep {
    pub ops: Vec<WorkerOp>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerOp {
    /// Load a peer agent's metadata. The name the transport reads out of it must be `agent`:
    /// a peer cannot make us load an agent under another name than the one it announced.
    LoadRemote { agent: String, metadata: Vec<u8> },
    /// Forget a peer agent (its engine is gone).
    ForgetRemote { agent: String },
    /// Post a transfer job.
    Post(TransferJob),
    /// Abort a job; its end is still reported (as failed), once the transport let it go.
    Abort { job: JobId },
    /// Let the peer agents `agents` do `op` on every byte of `blocks` (P: a handoff's blocks,
    /// to the D that reads them; D: a push registration's blocks, to the P that writes them),
    /// until revoked. Acknowledged in [`WorkerReport::granted`]; with `digest`, the rank's
    /// share of the KV digest of `blocks` is computed first and reported in
    /// [`WorkerReport::digests`].
    Grant {
        grant: GrantId,
        op: XferOp,
        agents: Vec<String>,
        blocks: Vec<u32>,
        digest: Option<DigestOf>,
    },
    /// End a grant (its handoff ended, after its fence).
    Revoke { grant: GrantId },
    /// Compute this rank's share of the KV digest of `blocks` (push: P over its blocks once
    /// every layer is in them, D over its registered blocks once every write landed), reported
    /// in [`WorkerReport::digests`] as [`Digested::Handoff`], or in
    /// [`WorkerReport::undigested`] when it cannot be computed.
    Digest {
        handoff: HandoffId,
        blocks: Vec<u32>,
        of: DigestOf,
    },
    /// Zero the bytes of `blocks` past the first `num_tokens` tokens.
    ZeroTail { blocks: Vec<u32>, num_tokens: u32 },
    /// Push, D: P writes whole blocks (a layer of a contiguous run is then one descriptor; cut
    /// at the prompt's last token it would be one per head and plane), so the last block's tail
    /// holds P's stale bytes until zeroed. On every `PushDone` of `handoff` this rank's
    /// transport delivers, zero the bytes of `blocks` past `num_tokens` before reporting it:
    /// a `PushDone` comes after its writes landed, so once the last one is reported the tail is
    /// zero, before anyone digests or decodes the blocks. Dropped by `ForgetPushTail`.
    ZeroTailOnPushDone {
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// The push of `handoff` ended on D: no `PushDone` of it matters any more.
    ForgetPushTail { handoff: HandoffId },
    /// P, push: D renewed its grant on registration (`handoff`, `d_rank`). A write of it that
    /// the worker holds for its forward pass ([`PushLayer`]) may now be posted up to this many
    /// milliseconds after this op arrived (the grant's new end less the write margin), if that
    /// is later than what it was planned with. The forward pass that holds the writes runs
    /// while this op travels, so an engine hands it to its workers at once, outside its steps
    /// (vLLM: the grant line, `handoff_vllm::grant_line`).
    RenewWrites {
        handoff: HandoffId,
        d_rank: u16,
        post_within_ms: u32,
    },
}

/// Transfers to post together; the job ends when every part ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferJob {
    pub job: JobId,
    pub op: XferOp,
    pub parts: Vec<TransferPart>,
    /// Pull: once every part landed, zero the bytes of these blocks past this many tokens (whole
    /// blocks are moved, so the tail holds P's stale bytes) before the job counts as done.
    pub zero_tail: Option<(Vec<u32>, u32)>,
    /// Once every part landed (and the tail was zeroed), compute the rank's share of the KV
    /// digest of these blocks and report it in [`WorkerReport::digests`].
    pub digest: Option<(Vec<u32>, DigestOf)>,
    /// Push: the job writes one layer of one handoff's KV (see [`PushLayer`]).
    pub push_layer: Option<PushLayer>,
}

/// What a push WRITE moves, for a worker whose engine runs the forward pass that produces it
/// after the scheduler side planned the write (vLLM: the step's metadata is built before its
/// forward). Such a worker holds the job until the layer is in its blocks, and posts it only
/// while the registration grant it was planned on still holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushLayer {
    pub handoff: HandoffId,
    /// The D rank whose registration the job writes into (its grant is the one that counts).
    pub d_rank: u16,
    pub layer: u32,
    /// Milliseconds after the worker received the step within which the job may be posted:
    /// the registration grant's end less the producer's write margin, as the scheduler side
    /// saw it when planning (later [`WorkerOp::RenewWrites`] extend it). The margin covers the
    /// step's way to the worker.
    pub post_within_ms: u32,
}

/// What a reported digest is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Digested {
    /// P: the blocks of a grant.
    Grant(GrantId),
    /// D: the blocks a job landed in.
    Job(JobId),
    /// Push: the blocks of a [`WorkerOp::Digest`].
    Handoff(HandoffId),
}

/// One transfer with one peer agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPart {
    pub agent: String,
    pub descs: Vec<XferDesc>,
    /// Delivered to the peer only after every byte of this transfer landed.
    pub notification: Option<Vec<u8>>,
}

/// What one worker reports back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReport {
    pub rank: u16,
    /// Jobs that ended, and whether every byte landed.
    pub ended: Vec<(JobId, bool)>,
    /// Notifications from peer agents: (agent, bytes).
    pub notifications: Vec<(String, Vec<u8>)>,
    /// Peer agents the transport found dead.
    pub dead_agents: Vec<String>,
    /// Peer agents whose metadata could not be loaded: (agent, why).
    pub load_failed: Vec<(String, String)>,
    /// Inbound transport connections refused at their handshake since the last report.
    pub refused_connections: u64,
    /// Grants in force on this rank's transport since the last report (and whether the
    /// transport took them: false only for blocks outside the pool, which is a core bug).
    pub granted: Vec<(GrantId, bool)>,
    /// Inbound transfers refused outside any grant since the last report.
    pub refused_transfers: u64,
    /// KV digests asked for (this rank's share), reported before the grant or job they belong
    /// to.
    pub digests: Vec<(Digested, u64)>,
    /// Push digests asked for that this rank could not compute (the handoff goes unchecked).
    pub undigested: Vec<HandoffId>,
}

impl WorkerReport {
    pub fn is_empty(&self) -> bool {
        self.ended.is_empty()
            && self.notifications.is_empty()
            && self.dead_agents.is_empty()
            && self.load_failed.is_empty()
            && self.refused_connections == 0
            && self.granted.is_empty()
            && self.refused_transfers == 0
            && self.digests.is_empty()
            && self.undigested.is_empty()
    }
}
