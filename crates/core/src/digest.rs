//! What a KV digest covers and how the shares of an engine's ranks add up: the part of the
//! digest the sans-IO core plans with. The hashing itself runs on the workers, over their
//! registered memory (`handoff_core::digest`, where the digest is defined).

use serde::{Deserialize, Serialize};

/// What a digest covers: the first `num_tokens` tokens of a list of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DigestOf {
    pub num_tokens: u32,
    /// Opaque pages: hash whole blocks (see the module doc).
    pub whole_blocks: bool,
}

/// The shares of one digest an engine's ranks reported so far: their sum is the engine's digest
/// once every rank reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shares {
    sum: u64,
    ranks: usize,
}

impl Shares {
    pub fn add(&mut self, share: u64) {
        self.sum = self.sum.wrapping_add(share);
        self.ranks += 1;
    }

    /// The engine's digest, once all of its `ranks` reported a share.
    pub fn total(&self, ranks: usize) -> Option<u64> {
        (self.ranks == ranks).then_some(self.sum)
    }
}
