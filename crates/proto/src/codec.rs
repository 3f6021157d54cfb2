//! Binary encoding: `[version][postcard(Message)]`, at most [`MAX_MESSAGE_BYTES`], in any
//! version this build speaks ([`crate::versions`]).

use crate::batch::MAX_BATCH_ENTRIES;
use crate::error::{DecodeError, EncodeError};
use crate::message::*;
use crate::v7;
use crate::versions::{speaks, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION};

/// `msg` in this build's own version.
pub fn encode(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    encode_as(msg, PROTOCOL_VERSION)
}

/// `msg` in `version` (one this build speaks: what the connection to its receiver negotiated).
pub fn encode_as(msg: &Message, version: u8) -> Result<Vec<u8>, EncodeError> {
    validate(msg).map_err(EncodeError::OverLimit)?;
    let out = match version {
        7 => v7::encode(msg, vec![version])?,
        v if speaks(v) => postcard::to_extend(msg, vec![v])
            .map_err(|e| EncodeError::Serialize(e.to_string()))?,
        v => {
            return Err(EncodeError::NotInVersion {
                version: v,
                what: format!(
                    "anything: this build speaks versions {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
                ),
            })
        }
    };
    if out.len() > MAX_MESSAGE_BYTES {
        return Err(EncodeError::TooLarge { size: out.len() });
    }
    Ok(out)
}

/// Decodes one message of any version this build speaks. Never panics, whatever the bytes; the
/// input is capped at [`MAX_MESSAGE_BYTES`], so what a decode may allocate is bounded too
/// (serde may reserve up to 1 MiB for a list whose declared length the input cannot back,
/// before failing).
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    decode_up_to(bytes, PROTOCOL_VERSION).map(|(msg, _)| msg)
}

/// Decodes one message of a version from the oldest this build speaks up to `newest` (an
/// engine pinned to an older version refuses newer ones, as a build of that version would);
/// returns it with its version.
pub fn decode_up_to(bytes: &[u8], newest: u8) -> Result<(Message, u8), DecodeError> {
    let (&version, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge { size: bytes.len() });
    }
    let newest = newest.min(PROTOCOL_VERSION);
    if !(OLDEST_PROTOCOL_VERSION..=newest).contains(&version) {
        return Err(DecodeError::UnsupportedVersion {
            got: version,
            newest,
        });
    }
    let (msg, rest) = if version == 7 {
        v7::decode(body)?
    } else {
        postcard::take_from_bytes::<Message>(body)
            .map_err(|e| DecodeError::Malformed(e.to_string()))?
    };
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            trailing: rest.len(),
        });
    }
    validate(&msg)?;
    Ok((msg, version))
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
