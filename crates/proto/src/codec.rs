//! Binary encoding: `[PROTOCOL_VERSION][postcard(Message)]`, at most [`MAX_MESSAGE_BYTES`].

use crate::batch::MAX_BATCH_ENTRIES;
use crate::message::*;

/// Bumped on any incompatible change of [`Message`].
/// 2: `BlocksQuery` / `PullBlocks` (D reads the blocks P names).
/// 6: `BlockList::layers` (layer-wise pull).
pub const PROTOCOL_VERSION: u8 = 8;
/// Hard cap on one encoded message. Heartbeats and grant batches are split to stay under it
/// ([`crate::split_heartbeat`]), so a peer can size its receive buffer once.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

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
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error("message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge { size: usize },
    #[error("protocol version {got} is not supported (this build speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion { got: u8 },
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

pub fn encode(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    validate(msg).map_err(EncodeError::OverLimit)?;
    let out = postcard::to_extend(msg, vec![PROTOCOL_VERSION])
        .map_err(|e| EncodeError::Serialize(e.to_string()))?;
    if out.len() > MAX_MESSAGE_BYTES {
        return Err(EncodeError::TooLarge { size: out.len() });
    }
    Ok(out)
}

/// Decodes one message. Never panics, whatever the bytes; the input is capped at
/// [`MAX_MESSAGE_BYTES`], so what a decode may allocate is bounded too (serde may reserve up to
/// 1 MiB for a list whose declared length the input cannot back, before failing).
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    let (&version, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge { size: bytes.len() });
    }
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion { got: version });
    }
    let (msg, rest) = postcard::take_from_bytes::<Message>(body)
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            trailing: rest.len(),
        });
    }
    validate(&msg)?;
    Ok(msg)
}

fn check(field: &'static str, len: usize, max: usize) -> Result<(), DecodeError> {
    if len > max {
        Err(DecodeError::FieldTooLong { field, len, max })
    } else {
        Ok(())
    }
}

fn validate_hello(h: &Hello) -> Result<(), DecodeError> {
    check("engine_id", h.engine_id.len(), MAX_TEXT_BYTES)?;
    check("model", h.fingerprint.model.len(), MAX_TEXT_BYTES)?;
    check("dtype", h.fingerprint.dtype.len(), MAX_TEXT_BYTES)?;
    check("layout", h.layout.len(), MAX_BLOB_BYTES)?;
    check("agent_metadata", h.agent_metadata.len(), MAX_BLOB_BYTES)?;
    check("memory", h.memory.len(), MAX_HELLO_RANKS)
}

/// Limits that the size cap alone does not give: what a receiver may keep in memory per message.
fn validate(msg: &Message) -> Result<(), DecodeError> {
    match msg {
        Message::Hello(h) => validate_hello(h),
        Message::HelloReply(HelloReply::Accepted(h)) => validate_hello(h),
        Message::HelloReply(HelloReply::Refused { reason }) => {
            check("reason", reason.len(), MAX_TEXT_BYTES * 4)
        }
        Message::Heartbeat(hb) => check("entries", hb.entries.len(), MAX_BATCH_ENTRIES),
        Message::GrantBatch(g) => check("grants", g.grants.len() + g.gone.len(), MAX_BATCH_ENTRIES),
        Message::PushRegister(r) => check("block_ids", r.block_ids.len(), MAX_REGISTERED_BLOCKS),
        Message::BlocksQuery(q) => check("entries", q.entries.len(), MAX_BATCH_ENTRIES),
        Message::PullBlocks(b) => {
            check("lists", b.lists.len(), MAX_LISTS_PER_MESSAGE)?;
            let blocks = b.lists.iter().map(|l| l.blocks.len()).sum();
            check("blocks", blocks, MAX_REGISTERED_BLOCKS)
        }
        Message::PushFailed(f) => check("reason", f.reason.len(), MAX_TEXT_BYTES),
        Message::PullDone(_)
        | Message::Release(_)
        | Message::PushDone(_)
        | Message::PushCancel(_)
        | Message::PushCancelAck(_) => Ok(()),
    }
}
