//! Version 7's encoding, for a peer of the previous release (see [`crate::versions`]): only the
//! handshake differs from this version's (a hello without `memory`); every other message is
//! encoded alike.

use serde::{Deserialize, Serialize};

use crate::error::{DecodeError, EncodeError};
use crate::message::{Fingerprint, Hello, HelloReply, Message, MAX_HELLO_RANKS};
use crate::versions;
use crate::xfer::MemoryKind;

/// [`Hello`] as version 7 encodes it: no `memory`.
#[derive(Serialize, Deserialize)]
struct HelloV7 {
    engine_id: String,
    rank: u16,
    tp: u16,
    fingerprint: Fingerprint,
    layout: Vec<u8>,
    agent_metadata: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
enum HelloReplyV7 {
    Accepted(HelloV7),
    Refused { reason: String },
}

/// The two first variants of [`Message`] as version 7 encodes them. Same variant order, so the
/// same variant index on the wire: every other message needs no copy.
#[derive(Serialize, Deserialize)]
enum HandshakeV7 {
    Hello(HelloV7),
    HelloReply(HelloReplyV7),
}

fn hello_to_v7(h: &Hello) -> Result<HelloV7, EncodeError> {
    if let Some(m) = h.memory.iter().find(|m| !versions::describes(7, **m)) {
        return Err(EncodeError::NotInVersion {
            version: 7,
            what: format!("a hello naming {m} (version 7 knows host memory only)"),
        });
    }
    Ok(HelloV7 {
        engine_id: h.engine_id.clone(),
        rank: h.rank,
        tp: h.tp,
        fingerprint: h.fingerprint.clone(),
        layout: h.layout.clone(),
        agent_metadata: h.agent_metadata.clone(),
    })
}

fn hello_from_v7(h: HelloV7) -> Result<Hello, DecodeError> {
    if h.tp as usize > MAX_HELLO_RANKS {
        return Err(DecodeError::FieldTooLong {
            field: "tp",
            len: h.tp as usize,
            max: MAX_HELLO_RANKS,
        });
    }
    Ok(Hello {
        memory: vec![MemoryKind::Host; h.tp as usize],
        engine_id: h.engine_id,
        rank: h.rank,
        tp: h.tp,
        fingerprint: h.fingerprint,
        layout: h.layout,
        agent_metadata: h.agent_metadata,
    })
}

/// `msg` in version 7, appended to `out` (after the version byte).
pub(crate) fn encode(msg: &Message, out: Vec<u8>) -> Result<Vec<u8>, EncodeError> {
    let serialize = |e: postcard::Error| EncodeError::Serialize(e.to_string());
    match msg {
        Message::Hello(h) => {
            postcard::to_extend(&HandshakeV7::Hello(hello_to_v7(h)?), out).map_err(serialize)
        }
        Message::HelloReply(HelloReply::Accepted(h)) => postcard::to_extend(
            &HandshakeV7::HelloReply(HelloReplyV7::Accepted(hello_to_v7(h)?)),
            out,
        )
        .map_err(serialize),
        Message::HelloReply(HelloReply::Refused { reason }) => postcard::to_extend(
            &HandshakeV7::HelloReply(HelloReplyV7::Refused {
                reason: reason.clone(),
            }),
            out,
        )
        .map_err(serialize),
        other => postcard::to_extend(other, out).map_err(serialize),
    }
}

/// One version-7 message from `body`; returns it and what is left.
pub(crate) fn decode(body: &[u8]) -> Result<(Message, &[u8]), DecodeError> {
    let malformed = |e: postcard::Error| DecodeError::Malformed(e.to_string());
    // Postcard writes the variant index first, as a u32 varint: 0 and 1 are a hello and its
    // reply. The index is read as the varint it is, not as its first byte: postcard also takes
    // an over-long varint (0x80 0x00 is 0), and a hello under that spelling must still be read
    // as version 7's (read as this version's, it would bring a `memory` that version 7 cannot
    // say back).
    let (variant, _) = postcard::take_from_bytes::<u32>(body).map_err(malformed)?;
    if variant > 1 {
        return postcard::take_from_bytes::<Message>(body).map_err(malformed);
    }
    let (msg, rest) = postcard::take_from_bytes::<HandshakeV7>(body).map_err(malformed)?;
    let msg = match msg {
        HandshakeV7::Hello(h) => Message::Hello(hello_from_v7(h)?),
        HandshakeV7::HelloReply(HelloReplyV7::Accepted(h)) => {
            Message::HelloReply(HelloReply::Accepted(hello_from_v7(h)?))
        }
        HandshakeV7::HelloReply(HelloReplyV7::Refused { reason }) => {
            Message::HelloReply(HelloReply::Refused { reason })
        }
    };
    Ok((msg, rest))
}
