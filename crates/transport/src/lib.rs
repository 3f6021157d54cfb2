//! The transport layer of handoff: one trait shaped after a NIXL agent, and its backends.
//! In the book (`docs/` in the repository): `docs/src/guides/nixl.md`.
//!
//! - [`tcp`]: pure Rust, the embedded default; across processes and hosts.
//! - [`nixl`]: NIXL's C API (`libnixl_capi.so` from the `nixl-cu12` wheel), loaded at run time so
//!   handoff builds and runs where NIXL is absent. With `backing` (the memory under a region:
//!   handoff's own or an engine's KV tensors, [`KvRegion::from_foreign`]) and [`device`]'s CUDA
//!   driver calls, the only places with `unsafe` in handoff.
//! - [`mem`]: in-process and deterministic, for connector tests.
//! - [`faulty`]: wraps any backend and, from a seed, drops, duplicates, delays or reorders
//!   notifications, fails transfers and kills peers, so an end-to-end test can replay a fault.
//!
//! The trait is synchronous and non-blocking apart from [`Transport::post`], which may copy on
//! the caller's thread (NIXL's CMA path does): async callers post from a blocking thread.

// `unsafe` is refused everywhere in handoff but the NIXL binding and foreign memory, which allow
// it for themselves.
#![deny(unsafe_code)]

pub mod auth;
mod backing;
/// The conformance suite's shared pieces (feature `testing`; not API).
#[cfg(any(test, feature = "testing"))]
pub mod conformance;
pub mod device;
pub mod faulty;
pub mod grants;
pub mod mem;
pub mod nixl;
mod region;
pub mod tcp;

use std::sync::Arc;

pub use grants::{Extent, GrantTable};
pub use handoff_proto::xfer::GrantId;
pub use region::{KvRegion, OwnedReadGuard, OwnedWriteGuard};

pub use handoff_proto::xfer::{RegionId, XferDesc, XferOp};

/// A posted transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct XferId(pub u64);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferStatus {
    InProgress,
    /// Every byte landed; the notification (if any) is or will be delivered to the peer after
    /// that.
    Done,
    Failed(String),
}

/// A notification received from a peer agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub from: String,
    pub msg: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("backend {backend} is not available: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("invalid metadata: {0}")]
    BadMetadata(String),
    #[error("unknown peer {0:?}")]
    UnknownPeer(String),
    #[error("peer {0:?} is dead")]
    PeerDead(String),
    #[error("region {region} is not registered")]
    UnknownRegion { region: RegionId },
    #[error("descriptor out of bounds: region {region}, offset {offset}, len {len}, region length {region_len}")]
    OutOfBounds {
        region: RegionId,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("region {0} is already registered")]
    AlreadyRegistered(RegionId),
    #[error("unknown transfer {0:?}")]
    UnknownXfer(XferId),
    #[error("notification of {len} bytes exceeds the {max}-byte limit")]
    NotificationTooLarge { len: usize, max: usize },
    #[error("{peer:?} holds no grant to {op:?} {len} bytes at offset {offset} of region {region}")]
    NotGranted {
        peer: String,
        op: XferOp,
        region: RegionId,
        offset: u64,
        len: u64,
    },
    #[error("{count} descriptors in one transfer exceed this agent's limit of {max}")]
    TooManyDescriptors { count: usize, max: usize },
    #[error("transport failure: {0}")]
    Io(String),
    #[error("this region is {memory}: the host takes no slice of it")]
    NotHostMemory { memory: device::MemoryKind },
    #[error(transparent)]
    Device(#[from] device::DeviceError),
}

/// Largest notification a backend must carry (a handoff wire message fits).
pub const MAX_NOTIFICATION_BYTES: usize = 64 * 1024;

/// An agent: registers memory, exchanges metadata, posts READ/WRITE of descriptor lists with an
/// optional notification, reports progress, carries notifications and reports dead peers.
pub trait Transport: Send + Sync {
    /// This agent's name, unique in a cluster; peers address it by this name.
    fn name(&self) -> &str;

    /// `"tcp"`, `"nixl"`, `"mem"`, ...
    fn backend(&self) -> &'static str;

    /// Registers `region` under `id`. The transport keeps the `Arc` until deregistration, so the
    /// memory outlives every transfer that may touch it. Register everything before publishing
    /// metadata.
    fn register(&self, id: RegionId, region: Arc<KvRegion>) -> Result<(), TransportError>;

    /// Removes a registration; transfers already posted keep their own reference.
    fn deregister(&self, id: RegionId) -> Result<(), TransportError>;

    /// What a peer needs to reach this agent and its regions (opaque, bounded).
    fn local_metadata(&self) -> Result<Vec<u8>, TransportError>;

    /// Loads a peer's metadata; returns the peer's name. Bad bytes are an error, never a panic.
    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError>;

    /// Forgets a peer (and closes what connects to it).
    fn forget_remote(&self, peer: &str);

    /// Posts a transfer. Descriptors are checked against the local regions here and against the
    /// remote ones by the peer, which refuses what it did not register. `notification`, if any,
    /// reaches the peer strictly after every byte of the transfer landed.
    fn post(
        &self,
        op: XferOp,
        peer: &str,
        descs: &[XferDesc],
        notification: Option<&[u8]>,
    ) -> Result<XferId, TransportError>;

    /// Progress of a posted transfer.
    fn status(&self, id: XferId) -> Result<XferStatus, TransportError>;

    /// Forgets a transfer; one still in progress is aborted first (best effort: the backend may
    /// keep running it, see [`Transport::still_running`]).
    fn release(&self, id: XferId) -> Result<(), TransportError>;

    /// Whether a transfer released while in progress may still move bytes: the backend could
    /// not stop it yet (NIXL keeps such a request until it can release it). A worker reports an
    /// aborted job ended only once none of its transfers is, so no block goes back to a pool
    /// under a transfer still landing (rules 2 and 3). Backends that stop a transfer at once
    /// say `false`.
    fn still_running(&self, _id: XferId) -> bool {
        false
    }

    /// Sends a notification with no transfer.
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError>;

    /// Takes every notification received since the last call, in arrival order.
    fn drain_notifications(&self) -> Vec<Notification>;

    /// Takes the names of peers found dead since the last call (lost connection, keepalive
    /// timeout, disconnect reported by the backend).
    fn drain_dead_peers(&self) -> Vec<String>;

    /// Inbound connections refused at their handshake so far (no or wrong proof of the cluster
    /// key, a name the caller did not prove). Backends that authenticate nothing say 0.
    fn refused_connections(&self) -> u64 {
        0
    }

    /// Lets the agents `peers` do `op` (seen from them: `Read` = they read these bytes) on
    /// `extents` of local regions until [`Transport::revoke`] (see [`grants`]). Granting an id
    /// again replaces it. A backend that does not check grants accepts and ignores them.
    fn grant(
        &self,
        _grant: GrantId,
        _op: XferOp,
        _peers: &[String],
        _extents: &[Extent],
    ) -> Result<(), TransportError> {
        Ok(())
    }

    /// Ends a grant (no-op for an unknown one).
    fn revoke(&self, _grant: GrantId) {}

    /// Whether inbound READs and WRITEs are refused outside a live grant to their peer.
    fn checks_grants(&self) -> bool {
        false
    }

    /// Inbound transfers refused so far because no grant covered them.
    fn refused_transfers(&self) -> u64 {
        0
    }
}

/// Checks a descriptor against a region length without overflow.
pub(crate) fn check_bounds(
    region: RegionId,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<(), TransportError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransportError::OutOfBounds {
            region,
            offset,
            len,
            region_len,
        }),
    }
}

/// Where a backend listens and the host its peers dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// tcp: the data listener (port 0: any free port).
    pub bind: std::net::SocketAddr,
    /// tcp: the host written into the metadata peers load.
    pub advertise_host: String,
    /// tcp: the cluster key every connection must prove (see [`auth`]).
    pub key: Option<auth::ClusterKey>,
    /// tcp: serve only what [`Transport::grant`] opened to the peer (an engine's connector
    /// grants each handoff's blocks to its reader or writer); off for a bare transport.
    pub check_grants: bool,
}

/// Opens a backend by name with its default settings, listening on loopback (`mem` needs a
/// fabric: use [`mem::MemTransport::new`]).
pub fn open_backend(kind: &str, name: &str) -> Result<Arc<dyn Transport>, TransportError> {
    let tcp = tcp::TcpConfig::from_env();
    let at = Endpoint {
        advertise_host: tcp.bind.ip().to_string(),
        bind: tcp.bind,
        key: None,
        check_grants: false,
    };
    open_backend_at(kind, name, &at)
}

/// Opens a backend by name, listening at `at` (tcp). NIXL's UCX chooses its own interfaces and
/// transports (`UCX_NET_DEVICES`, `UCX_TLS`): see the book, `docs/src/guides/nixl.md`.
pub fn open_backend_at(
    kind: &str,
    name: &str,
    at: &Endpoint,
) -> Result<Arc<dyn Transport>, TransportError> {
    match kind {
        "tcp" => {
            let cfg = tcp::TcpConfig {
                bind: at.bind,
                advertise_host: Some(at.advertise_host.clone()),
                key: at.key.clone(),
                check_grants: at.check_grants,
                ..tcp::TcpConfig::from_env()
            };
            let t = tcp::TcpTransport::new(name, cfg)?;
            Ok(t as Arc<dyn Transport>)
        }
        "nixl" => {
            let t = nixl::NixlTransport::open(name, nixl::NixlConfig::from_env())?;
            Ok(t as Arc<dyn Transport>)
        }
        other => Err(TransportError::Unavailable {
            backend: "unknown",
            reason: format!("no backend named {other:?} (expected tcp or nixl)"),
        }),
    }
}
