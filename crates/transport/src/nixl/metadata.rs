//! The metadata one NIXL transport gives its peers: magic, version, an FNV-1a checksum of the
//! body, then the postcard body: the agent's name, its regions (id → address, length, lock chunk
//! size), NIXL's own agent metadata and, from version 3 on, which regions are device memory
//! (NIXL needs a descriptor list's memory type and device on both sides). Metadata with host
//! memory only is still written as version 2, which the previous release reads: a rolling
//! upgrade of a host-memory fleet keeps pairing. Decoding checks everything a hostile peer
//! could get wrong before NIXL sees a byte. No NIXL call here.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::device::MemoryKind;
use crate::{RegionId, TransportError};

/// Longest agent name, ours or a peer's.
pub(super) const MAX_NAME_BYTES: usize = 256;

const MD_MAGIC: &[u8; 8] = b"HNDFNIXL";
/// Host memory only: what the previous release writes and reads.
const MD_VERSION_HOST: u8 = 2;
/// With the regions that are device memory.
const MD_VERSION: u8 = 3;
/// Magic, version, checksum.
const MD_HEADER: usize = 8 + 1 + 8;
/// Largest metadata accepted (NIXL's own part is about 500 bytes per agent).
pub const MAX_METADATA_BYTES: usize = 1 << 20;
const MAX_REGIONS: usize = 1 << 16;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct MdBody {
    pub(super) name: String,
    /// (region id, base address, length, lock chunk size).
    pub(super) regions: Vec<(RegionId, u64, u64, u64)>,
    pub(super) nixl: Vec<u8>,
    /// The regions that are device memory, with their device; every other one is host memory.
    /// Absent from version 2.
    pub(super) devices: Vec<(RegionId, MemoryKind)>,
}

/// Version 2's body: [`MdBody`]'s fields but `devices`, in order (postcard writes a struct as
/// its fields in order, so this tuple is exactly the struct version 2 had).
type HostBody = (String, Vec<(RegionId, u64, u64, u64)>, Vec<u8>);

#[cfg(test)]
impl MdBody {
    /// Where region `id`'s bytes live.
    pub(super) fn memory_of(&self, id: RegionId) -> MemoryKind {
        self.devices
            .iter()
            .find(|(r, _)| *r == id)
            .map_or(MemoryKind::Host, |(_, m)| *m)
    }
}

pub(super) fn encode_md(body: &MdBody) -> Result<Vec<u8>, TransportError> {
    let io = |e: postcard::Error| TransportError::Io(e.to_string());
    let (version, enc) = if body.devices.is_empty() {
        let host = (&body.name, &body.regions, &body.nixl);
        (MD_VERSION_HOST, postcard::to_allocvec(&host).map_err(io)?)
    } else {
        (MD_VERSION, postcard::to_allocvec(body).map_err(io)?)
    };
    let mut out = Vec::with_capacity(MD_HEADER + enc.len());
    out.extend_from_slice(MD_MAGIC);
    out.push(version);
    out.extend_from_slice(&fnv1a64(&enc).to_le_bytes());
    out.extend_from_slice(&enc);
    Ok(out)
}

/// FNV-1a, 64 bits: catches truncated or corrupted metadata before NIXL parses it (NIXL 1.5
/// can be left unable to reload a peer after failing on a damaged blob of that peer).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub(super) fn decode_md(bytes: &[u8]) -> Result<MdBody, TransportError> {
    let bad = |s: String| TransportError::BadMetadata(s);
    if bytes.len() > MAX_METADATA_BYTES {
        return Err(bad(format!(
            "{} bytes exceeds the {MAX_METADATA_BYTES}-byte limit",
            bytes.len()
        )));
    }
    let Some(rest) = bytes.strip_prefix(MD_MAGIC.as_slice()) else {
        return Err(bad("not nixl metadata (bad magic)".into()));
    };
    let Some((&version, rest)) = rest.split_first() else {
        return Err(bad("truncated".into()));
    };
    if version != MD_VERSION && version != MD_VERSION_HOST {
        return Err(bad(format!(
            "nixl metadata version {version}, expected {MD_VERSION_HOST} or {MD_VERSION}"
        )));
    }
    let Some((sum, rest)) = rest.split_first_chunk::<8>() else {
        return Err(bad("truncated".into()));
    };
    if u64::from_le_bytes(*sum) != fnv1a64(rest) {
        return Err(bad("checksum mismatch (truncated or corrupted)".into()));
    }
    let undecodable = |e: postcard::Error| bad(format!("undecodable: {e}"));
    let (body, trailing): (MdBody, _) = if version == MD_VERSION_HOST {
        let ((name, regions, nixl), trailing): (HostBody, _) =
            postcard::take_from_bytes(rest).map_err(undecodable)?;
        let body = MdBody {
            name,
            regions,
            nixl,
            devices: Vec::new(),
        };
        (body, trailing)
    } else {
        postcard::take_from_bytes(rest).map_err(undecodable)?
    };
    if !trailing.is_empty() {
        return Err(bad(format!("{} trailing bytes", trailing.len())));
    }
    if body.name.is_empty() || body.name.contains('\0') || body.name.len() > MAX_NAME_BYTES {
        return Err(bad(format!("invalid agent name {:?}", body.name)));
    }
    if body.nixl.is_empty() {
        return Err(bad("no NIXL agent metadata".into()));
    }
    if body.regions.len() > MAX_REGIONS {
        return Err(bad(format!("{} regions", body.regions.len())));
    }
    let mut seen = HashSet::new();
    for &(id, addr, len, chunk) in &body.regions {
        if chunk == 0 {
            return Err(bad(format!("region {id} has a chunk size of 0")));
        }
        if !seen.insert(id) {
            return Err(bad(format!("region {id} listed twice")));
        }
        if addr.checked_add(len).is_none() || usize::try_from(addr + len).is_err() {
            return Err(bad(format!(
                "region {id} wraps the address space ({addr:#x} + {len})"
            )));
        }
    }
    let mut on_device = HashSet::new();
    for &(id, memory) in &body.devices {
        if !seen.contains(&id) {
            return Err(bad(format!(
                "device memory named for region {id}, which is not listed"
            )));
        }
        if !on_device.insert(id) {
            return Err(bad(format!("region {id} given a device twice")));
        }
        if memory == MemoryKind::Host {
            return Err(bad(format!(
                "region {id} listed among device regions as host memory"
            )));
        }
    }
    Ok(body)
}
