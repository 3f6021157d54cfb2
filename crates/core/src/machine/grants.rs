//! Transport grants: the core opens a handoff's blocks on its own workers' transports to exactly
//! the peer that must reach them, before telling that peer where they are, and closes them
//! when the handoff ends.
//!
//! - P, pull: the blocks of a handoff are granted for READ to its reader's agents when P first
//!   answers the reader's block query; the `PullBlocks` answer leaves only once every local
//!   worker confirmed the grant, so a READ never reaches a transport that would refuse it.
//!   Revoked when P's ledger releases the blocks (after the fence).
//! - D, push: the blocks of a registration are granted for WRITE to P's agents; the
//!   `PushRegister`s leave once every worker confirmed. Revoked when the transfer has an
//!   outcome or its blocks are released, whichever comes first (a WRITE after that is refused).
//!
//! With `kv_digest`, P's workers compute their share of a pulled handoff's KV digest when they
//! put its grant in force, and the `PullBlocks` answer carries the sum of every rank's share.
//!
//! With a backend that does not check grants (NIXL, mem) the workers confirm at once and
//! nothing else changes.

use std::collections::{BTreeMap, HashMap};

use handoff_ledger::PeerId;
use handoff_proto::xfer::{GrantId, XferOp};
use handoff_proto::{HandoffId, Message, PullBlocks};

use super::ConnectorCore;
use crate::digest::{DigestOf, Shares};
use crate::worker_protocol::WorkerOp;

/// Which of this engine's memory a grant opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Opens {
    /// P: a handoff's blocks, for its reader's READs.
    Reads,
    /// D: a push registration's blocks, for P's WRITEs.
    Writes,
}

#[derive(Debug)]
struct Live {
    id: GrantId,
    peer: PeerId,
    /// Ranks that confirmed.
    confirmed: Vec<bool>,
    /// Messages waiting for every rank to confirm, one per slot (a PullBlocks' list, one
    /// PushRegister per D rank).
    held: BTreeMap<u16, Message>,
    /// Whether the workers were asked for the KV digest of the blocks, and their shares so far.
    digest: Option<Shares>,
}

impl Live {
    /// The KV digest for the reader: every rank's share, or none (not asked, or a rank could
    /// not compute it).
    fn digest(&self) -> Option<u64> {
        self.digest?.total(self.confirmed.len())
    }
}

/// `msg` with the grant's KV digest on its block lists.
fn with_digest(msg: Message, digest: Option<u64>) -> Message {
    match msg {
        Message::PullBlocks(mut p) => {
            for l in &mut p.lists {
                l.digest = digest;
            }
            Message::PullBlocks(p)
        }
        other => other,
    }
}

/// Live grants, one per (what they open, handoff): bounded by the ledgers' live handoffs.
#[derive(Debug, Default)]
pub(super) struct Grants {
    next: u64,
    live: HashMap<(Opens, HandoffId), Live>,
    by_id: HashMap<GrantId, (Opens, HandoffId)>,
}

impl Grants {
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn uses_peer(&self, peer: PeerId) -> bool {
        self.live.values().any(|l| l.peer == peer)
    }

    /// A worker's share of the KV digest of grant `id`'s blocks.
    pub fn add_digest_share(&mut self, id: GrantId, share: u64) {
        let Some(key) = self.by_id.get(&id) else {
            return; // revoked meanwhile
        };
        if let Some(shares) = self.live.get_mut(key).and_then(|l| l.digest.as_mut()) {
            shares.add(share);
        }
    }
}

impl ConnectorCore {
    /// A message about to go to `peer`: passed on, or held until its grant is in force.
    pub(super) fn gate(&mut self, peer: PeerId, msg: Message) -> Option<Message> {
        match msg {
            Message::PullBlocks(PullBlocks { lists }) => {
                let mut pass = Vec::with_capacity(lists.len());
                for list in lists {
                    let (handoff, blocks) = (list.handoff, list.blocks.clone());
                    let held = Message::PullBlocks(PullBlocks { lists: vec![list] });
                    if let Some(Message::PullBlocks(p)) =
                        self.hold_for_grant(Opens::Reads, handoff, peer, 0, &blocks, held)
                    {
                        pass.extend(p.lists);
                    }
                }
                (!pass.is_empty()).then_some(Message::PullBlocks(PullBlocks { lists: pass }))
            }
            Message::PushRegister(r) => {
                // Queued while P's connection was being made, for a request that ended since:
                // its blocks are back in the pool (and may be another request's), so no grant
                // may open on them, and P need not hear of it.
                if !self
                    .consumer
                    .as_ref()
                    .is_some_and(|c| c.is_registered(r.handoff))
                {
                    return None;
                }
                let (handoff, slot, blocks) = (r.handoff, r.d_rank, r.block_ids.clone());
                let msg = Message::PushRegister(r);
                self.hold_for_grant(Opens::Writes, handoff, peer, slot, &blocks, msg)
            }
            other => Some(other),
        }
    }

    /// Returns `msg` when the grant for (`opens`, `handoff`) to `peer` is in force; otherwise
    /// keeps it (in `slot`) and, the first time, asks every worker for the grant.
    fn hold_for_grant(
        &mut self,
        opens: Opens,
        handoff: HandoffId,
        peer: PeerId,
        slot: u16,
        blocks: &[u32],
        msg: Message,
    ) -> Option<Message> {
        let key = (opens, handoff);
        // A grant to another peer is not this one's (a handoff's reader never changes; this is
        // defence in depth): it goes, and a new one is made.
        if self.grants.live.get(&key).is_some_and(|l| l.peer != peer) {
            self.revoke(opens, handoff);
        }
        if let Some(l) = self.grants.live.get_mut(&key) {
            if l.confirmed.iter().all(|c| *c) {
                return Some(with_digest(msg, l.digest()));
            }
            l.held.insert(slot, msg);
            return None;
        }
        let agents = self
            .peers
            .get(peer)
            .map(|p| p.agents.clone())
            .unwrap_or_default();
        self.grants.next += 1;
        let id = GrantId(self.grants.next);
        let op = match opens {
            Opens::Reads => XferOp::Read,
            Opens::Writes => XferOp::Write,
        };
        let ranks = self.ranks.len() as u16;
        let digest = match (opens, self.prompt_tokens.get(&handoff)) {
            (Opens::Reads, Some(&num_tokens)) => Some(DigestOf {
                num_tokens,
                whole_blocks: self.cfg.opaque_blocks,
            }),
            _ => None,
        };
        for rank in 0..ranks {
            self.out.worker_ops.push((
                rank,
                WorkerOp::Grant {
                    grant: id,
                    op,
                    agents: agents.clone(),
                    blocks: blocks.to_vec(),
                    digest,
                },
            ));
        }
        self.grants.by_id.insert(id, key);
        self.grants.live.insert(
            key,
            Live {
                id,
                peer,
                confirmed: vec![false; ranks as usize],
                held: BTreeMap::from([(slot, msg)]),
                digest: digest.map(|_| Shares::default()),
            },
        );
        None
    }

    /// Worker `rank` put grant `id` in force: once every rank did, what waited on it goes.
    pub(super) fn grant_confirmed(&mut self, rank: u16, id: GrantId, ok: bool) {
        if !ok {
            // Only blocks outside the pool fail; the peer's transfer will be refused and the
            // request recomputed or failed by the ledgers' rules.
            tracing::error!(
                rank,
                grant = id.0,
                "a worker could not put a grant in force"
            );
        }
        let Some(key) = self.grants.by_id.get(&id).copied() else {
            return; // revoked meanwhile
        };
        let Some(l) = self.grants.live.get_mut(&key) else {
            return;
        };
        if let Some(c) = l.confirmed.get_mut(rank as usize) {
            *c = true;
        }
        if !l.confirmed.iter().all(|c| *c) {
            return;
        }
        let (peer, digest) = (l.peer, l.digest());
        let held = std::mem::take(&mut l.held);
        for (_, msg) in held {
            self.send(peer, with_digest(msg, digest));
        }
    }

    /// Ends the grant for (`opens`, `handoff`), if any, on every worker.
    pub(super) fn revoke(&mut self, opens: Opens, handoff: HandoffId) {
        let Some(l) = self.grants.live.remove(&(opens, handoff)) else {
            return;
        };
        self.grants.by_id.remove(&l.id);
        for rank in 0..self.ranks.len() as u16 {
            self.out
                .worker_ops
                .push((rank, WorkerOp::Revoke { grant: l.id }));
        }
    }
}
