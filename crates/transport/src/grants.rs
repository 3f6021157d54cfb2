//! Grants: the bytes of an agent's registered memory each peer may read or write, and nothing
//! else.
//!
//! Region bounds say what memory an agent registered; grants say what one peer may touch of it
//! now. The connector grants a handoff's blocks to the engine that reads them (P) or the blocks
//! of a push registration to the P that writes them (D), and revokes the grant when the handoff
//! ends (after its fence). A backend that checks grants refuses every descriptor outside a live
//! grant to the peer that sent it, under the name that peer proved: a second enforcement of
//! rules 2 and 3 beside the ledgers, that holds even if a peer or the ledgers got it wrong.
//!
//! Grants may overlap (two handoffs sharing prefix blocks, the same block granted twice): the
//! table counts how many grants cover each byte range, so revoking one leaves the other's bytes
//! open.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::{RegionId, XferOp};

pub use handoff_proto::xfer::GrantId;

/// A byte range of one local region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Extent {
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

struct Grant {
    op: XferOp,
    peers: Vec<String>,
    extents: Vec<Extent>,
}

/// Disjoint byte ranges of one region, each with the number of grants covering it (> 0).
#[derive(Default)]
struct Coverage {
    /// start → (end, grants covering it).
    pieces: BTreeMap<u64, (u64, u32)>,
}

impl Coverage {
    /// Cuts the piece that straddles `at` in two.
    fn split_at(&mut self, at: u64) {
        let Some((&start, &(end, n))) = self.pieces.range(..at).next_back() else {
            return;
        };
        if start < at && at < end {
            self.pieces.insert(start, (at, n));
            self.pieces.insert(at, (end, n));
        }
    }

    fn add(&mut self, start: u64, end: u64) {
        self.split_at(start);
        self.split_at(end);
        let inside: Vec<(u64, u64)> = self
            .pieces
            .range(start..end)
            .map(|(&s, &(e, _))| (s, e))
            .collect();
        let mut at = start;
        for (s, e) in inside {
            if at < s {
                self.pieces.insert(at, (s, 1));
            }
            if let Some(p) = self.pieces.get_mut(&s) {
                p.1 += 1;
            }
            at = e;
        }
        if at < end {
            self.pieces.insert(at, (end, 1));
        }
        self.merge_around(start);
        self.merge_around(end);
    }

    fn remove(&mut self, start: u64, end: u64) {
        self.split_at(start);
        self.split_at(end);
        let inside: Vec<u64> = self.pieces.range(start..end).map(|(&s, _)| s).collect();
        for s in inside {
            if let Some(p) = self.pieces.get_mut(&s) {
                p.1 -= 1;
                if p.1 == 0 {
                    self.pieces.remove(&s);
                }
            }
        }
        self.merge_around(start);
        self.merge_around(end);
    }

    /// Joins the piece starting at `at` with the one ending there when both have the same count
    /// (so revoked grants leave no cuts behind).
    fn merge_around(&mut self, at: u64) {
        let Some(&(end, n)) = self.pieces.get(&at) else {
            return;
        };
        let Some((&prev, &(prev_end, prev_n))) = self.pieces.range(..at).next_back() else {
            return;
        };
        if prev_end == at && prev_n == n {
            self.pieces.remove(&at);
            self.pieces.insert(prev, (end, n));
        }
    }

    /// Whether every byte of `start..end` is covered.
    fn covers(&self, start: u64, end: u64) -> bool {
        let Some((_, &(mut reached, _))) = self.pieces.range(..=start).next_back() else {
            return false;
        };
        if reached <= start {
            return false;
        }
        while reached < end {
            match self.pieces.get(&reached) {
                Some(&(e, _)) => reached = e,
                None => return false,
            }
        }
        true
    }

    fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

/// The live grants of one agent. Plain data: a backend keeps it under its own lock.
#[derive(Default)]
pub struct GrantTable {
    grants: HashMap<GrantId, Grant>,
    /// peer → (op, region) → coverage.
    cover: HashMap<String, HashMap<(XferOp, RegionId), Coverage>>,
}

impl GrantTable {
    /// Lets every agent in `peers` do `op` on `extents` (zero-length ones are ignored), until
    /// [`GrantTable::revoke`]. Granting an id again replaces the earlier grant.
    pub fn grant(&mut self, id: GrantId, op: XferOp, peers: &[String], extents: &[Extent]) {
        self.revoke(id);
        let extents: Vec<Extent> = extents
            .iter()
            .copied()
            .filter(|e| e.len > 0 && e.offset.checked_add(e.len).is_some())
            .collect();
        for p in peers {
            let mine = self.cover.entry(p.clone()).or_default();
            for e in &extents {
                mine.entry((op, e.region))
                    .or_default()
                    .add(e.offset, e.offset + e.len);
            }
        }
        self.grants.insert(
            id,
            Grant {
                op,
                peers: peers.to_vec(),
                extents,
            },
        );
    }

    /// Ends a grant; false if it was not live.
    pub fn revoke(&mut self, id: GrantId) -> bool {
        let Some(g) = self.grants.remove(&id) else {
            return false;
        };
        for p in &g.peers {
            let Some(mine) = self.cover.get_mut(p) else {
                continue;
            };
            for e in &g.extents {
                let key = (g.op, e.region);
                if let Some(c) = mine.get_mut(&key) {
                    c.remove(e.offset, e.offset + e.len);
                    if c.is_empty() {
                        mine.remove(&key);
                    }
                }
            }
            if mine.is_empty() {
                self.cover.remove(p);
            }
        }
        true
    }

    /// Whether `peer` may do `op` on `len` bytes at `offset` of `region`. Nothing is granted
    /// for zero bytes either: a descriptor must name granted memory.
    pub fn allows(&self, peer: &str, op: XferOp, region: RegionId, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len.max(1)) else {
            return false;
        };
        self.cover
            .get(peer)
            .and_then(|m| m.get(&(op, region)))
            .is_some_and(|c| c.covers(offset, end))
    }

    /// Live grants.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ext(region: RegionId, offset: u64, len: u64) -> Extent {
        Extent {
            region,
            offset,
            len,
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_grant_opens_its_bytes_to_its_peers_for_its_op_only() {
        let mut t = GrantTable::default();
        t.grant(
            GrantId(1),
            XferOp::Read,
            &names(&["d-r0", "d-r1"]),
            &[ext(0, 100, 50), ext(0, 150, 50), ext(2, 0, 10)],
        );
        assert!(
            t.allows("d-r0", XferOp::Read, 0, 100, 100),
            "adjacent extents join"
        );
        assert!(t.allows("d-r1", XferOp::Read, 2, 3, 7));
        assert!(!t.allows("d-r0", XferOp::Read, 0, 99, 2), "a byte before");
        assert!(!t.allows("d-r0", XferOp::Read, 0, 199, 2), "a byte after");
        assert!(!t.allows("d-r0", XferOp::Write, 0, 100, 10), "another op");
        assert!(
            !t.allows("mallory", XferOp::Read, 0, 100, 10),
            "another peer"
        );
        assert!(
            !t.allows("d-r0", XferOp::Read, 1, 100, 10),
            "another region"
        );
        assert!(!t.allows("d-r0", XferOp::Read, 0, u64::MAX, 2), "overflow");
        assert!(t.revoke(GrantId(1)));
        assert!(!t.allows("d-r0", XferOp::Read, 0, 100, 10));
        assert!(!t.revoke(GrantId(1)));
        assert!(t.is_empty() && t.cover.is_empty());
    }

    #[test]
    fn overlapping_grants_are_counted() {
        let mut t = GrantTable::default();
        let d = names(&["d"]);
        t.grant(GrantId(1), XferOp::Read, &d, &[ext(0, 0, 100)]);
        t.grant(GrantId(2), XferOp::Read, &d, &[ext(0, 50, 100)]);
        assert!(t.allows("d", XferOp::Read, 0, 0, 150));
        t.revoke(GrantId(1));
        assert!(!t.allows("d", XferOp::Read, 0, 0, 60));
        assert!(t.allows("d", XferOp::Read, 0, 50, 100));
        t.revoke(GrantId(2));
        assert!(t.cover.is_empty());
    }

    proptest! {
        /// Against a byte-by-byte model: after any sequence of grants and revokes, a range is
        /// allowed exactly when every byte of it is covered by a live grant, and nothing is
        /// left behind once every grant is revoked.
        #[test]
        fn matches_a_byte_model(
            ops in prop::collection::vec((0u64..6, 0u64..64, 1u64..24, any::<bool>()), 1..40),
            probes in prop::collection::vec((0u64..80, 1u64..30), 20),
        ) {
            let mut t = GrantTable::default();
            let mut live: HashMap<u64, (u64, u64)> = HashMap::new();
            let d = names(&["d"]);
            for (id, off, len, revoke) in ops {
                if revoke {
                    t.revoke(GrantId(id));
                    live.remove(&id);
                } else {
                    t.grant(GrantId(id), XferOp::Read, &d, &[ext(0, off, len)]);
                    live.insert(id, (off, len));
                }
                for &(off, len) in &probes {
                    let model = (off..off + len)
                        .all(|b| live.values().any(|&(o, l)| o <= b && b < o + l));
                    prop_assert_eq!(t.allows("d", XferOp::Read, 0, off, len), model);
                }
            }
            let ids: Vec<u64> = live.keys().copied().collect();
            for id in ids {
                t.revoke(GrantId(id));
            }
            prop_assert!(t.cover.is_empty());
        }
    }
}
