//! KV cache groups: models whose layers do not all keep the same KV.
//!
//! A hybrid model (Gemma 3, gpt-oss: full attention in some layers, a sliding window in the
//! others) keeps each kind of layer in a **group** of its own, with block lists of its own:
//! vLLM's hybrid KV cache manager gives each group its blocks from one shared pool (a block id
//! belongs to one group of one request at a time) and frees a sliding group's blocks once they
//! fall out of the window. A handoff then moves, per group, only what D still needs: every block
//! of the prompt for full attention, the window's tail for a sliding group
//! ([`crate::window_blocks`]).
//!
//! On the wire and in the ledgers a handoff still carries one list of block ids: the
//! **concatenation of each group's moved blocks, in group order** ([`KvGroups::clip`]). Both
//! sides know the groups (they are exchanged and compared in the handshake,
//! [`KvGroups::check_pair`]) and the prompt's length, so each cuts the list back into groups the
//! same way ([`KvGroups::runs`]) and a list of any other length is refused. The ledgers hold the
//! concatenation as the handoff's blocks: they are distinct (one pool), every one goes back
//! exactly once, and a block in it is the request's in every layer.
//!
//! A model with one group ([`KvGroups::single`], every model before hybrids) is the old case
//! exactly: one run, every layer, every block.
//!
//! A hybrid SSM model (Granite 4, Qwen3-Next: Mamba or linear-attention layers beside full
//! attention) keeps, in each state layer, one recurrent state per request instead of KV per
//! token: a group of kind [`GroupKind::State`], whose list is one block holding the state at
//! token slot 0. A handoff moves that block whatever the prompt's length. The state in it is the
//! one after every prompt token *but the last*: the engine that samples the first token
//! computes the last one itself (vLLM does, even on a full cache hit), and a recurrent state,
//! unlike KV, cannot take the same token twice. So P hands over the state after `n − 1`
//! tokens, as vLLM's own connectors do, and D steps it over token `n − 1`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::layout::{RankLayout, Side};
use crate::planner::{check_disjoint, plan_layers, Plan, PlanError, Span};
use crate::window::{window_blocks, WindowError};

/// What the layers of one group keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupKind {
    /// Every token of the prompt.
    Full,
    /// The last `window` tokens (a token attends to itself and the `window - 1` before it).
    Sliding {
        /// Tokens in the window.
        window: u32,
    },
    /// One recurrent state per request (Mamba, linear attention), in the group's first block,
    /// token slot 0: the state after the prompt's tokens but the last.
    State,
}

/// One group: its kind and its layers (indices into the model's KV layers).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGroup {
    /// What its layers keep.
    pub kind: GroupKind,
    /// Its layers, ascending.
    pub layers: Vec<u32>,
}

/// The model's KV cache groups, validated: every layer in exactly one group.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGroups {
    /// Empty: one full-attention group of every layer.
    groups: Vec<KvGroup>,
}

/// Why groups, or a block list cut by them, cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// A layer in no group, in two, or beyond the model's.
    #[error("layer {layer} is in {count} KV cache groups (every one of the model's {num_layers} layers must be in exactly one)")]
    Layer {
        /// The layer.
        layer: u32,
        /// Groups it is in.
        count: u32,
        /// Layers of the model.
        num_layers: u32,
    },
    /// A group without layers, or a window of no token.
    #[error("KV cache group {group} is empty or has a window of 0 tokens")]
    Empty {
        /// The group's index.
        group: usize,
    },
    /// Decoded groups not in the one spelling [`KvGroups::new`] gives them (layers ascending;
    /// the single group as no group).
    #[error("KV cache group {group} is not in canonical form (layers ascending, one full group of every layer named as none)")]
    Unsorted {
        /// The group's index.
        group: usize,
    },
    /// A block list for the wrong number of groups.
    #[error("{got} block lists for {groups} KV cache groups")]
    GroupCount {
        /// Groups of the model.
        groups: usize,
        /// Lists given.
        got: usize,
    },
    /// A handoff's list is not as long as its groups make it.
    #[error("a handoff of {num_tokens} tokens in blocks of {block_size} moves {expected} blocks over its KV cache groups, the list has {got}")]
    Length {
        /// Tokens of the prompt.
        num_tokens: u32,
        /// Tokens per block.
        block_size: u32,
        /// Blocks the groups move.
        expected: usize,
        /// Blocks in the list.
        got: usize,
    },
    /// A cut asked for that the list cannot serve (it starts later than asked).
    #[error("the list starts at block {built} of each group, a cut from block {want} was asked")]
    Skip {
        /// Where the list starts.
        built: u32,
        /// Where the cut should start.
        want: u32,
    },
    /// A group's list cannot serve its window.
    #[error("KV cache group {group}: {source}")]
    Window {
        /// The group's index.
        group: usize,
        /// What is wrong.
        source: WindowError,
    },
}

/// Why two engines' groups cannot pair.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupMismatch {
    /// Different groups (another model, or one side without its hybrid manager).
    #[error("KV cache groups differ: P has {p}, D has {d}")]
    Differ {
        /// P's groups, described.
        p: String,
        /// D's groups, described.
        d: String,
    },
    /// A sliding group with different block sizes (the windows' tails would start at different
    /// tokens).
    #[error("a sliding-window KV cache group needs equal block sizes, P has {p}, D has {d}")]
    BlockSize {
        /// P's block size.
        p: u32,
        /// D's block size.
        d: u32,
    },
}

/// Blocks of one group that a handoff moves: the request's blocks `first_block ..` of that
/// group, holding KV for `layers` (tokens from `first_block × block_size` on; a state group's
/// one block, its state in slot 0).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockRun {
    /// What the group keeps.
    pub kind: GroupKind,
    /// The layers these blocks hold KV for, ascending.
    pub layers: Vec<u32>,
    /// Index of the first block in the group's block list.
    pub first_block: u32,
    /// The block ids.
    pub blocks: Vec<u32>,
}

impl BlockRun {
    /// Token slots of a prompt of `num_tokens` that this run's blocks hold (the prompt from
    /// its first block to its end; a state: slot 0 of its block).
    pub fn tokens(&self, num_tokens: u32, block_size: u32) -> u32 {
        match self.kind {
            GroupKind::State => 1,
            _ => num_tokens.saturating_sub(self.first_block.saturating_mul(block_size)),
        }
    }
}

impl KvGroups {
    /// One full-attention group of every layer.
    pub fn single() -> Self {
        Self::default()
    }

    /// `groups`, checked against a model of `num_layers` layers. One full group of every layer
    /// is [`KvGroups::single`] (so it compares equal to an engine that never named groups).
    pub fn new(mut groups: Vec<KvGroup>, num_layers: u32) -> Result<Self, GroupError> {
        for g in &mut groups {
            g.layers.sort_unstable();
        }
        check_cover(&groups, num_layers)?;
        if groups.len() == 1 && groups[0].kind == GroupKind::Full {
            groups.clear();
        }
        Ok(Self { groups })
    }

    /// Checks groups that arrived decoded (a peer's hello, a worker's) as [`KvGroups::new`]
    /// checks them: every one of `num_layers` layers in exactly one group, layers ascending,
    /// no empty group, and not one full group spelled out (the single group has one spelling).
    pub fn validate(&self, num_layers: u32) -> Result<(), GroupError> {
        if self.groups.is_empty() {
            return Ok(());
        }
        if let Some(i) = self
            .groups
            .iter()
            .position(|g| !g.layers.windows(2).all(|w| w[0] < w[1]))
        {
            return Err(GroupError::Unsorted { group: i });
        }
        if self.groups.len() == 1 && self.groups[0].kind == GroupKind::Full {
            return Err(GroupError::Unsorted { group: 0 });
        }
        check_cover(&self.groups, num_layers)
    }
}

/// Every layer of `num_layers` in exactly one of `groups`, none of them empty.
fn check_cover(groups: &[KvGroup], num_layers: u32) -> Result<(), GroupError> {
    let mut count = vec![0u32; num_layers as usize];
    for (i, g) in groups.iter().enumerate() {
        if g.layers.is_empty() || g.kind == (GroupKind::Sliding { window: 0 }) {
            return Err(GroupError::Empty { group: i });
        }
        for &l in &g.layers {
            match count.get_mut(l as usize) {
                Some(c) => *c += 1,
                None => {
                    return Err(GroupError::Layer {
                        layer: l,
                        count: 1,
                        num_layers,
                    })
                }
            }
        }
    }
    if let Some((layer, &c)) = count.iter().enumerate().find(|(_, &c)| c != 1) {
        return Err(GroupError::Layer {
            layer: layer as u32,
            count: c,
            num_layers,
        });
    }
    Ok(())
}

impl KvGroups {
    /// Whether this is one full-attention group of every layer.
    pub fn is_single(&self) -> bool {
        self.groups.is_empty()
    }

    /// How many block lists a request has: one per group.
    pub fn len(&self) -> usize {
        self.groups.len().max(1)
    }

    /// Never: a model has at least one group.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The groups, for a model of `num_layers` layers.
    pub fn groups(&self, num_layers: u32) -> Vec<KvGroup> {
        if self.groups.is_empty() {
            return vec![KvGroup {
                kind: GroupKind::Full,
                layers: (0..num_layers).collect(),
            }];
        }
        self.groups.clone()
    }

    /// Whether any group keeps a sliding window.
    pub fn has_windows(&self) -> bool {
        self.groups
            .iter()
            .any(|g| matches!(g.kind, GroupKind::Sliding { .. }))
    }

    /// The range of each group's block list a handoff of `num_tokens` tokens moves when the
    /// first `skip_blocks` blocks of every group are not moved (D's prefix-cache hit).
    pub fn moved(
        &self,
        num_tokens: u32,
        block_size: u32,
        skip_blocks: u32,
    ) -> Result<Vec<Range<u32>>, GroupError> {
        let end = num_tokens.div_ceil(block_size.max(1));
        let kinds: Vec<GroupKind> = if self.groups.is_empty() {
            vec![GroupKind::Full]
        } else {
            self.groups.iter().map(|g| g.kind).collect()
        };
        kinds
            .into_iter()
            .enumerate()
            .map(|(group, kind)| {
                let start = match kind {
                    // The one block of the state, whatever D's prefix cache holds: a cached
                    // prefix holds no state for this prompt.
                    GroupKind::State => return Ok(0..1),
                    GroupKind::Full => 0,
                    // D computes the prompt's last token again (vLLM does, to sample the first
                    // output token once the whole prompt was loaded): its window reaches one
                    // token further back than the next token's.
                    GroupKind::Sliding { window } => {
                        window_blocks(num_tokens, block_size, window.saturating_add(1))
                            .map_err(|source| GroupError::Window { group, source })?
                            .start
                    }
                };
                let start = start.max(skip_blocks).min(end);
                Ok(start..end)
            })
            .collect()
    }

    /// Whether the engine that computed a prompt of `num_tokens` tokens still holds every block
    /// its handoff moves once the request finished. vLLM's hybrid manager then frees a sliding
    /// group's blocks that lie wholly before token `n - w + 1` (all its next token attends to),
    /// while the handoff's window starts one token earlier ([`KvGroups::moved`]): when token
    /// `n - w` is the last of its block, that block is gone, and the handoff is refused (D
    /// computes the prompt) rather than sent without it. Checked before a push streams, whose
    /// writes would still read the block as it is freed.
    pub fn check_producer_keeps(&self, num_tokens: u32, block_size: u32) -> Result<(), GroupError> {
        let bs = block_size.max(1);
        let ranges = self.moved(num_tokens, bs, 0)?;
        for (group, (g, r)) in self.groups.iter().zip(ranges).enumerate() {
            let GroupKind::Sliding { window } = g.kind else {
                continue;
            };
            let kept_from = num_tokens.saturating_sub(window - 1);
            if !r.is_empty() && (r.start + 1).saturating_mul(bs) <= kept_from {
                return Err(GroupError::Window {
                    group,
                    source: WindowError::NullInWindow { index: r.start },
                });
            }
        }
        Ok(())
    }

    /// A handoff's one list from the request's per-group lists (each covering the prompt, in
    /// token order, `null` wherever the engine freed a block): each group's moved blocks, in
    /// group order. A group whose window reaches a freed block is refused.
    pub fn clip(
        &self,
        lists: &[Vec<u32>],
        num_tokens: u32,
        block_size: u32,
        null: Option<u32>,
    ) -> Result<Vec<u32>, GroupError> {
        self.clip_after(lists, num_tokens, block_size, 0, null)
    }

    /// [`KvGroups::clip`] from block `skip` of every group on (D's list after its prefix-cache
    /// hit of `skip` blocks: those are not moved, and their ids are not in the list).
    pub fn clip_after(
        &self,
        lists: &[Vec<u32>],
        num_tokens: u32,
        block_size: u32,
        skip: u32,
        null: Option<u32>,
    ) -> Result<Vec<u32>, GroupError> {
        if lists.len() != self.len() {
            return Err(GroupError::GroupCount {
                groups: self.len(),
                got: lists.len(),
            });
        }
        let ranges = self.moved(num_tokens, block_size, skip)?;
        let mut out = Vec::new();
        for (group, (list, r)) in lists.iter().zip(ranges).enumerate() {
            let too_short = || GroupError::Window {
                group,
                source: WindowError::TooShort {
                    num_tokens,
                    block_size,
                    need: r.end,
                    have: u32::try_from(list.len()).unwrap_or(u32::MAX),
                },
            };
            let part = list
                .get(r.start as usize..r.end as usize)
                .ok_or_else(too_short)?;
            if let Some(i) = null.and_then(|n| part.iter().position(|&b| b == n)) {
                return Err(GroupError::Window {
                    group,
                    source: WindowError::NullInWindow {
                        index: r.start + i as u32,
                    },
                });
            }
            out.extend_from_slice(part);
        }
        Ok(out)
    }

    /// Cuts a handoff's list (as [`KvGroups::clip`] built it, or built from block `built_skip`
    /// of every group on) into one run per group that moves anything, from block `want_skip` of
    /// every group on. A list of any other length is refused.
    pub fn runs(
        &self,
        list: &[u32],
        num_layers: u32,
        num_tokens: u32,
        block_size: u32,
        built_skip: u32,
        want_skip: u32,
    ) -> Result<Vec<BlockRun>, GroupError> {
        if want_skip < built_skip {
            return Err(GroupError::Skip {
                built: built_skip,
                want: want_skip,
            });
        }
        let built = self.moved(num_tokens, block_size, built_skip)?;
        let expected: usize = built.iter().map(|r| r.len()).sum();
        if expected != list.len() {
            return Err(GroupError::Length {
                num_tokens,
                block_size,
                expected,
                got: list.len(),
            });
        }
        let want = self.moved(num_tokens, block_size, want_skip)?;
        let mut at = 0usize;
        let mut out = Vec::new();
        for ((g, b), w) in self.groups(num_layers).into_iter().zip(built).zip(want) {
            let part = &list[at..at + b.len()];
            at += b.len();
            if w.is_empty() {
                continue;
            }
            // `w` lies inside `b`: same end, a start no earlier.
            let from = (w.start - b.start) as usize;
            out.push(BlockRun {
                kind: g.kind,
                layers: g.layers,
                first_block: w.start,
                blocks: part[from..].to_vec(),
            });
        }
        Ok(out)
    }

    /// Whether an engine with these groups and block size `p_bs` (P) can pair with one with
    /// `d` and `d_bs` (D).
    pub fn check_pair(&self, d: &KvGroups, p_bs: u32, d_bs: u32) -> Result<(), GroupMismatch> {
        if self != d {
            return Err(GroupMismatch::Differ {
                p: self.describe(),
                d: d.describe(),
            });
        }
        // A state sits in slot 0 of one block on both sides: any block sizes pair.
        if self.has_windows() && p_bs != d_bs {
            return Err(GroupMismatch::BlockSize { p: p_bs, d: d_bs });
        }
        Ok(())
    }

    /// For messages: `full(0-3) + window 512(4-9)`, or `one full-attention group`.
    pub fn describe(&self) -> String {
        if self.groups.is_empty() {
            return "one full-attention group".into();
        }
        let parts: Vec<String> = self
            .groups
            .iter()
            .map(|g| {
                let layers: Vec<String> = g.layers.iter().map(u32::to_string).collect();
                match g.kind {
                    GroupKind::Full => format!("full[{}]", layers.join(",")),
                    GroupKind::Sliding { window } => {
                        format!("window {window}[{}]", layers.join(","))
                    }
                    GroupKind::State => format!("state[{}]", layers.join(",")),
                }
            })
            .collect();
        parts.join(" + ")
    }
}

/// One group's blocks on both sides, for [`plan_runs`]: P's and D's blocks from the same token
/// on, `num_tokens` tokens of them to move, for `layers`.
#[derive(Debug, Clone, Copy)]
pub struct RunPair<'a> {
    /// The group's layers, ascending.
    pub layers: &'a [u32],
    /// P's blocks.
    pub p_blocks: &'a [u32],
    /// D's blocks.
    pub d_blocks: &'a [u32],
    /// Tokens to move from the runs' first blocks on.
    pub num_tokens: u32,
}

/// [`crate::plan_layers`] for a handoff cut into groups: each run's layers inside `layers` with
/// that run's blocks, one plan. Runs of one layer range (a single group) plan exactly as
/// [`crate::plan_layers`] does; the layers of several groups are planned a contiguous stretch
/// at a time and the pairs' descriptors joined, and a D rank's writes are checked disjoint over
/// all of them (groups whose layers share memory, as vLLM's hybrid manager lays them out, must
/// still touch different blocks).
pub fn plan_runs(
    p: &[RankLayout],
    d: &[RankLayout],
    runs: &[RunPair<'_>],
    layers: Range<u32>,
) -> Result<Plan, PlanError> {
    let first = runs.first().ok_or(PlanError::LayerRange {
        start: layers.start,
        end: layers.end,
        num_layers: 0,
    })?;
    // The pairs, in topology order, with nothing to move yet.
    let mut plan = plan_layers(
        p,
        d,
        first.p_blocks,
        first.d_blocks,
        first.num_tokens,
        layers.start..layers.start,
    )?;
    for run in runs {
        for stretch in stretches(run.layers, &layers) {
            let part = plan_layers(p, d, run.p_blocks, run.d_blocks, run.num_tokens, stretch)?;
            for (into, from) in plan.pairs.iter_mut().zip(part.pairs) {
                into.descriptors.extend(from.descriptors);
            }
        }
    }
    if runs.len() > 1 {
        for d_rank in 0..plan.topology.d_tp() {
            let spans = plan
                .pairs
                .iter()
                .filter(|pp| pp.d_rank == d_rank)
                .flat_map(|pp| pp.descriptors.iter())
                .map(|x| Span {
                    region: x.dst_region,
                    offset: x.dst_offset,
                    len: x.len,
                });
            check_disjoint(Side::Decode, d_rank, spans.collect())?;
        }
    }
    Ok(plan)
}

/// The maximal ranges of consecutive layers of `layers` (ascending) inside `within`.
fn stretches(layers: &[u32], within: &Range<u32>) -> Vec<Range<u32>> {
    let mut out: Vec<Range<u32>> = Vec::new();
    for &l in layers.iter().filter(|l| within.contains(l)) {
        match out.last_mut() {
            Some(r) if r.end == l => r.end = l + 1,
            _ => out.push(l..l + 1),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3's pattern on 6 layers: one full group (layer 5), sliding groups of the rest.
    fn hybrid(window: u32) -> KvGroups {
        crate::testing::hybrid_groups(&[5], window, 6)
    }

    /// 6 layers of the tiny spec, one region each, 64 blocks.
    fn tiny(layers: u32) -> RankLayout {
        RankLayout::per_layer(crate::testing::tiny_spec(layers), 0, 64, 0).unwrap()
    }

    fn run_pairs<'a>(p: &'a [BlockRun], d: &'a [BlockRun], n: u32, bs: u32) -> Vec<RunPair<'a>> {
        p.iter()
            .zip(d)
            .map(|(p, d)| RunPair {
                layers: &p.layers,
                p_blocks: &p.blocks,
                d_blocks: &d.blocks,
                num_tokens: p.tokens(n, bs),
            })
            .collect()
    }

    #[test]
    fn a_sliding_layer_moves_only_its_windows_bytes() {
        let (p, d) = ([tiny(6)], [tiny(6)]);
        let g = hybrid(20);
        // 100 tokens in blocks of 16: 7 blocks; the window (tokens 81..100) lies in blocks 5, 6.
        let p_list = g
            .clip(&[(10..17).collect(), (20..27).collect()], 100, 16, None)
            .unwrap();
        let d_list = g
            .clip(&[(30..37).collect(), (40..47).collect()], 100, 16, None)
            .unwrap();
        assert_eq!(p_list.len(), 7 + 2);
        let (pr, dr) = (
            g.runs(&p_list, 6, 100, 16, 0, 0).unwrap(),
            g.runs(&d_list, 6, 100, 16, 0, 0).unwrap(),
        );
        let runs = run_pairs(&pr, &dr, 100, 16);
        let plan = plan_runs(&p, &d, &runs, 0..6).unwrap();
        // 64 bytes a token a layer (K and V of two heads of 8 fp16): every token in layer 5,
        // tokens 80..100 (blocks 5 and 6) in the five others.
        assert_eq!(plan.bytes(), 100 * 64 + 5 * 20 * 64);
        let block = p[0].spec.block_bytes();
        for x in &plan.pairs[0].descriptors {
            let (layer, b) = (x.src_region, x.src_offset / block);
            if layer == 5 {
                assert!((10..17).contains(&(b as u32)), "{x:?}");
            } else {
                assert!((25..27).contains(&(b as u32)), "{x:?}");
                assert!((45..47).contains(&((x.dst_offset / block) as u32)), "{x:?}");
            }
        }
        // One layer at a time (push), the same bytes in all.
        let per_layer: u64 = (0..6)
            .map(|l| plan_runs(&p, &d, &runs, l..l + 1).unwrap().bytes())
            .sum();
        assert_eq!(per_layer, plan.bytes());
        // The single group plans as plan_layers does.
        let one = KvGroups::single();
        let list: Vec<u32> = (10..17).collect();
        let dl: Vec<u32> = (30..37).collect();
        let (a, b) = (
            one.runs(&list, 6, 100, 16, 0, 0).unwrap(),
            one.runs(&dl, 6, 100, 16, 0, 0).unwrap(),
        );
        assert_eq!(
            plan_runs(&p, &d, &run_pairs(&a, &b, 100, 16), 0..6).unwrap(),
            plan_layers(&p, &d, &list, &dl, 100, 0..6).unwrap()
        );
    }

    #[test]
    fn groups_sharing_memory_must_touch_different_blocks() {
        // vLLM's hybrid manager: layer 0 (sliding) and layer 5 (full) live in one tensor, each
        // group's blocks taken from the one pool.
        let mut d = tiny(6);
        d.layers[5] = d.layers[0];
        d.regions.retain(|r| r.id != 5);
        let (p, d) = ([tiny(6)], [d]);
        let g = hybrid(20);
        let p_list = g
            .clip(&[(10..17).collect(), (20..27).collect()], 100, 16, None)
            .unwrap();
        let plan_with = |d_list: Vec<u32>| {
            let pr = g.runs(&p_list, 6, 100, 16, 0, 0).unwrap();
            let dr = g.runs(&d_list, 6, 100, 16, 0, 0).unwrap();
            plan_runs(&p, &d, &run_pairs(&pr, &dr, 100, 16), 0..6)
        };
        let distinct: Vec<u32> = (30..37).chain(40..42).collect();
        assert!(plan_with(distinct).is_ok());
        // The control: the sliding group names a block of the full group's, so two layers
        // would write the same bytes.
        let shared: Vec<u32> = (30..37).chain([35, 36]).collect();
        assert!(matches!(plan_with(shared), Err(PlanError::Aliased { .. })));
    }

    #[test]
    fn groups_must_cover_every_layer_once() {
        let full = |layers: Vec<u32>| KvGroup {
            kind: GroupKind::Full,
            layers,
        };
        assert_eq!(
            KvGroups::new(vec![full(vec![0, 1]), full(vec![1, 2])], 3),
            Err(GroupError::Layer {
                layer: 1,
                count: 2,
                num_layers: 3
            })
        );
        assert_eq!(
            KvGroups::new(vec![full(vec![0, 2])], 3),
            Err(GroupError::Layer {
                layer: 1,
                count: 0,
                num_layers: 3
            })
        );
        assert!(matches!(
            KvGroups::new(vec![full(vec![0, 1, 7])], 3),
            Err(GroupError::Layer { layer: 7, .. })
        ));
        assert_eq!(
            KvGroups::new(vec![full(vec![])], 0),
            Err(GroupError::Empty { group: 0 })
        );
        let zero = KvGroup {
            kind: GroupKind::Sliding { window: 0 },
            layers: vec![0],
        };
        assert_eq!(
            KvGroups::new(vec![zero], 1),
            Err(GroupError::Empty { group: 0 })
        );
        // One full group of every layer is the single group: it pairs with an engine that
        // never named groups.
        assert_eq!(
            KvGroups::new(vec![full(vec![2, 0, 1])], 3),
            Ok(KvGroups::single())
        );
        // Groups decoded from a peer are checked the same way, and must be in the one
        // spelling `new` gives.
        assert_eq!(hybrid(9).validate(6), Ok(()));
        assert_eq!(KvGroups::single().validate(3), Ok(()));
        assert!(hybrid(9).validate(7).is_err());
        let forged = |groups| KvGroups { groups };
        assert!(forged(vec![full(vec![0, 1]), full(vec![1, 2])])
            .validate(3)
            .is_err());
        assert_eq!(
            forged(vec![full(vec![0, 1, 2])]).validate(3),
            Err(GroupError::Unsorted { group: 0 })
        );
        assert_eq!(
            forged(vec![full(vec![1, 0]), full(vec![2])]).validate(3),
            Err(GroupError::Unsorted { group: 0 })
        );
    }

    #[test]
    fn a_sliding_group_moves_its_window_and_a_full_group_everything() {
        let g = hybrid(9);
        // 40 tokens in blocks of 4: the full group moves blocks 0..10, the window blocks
        // 7..10: tokens 31..40, what the prompt's last token (39), computed again on D, attends
        // to.
        assert_eq!(g.moved(40, 4, 0).unwrap(), vec![0..10, 7..10]);
        // D's prefix-cache hit of 9 blocks: what is left of each.
        assert_eq!(g.moved(40, 4, 9).unwrap(), vec![9..10, 9..10]);
        // A prompt inside the window: every block of both.
        assert_eq!(g.moved(7, 4, 0).unwrap(), vec![0..2, 0..2]);
        assert_eq!(KvGroups::single().moved(40, 4, 0).unwrap(), vec![0..10]);
    }

    #[test]
    fn the_list_is_each_groups_moved_blocks_and_is_cut_back_the_same_way() {
        let g = hybrid(9);
        let full: Vec<u32> = (100..110).collect();
        // The sliding group's first 7 blocks were freed (vLLM's null block, 0).
        let mut sliding: Vec<u32> = (200..210).collect();
        sliding[..7].fill(0);
        let list = g
            .clip(&[full.clone(), sliding.clone()], 40, 4, Some(0))
            .unwrap();
        assert_eq!(list, [&full[..], &[207, 208, 209]].concat());
        let runs = g.runs(&list, 6, 40, 4, 0, 0).unwrap();
        assert_eq!(
            runs,
            vec![
                BlockRun {
                    kind: GroupKind::Full,
                    layers: vec![5],
                    first_block: 0,
                    blocks: full.clone()
                },
                BlockRun {
                    kind: GroupKind::Sliding { window: 9 },
                    layers: vec![0, 1, 2, 3, 4],
                    first_block: 7,
                    blocks: vec![207, 208, 209]
                },
            ]
        );
        assert_eq!(runs[1].tokens(40, 4), 12);
        // From block 9 on (a prefix hit): the tail of each, and D's list after such a hit is
        // what a cut from there gets.
        let runs = g.runs(&list, 6, 40, 4, 0, 9).unwrap();
        assert_eq!(runs[0].blocks, vec![109]);
        assert_eq!(runs[1].blocks, vec![209]);
        let after = g
            .clip_after(&[full.clone(), sliding.clone()], 40, 4, 9, Some(0))
            .unwrap();
        assert_eq!(after, vec![109, 209]);
        assert_eq!(g.runs(&after, 6, 40, 4, 9, 9).unwrap(), runs);
        // A list one block short or long is refused, not cut at the wrong place.
        for bad in [&list[1..], &[&list[..], &[7]].concat()[..]] {
            assert!(matches!(
                g.runs(bad, 6, 40, 4, 0, 0),
                Err(GroupError::Length { expected: 13, .. })
            ));
        }
        // A list built from block 9 on cannot serve a cut from block 0.
        assert!(matches!(
            g.runs(&list, 6, 40, 4, 9, 0),
            Err(GroupError::Skip { .. })
        ));
    }

    #[test]
    fn a_window_that_reaches_a_freed_block_is_refused() {
        let g = hybrid(9);
        let full: Vec<u32> = (100..110).collect();
        // P computed 40 tokens and freed what its next token would not attend to (tokens
        // before 32: blocks 0..8), but D computes token 39 again, whose window starts at token
        // 31, in block 7.
        let mut sliding: Vec<u32> = (200..210).collect();
        sliding[..8].fill(0);
        assert_eq!(
            g.clip(&[full.clone(), sliding], 40, 4, Some(0)),
            Err(GroupError::Window {
                group: 1,
                source: WindowError::NullInWindow { index: 7 }
            })
        );
        // The engine that computed the prompt can tell before its blocks are freed: the
        // window's first block ends at token 31, before 32, where the kept tokens start.
        assert!(matches!(
            g.check_producer_keeps(40, 4),
            Err(GroupError::Window { group: 1, .. })
        ));
        for n in [39, 41, 42, 7] {
            assert_eq!(g.check_producer_keeps(n, 4), Ok(()), "{n} tokens");
        }
        assert!(matches!(
            g.clip(std::slice::from_ref(&full), 40, 4, Some(0)),
            Err(GroupError::GroupCount { groups: 2, got: 1 })
        ));
        assert!(matches!(
            g.clip(&[full[..9].to_vec(), full.clone()], 40, 4, Some(0)),
            Err(GroupError::Window {
                group: 0,
                source: WindowError::TooShort { .. }
            })
        ));
    }

    /// Granite 4's shape on 6 layers: layer 5 full attention, a state in the others.
    #[test]
    fn a_state_group_moves_its_one_block_whatever_the_prompt_and_the_block_size() {
        let g = crate::testing::state_groups(&[5], 6);
        assert_eq!(g.describe(), "full[5] + state[0,1,2,3,4]");
        // 40 tokens in blocks of 4; D's prefix hit of 9 blocks leaves the state to move.
        assert_eq!(g.moved(40, 4, 0).unwrap(), vec![0..10, 0..1]);
        assert_eq!(g.moved(40, 4, 9).unwrap(), vec![9..10, 0..1]);
        // vLLM's state list may hold scratch blocks past the state: only the first moves.
        let list = g
            .clip(&[(100..110).collect(), vec![300, 301, 302]], 40, 4, Some(0))
            .unwrap();
        assert_eq!(list.last(), Some(&300));
        assert_eq!(list.len(), 11);
        let runs = g.runs(&list, 6, 40, 4, 0, 0).unwrap();
        assert_eq!(runs[1].blocks, vec![300]);
        assert_eq!(
            (runs[0].tokens(40, 4), runs[1].tokens(40, 4)),
            (40, 1),
            "the state is one slot"
        );
        // Planned: every token of layer 5, one slot of each state layer (64 bytes a slot).
        let (p, d) = ([tiny(6)], [tiny(6)]);
        let d_list = g
            .clip(&[(30..37).collect(), vec![50]], 100, 16, None)
            .unwrap();
        let p_list = g
            .clip(&[(10..17).collect(), vec![20]], 100, 16, None)
            .unwrap();
        let (pr, dr) = (
            g.runs(&p_list, 6, 100, 16, 0, 0).unwrap(),
            g.runs(&d_list, 6, 100, 16, 0, 0).unwrap(),
        );
        let plan = plan_runs(&p, &d, &run_pairs(&pr, &dr, 100, 16), 0..6).unwrap();
        assert_eq!(plan.bytes(), 100 * 64 + 5 * 64);
        // Block sizes may differ (the state is in slot 0 on both sides); another kind of
        // group may not pair with a state group.
        assert_eq!(g.check_pair(&g.clone(), 16, 32), Ok(()));
        assert!(g.check_pair(&hybrid(9), 16, 16).is_err());
        assert_eq!(g.check_producer_keeps(40, 4), Ok(()));
    }

    #[test]
    fn engines_pair_only_with_the_same_groups() {
        let g = hybrid(9);
        assert_eq!(g.check_pair(&g.clone(), 16, 16), Ok(()));
        let e = g.check_pair(&KvGroups::single(), 16, 16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "KV cache groups differ: P has full[5] + window 9[0,1,2,3,4], D has one \
             full-attention group"
        );
        assert!(g.check_pair(&hybrid(10), 16, 16).is_err());
        assert_eq!(
            g.check_pair(&g.clone(), 16, 32),
            Err(GroupMismatch::BlockSize { p: 16, d: 32 })
        );
        // Without a window, block sizes may differ as before.
        assert_eq!(
            KvGroups::single().check_pair(&KvGroups::single(), 16, 32),
            Ok(())
        );
    }
}
