//! The protocol versions this build speaks: its own ([`PROTOCOL_VERSION`]) and the one before
//! ([`OLDEST_PROTOCOL_VERSION`]), so that a fleet upgrades one engine at a time and a new
//! engine still moves KV with an old one instead of refusing it (every request would be
//! prefilled twice until the whole fleet is upgraded).
//!
//! A connection speaks one version, the newest both ends know. The dialer says hello in its
//! newest; an engine that does not know that version closes the connection without a reply
//! (the decoder refuses the version byte), and the dialer says hello once more, in the older
//! one. The acceptor answers in the version of the hello it got, and both ends encode every
//! later message of that peer, on the side channel and in the transport's notifications, in
//! it. The fingerprint of a hello carries the version it is said in.
//!
//! What changed, version by version (a message not named here is encoded alike in both):
//! - 8: `Hello::memory`, where each rank's KV lives. A version-7 hello decodes as host memory
//!   on every rank; a hello that names device memory cannot be said in version 7 (an error: the
//!   old peer would take device addresses for host ones).

use crate::xfer::MemoryKind;

/// The version this build says hello in.
pub const PROTOCOL_VERSION: u8 = 8;
/// The oldest version this build still speaks (the previous release's).
pub const OLDEST_PROTOCOL_VERSION: u8 = 7;

/// The first version whose hello says where each rank's KV lives.
pub const DEVICE_MEMORY_SINCE: u8 = 8;

/// Whether this build speaks `version`.
pub fn speaks(version: u8) -> bool {
    (OLDEST_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version)
}

/// Whether a hello of `version` can describe KV in `memory` (before
/// [`DEVICE_MEMORY_SINCE`], every KV cache is host memory).
pub fn describes(version: u8, memory: MemoryKind) -> bool {
    memory == MemoryKind::Host || version >= DEVICE_MEMORY_SINCE
}
