//! Which D rank reads which heads from which P rank, and the handshake compatibility check.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::layout::{BlockLayout, KvSpec, Side, SpecError};

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
    /// Head-major on one side and token-major on the other: every (token, head) row would be its
    /// own descriptor (or D would have to permute after receipt), so this is refused.
    #[error(
        "block layouts differ: P is {p:?} but D is {d:?}; a token-major/head-major mix would need \
         one descriptor per token per head or a permute after receipt, which is not supported"
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
    if p.block_layout != d.block_layout {
        return Err(Incompatible::LayoutMismatch {
            p: p.block_layout,
            d: d.block_layout,
        });
    }
    Topology::new(p.tp, d.tp, ps.num_kv_heads)
}

/// One (D rank, P rank) pair that moves data, and the global KV heads it moves.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankPair {
    /// The D rank (destination).
    pub d_rank: u32,
    /// The P rank (source).
    pub p_rank: u32,
    /// Global KV heads this pair moves (owned by both ranks).
    pub heads: Range<u32>,
}

/// The rank mapping between a P engine and a D engine.
///
/// Ranks own consecutive equal head ranges, so with `P tp > D tp` each D rank gathers from
/// `P/D` consecutive P ranks, and with `D tp > P tp` each P rank is read by `D/P` consecutive D
/// ranks, each taking its own head slice.
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
            } else if tp > num_kv_heads {
                SpecError::TpExceedsHeads { tp, num_kv_heads }
            } else if num_kv_heads % tp != 0 {
                SpecError::HeadsNotDivisible { tp, num_kv_heads }
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
        let hpr = self.num_kv_heads / tp;
        rank * hpr..(rank + 1) * hpr
    }

    /// The P ranks D rank `d_rank` reads from (empty if `d_rank` is out of range).
    pub fn sources(&self, d_rank: u32) -> Range<u32> {
        if d_rank >= self.d_tp {
            return 0..0;
        }
        if self.p_tp >= self.d_tp {
            let k = self.p_tp / self.d_tp;
            d_rank * k..(d_rank + 1) * k
        } else {
            let p = d_rank / (self.d_tp / self.p_tp);
            p..p + 1
        }
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

    /// The global heads the pair (`d_rank`, `p_rank`) moves, or `None` if they share none.
    pub fn pair_heads(&self, d_rank: u32, p_rank: u32) -> Option<Range<u32>> {
        if d_rank >= self.d_tp || p_rank >= self.p_tp {
            return None;
        }
        let (d, p) = (
            self.heads_of(self.d_tp, d_rank),
            self.heads_of(self.p_tp, p_rank),
        );
        let heads = d.start.max(p.start)..d.end.min(p.end);
        (!heads.is_empty()).then_some(heads)
    }

    /// Every pair that moves data, ordered by D rank, then P rank.
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
