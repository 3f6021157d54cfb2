//! The connector: drives the ledgers, the planner and the transports for one engine.
//! In the book (`docs/` in the repository): `docs/src/design/connector.md`.
//!
//! It plugs into an engine at the points of vLLM's `KVConnectorBase_V1` (the book:
//! `docs/src/design/vllm-hooks.md`) and is split the way vLLM's processes are:
//!
//! - [`ConnectorCore`] (crate `handoff-core`, re-exported here): the scheduler side's logic,
//!   sans-IO. Both ledgers, the peer table, the transfers in flight and the push write gate;
//!   `handle(Input, now)` in, one [`Ready`] batch out.
//! - [`WorkerSide`] (module `worker`): one per rank, owns the rank's registered KV memory and
//!   transport agent, posts and polls what the scheduler side's [`WorkerStep`]s say and answers
//!   with [`WorkerReport`]s. The two sides share nothing but those serialisable values
//!   (module `worker_protocol`), so workers may run in other processes (module `remote`).
//! - [`Connector`] (module `executor`): the thin I/O shell of the scheduler side, and the handle
//!   the engine's scheduler calls: one thread owns the core, reads the clock for it, and carries
//!   out its batches (side-channel sends through bounded per-connection queues, connects, worker
//!   steps, events).

#![forbid(unsafe_code)]

pub mod digest;
mod executor;
pub mod forward_gate;
mod metrics;
pub mod recorder;
pub mod remote;
pub mod side_channel;
pub mod worker;

use std::net::SocketAddr;

use handoff_ledger::{ConsumerConfig, ProducerConfig};
use handoff_proto::TransferMode;

pub use executor::{Connector, ReportSink, WorkerLink};
pub use forward_gate::Fence;
pub use handoff_core::{
    worker_protocol, Answer, Arrival, ConnId, Connect, ConnectorCore, ConnectorEvent, CoreConfig,
    CoreError, CoreMemory, Hooks, Input, LayerReports, LedgerCounters, Observation, PrefillEnd,
    PrefillOutcome, Ready, Role,
};
pub use handoff_transport::auth::ClusterKey;
pub use metrics::Metrics;
pub use worker::{RankMemory, WorkerSide};
pub use worker_protocol::{
    JobId, PushLayer, TransferJob, TransferPart, WorkerHello, WorkerOp, WorkerReport, WorkerStep,
};

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
    /// The engine takes part in a layer-wise pull (pull mode): as P it reports each layer as
    /// it is saved (`LayersSaved`, [`LayerReports::Saved`]), as D it admits such a request only
    /// after [`ConnectorEvent::RemoteStarted`]. Said in its info (`layerwise_pull`), which is
    /// what makes the proxy choose one. vLLM: false.
    pub layerwise_pull: bool,
    /// See [`CoreConfig::layer_reports`] (vLLM: `Planned`).
    pub layer_reports: LayerReports,
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
    /// Record every core input to a trace (`handoff replay` reads it; see [`recorder`]).
    pub record: Option<recorder::RecordConfig>,
    /// See [`CoreConfig::protocol_version`]: the newest protocol version spoken on the side
    /// channel and in transfer notifications.
    pub protocol_version: u8,
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

/// Errors of the connector: the core's, and those of the I/O around it.
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("rank {rank}: region {region} is {len} bytes, the layout says {expected:?}")]
    RegionSize {
        rank: u16,
        region: u32,
        len: u64,
        expected: Option<u64>,
    },
    #[error("rank {rank}: region {region} is {memory}, region one of the rank is {first}: a rank's KV lives in one place")]
    MixedMemory {
        rank: u16,
        region: u32,
        memory: handoff_transport::device::MemoryKind,
        first: handoff_transport::device::MemoryKind,
    },
    #[error("invalid KV layout: {0}")]
    Layout(handoff_plan::LayoutError),
    #[error("plan: {0}")]
    Plan(handoff_plan::PlanError),
    #[error("transport: {0}")]
    Transport(#[from] handoff_transport::TransportError),
    #[error(
        "refusing to listen on {0} without a cluster key: anyone who reaches it could read or \
         overwrite KV memory. Give every engine the same key (`handoff keygen`, then \
         cluster_key_file / HANDOFF_CLUSTER_KEY), bind loopback, or pass --insecure"
    )]
    Unauthenticated(std::net::IpAddr),
    #[error("side channel cannot listen on {0}: {1}")]
    Listen(std::net::SocketAddr, std::io::Error),
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error("no randomness for a handoff id: {0}")]
    Random(String),
    #[error("the connector stopped")]
    Stopped,
    #[error("cannot record the trace at {0}: {1}")]
    Record(std::path::PathBuf, std::io::Error),
    #[error("cannot digest layer {layer}: its rows are not addressable in this layout")]
    Digest { layer: u32 },
    #[error("cannot digest a hybrid model's blocks: {0}")]
    DigestGroups(String),
    #[error("KV cache groups: {0}")]
    Groups(handoff_plan::GroupError),
}
