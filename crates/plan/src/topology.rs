//! Which D rank reads which heads from which P rank, and the handshake compatibility check.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::layout::{check_heads, owned_heads, BlockLayout, KvSpec, Side, SpecError};

/// Why two engines cannot exchange KV. Every message says what differs, with both values.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Incompatible {
    /// One engine's spec is unusable on its own (zero size, tp > KV heads, uneven head split).
    #[error("{side} engine: {source}")]
    Spec {
        /// The engine.
        side: Side,
        /// What is wrong with it.
        source: SpecError,
    },
    /// A model-shape field differs: the engines do not serve the same model.
    #[error("model shape differs: {field} is {p} on P but {d} on D")]
    Shape {
        /// `num_layers`, `num_kv_heads` or `head_dim`.
        field: &'static str,
        /// P's value.
        p: u32,
        /// D's value.
        d: u32,
    },
    /// The KV dtypes differ in size (e.g. bf16 vs fp8): bytes cannot be copied as they are.
    #[error(
        "KV dtype size differs: {p} bytes per element on P but {d} on D (no conversion is done)"
    )]
    DtypeSize {
        /// P's element size.
        p: u32,
        /// D's element size.
        d: u32,
    },
    /// Neither TP size divides the other, so head ranges would straddle ranks irregularly.
    #[error("tensor-parallel sizes do not divide each other: P tp {p_tp}, D tp {d_tp}")]
    TpNotDivisible {
        /// P's TP size.
        p_tp: u32,
        /// D's TP size.
        d_tp: u32,
    },
    /// The block sizes are not a power-of-two multiple of each other.
    #[error(
        "block sizes {p} (P) and {d} (D) are not a power-of-two multiple of each other; only \
         power-of-two block-size ratios are supported"
    )]
    BlockSizeRatio {
        /// P's block size in tokens.
        p: u32,
        /// D's block size in tokens.
        d: u32,
    },
    /// Head-major on one side and token-major on the other (every (token, head) row would be its
    /// own descriptor, or D would have to permute after receipt), or a latent against K and V:
    /// refused.
    #[error(
        "block layouts differ: P is {p:?} but D is {d:?}; engines pair when their rows are in the \
         same order (K and V interleaved or not), and a latent (MLA) only with a latent"
    )]
    LayoutMismatch {
        /// P's layout.
        p: BlockLayout,
        /// D's layout.
        d: BlockLayout,
    },
}

/// Checks that P's and D's specs can be planned for, and returns their rank topology.
///
/// Must match: model shape, dtype size, block layout. May differ (and are planned for): TP size
/// (when one divides the other and every rank owns ≥ 1 whole head) and block size (when the ratio
/// is a power of two).
pub fn check_compatible(p: &KvSpec, d: &KvSpec) -> Result<Topology, Incompatible> {
    p.validate().map_err(|source| Incompatible::Spec {
        side: Side::Prefill,
        source,
    })?;
    d.validate().map_err(|source| Incompatible::Spec {
        side: Side::Decode,
        source,
    })?;
    let (ps, ds) = (&p.shape, &d.shape);
    for (field, pv, dv) in [
        ("num_layers", ps.num_layers, ds.num_layers),
        ("num_kv_heads", ps.num_kv_heads, ds.num_kv_heads),
        ("head_dim", ps.head_dim, ds.head_dim),
    ] {
        if pv != dv {
            return Err(Incompatible::Shape {
                field,
                p: pv,
                d: dv,
            });
        }
    }
    if ps.dtype_size != ds.dtype_size {
        return Err(Incompatible::DtypeSize {
            p: ps.dtype_size,
            d: ds.dtype_size,
        });
    }
    let (big, small) = (
        p.block_size.max(d.block_size),
        p.block_size.min(d.block_size),
    );
    if big % small != 0 || !(big / small).is_power_of_two() {
        return Err(Incompatible::BlockSizeRatio {
            p: p.block_size,
            d: d.block_size,
        });
    }
    // Rows in the same order pair; K and V interleaved on one side only cost a descriptor per
    // row (the planner cuts them), not a refusal.
    if p.block_layout.order() != d.block_layout.order() {
        return Err(Incompatible::LayoutMismatch {
            p: p.block_layout,
            d: d.block_layout,
        });
    }
    Topology::new(p.tp, d.tp, ps.num_kv_heads)
}

/// One (D rank, P rank) pair of a transfer, and the global KV heads it moves (none when it only
/// confirms: see [`Topology::pair_heads`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankPair {
    /// The D rank (destination).
    pub d_rank: u32,
    /// The P rank (source).
    pub p_rank: u32,
    /// Global KV heads this pair moves (owned by both ranks; empty for a pair that only
    /// confirms).
    pub heads: Range<u32>,
}

/// The rank mapping between a P engine and a D engine.
///
/// Ranks own consecutive equal head ranges, so with `P tp > D tp` each D rank gathers from
/// `P/D` consecutive P ranks, and with `D tp > P tp` each P rank is read by `D/P` consecutive D
/// ranks, each taking its own head slice. With more ranks than heads each head has copies on
/// consecutive ranks; D reads each head it needs from one of them.
///
/// Deserialising re-runs [`Topology::new`]'s checks, so a `Topology` from the wire is as valid as
/// one built here (its methods divide by the TP sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawTopology")]
pub struct Topology {
    p_tp: u32,
    d_tp: u32,
    num_kv_heads: u32,
}

#[derive(Deserialize)]
struct RawTopology {
    p_tp: u32,
    d_tp: u32,
    num_kv_heads: u32,
}

impl TryFrom<RawTopology> for Topology {
    type Error = Incompatible;

    fn try_from(r: RawTopology) -> Result<Self, Incompatible> {
        Topology::new(r.p_tp, r.d_tp, r.num_kv_heads)
    }
}

impl Topology {
    /// Checks the TP sizes against each other and the head count.
    pub fn new(p_tp: u32, d_tp: u32, num_kv_heads: u32) -> Result<Self, Incompatible> {
        for (side, tp) in [(Side::Prefill, p_tp), (Side::Decode, d_tp)] {
            let source = if tp == 0 {
                SpecError::Zero { field: "tp" }
            } else if num_kv_heads == 0 {
                SpecError::Zero {
                    field: "num_kv_heads",
                }
            } else if let Err(e) = check_heads(tp, num_kv_heads) {
                e
            } else {
                continue;
            };
            return Err(Incompatible::Spec { side, source });
        }
        if p_tp.max(d_tp) % p_tp.min(d_tp) != 0 {
            return Err(Incompatible::TpNotDivisible { p_tp, d_tp });
        }
        Ok(Self {
            p_tp,
            d_tp,
            num_kv_heads,
        })
    }

    /// P's TP size.
    pub fn p_tp(&self) -> u32 {
        self.p_tp
    }

    /// D's TP size.
    pub fn d_tp(&self) -> u32 {
        self.d_tp
    }

    /// KV heads of the model.
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }

    fn heads_of(&self, tp: u32, rank: u32) -> Range<u32> {
        owned_heads(tp, self.num_kv_heads, rank)
    }

    /// The P ranks D rank `d_rank` reads from (empty if `d_rank` is out of range).
    pub fn sources(&self, d_rank: u32) -> Range<u32> {
        rank_sources(self.p_tp, self.d_tp, d_rank)
    }

    /// The D ranks that read from P rank `p_rank` (empty if `p_rank` is out of range).
    pub fn readers(&self, p_rank: u32) -> Range<u32> {
        if p_rank >= self.p_tp {
            return 0..0;
        }
        if self.d_tp >= self.p_tp {
            let r = self.d_tp / self.p_tp;
            p_rank * r..(p_rank + 1) * r
        } else {
            let d = p_rank / (self.p_tp / self.d_tp);
            d..d + 1
        }
    }

    /// How many D ranks read from `p_rank` (`D tp / P tp` when D is wider, else 1): the number
    /// of "done" notifications P must collect before the handoff is finished on that rank.
    pub fn consumers(&self, p_rank: u32) -> u32 {
        let r = self.readers(p_rank);
        r.end - r.start
    }

    /// The global heads the pair (`d_rank`, `p_rank`) moves, or `None` if `p_rank` is not one of
    /// `d_rank`'s sources. Each head D needs is read once, from the first of its sources that
    /// holds it: with replicated heads, a later source holding only heads read already moves
    /// nothing (an empty range) and its pair only confirms the transfer, so that P rank, which
    /// the ledgers count on to hear from D, lets its blocks go as the others do.
    pub fn pair_heads(&self, d_rank: u32, p_rank: u32) -> Option<Range<u32>> {
        if d_rank >= self.d_tp || p_rank >= self.p_tp || !self.sources(d_rank).contains(&p_rank) {
            return None;
        }
        let d = self.heads_of(self.d_tp, d_rank);
        let shared = |p: u32| {
            let p = self.heads_of(self.p_tp, p);
            d.start.max(p.start)..d.end.min(p.end)
        };
        // Heads are owned in rank order, so what earlier sources gave is a prefix of D's heads.
        let read = self
            .sources(d_rank)
            .take_while(|&p| p < p_rank)
            .map(|p| shared(p).end)
            .max()
            .unwrap_or(d.start);
        let heads = shared(p_rank);
        Some(heads.start.max(read).min(heads.end)..heads.end)
    }

    /// Every (D rank, P rank) pair of a transfer, ordered by D rank, then P rank: the pairs the
    /// ledgers count ([`rank_pairs`]). A pair whose `heads` are empty moves no byte and only
    /// confirms (a replica another source already gave that D rank).
    pub fn pairs(&self) -> Vec<RankPair> {
        let mut out = Vec::new();
        for d_rank in 0..self.d_tp {
            for p_rank in self.sources(d_rank) {
                if let Some(heads) = self.pair_heads(d_rank, p_rank) {
                    out.push(RankPair {
                        d_rank,
                        p_rank,
                        heads,
                    });
                }
            }
        }
        out
    }
}

/// The P ranks D rank `d_rank` reads from when P runs `p_tp` ranks and D `d_tp`: the rank
/// arithmetic alone, for the ledgers, which count who must confirm a transfer. Total: with sizes
/// that do not divide each other (refused at the handshake, see [`Topology::new`]) or a zero
/// size, every D rank still gets one source and nothing panics.
pub fn rank_sources(p_tp: u32, d_tp: u32, d_rank: u32) -> Range<u32> {
    let (p, d) = (p_tp.max(1), d_tp.max(1));
    if d_rank >= d {
        return 0..0;
    }
    if p >= d && p % d == 0 {
        let k = p / d;
        d_rank * k..(d_rank + 1) * k
    } else {
        let s = (u64::from(d_rank) * u64::from(p) / u64::from(d)) as u32;
        s..s + 1
    }
}

/// Every (D rank, P rank) pair that moves KV, ordered by D rank, then P rank
/// (see [`rank_sources`]).
pub fn rank_pairs(p_tp: u16, d_tp: u16) -> Vec<(u16, u16)> {
    (0..u32::from(d_tp.max(1)))
        .flat_map(|d| {
            rank_sources(u32::from(p_tp), u32::from(d_tp), d).map(move |p| (d as u16, p as u16))
        })
        .collect()
}

/// How many D ranks read P rank `p_rank`: the completions P must collect for that rank.
pub fn rank_consumers(p_tp: u16, d_tp: u16, p_rank: u16) -> u16 {
    rank_pairs(p_tp, d_tp)
        .iter()
        .filter(|(_, p)| *p == p_rank)
        .count() as u16
}

#[cfg(test)]
mod rank_tests {
    use super::*;

    #[test]
    fn equal_tp_pairs_rank_to_rank() {
        assert_eq!(rank_pairs(2, 2), vec![(0, 0), (1, 1)]);
        assert_eq!(rank_consumers(2, 2, 1), 1);
    }

    #[test]
    fn d_tp_four_p_tp_two_needs_two_consumers_per_p_rank() {
        assert_eq!(rank_pairs(2, 4), vec![(0, 0), (1, 0), (2, 1), (3, 1)]);
        assert_eq!(rank_consumers(2, 4, 0), 2);
        assert_eq!(rank_consumers(2, 4, 1), 2);
    }

    #[test]
    fn p_tp_four_d_tp_two_reads_two_p_ranks_per_d_rank() {
        assert_eq!(rank_pairs(4, 2), vec![(0, 0), (0, 1), (1, 2), (1, 3)]);
        assert!((0..4).all(|r| rank_consumers(4, 2, r) == 1));
    }

    #[test]
    fn sizes_that_do_not_divide_still_pair_every_d_rank_once() {
        assert_eq!(rank_pairs(3, 2), vec![(0, 0), (1, 1)]);
        assert_eq!(rank_pairs(0, 0), vec![(0, 0)]);
    }

    #[test]
    fn the_ledgers_pairs_are_the_planners_pairs() {
        for (p, d) in [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1)] {
            let t = Topology::new(p, d, 8).unwrap();
            let planned: Vec<(u16, u16)> = t
                .pairs()
                .iter()
                .map(|r| (r.d_rank as u16, r.p_rank as u16))
                .collect();
            assert_eq!(rank_pairs(p as u16, d as u16), planned, "p {p} d {d}");
        }
    }
}
