//! The planner: block lists → per-pair descriptor lists, coalesced and bounds-checked.
//!
//! One file, over 800 lines: the planner's invariants (one descriptor per contiguous run, no byte
//! outside the blocks, every layout) are checked against one body of code.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::layout::{BlockLayout, LayoutError, RankLayout, Side};
use crate::topology::{check_compatible, Incompatible, Topology};

/// One contiguous copy: `len` bytes from P's region `src_region` at `src_offset` to D's region
/// `dst_region` at `dst_offset`. The same list serves a READ posted by D and a WRITE posted by P.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Descriptor {
    /// Region id in the P rank's layout.
    pub src_region: u32,
    /// Byte offset in that region.
    pub src_offset: u64,
    /// Region id in the D rank's layout.
    pub dst_region: u32,
    /// Byte offset in that region.
    pub dst_offset: u64,
    /// Bytes to copy (> 0).
    pub len: u64,
}

/// A byte range of one region of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Span {
    /// Region id.
    pub region: u32,
    /// Byte offset.
    pub offset: u64,
    /// Bytes (> 0).
    pub len: u64,
}

/// The descriptors of one (D rank, P rank) pair, sorted by source address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairPlan {
    /// The D rank (destination memory).
    pub d_rank: u32,
    /// The P rank (source memory).
    pub p_rank: u32,
    /// Global KV heads this pair moves.
    pub heads: Range<u32>,
    /// Maximal contiguous copies, sorted by (src_region, src_offset).
    pub descriptors: Vec<Descriptor>,
}

impl PairPlan {
    /// Total bytes the pair moves.
    pub fn bytes(&self) -> u64 {
        self.descriptors.iter().map(|d| d.len).sum()
    }
}

/// A whole transfer: one [`PairPlan`] per pair of the topology, ordered by D rank then P rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The rank mapping the plan follows.
    pub topology: Topology,
    /// One entry per pair that moves data.
    pub pairs: Vec<PairPlan>,
}

impl Plan {
    /// The plan of one pair, if the two ranks share heads.
    pub fn pair(&self, d_rank: u32, p_rank: u32) -> Option<&PairPlan> {
        self.pairs
            .iter()
            .find(|p| p.d_rank == d_rank && p.p_rank == p_rank)
    }

    /// Descriptors over all pairs.
    pub fn descriptor_count(&self) -> usize {
        self.pairs.iter().map(|p| p.descriptors.len()).sum()
    }

    /// Bytes over all pairs.
    pub fn bytes(&self) -> u64 {
        self.pairs.iter().map(PairPlan::bytes).sum()
    }
}

/// Why a transfer cannot be planned. Never a panic: every bad input is one of these.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// The engines cannot exchange KV at all.
    #[error(transparent)]
    Incompatible(#[from] Incompatible),
    /// A rank's layout is invalid.
    #[error("{side} rank {rank}: {source}")]
    Layout {
        /// Engine.
        side: Side,
        /// Rank.
        rank: u32,
        /// What is wrong.
        source: LayoutError,
    },
    /// [`plan`] needs every rank's layout in rank order; one is missing.
    #[error("{side} rank {rank}'s layout is missing: plan() needs every rank, in rank order")]
    MissingRank {
        /// Engine.
        side: Side,
        /// The missing rank.
        rank: u32,
    },
    /// [`plan`] needs layouts in rank order.
    #[error(
        "{side} layout at index {index} is for rank {rank}: plan() needs layouts in rank order"
    )]
    RankOrder {
        /// Engine.
        side: Side,
        /// Index in the slice.
        index: usize,
        /// Rank found there.
        rank: u32,
    },
    /// Ranks of one engine disagree on the engine-wide spec.
    #[error("{side} rank {rank}'s KV spec differs from rank 0's")]
    SpecDiffers {
        /// Engine.
        side: Side,
        /// Rank.
        rank: u32,
    },
    /// The two ranks share no KV head, so nothing moves between them.
    #[error("D rank {d_rank} and P rank {p_rank} share no KV head")]
    NotAPair {
        /// D rank.
        d_rank: u32,
        /// P rank.
        p_rank: u32,
    },
    /// The layer range is not inside `0..num_layers`.
    #[error("layer range {start}..{end} is not inside 0..{num_layers}")]
    LayerRange {
        /// Start.
        start: u32,
        /// End.
        end: u32,
        /// Layers of the model.
        num_layers: u32,
    },
    /// The block list does not have `ceil(num_tokens / block_size)` entries.
    #[error(
        "{side} block list has {got} blocks but {num_tokens} tokens in blocks of {block_size} \
         need exactly {expected}"
    )]
    BlockCount {
        /// Engine.
        side: Side,
        /// Blocks needed.
        expected: u32,
        /// Blocks given.
        got: usize,
        /// Tokens to move.
        num_tokens: u32,
        /// Tokens per block on that side.
        block_size: u32,
    },
    /// A block id is not in the rank's pool.
    #[error("{side} rank {rank}: block id {block} (list index {index}) is outside the pool of {num_blocks} blocks")]
    BlockOutOfPool {
        /// Engine.
        side: Side,
        /// Rank.
        rank: u32,
        /// Index in the block list.
        index: usize,
        /// The id.
        block: u32,
        /// Pool size.
        num_blocks: u32,
    },
    /// A block id appears twice in one list (two token ranges would share memory).
    #[error("{side} block id {block} appears more than once in the block list")]
    DuplicateBlock {
        /// Engine.
        side: Side,
        /// The id.
        block: u32,
    },
    /// A planned range does not fit in its region (defence in depth: validated layouts never
    /// produce one).
    #[error(
        "{side} rank {rank}: range {offset}+{len} does not fit in region {region} ({region_len} bytes)"
    )]
    OutOfRegion {
        /// Engine.
        side: Side,
        /// Rank.
        rank: u32,
        /// Region id.
        region: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region length (0 if the region is unknown).
        region_len: u64,
    },
    /// An address computation overflowed `u64`.
    #[error("{side} rank {rank}: address arithmetic overflows u64")]
    Overflow {
        /// Engine.
        side: Side,
        /// Rank.
        rank: u32,
    },
    /// Two planned ranges overlap: the layout maps different (layer, plane, block) to the same
    /// bytes, so the copy would read or write the same bytes twice.
    #[error(
        "{side} rank {rank}: planned ranges overlap in region {region} at offset {offset}; the \
         layout aliases blocks, planes or layers"
    )]
    Aliased {
        /// Engine.
        side: Side,
        /// Rank.
        rank: u32,
        /// Region id.
        region: u32,
        /// Offset where the overlap starts.
        offset: u64,
    },
}

/// Plans the whole transfer, every layer, between all ranks of P (`p[i]` = rank `i`) and all
/// ranks of D (`d[i]` = rank `i`).
///
/// `p_blocks` / `d_blocks` are the request's block ids in token order (the same ids on every rank
/// of an engine) and must hold exactly `ceil(num_tokens / block_size)` ids each; only the first
/// `num_tokens` tokens are moved.
pub fn plan(
    p: &[RankLayout],
    d: &[RankLayout],
    p_blocks: &[u32],
    d_blocks: &[u32],
    num_tokens: u32,
) -> Result<Plan, PlanError> {
    let layers = p.first().map_or(0, |l| l.spec.shape.num_layers);
    plan_layers(p, d, p_blocks, d_blocks, num_tokens, 0..layers)
}

/// [`plan`] restricted to `layers` (e.g. one layer at a time, for push mode's layer-by-layer
/// writes). A layout that places several layers in one contiguous range is then cut at layer
/// boundaries.
pub fn plan_layers(
    p: &[RankLayout],
    d: &[RankLayout],
    p_blocks: &[u32],
    d_blocks: &[u32],
    num_tokens: u32,
    layers: Range<u32>,
) -> Result<Plan, PlanError> {
    let (p0, d0) = match (p.first(), d.first()) {
        (Some(p0), Some(d0)) => (p0, d0),
        (None, _) => {
            return Err(PlanError::MissingRank {
                side: Side::Prefill,
                rank: 0,
            })
        }
        (_, None) => {
            return Err(PlanError::MissingRank {
                side: Side::Decode,
                rank: 0,
            })
        }
    };
    let topology = check_compatible(&p0.spec, &d0.spec)?;
    for (side, ranks) in [(Side::Prefill, p), (Side::Decode, d)] {
        check_rank_set(side, ranks)?;
    }
    let req = Request::new(p0, d0, p_blocks, d_blocks, num_tokens, layers)?;
    for l in p {
        req.check_pool(Side::Prefill, l)?;
    }
    for l in d {
        req.check_pool(Side::Decode, l)?;
    }
    let mut pairs = Vec::new();
    for pair in topology.pairs() {
        // Indexing is sound: check_rank_set proved p[i].rank == i for every i < tp, and every
        // rank of topology.pairs() is < tp.
        let (pl, dl) = (&p[pair.p_rank as usize], &d[pair.d_rank as usize]);
        let descriptors = req.pair(pl, dl, pair.heads.clone())?;
        pairs.push(PairPlan {
            d_rank: pair.d_rank,
            p_rank: pair.p_rank,
            heads: pair.heads,
            descriptors,
        });
    }
    // Different pairs of one D rank must write disjoint bytes too (different heads, unless the
    // layout aliases).
    for d_rank in 0..topology.d_tp() {
        let spans = pairs
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
    Ok(Plan { topology, pairs })
}

/// Plans one (P rank, D rank) pair over every layer: what a D worker needs for each of
/// `Topology::sources(d_rank)`, or a P worker for each of `Topology::readers(p_rank)`.
pub fn plan_pair(
    p: &RankLayout,
    d: &RankLayout,
    p_blocks: &[u32],
    d_blocks: &[u32],
    num_tokens: u32,
) -> Result<PairPlan, PlanError> {
    plan_pair_layers(
        p,
        d,
        p_blocks,
        d_blocks,
        num_tokens,
        0..p.spec.shape.num_layers,
    )
}

/// [`plan_pair`] restricted to `layers`.
pub fn plan_pair_layers(
    p: &RankLayout,
    d: &RankLayout,
    p_blocks: &[u32],
    d_blocks: &[u32],
    num_tokens: u32,
    layers: Range<u32>,
) -> Result<PairPlan, PlanError> {
    let topology = check_compatible(&p.spec, &d.spec)?;
    validate(Side::Prefill, p)?;
    validate(Side::Decode, d)?;
    let heads = topology
        .pair_heads(d.rank, p.rank)
        .ok_or(PlanError::NotAPair {
            d_rank: d.rank,
            p_rank: p.rank,
        })?;
    let req = Request::new(p, d, p_blocks, d_blocks, num_tokens, layers)?;
    req.check_pool(Side::Prefill, p)?;
    req.check_pool(Side::Decode, d)?;
    let descriptors = req.pair(p, d, heads.clone())?;
    Ok(PairPlan {
        d_rank: d.rank,
        p_rank: p.rank,
        heads,
        descriptors,
    })
}

/// The bytes of D's destination blocks that a transfer of `num_tokens` tokens does not write:
/// the tail (tokens `num_tokens mod block_size ..`) of the last, partially filled block, for
/// every layer, K and V, every head of the rank. They hold whatever the block held before; a
/// caller that must not expose stale bytes zeroes these spans (the planner never plans writes
/// beyond the request's tokens, so it cannot zero them itself). Empty when the last block is full.
/// Coalesced and sorted like descriptors.
pub fn uncovered_dst(
    d: &RankLayout,
    d_blocks: &[u32],
    num_tokens: u32,
) -> Result<Vec<Span>, PlanError> {
    validate(Side::Decode, d)?;
    let spec = &d.spec;
    let expected = spec.blocks_for(num_tokens);
    check_block_list(
        Side::Decode,
        d_blocks,
        expected,
        num_tokens,
        spec.block_size,
    )?;
    check_pool(Side::Decode, d, d_blocks, max_id(d_blocks))?;
    let bs = spec.block_size;
    let filled = num_tokens % bs;
    let Some(&last_block) = d_blocks.last() else {
        return Ok(Vec::new());
    };
    if filled == 0 {
        return Ok(Vec::new());
    }
    // A row of K and V interleaved is one double row: K's tail covers V's.
    let (pitch, planes) = (spec.row_pitch(), spec.planes_apart() as usize);
    let hpr = spec.heads_per_rank();
    let ovf = PlanError::Overflow {
        side: Side::Decode,
        rank: d.rank,
    };
    // Head-major: every head has its own tail; token-major: the tail is one range.
    let (pieces, piece_len) = match spec.block_layout.order() {
        BlockLayout::TokenMajor => (1, u64::from(bs - filled) * u64::from(hpr) * pitch),
        _ => (hpr, u64::from(bs - filled) * pitch),
    };
    let mut out: Vec<Descriptor> = Vec::new();
    for (layer, lp) in (0u32..).zip(&d.layers) {
        for kv in 0..planes {
            let region = lp.plane(kv).region;
            for h in 0..pieces {
                let off = d
                    .row_offset(layer, kv, last_block, h, filled)
                    .ok_or(ovf.clone())?;
                push_span(&mut out, region, off, piece_len);
            }
        }
    }
    let spans = finish_spans(Side::Decode, d, out)?;
    check_disjoint(Side::Decode, d.rank, spans.clone())?;
    Ok(spans)
}

/// Every byte of `blocks` on this rank: every layer, K and V, every head, every token slot.
/// What a transport may let a peer read (P) or write (D) for a handoff, and nothing more.
/// Coalesced and sorted like descriptors; duplicate block ids count once.
pub fn block_spans(l: &RankLayout, blocks: &[u32]) -> Result<Vec<Span>, PlanError> {
    spans_of_layers(l, 0..l.spec.shape.num_layers, blocks)
}

/// The bytes of `blocks` in one layer (every head, K and V): what a layer-wise transfer may
/// touch once that layer is saved, and how a checker tells which layer a byte belongs to.
pub fn layer_block_spans(
    l: &RankLayout,
    layer: u32,
    blocks: &[u32],
) -> Result<Vec<Span>, PlanError> {
    spans_of_layers(l, layer..layer.saturating_add(1), blocks)
}

fn spans_of_layers(
    l: &RankLayout,
    layers: Range<u32>,
    blocks: &[u32],
) -> Result<Vec<Span>, PlanError> {
    validate(Side::Prefill, l)?;
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    check_pool(Side::Prefill, l, &sorted, max_id(&sorted))?;
    let spec = &l.spec;
    let ovf = PlanError::Overflow {
        side: Side::Prefill,
        rank: l.rank,
    };
    let mut out: Vec<Descriptor> = Vec::new();
    for (layer, lp) in (0u32..).zip(&l.layers) {
        if !layers.contains(&layer) {
            continue;
        }
        // Heads inside the block: one plane per block (both at once when K and V rows
        // interleave); heads outside: one run per head.
        let (pieces, piece_len) = if lp.head_stride == 0 {
            (1, spec.walk_bytes())
        } else {
            (
                spec.heads_per_rank(),
                u64::from(spec.block_size) * spec.shape.row_bytes(),
            )
        };
        for kv in 0..spec.planes_apart() as usize {
            let region = lp.plane(kv).region;
            for h in 0..pieces {
                for &b in &sorted {
                    let off = l.row_offset(layer, kv, b, h, 0).ok_or(ovf.clone())?;
                    push_span(&mut out, region, off, piece_len);
                }
            }
        }
    }
    finish_spans(Side::Prefill, l, out)
}

/// Adds a span of one rank's memory to `out`, merged with the previous one when contiguous
/// (spans reuse the descriptor merge logic with src = dst).
fn push_span(out: &mut Vec<Descriptor>, region: u32, offset: u64, len: u64) {
    push_merge(
        out,
        Descriptor {
            src_region: region,
            src_offset: offset,
            dst_region: region,
            dst_offset: offset,
            len,
        },
    );
}

/// The spans collected with [`push_span`], sorted and coalesced, each checked inside `l`'s
/// regions.
fn finish_spans(side: Side, l: &RankLayout, out: Vec<Descriptor>) -> Result<Vec<Span>, PlanError> {
    let spans: Vec<Span> = finish(out)
        .iter()
        .map(|x| Span {
            region: x.src_region,
            offset: x.src_offset,
            len: x.len,
        })
        .collect();
    for s in &spans {
        bounds(side, l, s.region, s.offset, s.len)?;
    }
    Ok(spans)
}

/// One run of tokens that lies in one P block and one D block.
#[derive(Debug, Clone, Copy)]
struct Seg {
    p_block: u32,
    p_tok: u32,
    d_block: u32,
    d_tok: u32,
    n: u32,
}

/// A validated request: block lists checked, token runs computed once for all pairs.
struct Request<'a> {
    p_blocks: &'a [u32],
    d_blocks: &'a [u32],
    p_max: Option<u32>,
    d_max: Option<u32>,
    segs: Vec<Seg>,
    layers: Range<u32>,
}

impl<'a> Request<'a> {
    fn new(
        p: &RankLayout,
        d: &RankLayout,
        p_blocks: &'a [u32],
        d_blocks: &'a [u32],
        num_tokens: u32,
        layers: Range<u32>,
    ) -> Result<Self, PlanError> {
        let num_layers = p.spec.shape.num_layers;
        if layers.start > layers.end || layers.end > num_layers {
            return Err(PlanError::LayerRange {
                start: layers.start,
                end: layers.end,
                num_layers,
            });
        }
        let (pbs, dbs) = (p.spec.block_size, d.spec.block_size);
        check_block_list(
            Side::Prefill,
            p_blocks,
            p.spec.blocks_for(num_tokens),
            num_tokens,
            pbs,
        )?;
        check_block_list(
            Side::Decode,
            d_blocks,
            d.spec.blocks_for(num_tokens),
            num_tokens,
            dbs,
        )?;
        // Walk the tokens once, cutting at every P or D block boundary: O(#P blocks + #D blocks).
        let mut segs = Vec::with_capacity(p_blocks.len().max(d_blocks.len()) + 1);
        let mut g = 0u32;
        while g < num_tokens {
            let (i, j) = (g / pbs, g / dbs);
            let (p_tok, d_tok) = (g % pbs, g % dbs);
            let n = (pbs - p_tok).min(dbs - d_tok).min(num_tokens - g);
            // Indexing is sound: the lists hold ceil(num_tokens / bs) ids (checked above) and
            // g < num_tokens, so g / bs < ceil(num_tokens / bs).
            segs.push(Seg {
                p_block: p_blocks[i as usize],
                p_tok,
                d_block: d_blocks[j as usize],
                d_tok,
                n,
            });
            g += n;
        }
        Ok(Self {
            p_blocks,
            d_blocks,
            p_max: max_id(p_blocks),
            d_max: max_id(d_blocks),
            segs,
            layers,
        })
    }

    fn check_pool(&self, side: Side, l: &RankLayout) -> Result<(), PlanError> {
        match side {
            Side::Prefill => check_pool(side, l, self.p_blocks, self.p_max),
            Side::Decode => check_pool(side, l, self.d_blocks, self.d_max),
        }
    }

    /// The descriptors of one pair (layouts validated, compatible, block ids in both pools).
    fn pair(
        &self,
        p: &RankLayout,
        d: &RankLayout,
        heads: Range<u32>,
    ) -> Result<Vec<Descriptor>, PlanError> {
        if heads.is_empty() {
            // A pair that only confirms: another source gave D these replicated heads.
            return Ok(Vec::new());
        }
        let (ps, ds) = (&p.spec, &d.spec);
        let (p_il, d_il) = (ps.block_layout.interleaved(), ds.block_layout.interleaved());
        // K and V rows interleaved on both sides: a token's K and V rows are one double row on
        // both, moved with K's (V has nothing left). On one side only: a row is contiguous with
        // the next on neither side at once, so every row is its own descriptor.
        let (unit, planes) = if p_il && d_il {
            (ps.row_pitch(), 0..ps.planes_apart() as usize)
        } else {
            // K and V, or a latent's one plane (both sides alike: check_compatible).
            (ps.shape.row_bytes(), 0..ps.block_layout.planes() as usize)
        };
        let row_by_row = p_il != d_il;
        let (p_hpr, d_hpr) = (ps.heads_per_rank(), ds.heads_per_rank());
        // Local index of the pair's first head on each side, and how many heads it moves.
        let p_head = heads.start - p.owned_heads().start;
        let d_head = heads.start - d.owned_heads().start;
        let nh = heads.end - heads.start;
        let p_ovf = PlanError::Overflow {
            side: Side::Prefill,
            rank: p.rank,
        };
        let d_ovf = PlanError::Overflow {
            side: Side::Decode,
            rank: d.rank,
        };
        let mut out = Vec::new();
        for layer in self.layers.clone() {
            // Indexing is sound: validate() proved layers.len() == num_layers, and Request::new
            // proved self.layers ⊆ 0..num_layers (both engines have the same num_layers).
            let (pl, dl) = (&p.layers[layer as usize], &d.layers[layer as usize]);
            for kv in planes.clone() {
                let (src, dst) = (pl.plane(kv), dl.plane(kv));
                for s in &self.segs {
                    // Where (local head, token) of this run lives on each side.
                    let src_at = |h: u32, t: u32| {
                        p.row_offset(layer, kv, s.p_block, h, t)
                            .ok_or(p_ovf.clone())
                    };
                    let dst_at = |h: u32, t: u32| {
                        d.row_offset(layer, kv, s.d_block, h, t)
                            .ok_or(d_ovf.clone())
                    };
                    let mut emit = |src_offset: u64, dst_offset: u64, rows: u64| {
                        let len = rows * unit;
                        src_offset.checked_add(len).ok_or(p_ovf.clone())?;
                        dst_offset.checked_add(len).ok_or(d_ovf.clone())?;
                        push_merge(
                            &mut out,
                            Descriptor {
                                src_region: src.region,
                                src_offset,
                                dst_region: dst.region,
                                dst_offset,
                                len,
                            },
                        );
                        Ok::<(), PlanError>(())
                    };
                    match ps.block_layout.order() {
                        _ if row_by_row => {
                            for h in 0..nh {
                                for t in 0..s.n {
                                    emit(
                                        src_at(p_head + h, s.p_tok + t)?,
                                        dst_at(d_head + h, s.d_tok + t)?,
                                        1,
                                    )?;
                                }
                            }
                        }
                        // Head-major (heads inside the block or outside it): each head's tokens
                        // of this run are contiguous on both sides. Heads, blocks and layers
                        // merge with each other wherever the addresses continue on both sides
                        // (push_merge and finish find that out).
                        BlockLayout::HeadMajor => {
                            for h in 0..nh {
                                emit(
                                    src_at(p_head + h, s.p_tok)?,
                                    dst_at(d_head + h, s.d_tok)?,
                                    u64::from(s.n),
                                )?;
                            }
                        }
                        // Token-major (heads always inside the block: validate refuses a head
                        // stride), and the pair moves every head of both ranks: the whole run
                        // of tokens is one contiguous range on both sides.
                        BlockLayout::TokenMajor if nh == p_hpr && nh == d_hpr => {
                            emit(
                                src_at(0, s.p_tok)?,
                                dst_at(0, s.d_tok)?,
                                u64::from(s.n) * u64::from(nh),
                            )?;
                        }
                        // Token-major with a head slice: contiguous only within one token.
                        _ => {
                            for t in 0..s.n {
                                emit(
                                    src_at(p_head, s.p_tok + t)?,
                                    dst_at(d_head, s.d_tok + t)?,
                                    u64::from(nh),
                                )?;
                            }
                        }
                    }
                }
            }
        }
        let out = finish(out);
        for x in &out {
            bounds(Side::Prefill, p, x.src_region, x.src_offset, x.len)?;
            bounds(Side::Decode, d, x.dst_region, x.dst_offset, x.len)?;
        }
        // `out` is sorted by source: overlapping sources are neighbours.
        for w in out.windows(2) {
            if w[0].src_region == w[1].src_region && w[0].src_offset + w[0].len > w[1].src_offset {
                return Err(PlanError::Aliased {
                    side: Side::Prefill,
                    rank: p.rank,
                    region: w[1].src_region,
                    offset: w[1].src_offset,
                });
            }
        }
        let spans = out.iter().map(|x| Span {
            region: x.dst_region,
            offset: x.dst_offset,
            len: x.len,
        });
        check_disjoint(Side::Decode, d.rank, spans.collect())?;
        Ok(out)
    }
}

fn validate(side: Side, l: &RankLayout) -> Result<(), PlanError> {
    l.validate().map_err(|source| PlanError::Layout {
        side,
        rank: l.rank,
        source,
    })
}

/// Every rank `0..tp` present once, in order, valid, with the same spec.
fn check_rank_set(side: Side, ranks: &[RankLayout]) -> Result<(), PlanError> {
    let Some(first) = ranks.first() else {
        return Err(PlanError::MissingRank { side, rank: 0 });
    };
    for (index, l) in ranks.iter().enumerate() {
        if u32::try_from(index) != Ok(l.rank) {
            return Err(PlanError::RankOrder {
                side,
                index,
                rank: l.rank,
            });
        }
        if l.spec != first.spec {
            return Err(PlanError::SpecDiffers { side, rank: l.rank });
        }
        validate(side, l)?;
    }
    // All ranks are < tp (validated) and in order, so only a short list can be incomplete.
    if ranks.len() < first.spec.tp as usize {
        return Err(PlanError::MissingRank {
            side,
            rank: ranks.len() as u32,
        });
    }
    Ok(())
}

fn check_block_list(
    side: Side,
    blocks: &[u32],
    expected: u32,
    num_tokens: u32,
    block_size: u32,
) -> Result<(), PlanError> {
    if blocks.len() != expected as usize {
        return Err(PlanError::BlockCount {
            side,
            expected,
            got: blocks.len(),
            num_tokens,
            block_size,
        });
    }
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(PlanError::DuplicateBlock { side, block: w[0] });
    }
    Ok(())
}

fn max_id(blocks: &[u32]) -> Option<u32> {
    blocks.iter().copied().max()
}

fn check_pool(
    side: Side,
    l: &RankLayout,
    blocks: &[u32],
    max: Option<u32>,
) -> Result<(), PlanError> {
    if max.is_some_and(|m| m >= l.num_blocks) {
        if let Some((index, &block)) = blocks.iter().enumerate().find(|(_, &b)| b >= l.num_blocks) {
            return Err(PlanError::BlockOutOfPool {
                side,
                rank: l.rank,
                index,
                block,
                num_blocks: l.num_blocks,
            });
        }
    }
    Ok(())
}

pub(crate) fn bounds(
    side: Side,
    l: &RankLayout,
    region: u32,
    offset: u64,
    len: u64,
) -> Result<(), PlanError> {
    let region_len = l.region_len(region);
    match (region_len, offset.checked_add(len)) {
        (Some(rl), Some(end)) if end <= rl => Ok(()),
        _ => Err(PlanError::OutOfRegion {
            side,
            rank: l.rank,
            region,
            offset,
            len,
            region_len: region_len.unwrap_or(0),
        }),
    }
}

/// Appends `d`, extending the last descriptor instead when `d` continues it on both sides.
fn push_merge(out: &mut Vec<Descriptor>, d: Descriptor) {
    if let Some(last) = out.last_mut() {
        if continues(last, &d) {
            last.len += d.len;
            return;
        }
    }
    out.push(d);
}

fn continues(a: &Descriptor, b: &Descriptor) -> bool {
    a.src_region == b.src_region
        && a.dst_region == b.dst_region
        && a.src_offset.checked_add(a.len) == Some(b.src_offset)
        && a.dst_offset.checked_add(a.len) == Some(b.dst_offset)
}

/// Sorts by source and merges every neighbour pair that continues on both sides.
///
/// Why this is exact (minimal): the copy is a one-to-one map from source bytes to destination
/// bytes, and a descriptor is a source interval on which the map is a shift. Sorting by source
/// makes every such interval a run of neighbours, so greedy merging of neighbours yields the
/// maximal runs, and no list can have fewer descriptors. Emission order (token order, which
/// follows the block *lists*, not addresses) does not matter: a shuffled allocation whose P and D
/// blocks happen to be address-contiguous in the same order still becomes one descriptor.
fn finish(mut v: Vec<Descriptor>) -> Vec<Descriptor> {
    v.sort_unstable_by_key(|d| (d.src_region, d.src_offset, d.dst_region, d.dst_offset));
    let mut out: Vec<Descriptor> = Vec::with_capacity(v.len());
    for d in v {
        push_merge(&mut out, d);
    }
    out
}

/// Fails if two spans of one rank overlap.
pub(crate) fn check_disjoint(side: Side, rank: u32, mut spans: Vec<Span>) -> Result<(), PlanError> {
    spans.sort_unstable_by_key(|s| (s.region, s.offset));
    for w in spans.windows(2) {
        if w[0].region == w[1].region && w[0].offset.saturating_add(w[0].len) > w[1].offset {
            return Err(PlanError::Aliased {
                side,
                rank,
                region: w[1].region,
                offset: w[1].offset,
            });
        }
    }
    Ok(())
}
