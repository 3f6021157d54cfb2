//! The transfer vocabulary every layer shares: what a descriptor says, which way it copies, and
//! how a grant is named. Plain data, so the sans-IO core can plan transfers and grants without
//! depending on the transports that carry them out (`handoff-transport` re-exports these).

use serde::{Deserialize, Serialize};

/// A region of registered memory, as numbered by the engine (one per layer, or one in all).
pub type RegionId = u32;

/// Direction of a transfer, seen from the side that posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum XferOp {
    /// Copy remote bytes into local memory.
    Read,
    /// Copy local bytes into remote memory.
    Write,
}

/// One contiguous copy between a local and a remote registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct XferDesc {
    pub local_region: RegionId,
    pub local_offset: u64,
    pub remote_region: RegionId,
    pub remote_offset: u64,
    pub len: u64,
}

/// A grant, numbered by whoever grants (the connector).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GrantId(pub u64);

/// Where a region's bytes live. It travels in each rank's hello and in NIXL's metadata, so a
/// peer knows what it reads from or writes into (NIXL registers device memory as VRAM).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Host memory: the CPU reads and writes it in place.
    #[default]
    Host,
    /// Memory of CUDA device `device` (its ordinal on the machine): the host never takes a
    /// slice of it, bytes move by the driver's copies (or by a NIC reaching the device).
    Cuda { device: u32 },
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host memory"),
            MemoryKind::Cuda { device } => write!(f, "memory of CUDA device {device}"),
        }
    }
}
