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
//!
//! A state layer (a hybrid SSM model, `recurrent_state`) keeps one block per request, its
//! recurrent state in slot 0. The prefill leaves there the state after every prompt token but
//! the last, the one a handoff moves (`handoff_plan::GroupKind::State`); the step that samples
//! the first token (D's, or a monolithic engine's) steps that state over the last token: it
//! reads the state's bytes and folds in the last token, so a state that did not arrive, or the
//! state after all `n` tokens, changes the answer.

use handoff_plan::{BlockRun, GroupKind, KvGroups};

use crate::kv::{KvError, KvMemory};
use crate::model;

/// Salts the state's seed apart from any token's KV.
const STATE_SALT: u64 = 0x5eed_57a7_e000_0001;

/// The seed of a state layer's rows after the first `tokens` tokens of a prompt whose prefix
/// hashes are `prefix` (each hash already covers every token before it).
fn state_seed(prefix: &[u64], tokens: usize) -> u64 {
    let after = tokens
        .checked_sub(1)
        .and_then(|i| prefix.get(i))
        .copied()
        .unwrap_or(0);
    model::mix(after ^ STATE_SALT)
}

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

    /// Each group's blocks of a prompt of `n` tokens in `list`.
    fn runs(&self, list: &[u32], n: usize) -> Result<Vec<BlockRun>, KvError> {
        let tokens = u32::try_from(n).unwrap_or(u32::MAX);
        Ok(self
            .groups
            .runs(list, self.num_layers, tokens, self.block_size, 0, 0)?)
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
        for run in self.runs(list, n)? {
            if !run.layers.contains(&layer) {
                continue;
            }
            if run.kind == GroupKind::State {
                // The state after the first n - 1 tokens, in slot 0 of its block.
                let seed = [state_seed(prefix, n.saturating_sub(1))];
                return kv.write_run(&seed, 0..1, &run.blocks, 0, layer..layer + 1);
            }
            let first = run.first_block as usize;
            let from = first * self.block_size as usize;
            return kv.write_run(prefix, from..n, &run.blocks, first, layer..layer + 1);
        }
        Ok(())
    }

    /// The digest of what the model reads back of a prompt of `n` tokens in `list`, whose last
    /// token's prefix hash is `last_prefix`.
    pub fn digest(
        &self,
        kv: &KvMemory,
        list: &[u32],
        (n, last_prefix): (usize, u64),
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
        for run in self.runs(list, n)? {
            let first = run.first_block as usize;
            let range = match (reads, run.kind) {
                // The state's one slot; stepped over the last token below.
                (_, GroupKind::State) => 0..1,
                (Reads::Last, _) => last.clone(),
                (Reads::Attended, GroupKind::Full) => 0..n,
                (Reads::Attended, GroupKind::Sliding { window }) => {
                    n.saturating_sub(window as usize - 1)..n
                }
            };
            digest = kv.digest_run(digest, range, &run.blocks, first, &run.layers)?;
            if run.kind == GroupKind::State && reads == Reads::Attended {
                // The last token, computed here: the state read back, stepped over it.
                digest = model::mix(digest ^ last_prefix.rotate_left(17));
            }
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
        let clean = p
            .digest(&kv, &list, (40, prefix[39]), Reads::Attended)
            .unwrap();
        // Block 3 holds tokens 16..32 of the sliding layers: token 21, inside the window, counts.
        let off = kv.layouts[0].row_offset(0, 0, 3, 0, 5).unwrap() as usize;
        kv.regions[0].write(off, &[0x55]).unwrap();
        assert_ne!(
            p.digest(&kv, &list, (40, prefix[39]), Reads::Attended)
                .unwrap(),
            clean
        );
        // A list of any other length is refused.
        assert!(p
            .digest(&kv, &list[1..], (40, prefix[39]), Reads::Attended)
            .is_err());
        // One group: the whole prompt in every layer, as before.
        let one = PromptKv::new(KvGroups::single(), 4, 16);
        assert_eq!(one.blocks(40), 3);
    }

    /// Granite 4's shape on the test pool's four layers (layer 3 full, a state in the others):
    /// a 40-token prompt takes the full layer's three blocks and one for the state; the first
    /// token reads the state (the one after 39 tokens) and steps it over the last token.
    #[test]
    fn a_state_layer_keeps_the_state_before_the_last_token_in_one_block() {
        let kv = memory(PoolLayout::LayersOutermost);
        let groups = handoff_plan::testing::state_groups(&[3], 4);
        let p = PromptKv::new(groups, 4, 16);
        assert_eq!(p.blocks(40), 3 + 1);
        assert_eq!(p.blocks(4000), 250 + 1, "one state block for any prompt");
        let prompt: Vec<u32> = (0..40).collect();
        let prefix = model::prefix_hashes(&prompt, 0);
        let list = [0, 1, 2, 3];
        for layer in 0..4 {
            p.write_layer(&kv, &prefix, &list, layer).unwrap();
        }
        let first = |kv: &KvMemory| p.digest(kv, &list, (40, prefix[39]), Reads::Attended);
        let clean = first(&kv).unwrap();
        // Another last token: another answer (the state is stepped over it).
        let mut other = prompt.clone();
        other[39] = 77;
        let other_last = *model::prefix_hashes(&other, 0).last().unwrap();
        assert_ne!(
            p.digest(&kv, &list, (40, other_last), Reads::Attended)
                .unwrap(),
            clean
        );
        // The state written after all 40 tokens (P handing over what it stepped once more):
        // another answer.
        let after_all = model::prefix_hashes(&[prompt.clone(), vec![0]].concat(), 0);
        p.write_layer(&kv, &after_all, &list, 0).unwrap();
        assert_ne!(first(&kv).unwrap(), clean);
        p.write_layer(&kv, &prefix, &list, 0).unwrap();
        assert_eq!(first(&kv).unwrap(), clean);
        // One byte of the state block (block 3, slot 0 of layer 1): another answer.
        let off = kv.layouts[0].row_offset(1, 0, 3, 0, 0).unwrap() as usize;
        kv.regions[0].write(off, &[0x55]).unwrap();
        assert_ne!(first(&kv).unwrap(), clean);
    }
}
