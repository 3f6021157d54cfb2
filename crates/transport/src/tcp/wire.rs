//! Wire format of the tcp backend: metadata, connection handshake and frames.
//!
//! Integers are little-endian. A descriptor on the wire is `region u32, offset u64, len u64`
//! (20 bytes) and always names the *target's* memory.
//!
//! Metadata: `"HOTCPM" version:u8` then postcard of [`Meta`]; at most [`MAX_METADATA_BYTES`].
//!
//! Handshake (initiator opens the connection):
//! - hello `"HOTH" version:u8 from_len:u16 from to_len:u16 to`
//! - ack   `"HOTA" version:u8 status:u8 len:u16 text` (status 0: text is the target's name;
//!   otherwise text says why it refused, and the target closes)
//!
//! Frames, `type:u8` then a fixed header:
//!
//! | type | dir | body |
//! | --- | --- | --- |
//! | 1 PING | both | – (sent by a writer idle for `keepalive`) |
//! | 2 READ_REQ | I→T | `xfer:u64 n:u32` n descriptors |
//! | 3 WRITE_REQ | I→T | `xfer:u64 n:u32 nlen:u32` n descriptors, nlen notification bytes (`u32::MAX`: none), then the bytes of every descriptor in order |
//! | 4 NOTIFY | I→T | `len:u32` bytes |
//! | 5 GOODBYE | I→T | – (the initiator forgot the target: not a death) |
//! | 6 READ_DATA | T→I | `xfer:u64 total:u64` then the bytes of every descriptor in order |
//! | 7 READ_ERR | T→I | `xfer:u64 len:u32` message |
//! | 8 WRITE_DONE | T→I | `xfer:u64` |
//! | 9 WRITE_ERR | T→I | `xfer:u64 len:u32` message (the bytes were drained, not landed) |
//!
//! A frame that breaks a limit closes the connection.

use serde::{Deserialize, Serialize};

use crate::{RegionId, TransportError};

pub(super) const META_MAGIC: [u8; 6] = *b"HOTCPM";
pub(super) const HELLO_MAGIC: [u8; 4] = *b"HOTH";
pub(super) const ACK_MAGIC: [u8; 4] = *b"HOTA";
pub(super) const VERSION: u8 = 1;

pub(super) const MAX_METADATA_BYTES: usize = 1 << 20;
pub(super) const MAX_NAME_BYTES: usize = 255;
pub(super) const MAX_REGIONS: usize = 1 << 16;
/// Most descriptors in one transfer (20 MiB of request header).
pub(super) const MAX_DESCS: usize = 1 << 20;
pub(super) const MAX_ERROR_BYTES: usize = 4096;
pub(super) const DESC_BYTES: usize = 20;
pub(super) const NO_NOTIFICATION: u32 = u32::MAX;

pub(super) const PING: u8 = 1;
pub(super) const READ_REQ: u8 = 2;
pub(super) const WRITE_REQ: u8 = 3;
pub(super) const NOTIFY: u8 = 4;
pub(super) const GOODBYE: u8 = 5;
pub(super) const READ_DATA: u8 = 6;
pub(super) const READ_ERR: u8 = 7;
pub(super) const WRITE_DONE: u8 = 8;
pub(super) const WRITE_ERR: u8 = 9;

/// What `local_metadata` publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Meta {
    pub name: String,
    pub host: String,
    pub port: u16,
    /// (id, length in bytes), sorted by id.
    pub regions: Vec<(RegionId, u64)>,
}

pub(super) fn encode_meta(m: &Meta) -> Result<Vec<u8>, TransportError> {
    let body = postcard::to_stdvec(m)
        .map_err(|e| TransportError::Io(format!("encoding metadata: {e}")))?;
    let mut out = Vec::with_capacity(META_MAGIC.len() + 1 + body.len());
    out.extend_from_slice(&META_MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&body);
    if out.len() > MAX_METADATA_BYTES {
        return Err(TransportError::Io(format!(
            "metadata of {} bytes exceeds {MAX_METADATA_BYTES}",
            out.len()
        )));
    }
    Ok(out)
}

pub(super) fn decode_meta(b: &[u8]) -> Result<Meta, TransportError> {
    let bad = |m: String| Err(TransportError::BadMetadata(m));
    if b.len() > MAX_METADATA_BYTES {
        return bad(format!("{} bytes exceed {MAX_METADATA_BYTES}", b.len()));
    }
    let head = META_MAGIC.len();
    if b.len() <= head || b[..head] != META_MAGIC {
        return bad("not tcp metadata (bad magic)".into());
    }
    if b[head] != VERSION {
        return bad(format!(
            "tcp metadata version {} (this build speaks {VERSION})",
            b[head]
        ));
    }
    let (m, rest): (Meta, &[u8]) = match postcard::take_from_bytes(&b[head + 1..]) {
        Ok(v) => v,
        Err(e) => return bad(format!("undecodable tcp metadata: {e}")),
    };
    if !rest.is_empty() {
        return bad(format!("{} trailing bytes", rest.len()));
    }
    if m.name.is_empty() || m.name.len() > MAX_NAME_BYTES {
        return bad(format!("agent name of {} bytes", m.name.len()));
    }
    if m.host.is_empty() || m.host.len() > MAX_NAME_BYTES {
        return bad(format!("host of {} bytes", m.host.len()));
    }
    if m.port == 0 {
        return bad("port 0".into());
    }
    if m.regions.len() > MAX_REGIONS {
        return bad(format!("{} regions exceed {MAX_REGIONS}", m.regions.len()));
    }
    let mut ids: Vec<RegionId> = m.regions.iter().map(|r| r.0).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return bad("a region id appears twice".into());
    }
    Ok(m)
}

/// A descriptor as the target sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WireDesc {
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

fn put_descs(out: &mut Vec<u8>, descs: &[WireDesc]) {
    for d in descs {
        out.extend_from_slice(&d.region.to_le_bytes());
        out.extend_from_slice(&d.offset.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
    }
}

pub(super) fn parse_descs(b: &[u8]) -> Vec<WireDesc> {
    b.chunks_exact(DESC_BYTES)
        .map(|c| WireDesc {
            region: u32::from_le_bytes(c[0..4].try_into().expect("4 bytes")),
            offset: u64::from_le_bytes(c[4..12].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(c[12..20].try_into().expect("8 bytes")),
        })
        .collect()
}

pub(super) fn read_req(xfer: u64, descs: &[WireDesc]) -> Vec<u8> {
    let mut out = Vec::with_capacity(13 + descs.len() * DESC_BYTES);
    out.push(READ_REQ);
    out.extend_from_slice(&xfer.to_le_bytes());
    out.extend_from_slice(&(descs.len() as u32).to_le_bytes());
    put_descs(&mut out, descs);
    out
}

pub(super) fn write_req(xfer: u64, descs: &[WireDesc], notification: Option<&[u8]>) -> Vec<u8> {
    let nlen = notification.map_or(0, <[u8]>::len);
    let mut out = Vec::with_capacity(17 + descs.len() * DESC_BYTES + nlen);
    out.push(WRITE_REQ);
    out.extend_from_slice(&xfer.to_le_bytes());
    out.extend_from_slice(&(descs.len() as u32).to_le_bytes());
    let code = notification.map_or(NO_NOTIFICATION, |n| n.len() as u32);
    out.extend_from_slice(&code.to_le_bytes());
    put_descs(&mut out, descs);
    if let Some(n) = notification {
        out.extend_from_slice(n);
    }
    out
}

pub(super) fn notify(msg: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + msg.len());
    out.push(NOTIFY);
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
    out
}

pub(super) fn read_data(xfer: u64, total: u64) -> [u8; 17] {
    let mut out = [0u8; 17];
    out[0] = READ_DATA;
    out[1..9].copy_from_slice(&xfer.to_le_bytes());
    out[9..17].copy_from_slice(&total.to_le_bytes());
    out
}

pub(super) fn write_done(xfer: u64) -> [u8; 9] {
    let mut out = [0u8; 9];
    out[0] = WRITE_DONE;
    out[1..9].copy_from_slice(&xfer.to_le_bytes());
    out
}

/// The longest prefix of `s` of at most `max` bytes that ends on a char boundary.
fn truncated(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// READ_ERR or WRITE_ERR.
pub(super) fn xfer_err(kind: u8, xfer: u64, msg: &str) -> Vec<u8> {
    let msg = truncated(msg, MAX_ERROR_BYTES);
    let mut out = Vec::with_capacity(13 + msg.len());
    out.push(kind);
    out.extend_from_slice(&xfer.to_le_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg.as_bytes());
    out
}

pub(super) fn hello(from: &str, to: &str) -> Vec<u8> {
    let (from, to) = (
        truncated(from, MAX_NAME_BYTES),
        truncated(to, MAX_NAME_BYTES),
    );
    let mut out = Vec::with_capacity(9 + from.len() + to.len());
    out.extend_from_slice(&HELLO_MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&(from.len() as u16).to_le_bytes());
    out.extend_from_slice(from.as_bytes());
    out.extend_from_slice(&(to.len() as u16).to_le_bytes());
    out.extend_from_slice(to.as_bytes());
    out
}

pub(super) fn ack(ok: bool, text: &str) -> Vec<u8> {
    let text = truncated(text, MAX_ERROR_BYTES);
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&ACK_MAGIC);
    out.push(VERSION);
    out.push(if ok { 0 } else { 1 });
    out.extend_from_slice(&(text.len() as u16).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips() {
        let m = Meta {
            name: "p0".into(),
            host: "127.0.0.1".into(),
            port: 4242,
            regions: vec![(0, 10), (7, 1 << 40)],
        };
        assert_eq!(decode_meta(&encode_meta(&m).unwrap()).unwrap(), m);
    }

    #[test]
    fn descriptors_round_trip() {
        let d = vec![
            WireDesc {
                region: 3,
                offset: 1 << 33,
                len: 17,
            },
            WireDesc {
                region: u32::MAX,
                offset: 0,
                len: u64::MAX,
            },
        ];
        let req = read_req(9, &d);
        assert_eq!(parse_descs(&req[13..]), d);
    }

    #[test]
    fn error_messages_are_cut_on_char_boundaries() {
        let s = "é".repeat(MAX_ERROR_BYTES);
        let f = xfer_err(READ_ERR, 1, &s);
        let len = u32::from_le_bytes(f[9..13].try_into().unwrap()) as usize;
        assert!(len <= MAX_ERROR_BYTES);
        assert!(std::str::from_utf8(&f[13..]).is_ok());
    }
}
