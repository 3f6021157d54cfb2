//! What the core refuses: bad parameters from a client or a router, a hook its role does not
//! take, a request it does not track, workers whose layouts do not fit.

/// Errors of [`crate::ConnectorCore`]; each leaves the core as it was.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("invalid kv_transfer_params: {0}")]
    BadParams(&'static str),
    #[error("invalid kv_transfer_params: {0}")]
    Params(#[from] handoff_proto::ParamsError),
    #[error("transfer_mode {} but this engine runs {}", params.as_str(), engine.as_str())]
    ModeMismatch {
        params: handoff_proto::TransferMode,
        engine: handoff_proto::TransferMode,
    },
    #[error("this engine does not {0}")]
    WrongRole(&'static str),
    #[error("request {0} is not tracked")]
    UnknownRequest(u64),
    #[error("request {0:?}: its prefill started twice")]
    PrefillStartedTwice(String),
    #[error("request {0:?}: no prefill for a remote decode started")]
    UnknownPrefill(String),
    #[error("remote_host {0:?} is not one of the prefill hosts this engine may dial (peer_hosts)")]
    PeerHostNotAllowed(String),
    #[error(transparent)]
    Create(#[from] handoff_ledger::CreateError),
    #[error(transparent)]
    Arrive(#[from] handoff_ledger::ArriveError),
    #[error(transparent)]
    Alloc(#[from] handoff_ledger::AllocError),
    #[error("no rank given")]
    NoRanks,
    #[error("protocol version {version}: this build speaks {oldest} to {newest}", oldest = handoff_proto::OLDEST_PROTOCOL_VERSION, newest = handoff_proto::PROTOCOL_VERSION)]
    ProtocolVersion { version: u8 },
    #[error("protocol version {version} cannot describe rank {rank}'s KV in {memory}: pin to {since} at least", since = handoff_proto::versions::DEVICE_MEMORY_SINCE)]
    VersionMemory {
        version: u8,
        rank: u16,
        memory: handoff_proto::MemoryKind,
    },
    #[error("{ranks} ranks given for tp {tp}")]
    RankCount { ranks: usize, tp: u32 },
    #[error("rank {rank}: its layout names another rank or another KV spec")]
    RankMismatch { rank: u16 },
    #[error("invalid KV spec: {0}")]
    Spec(handoff_plan::SpecError),
    #[error("invalid KV layout: {0}")]
    Layout(handoff_plan::LayoutError),
    #[error("invalid KV cache groups: {0}")]
    Groups(handoff_plan::GroupError),
    #[error("rank {rank}: its KV cache groups differ from rank 0's")]
    RankGroups { rank: u16 },
    #[error("cannot encode the handshake: {0}")]
    Encode(postcard::Error),
}
