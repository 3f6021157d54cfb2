//! Layout types: what a model's KV looks like ([`ModelShape`], [`KvSpec`]) and where one rank keeps
//! it in its registered memory ([`RankLayout`]).
//!
//! One file, over 800 lines: the spec, the placements and the one function that turns a row's
//! coordinates into an address ([`RankLayout::row_offset`]), with a constructor per placement, so
//! that every placement is checked by the same [`RankLayout::validate`] and addressed one way.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Which engine a layout, block list or error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Side {
    /// The prefill engine: the source of every descriptor.
    Prefill,
    /// The decode engine: the destination of every descriptor.
    Decode,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "P",
            Side::Decode => "D",
        })
    }
}

/// The model-level KV shape. Both engines of a pair must agree on every field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelShape {
    /// Attention layers that keep KV.
    pub num_layers: u32,
    /// KV heads of the whole model (not per rank).
    pub num_kv_heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8, 4 for fp32).
    pub dtype_size: u32,
}

impl ModelShape {
    /// Bytes of one token of one head of one layer, K or V alone (`head_dim × dtype_size`): the
    /// smallest unit the planner ever moves.
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.head_dim).saturating_mul(u64::from(self.dtype_size))
    }
}

/// Order of the bytes of one plane (K or V) of one block of one layer of one rank.
///
/// `hpr` = heads per rank, `bs` = block size in tokens, `row` = `head_dim × dtype_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockLayout {
    /// `[head][token][dim]`: element (h, t) at `(h × bs + t) × row`. A head's tokens are contiguous,
    /// so a head slice of a block is one contiguous range (vLLM's HND / `LBHNC`). Works with every
    /// TP and block-size combination.
    HeadMajor,
    /// `[token][head][dim]`: element (h, t) at `(t × hpr + h) × row` (vLLM's NHD / `LBNHC`). A head
    /// slice is contiguous only within one token, so heterogeneous TP costs one descriptor per
    /// token (planned, but many).
    TokenMajor,
    /// `[head][token][K|V][dim]`: the rows of [`HeadMajor`](Self::HeadMajor), with each token's
    /// K row and V row side by side: K's (h, t) at `(h × bs + t) × 2 × row`, V's one row later
    /// (vLLM 0.33's `[B, H, N, C]` views in `LBHNC` order, `C` = K then V). A block of one layer
    /// is one `2 × plane` range, and so is one head's tokens of it.
    HeadMajorInterleaved,
    /// `[token][head][K|V][dim]`: the rows of [`TokenMajor`](Self::TokenMajor), K and V side by
    /// side (vLLM 0.33's views in `LBNHC` order, its default).
    TokenMajorInterleaved,
    /// `[token][latent]`: one plane per block and no V, MLA's compressed KV (DeepSeek V2/V3,
    /// Kimi, GLM): one latent vector of `head_dim` elements per token, the same on every rank
    /// (the spec's one "head", replicated over the ranks). Pairs only with itself.
    Latent,
}

impl BlockLayout {
    /// The order of a block's rows, K and V apart or not: [`HeadMajor`](Self::HeadMajor) or
    /// [`TokenMajor`](Self::TokenMajor). Two engines pair when their orders are equal; whether
    /// K and V interleave may differ (it costs one descriptor per row).
    pub fn order(self) -> BlockLayout {
        match self {
            BlockLayout::HeadMajor | BlockLayout::HeadMajorInterleaved => BlockLayout::HeadMajor,
            BlockLayout::TokenMajor | BlockLayout::TokenMajorInterleaved => BlockLayout::TokenMajor,
            BlockLayout::Latent => BlockLayout::Latent,
        }
    }

    /// Planes a block holds: K and V, or the latent alone.
    pub fn planes(self) -> u32 {
        if self == BlockLayout::Latent {
            1
        } else {
            2
        }
    }

    /// Whether each token's K and V rows lie side by side (one `2 × row` run) instead of in
    /// planes of their own (never for a latent, which has no V).
    pub fn interleaved(self) -> bool {
        matches!(
            self,
            BlockLayout::HeadMajorInterleaved | BlockLayout::TokenMajorInterleaved
        )
    }
}

/// Engine-wide KV facts exchanged in a handshake: everything the planner needs to know about an
/// engine except where a particular rank put its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvSpec {
    /// Model KV shape (must match the peer's).
    pub shape: ModelShape,
    /// Tensor-parallel size: the KV heads are split evenly over `tp` ranks.
    pub tp: u32,
    /// Tokens per block (may differ from the peer's by a power-of-two ratio).
    pub block_size: u32,
    /// Byte order inside a block plane (must match the peer's).
    pub block_layout: BlockLayout,
}

/// Why a [`KvSpec`] cannot be used at all, whatever the peer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    /// A size that must be at least 1 is 0.
    #[error("{field} is 0; it must be at least 1")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// More ranks than KV heads, and not a whole number of copies of each: a rank would own a
    /// fraction of a head, or heads would have copies on different numbers of ranks.
    #[error(
        "tensor-parallel size {tp} exceeds the model's {num_kv_heads} KV heads and is not a \
         multiple of it: each head is replicated on tp / num_kv_heads ranks (as vLLM does), which \
         must be a whole number"
    )]
    HeadsNotReplicable {
        /// Tensor-parallel size.
        tp: u32,
        /// KV heads of the model.
        num_kv_heads: u32,
    },
    /// The heads do not split evenly over the ranks.
    #[error(
        "{num_kv_heads} KV heads do not split evenly over tensor-parallel size {tp}: every rank \
         must own the same whole number of heads"
    )]
    HeadsNotDivisible {
        /// Tensor-parallel size.
        tp: u32,
        /// KV heads of the model.
        num_kv_heads: u32,
    },
    /// A latent (MLA) spec with more than one "head": the latent is one vector per token.
    #[error(
        "a latent (MLA) block holds one vector per token, so num_kv_heads must be 1 (it is \
         {num_kv_heads})"
    )]
    LatentHeads {
        /// KV heads of the spec.
        num_kv_heads: u32,
    },
    /// One block plane is larger than `u64` bytes can describe.
    #[error("one block plane ({heads_per_rank} heads × {block_size} tokens × {row_bytes} bytes) overflows u64")]
    TooLarge {
        /// Heads per rank.
        heads_per_rank: u32,
        /// Tokens per block.
        block_size: u32,
        /// Bytes per head row.
        row_bytes: u64,
    },
}

/// Whether `num_kv_heads` KV heads can be laid out over `tp` ranks: split evenly (`tp` divides
/// the heads) or replicated evenly (the heads divide `tp`). Both nonzero.
pub fn check_heads(tp: u32, num_kv_heads: u32) -> Result<(), SpecError> {
    if tp > num_kv_heads && tp % num_kv_heads != 0 {
        return Err(SpecError::HeadsNotReplicable { tp, num_kv_heads });
    }
    if tp <= num_kv_heads && num_kv_heads % tp != 0 {
        return Err(SpecError::HeadsNotDivisible { tp, num_kv_heads });
    }
    Ok(())
}

/// KV heads each of `tp` ranks owns: `num_kv_heads / tp`, or 1 when `tp > num_kv_heads` (each
/// head replicated); 0 when `tp` is 0.
pub(crate) fn heads_per_rank(tp: u32, num_kv_heads: u32) -> u32 {
    match tp {
        0 => 0,
        t if t > num_kv_heads => num_kv_heads.min(1),
        t => num_kv_heads / t,
    }
}

/// The global KV heads `rank` of `tp` ranks owns. Ranks own consecutive, equal head ranges in
/// rank order (as Megatron-style TP shards the KV projection); with more ranks than heads, each
/// head is held by `tp / num_kv_heads` consecutive ranks (as vLLM replicates the KV projection),
/// so rank `r` owns head `r / (tp / num_kv_heads)` alone.
pub(crate) fn owned_heads(tp: u32, num_kv_heads: u32, rank: u32) -> Range<u32> {
    if tp > num_kv_heads && num_kv_heads > 0 {
        let h = rank / (tp / num_kv_heads);
        return h..h.saturating_add(1);
    }
    let hpr = heads_per_rank(tp, num_kv_heads);
    rank.saturating_mul(hpr)..rank.saturating_add(1).saturating_mul(hpr)
}

impl KvSpec {
    /// Checks that the spec describes something plannable on its own (nonzero sizes, whole heads
    /// per rank, sizes that fit in `u64`).
    pub fn validate(&self) -> Result<(), SpecError> {
        let s = &self.shape;
        for (field, v) in [
            ("num_layers", s.num_layers),
            ("num_kv_heads", s.num_kv_heads),
            ("head_dim", s.head_dim),
            ("dtype_size", s.dtype_size),
            ("tp", self.tp),
            ("block_size", self.block_size),
        ] {
            if v == 0 {
                return Err(SpecError::Zero { field });
            }
        }
        check_heads(self.tp, s.num_kv_heads)?;
        if self.block_layout == BlockLayout::Latent && s.num_kv_heads != 1 {
            return Err(SpecError::LatentHeads {
                num_kv_heads: s.num_kv_heads,
            });
        }
        let too_large = SpecError::TooLarge {
            heads_per_rank: self.heads_per_rank(),
            block_size: self.block_size,
            row_bytes: s.row_bytes(),
        };
        // The plane size times 2 (K and V) must fit too, so that block_bytes() is exact.
        u64::from(s.head_dim)
            .checked_mul(u64::from(s.dtype_size))
            .and_then(|r| r.checked_mul(u64::from(self.block_size)))
            .and_then(|r| r.checked_mul(u64::from(self.heads_per_rank())))
            .and_then(|r| r.checked_mul(2))
            .ok_or(too_large)?;
        Ok(())
    }

    /// KV heads each rank owns: `num_kv_heads / tp`, or 1 when heads are replicated (`tp >
    /// num_kv_heads`); 0 for a spec with `tp == 0`.
    pub fn heads_per_rank(&self) -> u32 {
        heads_per_rank(self.tp, self.shape.num_kv_heads)
    }

    /// Whether `rank` is the first of the ranks holding its heads: always, unless heads are
    /// replicated (more ranks than heads), where one rank in every `tp / num_kv_heads` is. What
    /// counts a head once over an engine's ranks (a digest, a byte count) counts it there.
    pub fn first_holder(&self, rank: u32) -> bool {
        let heads = self.shape.num_kv_heads;
        self.tp <= heads || heads == 0 || rank % (self.tp / heads) == 0
    }

    /// Whether blocks of this spec and of `other` can move between engines whose pages are the
    /// attention kernel's business (vLLM's CPU backend, where the kernel decides what sits where
    /// inside a head's part of a block): the pages are the same byte for byte (equal specs, or
    /// TP sizes that differ while every rank of both holds every KV head, as vLLM replicates one
    /// head when TP exceeds the heads), or only the TP sizes differ and each head's part of a
    /// block is one self-contained chunk (`HeadMajorInterleaved`: its K and V rows together),
    /// which moves whole from a rank that holds the head to the rank that needs it. Another
    /// block size or layout would need the rows inside a chunk, which an opaque page does not
    /// show.
    pub fn opaque_pages_pair(&self, other: &KvSpec) -> bool {
        let whole = |s: &KvSpec| s.heads_per_rank() == s.shape.num_kv_heads;
        let but_tp = KvSpec {
            tp: other.tp,
            ..*self
        } == *other;
        self == other
            || (but_tp
                && ((whole(self) && whole(other))
                    || self.block_layout == BlockLayout::HeadMajorInterleaved))
    }

    /// The global KV heads `rank` owns (see [`owned_heads`]).
    pub fn owned_heads(&self, rank: u32) -> Range<u32> {
        owned_heads(self.tp, self.shape.num_kv_heads, rank)
    }

    /// Bytes of one plane (K or V) of one block of one layer of one rank:
    /// `heads_per_rank × block_size × head_dim × dtype_size`. Saturates for specs that
    /// [`validate`](Self::validate) rejects.
    pub fn plane_bytes(&self) -> u64 {
        u64::from(self.heads_per_rank())
            .saturating_mul(u64::from(self.block_size))
            .saturating_mul(self.shape.row_bytes())
    }

    /// Bytes of one block of one layer of one rank, K and V together (`2 × plane_bytes`; one
    /// plane for a latent).
    pub fn block_bytes(&self) -> u64 {
        self.plane_bytes()
            .saturating_mul(u64::from(self.block_layout.planes()))
    }

    /// Position of (local head `head`, token `token`) inside one block plane, in rows (multiply
    /// by [`row_pitch`](Self::row_pitch) for bytes).
    pub fn row_index(&self, head: u32, token: u32) -> u64 {
        let (h, t) = (u64::from(head), u64::from(token));
        match self.block_layout.order() {
            BlockLayout::TokenMajor => t * u64::from(self.heads_per_rank()) + h,
            _ => h * u64::from(self.block_size) + t,
        }
    }

    /// Bytes from one row of a block plane to the next: one row, or two when K and V rows
    /// interleave.
    pub fn row_pitch(&self) -> u64 {
        let rows = if self.block_layout.interleaved() {
            2
        } else {
            1
        };
        self.shape.row_bytes().saturating_mul(rows)
    }

    /// Planes a walk over a block's bytes visits one after the other: K then V (2), or 1 when
    /// K and V rows interleave (K's rows walked [`row_pitch`](Self::row_pitch) wide cover V's)
    /// or the block holds a latent alone.
    pub fn planes_apart(&self) -> u32 {
        if self.block_layout.interleaved() {
            1
        } else {
            self.block_layout.planes()
        }
    }

    /// Bytes one such walk covers in one block: a plane, or the whole block when K and V rows
    /// interleave (`block_bytes / planes_apart`).
    pub fn walk_bytes(&self) -> u64 {
        self.block_bytes() / u64::from(self.planes_apart())
    }

    /// Bytes from a block's K plane to its V plane when both live in one block: a plane, or one
    /// row when K and V rows interleave; 0 for a latent, whose V names K's place.
    pub fn v_after_k(&self) -> u64 {
        match self.block_layout {
            BlockLayout::Latent => 0,
            l if l.interleaved() => self.shape.row_bytes(),
            _ => self.plane_bytes(),
        }
    }

    /// Blocks needed to hold `num_tokens` tokens (`ceil(num_tokens / block_size)`).
    pub fn blocks_for(&self, num_tokens: u32) -> u32 {
        if self.block_size == 0 {
            return 0;
        }
        num_tokens.div_ceil(self.block_size)
    }
}

/// One registered memory region of a rank (a NIXL registration, a tensor, a mmap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// Identifier, unique within the rank; descriptors name regions by it.
    pub id: u32,
    /// Length in bytes; every descriptor stays inside `0..len`.
    pub len: u64,
}

/// Where block 0 of one plane (K or V) of one layer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlaneLoc {
    /// Region id.
    pub region: u32,
    /// Byte offset of block 0's plane inside the region.
    pub offset: u64,
}

/// Where one layer's blocks live: block `b`'s K plane starts at `k.offset + b × block_stride` in
/// region `k.region`, its V plane likewise from `v`. With `head_stride = 0` a block's plane holds
/// all of the rank's heads in the [`BlockLayout`] order; with `head_stride > 0` each head has its
/// own run of blocks, local head `h`'s tokens of block `b` at
/// `offset + h × head_stride + b × block_stride` (`[token][dim]`, head-major by construction).
///
/// This covers the layouts engines use without more machinery:
/// - one region per layer, block = `[K plane][V plane]`: `v.offset = k.offset + plane`,
///   `block_stride = 2 × plane` ([`RankLayout::per_layer`]);
/// - K and V as separate tensors (vLLM's FlashAttention cache): two regions per layer,
///   `block_stride = plane` ([`RankLayout::split_kv`]);
/// - one region for all layers, block-outermost (vLLM's cross-layer `BLHNC`): layer `l` at
///   `l × 2 × plane`, `block_stride = num_layers × 2 × plane` ([`RankLayout::cross_layer`]);
/// - one region for all layers, heads outside blocks (`[layer][K|V][head][block][token][dim]`):
///   `block_stride = block_size × row`, `head_stride = num_blocks × block_stride`
///   ([`RankLayout::heads_outermost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerPlacement {
    /// K plane of block 0.
    pub k: PlaneLoc,
    /// V plane of block 0.
    pub v: PlaneLoc,
    /// Bytes from one block to the next, the same for K and V (≥ one plane, or ≥ one head's
    /// block when `head_stride > 0`).
    pub block_stride: u64,
    /// Bytes from one local head to the next, outside the block; 0 = the heads live inside each
    /// block's plane (absent in a peer's JSON means 0).
    #[serde(default)]
    pub head_stride: u64,
}

impl LayerPlacement {
    /// The plane location for `kv` (0 = K, 1 = V).
    pub fn plane(&self, kv: usize) -> PlaneLoc {
        if kv == 0 {
            self.k
        } else {
            self.v
        }
    }
}

/// How an engine arranges its KV pool in one region per rank: the two layouts handoff's own
/// engine offers (other engines describe theirs with a [`RankLayout`] directly).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolLayout {
    /// [`RankLayout::cross_layer`]: a block holds every layer. Between engines of equal TP and
    /// block size a run of contiguous blocks is one descriptor for the whole model; otherwise
    /// one per block per layer per plane.
    BlocksOutermost,
    /// [`RankLayout::heads_outermost`]: each (layer, plane, head) holds its blocks back to back.
    /// One descriptor per (layer, plane, head) moved for a contiguous run, whatever the TP sizes
    /// and block sizes of the two engines.
    HeadsOutermost,
    /// [`RankLayout::layers_outermost`]: each layer holds its blocks back to back (vLLM's one
    /// tensor per layer, in one region). Between engines of equal TP and block size a
    /// contiguous run of blocks is one descriptor per layer, for the whole model and for a
    /// layer range alike: the layout for layer-wise pulls and pushes, whose READs and WRITEs
    /// move one layer range at a time (blocks-outermost cuts such a range at every block).
    LayersOutermost,
}

impl PoolLayout {
    /// The layout of `rank`'s single region `region_id` holding `num_blocks` blocks.
    pub fn rank_layout(
        self,
        spec: KvSpec,
        rank: u32,
        num_blocks: u32,
        region_id: u32,
    ) -> Result<RankLayout, LayoutError> {
        match self {
            PoolLayout::BlocksOutermost => {
                RankLayout::cross_layer(spec, rank, num_blocks, region_id)
            }
            PoolLayout::HeadsOutermost => {
                RankLayout::heads_outermost(spec, rank, num_blocks, region_id)
            }
            PoolLayout::LayersOutermost => {
                RankLayout::layers_outermost(spec, rank, num_blocks, region_id)
            }
        }
    }
}

/// Where one rank of one engine keeps its KV: the unit a worker registers and sends in a
/// handshake.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankLayout {
    /// Engine-wide facts (identical on every rank of an engine).
    pub spec: KvSpec,
    /// This rank, `0..spec.tp`.
    pub rank: u32,
    /// Blocks in the pool: valid block ids are `0..num_blocks` (the same ids on every rank).
    pub num_blocks: u32,
    /// Registered regions.
    pub regions: Vec<Region>,
    /// One placement per layer, `spec.shape.num_layers` of them.
    pub layers: Vec<LayerPlacement>,
}

/// Why a [`RankLayout`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// The engine-wide spec is unusable.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// `rank ≥ tp`.
    #[error("rank {rank} is out of range for tensor-parallel size {tp}")]
    RankOutOfRange {
        /// The rank.
        rank: u32,
        /// Tensor-parallel size.
        tp: u32,
    },
    /// Not one placement per layer.
    #[error("the layout places {got} layers but the model has {expected}")]
    LayerCount {
        /// Layers of the model.
        expected: u32,
        /// Placements given.
        got: usize,
    },
    /// Two regions share an id.
    #[error("region id {id} is listed twice")]
    DuplicateRegion {
        /// The id.
        id: u32,
    },
    /// A placement names a region that is not listed.
    #[error("layer {layer} names region {region}, which is not registered")]
    UnknownRegion {
        /// Layer index.
        layer: u32,
        /// Region id.
        region: u32,
    },
    /// Blocks of one plane would overlap each other.
    #[error("layer {layer}: block stride {stride} is smaller than what one block of a plane holds ({plane_bytes} bytes)")]
    StrideTooSmall {
        /// Layer index.
        layer: u32,
        /// The stride.
        stride: u64,
        /// Plane size.
        plane_bytes: u64,
    },
    /// A head stride with a token-major block: a head's tokens could not be contiguous.
    #[error(
        "layer {layer}: a head stride places each head outside the block, which needs the \
         head-major block layout with K and V in planes of their own"
    )]
    HeadStrideNeedsHeadMajor {
        /// Layer index.
        layer: u32,
    },
    /// A latent (MLA) block has no V plane, but the placement puts one elsewhere than K.
    #[error("layer {layer}: a latent block has no V plane, so V must name K's place")]
    LatentV {
        /// Layer index.
        layer: u32,
    },
    /// The block layout interleaves K and V rows, but the placement does not put V one row after
    /// K in the same region.
    #[error(
        "layer {layer}: the block layout interleaves K and V rows, so V must start one row \
         ({row_bytes} bytes) after K, in K's region"
    )]
    NotInterleaved {
        /// Layer index.
        layer: u32,
        /// Bytes of one row.
        row_bytes: u64,
    },
    /// Heads of one block would overlap each other.
    #[error("layer {layer}: head stride {stride} is smaller than one head's block ({head_block_bytes} bytes)")]
    HeadStrideTooSmall {
        /// Layer index.
        layer: u32,
        /// The head stride.
        stride: u64,
        /// `block_size × row` bytes.
        head_block_bytes: u64,
    },
    /// The pool's last block does not fit in its region.
    #[error(
        "layer {layer} {plane}: the pool's blocks end at byte {end} but region {region} is only \
         {region_len} bytes"
    )]
    OutsideRegion {
        /// Layer index.
        layer: u32,
        /// "K" or "V".
        plane: &'static str,
        /// Region id.
        region: u32,
        /// End of the last block's plane (saturated at `u64::MAX`).
        end: u64,
        /// Region length.
        region_len: u64,
    },
}

impl RankLayout {
    /// Checks the layout: a valid spec, a rank in range, one placement per layer naming
    /// registered, uniquely named regions, non-overlapping blocks within a plane
    /// (`block_stride ≥ plane`), and every block of the pool inside its region. After this, any
    /// in-pool block's bytes are addressable without overflow.
    ///
    /// Not checked (too costly for a general placement): that K and V planes or different layers
    /// do not alias each other. The planner detects aliasing among the bytes it actually plans.
    pub fn validate(&self) -> Result<(), LayoutError> {
        self.spec.validate()?;
        if self.rank >= self.spec.tp {
            return Err(LayoutError::RankOutOfRange {
                rank: self.rank,
                tp: self.spec.tp,
            });
        }
        let expected = self.spec.shape.num_layers;
        if u32::try_from(self.layers.len()) != Ok(expected) {
            return Err(LayoutError::LayerCount {
                expected,
                got: self.layers.len(),
            });
        }
        let mut ids: Vec<u32> = self.regions.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(LayoutError::DuplicateRegion { id: w[0] });
        }
        let row = self.spec.shape.row_bytes();
        let interleaved = self.spec.block_layout.interleaved();
        // What a block's plane spans, and what one block must keep to itself: with interleaved
        // rows a plane's rows are a row apart, so both planes together fill the block.
        let (plane_span, block_bytes) = if interleaved {
            let block = self.spec.block_bytes();
            (block.saturating_sub(row), block)
        } else {
            (self.spec.plane_bytes(), self.spec.plane_bytes())
        };
        // (A latent's one plane is K's: V names the same place, checked below.)
        // One head's tokens of one block: what must fit between blocks (and between heads) when
        // the heads live outside the block.
        let head_block = u64::from(self.spec.block_size).saturating_mul(row);
        for (layer, p) in (0u32..).zip(&self.layers) {
            if self.spec.block_layout == BlockLayout::Latent && p.v != p.k {
                return Err(LayoutError::LatentV { layer });
            }
            if interleaved
                && (p.v.region != p.k.region || p.k.offset.checked_add(row) != Some(p.v.offset))
            {
                return Err(LayoutError::NotInterleaved {
                    layer,
                    row_bytes: row,
                });
            }
            let min_stride = if p.head_stride == 0 {
                block_bytes
            } else {
                if self.spec.block_layout != BlockLayout::HeadMajor {
                    return Err(LayoutError::HeadStrideNeedsHeadMajor { layer });
                }
                if p.head_stride < head_block {
                    return Err(LayoutError::HeadStrideTooSmall {
                        layer,
                        stride: p.head_stride,
                        head_block_bytes: head_block,
                    });
                }
                head_block
            };
            if p.block_stride < min_stride {
                return Err(LayoutError::StrideTooSmall {
                    layer,
                    stride: p.block_stride,
                    plane_bytes: min_stride,
                });
            }
            // The bytes from the plane's start to the end of block 0 (all heads).
            let first_block_end = if p.head_stride == 0 {
                Some(plane_span)
            } else {
                u64::from(self.spec.heads_per_rank() - 1)
                    .checked_mul(p.head_stride)
                    .and_then(|x| x.checked_add(head_block))
            };
            for (plane, loc) in [("K", p.k), ("V", p.v)] {
                let region_len = self
                    .region_len(loc.region)
                    .ok_or(LayoutError::UnknownRegion {
                        layer,
                        region: loc.region,
                    })?;
                if self.num_blocks == 0 {
                    continue;
                }
                let end = u64::from(self.num_blocks - 1)
                    .checked_mul(p.block_stride)
                    .and_then(|x| x.checked_add(loc.offset))
                    .and_then(|x| x.checked_add(first_block_end?));
                match end {
                    Some(end) if end <= region_len => {}
                    _ => {
                        return Err(LayoutError::OutsideRegion {
                            layer,
                            plane,
                            region: loc.region,
                            end: end.unwrap_or(u64::MAX),
                            region_len,
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// Length of region `id`, if registered.
    pub fn region_len(&self, id: u32) -> Option<u64> {
        self.regions.iter().find(|r| r.id == id).map(|r| r.len)
    }

    /// The global KV heads this rank owns.
    pub fn owned_heads(&self) -> Range<u32> {
        self.spec.owned_heads(self.rank)
    }

    /// Byte offset, in its plane's region, of the row of (`layer`, `kv` 0 = K / 1 = V, `block`,
    /// local head `head`, `token` within the block). The one place a row's coordinates become an
    /// address: the planner, the tail zeroing and an engine's own reads and writes all use it.
    /// `None` on a layer out of range or arithmetic overflow (a validated layout with in-pool
    /// coordinates never overflows).
    pub fn row_offset(
        &self,
        layer: u32,
        kv: usize,
        block: u32,
        head: u32,
        token: u32,
    ) -> Option<u64> {
        let p = self.layers.get(layer as usize)?;
        let row = self.spec.shape.row_bytes();
        let in_block = if p.head_stride == 0 {
            self.spec
                .row_index(head, token)
                .checked_mul(self.spec.row_pitch())?
        } else {
            u64::from(head)
                .checked_mul(p.head_stride)?
                .checked_add(u64::from(token).checked_mul(row)?)?
        };
        u64::from(block)
            .checked_mul(p.block_stride)?
            .checked_add(p.plane(kv).offset)?
            .checked_add(in_block)
    }

    /// One region per layer (ids `first_region_id + layer`), each holding the pool's blocks back
    /// to back, a block being `[K plane][V plane]`, or its rows interleaved when the spec says so
    /// (either way a block of one layer is one contiguous `block_bytes()` range).
    pub fn per_layer(
        spec: KvSpec,
        rank: u32,
        num_blocks: u32,
        first_region_id: u32,
    ) -> Result<Self, LayoutError> {
        spec.validate()?;
        let len = region_len_for(num_blocks, spec.block_bytes(), spec)?;
        let mut regions = Vec::new();
        let mut layers = Vec::new();
        for l in 0..spec.shape.num_layers {
            let id = first_region_id.wrapping_add(l);
            regions.push(Region { id, len });
            layers.push(LayerPlacement {
                k: PlaneLoc {
                    region: id,
                    offset: 0,
                },
                v: PlaneLoc {
                    region: id,
                    offset: spec.v_after_k(),
                },
                block_stride: spec.block_bytes(),
                head_stride: 0,
            });
        }
        Self::checked(Self {
            spec,
            rank,
            num_blocks,
            regions,
            layers,
        })
    }

    /// Two regions per layer, K (`first_region_id + 2·layer`) and V (`… + 1`), each holding one
    /// plane per block back to back: vLLM's FlashAttention cache (`[2][num_blocks][…]` per layer).
    pub fn split_kv(
        spec: KvSpec,
        rank: u32,
        num_blocks: u32,
        first_region_id: u32,
    ) -> Result<Self, LayoutError> {
        spec.validate()?;
        let plane = spec.plane_bytes();
        let len = region_len_for(num_blocks, plane, spec)?;
        let mut regions = Vec::new();
        let mut layers = Vec::new();
        for l in 0..spec.shape.num_layers {
            let k = first_region_id.wrapping_add(2 * l);
            let v = k.wrapping_add(1);
            regions.push(Region { id: k, len });
            regions.push(Region { id: v, len });
            layers.push(LayerPlacement {
                k: PlaneLoc {
                    region: k,
                    offset: 0,
                },
                v: PlaneLoc {
                    region: v,
                    offset: 0,
                },
                block_stride: plane,
                head_stride: 0,
            });
        }
        Self::checked(Self {
            spec,
            rank,
            num_blocks,
            regions,
            layers,
        })
    }

    /// One region (`region_id`) for all layers, block-outermost: block `b` holds every layer's
    /// `[K plane][V plane]` in layer order (vLLM's cross-layer `BLHNC`). A run of contiguous
    /// blocks is then one contiguous range for the whole model.
    pub fn cross_layer(
        spec: KvSpec,
        rank: u32,
        num_blocks: u32,
        region_id: u32,
    ) -> Result<Self, LayoutError> {
        spec.validate()?;
        let layer_bytes = spec.block_bytes();
        let stride = layer_bytes
            .checked_mul(u64::from(spec.shape.num_layers))
            .ok_or(too_large(spec))?;
        let len = region_len_for(num_blocks, stride, spec)?;
        let layers = one_region_layers(spec, region_id, layer_bytes, spec.v_after_k(), stride, 0);
        Self::checked(Self {
            spec,
            rank,
            num_blocks,
            regions: vec![Region { id: region_id, len }],
            layers,
        })
    }

    /// One region (`region_id`) for all layers, layer-outermost: layer `l` holds every block's
    /// `[K plane][V plane]` back to back, from `l × num_blocks × 2 × plane` (the layout of
    /// [`RankLayout::per_layer`] with its regions laid end to end). A run of contiguous blocks
    /// is one contiguous range per layer.
    pub fn layers_outermost(
        spec: KvSpec,
        rank: u32,
        num_blocks: u32,
        region_id: u32,
    ) -> Result<Self, LayoutError> {
        spec.validate()?;
        let block_stride = spec.block_bytes();
        let layer_bytes = region_len_for(num_blocks, block_stride, spec)?;
        let len = layer_bytes
            .checked_mul(u64::from(spec.shape.num_layers))
            .ok_or(too_large(spec))?;
        let layers = one_region_layers(
            spec,
            region_id,
            layer_bytes,
            spec.v_after_k(),
            block_stride,
            0,
        );
        Self::checked(Self {
            spec,
            rank,
            num_blocks,
            regions: vec![Region { id: region_id, len }],
            layers,
        })
    }

    /// One region (`region_id`) for all layers with the heads outside the blocks:
    /// `[layer][K|V][head][block][token][dim]`. Each head's tokens over a run of contiguous blocks
    /// are one contiguous range whatever the block size, so a transfer between engines of
    /// different TP sizes or block sizes costs one descriptor per (layer, K|V, head) for a
    /// contiguous allocation instead of one per block. Head-major specs only.
    pub fn heads_outermost(
        spec: KvSpec,
        rank: u32,
        num_blocks: u32,
        region_id: u32,
    ) -> Result<Self, LayoutError> {
        spec.validate()?;
        let head_block = u64::from(spec.block_size)
            .checked_mul(spec.shape.row_bytes())
            .ok_or(too_large(spec))?;
        // (An empty pool still gets a non-zero head stride: 0 would mean "heads inside blocks".)
        let head_stride = region_len_for(num_blocks.max(1), head_block, spec)?;
        let plane = head_stride
            .checked_mul(u64::from(spec.heads_per_rank()))
            .ok_or(too_large(spec))?;
        let layer_bytes = plane.checked_mul(2).ok_or(too_large(spec))?;
        let len = layer_bytes
            .checked_mul(u64::from(spec.shape.num_layers))
            .ok_or(too_large(spec))?;
        // Each head's run of blocks is inside its plane: V after every head's K.
        let layers =
            one_region_layers(spec, region_id, layer_bytes, plane, head_block, head_stride);
        Self::checked(Self {
            spec,
            rank,
            num_blocks,
            regions: vec![Region { id: region_id, len }],
            layers,
        })
    }

    fn checked(self) -> Result<Self, LayoutError> {
        self.validate()?;
        Ok(self)
    }
}

/// The placements of a layout with every layer in region `region_id`, layer after layer: layer
/// `l`'s K plane at `l × layer_stride`, its V plane `v_after_k` bytes after it. (The caller
/// checked that the region's length fits in a u64, so no offset overflows.)
fn one_region_layers(
    spec: KvSpec,
    region_id: u32,
    layer_stride: u64,
    v_after_k: u64,
    block_stride: u64,
    head_stride: u64,
) -> Vec<LayerPlacement> {
    (0..u64::from(spec.shape.num_layers))
        .map(|l| LayerPlacement {
            k: PlaneLoc {
                region: region_id,
                offset: l * layer_stride,
            },
            v: PlaneLoc {
                region: region_id,
                offset: l * layer_stride + v_after_k,
            },
            block_stride,
            head_stride,
        })
        .collect()
}

fn too_large(spec: KvSpec) -> SpecError {
    SpecError::TooLarge {
        heads_per_rank: spec.heads_per_rank(),
        block_size: spec.block_size,
        row_bytes: spec.shape.row_bytes(),
    }
}

fn region_len_for(num_blocks: u32, stride: u64, spec: KvSpec) -> Result<u64, LayoutError> {
    Ok(u64::from(num_blocks)
        .checked_mul(stride)
        .ok_or(too_large(spec))?)
}
