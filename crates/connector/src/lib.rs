//! The connector: drives the ledgers, the planner and the transports for one engine.
//! In the book (`docs/` in the repository): `docs/src/design/connector.md`.
//!
//! It plugs into an engine at the points of vLLM's `KVConnectorBase_V1` (the book:
//! `docs/src/design/vllm-hooks.md`) and is split the way vLLM's processes are:
//!
//! - [`ConnectorCore`] (module `core`): the scheduler side's logic, sans-IO. Both ledgers, the
//!   peer table, the transfers in flight and the push write gate; `handle_*(…, now)` in, one
//!   [`Ready`] batch out.
//! - [`WorkerSide`] (module `worker`): one per rank, owns the rank's registered KV memory and
//!   transport agent, posts and polls what the scheduler side's [`WorkerStep`]s say and answers
//!   with [`WorkerReport`]s. The two sides share nothing but those serialisable values
//!   (module `step`), so workers may run in other processes (module `remote`).
//! - [`Connector`] (module `executor`): the thin I/O shell of the scheduler side, and the handle
//!   the engine's scheduler calls: one thread owns the core, reads the clock for it, and carries
//!   out its batches (side-channel sends through bounded per-connection queues, connects, worker
//!   steps, events).

#![forbid(unsafe_code)]

mod core;
pub mod digest;
mod executor;
pub mod forward_gate;
mod metrics;
pub mod remote;
pub mod side_channel;
pub mod step;
pub mod worker;

use std::net::SocketAddr;

use handoff_ledger::{ConsumerConfig, ProducerConfig};
use handoff_proto::TransferMode;

pub use crate::core::{
    ConnId, Connect, ConnectorCore, CoreConfig, CoreMemory, LedgerCounters, Observation, Ready,
};
pub use executor::{Connector, ReportSink, WorkerLink};
pub use handoff_transport::auth::ClusterKey;
pub use metrics::Metrics;
pub use step::{
    JobId, PushLayer, TransferJob, TransferPart, WorkerHello, WorkerOp, WorkerReport, WorkerStep,
};
pub use worker::{RankMemory, WorkerSide};

/// What an engine does in a P/D cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Both ledgers: the engine can serve either side (and runs monolithic requests).
    Both,
}

#[derive(Debug, Clone)]
pub struct ConnectorConfig {
    pub engine_id: String,
    pub role: Role,
    pub mode: TransferMode,
    /// Model name and dtype for the compatibility fingerprint.
    pub model: String,
    pub dtype: String,
    /// Where the side channel listens (port 0: any free port).
    pub side_channel_bind: SocketAddr,
    /// Host that peers should dial (returned in `kv_transfer_params.remote_host`).
    pub advertise_host: String,
    pub producer: ProducerConfig,
    pub consumer: ConsumerConfig,
    /// See [`CoreConfig::opaque_blocks`] (vLLM: true).
    pub opaque_blocks: bool,
    /// See [`CoreConfig::kv_digest`].
    pub kv_digest: bool,
    /// The engine takes part in a layer-wise pull (pull mode): as P it drives
    /// `on_pull_prefill_start` / `on_layer_saved` / `on_pull_prefill_finished`, as D it admits
    /// such a request only after [`ConnectorEvent::RemoteStarted`]. Said in its info
    /// (`layerwise_pull`), which is what makes the proxy choose one. vLLM: false.
    pub layerwise_pull: bool,
    /// See [`CoreConfig::peer_hosts`].
    pub peer_hosts: Vec<String>,
    /// The cluster key every side-channel connection proves in both directions (the
    /// transports take theirs in their own settings). `None`: loopback only, unless
    /// `insecure`.
    pub key: Option<ClusterKey>,
    /// Allows a non-loopback side channel without a key (anyone who reaches the port is a peer).
    pub insecure: bool,
    /// Most side-channel connections open at once (see [`side_channel::SideConfig`]).
    pub max_side_connections: usize,
    /// Most inbound side-channel handshakes open at once from one source address (see
    /// [`side_channel::SideConfig`]).
    pub max_side_handshakes_per_source: usize,
}

/// Default of [`ConnectorConfig::max_side_connections`].
pub const DEFAULT_MAX_SIDE_CONNECTIONS: usize = 512;

/// Default of [`ConnectorConfig::max_side_handshakes_per_source`].
pub const DEFAULT_MAX_SIDE_HANDSHAKES_PER_SOURCE: usize = 32;

/// Refuses to expose an engine without a cluster key: with no key, only a loopback address
/// may be bound (every process on the host is trusted then), unless `insecure` says otherwise.
pub fn check_exposure(
    bind: std::net::IpAddr,
    key: Option<&ClusterKey>,
    insecure: bool,
) -> Result<(), ConnectorError> {
    match (key, bind.is_loopback(), insecure) {
        (Some(_), _, _) | (None, true, _) => Ok(()),
        (None, false, true) => {
            tracing::warn!(%bind, "no cluster key: any process that reaches this address is a peer (--insecure)");
            Ok(())
        }
        (None, false, false) => Err(ConnectorError::Unauthenticated(bind)),
    }
}

/// What the connector tells the engine's scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorEvent {
    /// These blocks are the pool's again (P: handoff ended; D: a transfer that will not be used).
    /// `handoff` names whose they were: block ids alone do not (on P a prefix cache shares a
    /// prompt's first blocks between requests, so two handoffs may hold the same ones).
    BlocksReleased {
        handoff: handoff_proto::HandoffId,
        blocks: Vec<u32>,
        reason: String,
    },
    /// The KV of these requests is in `blocks`, which now belong to the requests.
    Ready {
        requests: Vec<u64>,
        blocks: Vec<u32>,
    },
    /// D: P holds the handoff of these requests, still waiting for admission (in a layer-wise
    /// pull: P's prefill started). An engine admits a layer-wise pull only from then on
    /// (`ConsumerLedger::poll_started` says why); others may ignore it.
    RemoteStarted { requests: Vec<u64> },
    /// Transfer failed: prefill these requests locally.
    Recompute { requests: Vec<u64>, reason: String },
    /// Transfer failed: fail these requests with `reason`.
    Failed { requests: Vec<u64>, reason: String },
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    #[error("invalid kv_transfer_params: {0}")]
    BadParams(&'static str),
    #[error("invalid kv_transfer_params: {0}")]
    Params(#[from] handoff_proto::ParamsError),
    #[error("transfer_mode {} but this engine runs {}", params.as_str(), engine.as_str())]
    ModeMismatch {
        params: TransferMode,
        engine: TransferMode,
    },
    #[error("this engine does not {0}")]
    WrongRole(&'static str),
    #[error("request {0} is not tracked")]
    UnknownRequest(u64),
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
    #[error("{ranks} ranks given for tp {tp}")]
    RankCount { ranks: usize, tp: u32 },
    #[error("rank {rank}: its layout names another rank or another KV spec")]
    RankMismatch { rank: u16 },
    #[error("rank {rank}: region {region} is {len} bytes, the layout says {expected:?}")]
    RegionSize {
        rank: u16,
        region: u32,
        len: u64,
        expected: Option<u64>,
    },
    #[error("invalid KV spec: {0}")]
    Spec(handoff_plan::SpecError),
    #[error("invalid KV layout: {0}")]
    Layout(handoff_plan::LayoutError),
    #[error("plan: {0}")]
    Plan(handoff_plan::PlanError),
    #[error("transport: {0}")]
    Transport(#[from] handoff_transport::TransportError),
    #[error("cannot encode the handshake: {0}")]
    Encode(postcard::Error),
    #[error(
        "refusing to listen on {0} without a cluster key: anyone who reaches it could read or \
         overwrite KV memory. Give every engine the same key (`handoff keygen`, then \
         cluster_key_file / HANDOFF_CLUSTER_KEY), bind loopback, or pass --insecure"
    )]
    Unauthenticated(std::net::IpAddr),
    #[error("side channel cannot listen: {0}")]
    Listen(std::io::Error),
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error("no randomness for a handoff id: {0}")]
    Random(String),
    #[error("the connector stopped")]
    Stopped,
    #[error("cannot digest layer {layer}: its rows are not addressable in this layout")]
    Digest { layer: u32 },
}
