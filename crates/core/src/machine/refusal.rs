//! [`HandshakeRefusal`]: why this engine will not pair with a peer, as a value. The peer is
//! told its text (a `HelloReply::Refused`), the requests that came for it fail or recompute
//! with it, and [`HandshakeRefusal::kind`] names it in one word for logs.

use handoff_plan::{GroupError, GroupMismatch, Incompatible, KvSpec, LayoutError};
use handoff_proto::MemoryKind;

/// Why a handshake with a peer failed (its hello, its reply, or its claims).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeRefusal {
    /// The compatibility fingerprints differ (another model, dtype, mode or protocol version).
    #[error("{0}")]
    Fingerprint(String),
    #[error(
        "the peer speaks protocol version {version}, which cannot describe this engine's KV in \
         {memory}: upgrade the peer"
    )]
    CannotDescribe { version: u8, memory: MemoryKind },
    #[error("peer claims this engine's id {0:?}")]
    OwnEngineId(String),
    /// Its layouts or agent metadata do not decode.
    #[error("bad {what}: {error}")]
    Undecodable { what: &'static str, error: String },
    #[error(
        "peer announces tp {tp} with {layouts} layouts, {agents} agents and {memory} memory kinds"
    )]
    RankCount {
        tp: u16,
        layouts: usize,
        agents: usize,
        memory: usize,
    },
    #[error("peer rank {rank}: {error}")]
    RankLayout { rank: usize, error: LayoutError },
    #[error("peer rank {rank}: layout names rank {named}")]
    RankNamesAnother { rank: usize, named: u32 },
    #[error("peer agent names are empty or repeated: {0:?}")]
    AgentNames(String),
    #[error("agent name {0:?} belongs to another engine")]
    AgentTaken(String),
    /// The peer table lost the peer being bound (a bug, said rather than panicked on).
    #[error("unknown peer")]
    UnknownPeer,
    #[error("{0}")]
    Incompatible(#[from] Incompatible),
    /// The peer's KV cache groups are unusable.
    #[error("peer's KV cache groups: {0}")]
    BadGroups(GroupError),
    /// The two engines keep their layers in different KV cache groups.
    #[error("{0}")]
    Groups(#[from] GroupMismatch),
    #[error(
        "this engine's KV blocks are its attention kernel's pages, moved whole (or a KV head's \
         part of one, where each head's part is one chunk): the peer must have the same model \
         shape, block size and block layout, and the same TP size unless each head's part moves \
         whole or every rank of both holds every KV head (P {p:?}, D {d:?})"
    )]
    OpaqueBlocks { p: Box<KvSpec>, d: Box<KvSpec> },
    /// The peer answered our hello under another engine's name.
    #[error("{engine:?} answered as {answered:?}")]
    AnsweredAs { engine: String, answered: String },
    /// The peer refused us, saying why.
    #[error("{0}")]
    RefusedByPeer(String),
    #[error("unexpected handshake reply {0}")]
    UnexpectedReply(&'static str),
    /// The hello names another engine than the one the connection proved with the cluster key.
    #[error("the hello names {0:?}, not the engine id the connection proved")]
    NotTheProvenEngine(String),
}

impl HandshakeRefusal {
    /// One word for logs and reports.
    pub fn kind(&self) -> &'static str {
        match self {
            HandshakeRefusal::Fingerprint(_) => "fingerprint",
            HandshakeRefusal::CannotDescribe { .. } => "version_memory",
            HandshakeRefusal::OwnEngineId(_) => "own_engine_id",
            HandshakeRefusal::Undecodable { .. } => "undecodable",
            HandshakeRefusal::RankCount { .. } => "rank_count",
            HandshakeRefusal::RankLayout { .. } | HandshakeRefusal::RankNamesAnother { .. } => {
                "rank_layout"
            }
            HandshakeRefusal::AgentNames(_) | HandshakeRefusal::AgentTaken(_) => "agent_names",
            HandshakeRefusal::UnknownPeer => "unknown_peer",
            HandshakeRefusal::Incompatible(_)
            | HandshakeRefusal::OpaqueBlocks { .. }
            | HandshakeRefusal::Groups(_) => "incompatible_layout",
            HandshakeRefusal::BadGroups(_) => "rank_layout",
            HandshakeRefusal::AnsweredAs { .. } | HandshakeRefusal::NotTheProvenEngine(_) => {
                "impostor"
            }
            HandshakeRefusal::RefusedByPeer(_) => "refused_by_peer",
            HandshakeRefusal::UnexpectedReply(_) => "unexpected_reply",
        }
    }
}
