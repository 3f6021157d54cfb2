//! What one handoff moves, as runs the planner plans: P's and D's blocks of each KV cache group
//! that moves anything, from the same token on (after D's prefix-cache hit), with the tokens to
//! plan. A read plans every run at once; a push plans them a layer at a time.
//!
//! A model of one group is one run of every layer, exactly as before groups: P's blocks from
//! the first token after D's hit, D's blocks as D listed them, whole blocks moved where both
//! sides have them (the tail past the prompt is zeroed on arrival). A hybrid model's handoff
//! list is each group's moved blocks in group order (`handoff_plan::KvGroups`); both sides cut it
//! back the same way and a list of any other length is refused. Its runs move exactly the
//! prompt's tokens (on pages the engine keeps opaque, whole blocks, as every page is moved), so
//! no block's tail is left to zero.

use handoff_plan::{KvGroups, Plan, RankLayout, RunPair};

/// One group's blocks on both sides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct MovedRun {
    /// The group's layers, ascending.
    pub layers: Vec<u32>,
    pub p_blocks: Vec<u32>,
    pub d_blocks: Vec<u32>,
    /// Tokens to plan from the runs' first blocks on (at least the prompt's there).
    pub tokens: u32,
}

/// One side of a handoff: its block list and its block size.
#[derive(Debug, Clone, Copy)]
pub(super) struct SideBlocks<'a> {
    pub blocks: &'a [u32],
    pub block_size: u32,
}

/// What is left of a handoff of `num_tokens` tokens to move once D's first `skip` tokens came
/// from its prefix cache: P's list (built from its first block), D's (built from the block after
/// its hit). `whole_pages`: the engine's pages are opaque and move whole.
pub(super) fn moved_runs(
    groups: &KvGroups,
    num_layers: u32,
    (p, d): (SideBlocks<'_>, SideBlocks<'_>),
    num_tokens: u32,
    skip: u32,
    whole_pages: bool,
) -> Result<Vec<MovedRun>, String> {
    let (p_bs, d_bs) = (p.block_size.max(1), d.block_size.max(1));
    if skip % p_bs != 0 || skip % d_bs != 0 || skip >= num_tokens {
        return Err(format!(
            "{skip} cached tokens do not end a block of P's ({p_bs} tokens) inside the prompt"
        ));
    }
    if groups.is_single() {
        let Some(src) = p.blocks.get((skip / p_bs) as usize..) else {
            return Err(format!(
                "P's {} blocks end before D's {skip} cached tokens",
                p.blocks.len()
            ));
        };
        return Ok(vec![MovedRun {
            layers: (0..num_layers).collect(),
            tokens: whole_blocks((src, p_bs), (d.blocks, d_bs), num_tokens - skip),
            p_blocks: src.to_vec(),
            d_blocks: d.blocks.to_vec(),
        }]);
    }
    let cut = |s: SideBlocks<'_>, bs: u32, built: u32| {
        groups
            .runs(s.blocks, num_layers, num_tokens, bs, built, skip / bs)
            .map_err(|e| e.to_string())
    };
    let p_runs = cut(p, p_bs, 0).map_err(|e| format!("P's blocks: {e}"))?;
    let d_runs = cut(d, d_bs, skip / d_bs).map_err(|e| format!("D's blocks: {e}"))?;
    Ok(p_runs
        .into_iter()
        .zip(d_runs)
        .map(|(p, d)| {
            let exact = p.tokens(num_tokens, p_bs);
            MovedRun {
                tokens: if whole_pages {
                    whole_blocks((&p.blocks, p_bs), (&d.blocks, d_bs), exact)
                } else {
                    exact
                },
                layers: p.layers,
                p_blocks: p.blocks,
                d_blocks: d.blocks,
            }
        })
        .collect())
}

/// The plan of `layers` of `runs`.
pub(super) fn plan(
    p: &[RankLayout],
    d: &[RankLayout],
    runs: &[MovedRun],
    layers: std::ops::Range<u32>,
) -> Result<Plan, handoff_plan::PlanError> {
    let pairs: Vec<RunPair<'_>> = runs
        .iter()
        .map(|r| RunPair {
            layers: &r.layers,
            p_blocks: &r.p_blocks,
            d_blocks: &r.d_blocks,
            num_tokens: r.tokens,
        })
        .collect();
    handoff_plan::plan_runs(p, d, &pairs, layers)
}

/// How many tokens to move so that whole blocks go where both sides have them (the planner
/// cuts at this many tokens): at least the prompt's `num_tokens`.
pub(super) fn whole_blocks(p: (&[u32], u32), d: (&[u32], u32), num_tokens: u32) -> u32 {
    let p_cap = p.0.len() as u64 * p.1 as u64;
    let d_cap = d.0.len() as u64 * d.1 as u64;
    p_cap.min(d_cap).max(num_tokens as u64) as u32
}
