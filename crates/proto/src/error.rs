//! What encoding and decoding a message can fail on.

use crate::message::MAX_MESSAGE_BYTES;
use crate::versions::OLDEST_PROTOCOL_VERSION;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge { size: usize },
    /// A field over the limit every receiver enforces: refused here so that a peer never
    /// silently drops what we sent (split batches with [`crate::split_heartbeat`]).
    #[error("{0}")]
    OverLimit(DecodeError),
    #[error("message cannot be encoded: {0}")]
    Serialize(String),
    /// The connection speaks an older version that cannot say this.
    #[error("protocol version {version} cannot carry {what}")]
    NotInVersion { version: u8, what: String },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error("message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge { size: usize },
    #[error("protocol version {got} is not supported (this build speaks {OLDEST_PROTOCOL_VERSION} to {newest})")]
    UnsupportedVersion { got: u8, newest: u8 },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("{trailing} trailing bytes after the message")]
    TrailingBytes { trailing: usize },
    #[error("{field} too long: {len} > {max}")]
    FieldTooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
}
