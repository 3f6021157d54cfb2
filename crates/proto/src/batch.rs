//! Splitting heartbeats and grant replies into messages under [`crate::MAX_MESSAGE_BYTES`].

use crate::message::{
    BlockList, Grant, GrantBatch, Heartbeat, HeartbeatEntry, PullBlocks, MAX_LISTS_PER_MESSAGE,
    MAX_REGISTERED_BLOCKS,
};
use crate::params::TransferMode;

/// Most handoffs named in one heartbeat or grant batch. A grant is at most 16 + 5 + 5 bytes
/// encoded, so 2000 of them (plus the header) stay well under the 64 KiB message cap, and a reply
/// to a full heartbeat always fits in one message.
pub const MAX_BATCH_ENTRIES: usize = 2000;

/// Splits the handoffs to heartbeat for one peer engine into messages of at most
/// [`MAX_BATCH_ENTRIES`] each, all of flow `mode`; `next_seq` gives each message its own
/// sequence number.
pub fn split_heartbeat(
    entries: &[HeartbeatEntry],
    mode: TransferMode,
    mut next_seq: impl FnMut() -> u64,
) -> Vec<Heartbeat> {
    entries
        .chunks(MAX_BATCH_ENTRIES)
        .map(|chunk| Heartbeat {
            seq: next_seq(),
            mode,
            entries: chunk.to_vec(),
        })
        .collect()
}

/// Splits a reply into batches that each fit; all carry the heartbeat's `seq`.
pub fn split_grants(seq: u64, grants: Vec<Grant>, gone: Vec<HeartbeatEntry>) -> Vec<GrantBatch> {
    let mut out = Vec::new();
    let mut grants = grants.into_iter().peekable();
    let mut gone = gone.into_iter().peekable();
    loop {
        let g: Vec<Grant> = grants.by_ref().take(MAX_BATCH_ENTRIES).collect();
        let room = MAX_BATCH_ENTRIES - g.len();
        let x: Vec<HeartbeatEntry> = gone.by_ref().take(room).collect();
        if g.is_empty() && x.is_empty() {
            break;
        }
        out.push(GrantBatch {
            seq,
            grants: g,
            gone: x,
        });
    }
    out
}

/// Splits block lists into [`PullBlocks`] messages that each respect the decoder's limits. A
/// single list longer than [`MAX_REGISTERED_BLOCKS`] cannot be sent and is returned apart.
pub fn split_block_lists(lists: Vec<BlockList>) -> (Vec<PullBlocks>, Vec<BlockList>) {
    let mut out = Vec::new();
    let mut too_long = Vec::new();
    let mut cur = PullBlocks { lists: Vec::new() };
    let mut blocks = 0;
    for l in lists {
        if l.blocks.len() > MAX_REGISTERED_BLOCKS {
            too_long.push(l);
            continue;
        }
        if cur.lists.len() == MAX_LISTS_PER_MESSAGE
            || blocks + l.blocks.len() > MAX_REGISTERED_BLOCKS
        {
            out.push(std::mem::replace(
                &mut cur,
                PullBlocks { lists: Vec::new() },
            ));
            blocks = 0;
        }
        blocks += l.blocks.len();
        cur.lists.push(l);
    }
    if !cur.lists.is_empty() {
        out.push(cur);
    }
    (out, too_long)
}
