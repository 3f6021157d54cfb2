//! Wire protocol of handoff: every message P and D exchange, their binary encoding, and the
//! vLLM-compatible `kv_transfer_params` JSON.
//! In the book (`docs/` in the repository): `docs/src/design/wire-and-trust.md`.
//!
//! Design choices (the book: `docs/src/design/wire-and-trust.md`):
//! - Every encoded message starts with a version byte ([`PROTOCOL_VERSION`], or an older one a
//!   connection negotiated: [`versions`]) and is at most
//!   [`MAX_MESSAGE_BYTES`] long, and its lists and texts are bounded (checked on both encode and
//!   decode). A decoder never panics: bad bytes from a peer are an error and nothing else.
//! - Only durations cross the wire, never timestamps (`lease_ms`): each side measures its leases on
//!   its own monotonic clock.
//! - Heartbeats and their grant replies carry a sequence number so that the side that asked can
//!   anchor a grant at the moment it *sent* the question; that keeps every grant conservative no
//!   matter how long the reply was delayed, duplicated or reordered.

#![forbid(unsafe_code)]

mod batch;
mod codec;
mod error;
mod ids;
mod message;
mod params;
mod v7;
pub mod versions;
pub mod xfer;

pub use batch::{split_block_lists, split_grants, split_heartbeat, MAX_BATCH_ENTRIES};
pub use codec::{decode, decode_up_to, encode, encode_as};
pub use error::{DecodeError, EncodeError};
pub use ids::{Epoch, HandoffId, ParseHandoffIdError};
pub use message::*;
pub use params::{Flow, KvTransferParams, ParamsError, TransferMode};
pub use versions::{OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION};
pub use xfer::MemoryKind;
