//! Where a request's prompt KV lives: one list of blocks per request, the list its handoff
//! carries.
//!
//! A model of one KV cache group keeps every layer of the prompt in the same blocks. A hybrid
//! model (`sliding_window`) keeps each group's layers in blocks of their own, all from the one
//! pool: every block of the prompt for the full-attention layers, and for the sliding layers
//! only the blocks from the one that holds token `n − w` on (what a handoff moves,
//! `KvGroups::moved`); the earlier ones are never allocated, since nothing would read them. The
//! request's list is each group's blocks in group order, which is exactly the handoff's list:
//! P, D and a monolithic engine allocate, write and read the same way, and the ledger gives back
//! the list it was given.
//!
//! What the model reads back for a request's first token: every prompt token of a full layer,
//! and of a sliding layer the tokens the next token attends to (`n − w + 1 ..`). So a sliding
//! block that did not arrive changes the answer as a full one does.

use handoff_plan::{BlockRun, GroupKind, KvGroups};

use crate::kv::{KvError, KvMemory};

/// Which prompt positions a digest reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// The last position only (P samples the token it returns from the forward it ran).
    Last,
    /// What the first generated token attends to (D and a monolithic engine).
    Attended,
}

/// How the engine's model keeps a prompt's KV.
#[derive(Debug, Clone)]
pub struct PromptKv {
    groups: KvGroups,
    num_layers: u32,
    block_size: u32,
}

impl PromptKv {
    pub fn new(groups: KvGroups, num_layers: u32, block_size: u32) -> Self {
        PromptKv {
            groups,
            num_layers,
            block_size: block_size.max(1),
        }
    }

    /// Blocks a prompt of `n` tokens takes.
    pub fn blocks(&self, n: usize) -> usize {
        if self.groups.is_single() {
            return n.div_ceil(self.block_size as usize);
        }
        let tokens = u32::try_from(n).unwrap_or(u32::MAX);
        self.groups
            .moved(tokens, self.block_size, 0)
            .map_or(0, |ranges| ranges.iter().map(|r| r.len()).sum())
    }

    /// Each group's blocks of a prompt of `n` tokens in `list`, with its window (`None`: full).
    fn runs(&self, list: &[u32], n: usize) -> Result<Vec<(BlockRun, Option<u32>)>, KvError> {
        let tokens = u32::try_from(n).unwrap_or(u32::MAX);
        let runs = self
            .groups
            .runs(list, self.num_layers, tokens, self.block_size, 0, 0)?;
        let groups = self.groups.groups(self.num_layers);
        Ok(runs
            .into_iter()
            .map(|run| {
                let window = groups
                    .iter()
                    .find(|g| g.layers == run.layers)
                    .and_then(|g| match g.kind {
                        GroupKind::Sliding { window } => Some(window),
                        GroupKind::Full => None,
                    });
                (run, window)
            })
            .collect())
    }

    /// Writes `layer`'s KV of the whole prompt (prefix hashes `prefix`) into `list`.
    pub fn write_layer(
        &self,
        kv: &KvMemory,
        prefix: &[u64],
        list: &[u32],
        layer: u32,
    ) -> Result<(), KvError> {
        let n = prefix.len();
        if self.groups.is_single() {
            return kv.write_positions_layers(prefix, 0..n, list, layer..layer + 1);
        }
        for (run, _) in self.runs(list, n)? {
            if run.layers.contains(&layer) {
                let first = run.first_block as usize;
                let from = first * self.block_size as usize;
                return kv.write_run(prefix, from..n, &run.blocks, first, layer..layer + 1);
            }
        }
        Ok(())
    }

    /// The digest of what the model reads back of a prompt of `n` tokens in `list`.
    pub fn digest(
        &self,
        kv: &KvMemory,
        list: &[u32],
        n: usize,
        reads: Reads,
    ) -> Result<u64, KvError> {
        let last = n.saturating_sub(1)..n;
        if self.groups.is_single() {
            let range = match reads {
                Reads::Last => last,
                Reads::Attended => 0..n,
            };
            return kv.digest_positions(0, range, list);
        }
        let mut digest = 0;
        for (run, window) in self.runs(list, n)? {
            let range = match (reads, window) {
                (Reads::Last, _) => last.clone(),
                (Reads::Attended, None) => 0..n,
                (Reads::Attended, Some(w)) => n.saturating_sub(w as usize - 1)..n,
            };
            let first = run.first_block as usize;
            digest = kv.digest_run(digest, range, &run.blocks, first, &run.layers)?;
        }
        Ok(digest)
    }
}

#[cfg(test)]
mod tests {
    use handoff_plan::PoolLayout;

    use super::*;
    use crate::kv::tests::memory;
    use crate::model;

    /// A hybrid model of the test pool's four layers (layer 3 full, the rest a window of 20
    /// tokens): a 40-token prompt takes the full layer's three blocks and the window's two
    /// (tokens 20..40), and its digest reads a sliding layer's window from the window's blocks.
    #[test]
    fn a_sliding_layer_keeps_and_reads_its_window_only() {
        let kv = memory(PoolLayout::LayersOutermost);
        let groups = handoff_plan::testing::hybrid_groups(&[3], 20, 4);
        let p = PromptKv::new(groups, 4, 16);
        assert_eq!(p.blocks(40), 3 + 2);
        let prefix = model::prefix_hashes(&(0..40).collect::<Vec<u32>>(), 0);
        let list = [0, 1, 2, 3, 4];
        for layer in 0..4 {
            p.write_layer(&kv, &prefix, &list, layer).unwrap();
        }
        let clean = p.digest(&kv, &list, 40, Reads::Attended).unwrap();
        // Block 3 holds tokens 16..32 of the sliding layers: token 21, inside the window, counts.
        let off = kv.layouts[0].row_offset(0, 0, 3, 0, 5).unwrap() as usize;
        kv.regions[0].write(off, &[0x55]).unwrap();
        assert_ne!(p.digest(&kv, &list, 40, Reads::Attended).unwrap(), clean);
        // A list of any other length is refused.
        assert!(p.digest(&kv, &list[1..], 40, Reads::Attended).is_err());
        // One group: the whole prompt in every layer, as before.
        let one = PromptKv::new(KvGroups::single(), 4, 16);
        assert_eq!(one.blocks(40), 3);
    }
}
