//! vLLM's KV cache tensors, as `register_kv_caches` hands them to a worker, turned into handoff's
//! [`RankLayout`]: which bytes of which tensor hold which block of which layer. Derived from each
//! tensor's shape and strides; a layout handoff does not know is refused with the shape in the
//! error, never guessed.
//!
//! Known layouts (per attention layer, one tensor each, in layer order):
//! - **CPU backend** (`cpu_attn.py`, `LBHNC`): `[num_blocks, heads_per_rank, block_size,
//!   2·head_dim]`, contiguous. The kernel addresses a block one KV head at a time (its view is
//!   `[num_blocks, heads, 2·block_size, head_dim]`), but inside a head's `block_size × 2·head_dim`
//!   chunk it decides where K and V go (the "vec" kernel stores K transposed). So a block is an
//!   opaque page ([`KvTensors::opaque_blocks`]) of one chunk per head, described as
//!   `HeadMajorInterleaved` (a head's K and V rows together): moved whole, chunk by chunk,
//!   between engines of the same block size and layout, whatever their TP sizes
//!   (`KvSpec::opaque_pages_pair`).
//! - **FlashAttention** (`NHD`): `[2, num_blocks, block_size, heads_per_rank, head_dim]`,
//!   contiguous: K planes then V planes, each block's plane `[token][head][dim]`; `HND` strides
//!   (`[head][token][dim]`), and FlashInfer's blocks-first `[num_blocks, 2, …]`.
//! - **vLLM 0.33's per-layer views** (`vllm/v1/kv_cache_interface.py`, `create_kv_cache_views`):
//!   `[num_blocks, heads_per_rank, block_size, 2·head_dim]` on a GPU, the last dim K's row then
//!   V's (the attention backends split it in two), in `LBHNC` strides (head-major) or `LBNHC`
//!   (token-major, vLLM's default); block strides that step over other layers (`BL*` orders)
//!   too. On the host the same shape is the CPU backend's opaque page.
//!
//! One file, over 800 lines: every layout handoff recognises, matched from shapes and strides in
//! one place, so a tensor is tried against each of them the same way and a refusal names its shape.

use handoff_plan::{BlockLayout, KvSpec, LayerPlacement, ModelShape, PlaneLoc, RankLayout, Region};
use serde::{Deserialize, Serialize};

/// One tensor as the Python side describes it (no torch on the Rust side).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTensorInfo {
    pub name: String,
    pub data_ptr: u64,
    pub shape: Vec<i64>,
    /// In elements, as `tensor.stride()`.
    pub strides: Vec<i64>,
    pub element_size: u32,
    /// The CUDA device holding the tensor (`tensor.device.index`); `None`: host memory.
    #[serde(default)]
    pub device: Option<u32>,
}

impl KvTensorInfo {
    /// Bytes from the tensor's first element to past its last one (0 for an empty or
    /// malformed shape).
    pub fn span_bytes(&self) -> usize {
        if self.shape.len() != self.strides.len() || self.shape.iter().any(|&d| d <= 0) {
            return 0;
        }
        let last: i64 = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(d, s)| (d - 1).saturating_mul((*s).max(0)))
            .fold(0i64, |a, b| a.saturating_add(b));
        usize::try_from(last.saturating_add(1))
            .unwrap_or(0)
            .saturating_mul(self.element_size as usize)
    }
}

/// What the engine says about its model, to check the tensors against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFacts {
    /// KV heads of the whole model.
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub tp: u32,
    pub rank: u32,
    /// The model keeps MLA's latent (vLLM's `use_mla`): one vector of `head_dim` elements per
    /// token, the same on every rank (`num_kv_heads` is then 1).
    #[serde(default)]
    pub mla: bool,
}

/// The rank's KV memory: the layout and where each region lives in the engine's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvTensors {
    pub layout: RankLayout,
    /// (region id, address, length in bytes).
    pub regions: Vec<(u32, u64, u64)>,
    /// Bytes of one block of one layer (the chunk a region is locked in).
    pub block_bytes: u64,
    pub opaque_blocks: bool,
    /// The CUDA device every tensor is on (`None`: host memory).
    pub device: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvTensorError {
    #[error("no KV cache tensors were registered")]
    None,
    #[error(
        "KV cache tensor {name:?} has shape {shape:?} and strides {strides:?}: not a layout \
         handoff knows (FlashAttention [2, num_blocks, block_size, heads, head_dim] or FlashInfer \
         [num_blocks, 2, block_size, heads, head_dim], NHD or HND strides; vLLM 0.33's views \
         [num_blocks, heads, block_size, 2*head_dim], LBHNC or LBNHC strides, on a GPU, or \
         contiguous on the host for the CPU backend)"
    )]
    Unknown {
        name: String,
        shape: Vec<i64>,
        strides: Vec<i64>,
    },
    #[error("KV cache tensor {name:?} has shape {shape:?}, the first layer {first:?}")]
    Mixed {
        name: String,
        shape: Vec<i64>,
        first: Vec<i64>,
    },
    #[error("KV cache tensor {name:?}: {what}")]
    Mismatch { name: String, what: String },
    #[error("invalid KV layout: {0}")]
    Layout(#[from] handoff_plan::LayoutError),
}

fn contiguous(shape: &[i64], strides: &[i64]) -> bool {
    let mut expect = 1i64;
    for (d, s) in shape.iter().zip(strides).rev() {
        if *d != 1 && *s != expect {
            return false;
        }
        expect = expect.saturating_mul(*d);
    }
    true
}

fn where_(device: Option<u32>) -> String {
    device.map_or("the host".into(), |d| format!("cuda:{d}"))
}

fn u32_of(v: i64) -> Option<u32> {
    u32::try_from(v).ok().filter(|&x| x > 0)
}

/// Derives the rank's layout from its KV tensors (one per attention layer, in layer order).
pub fn derive(tensors: &[KvTensorInfo], facts: ModelFacts) -> Result<KvTensors, KvTensorError> {
    let first = tensors.first().ok_or(KvTensorError::None)?;
    for t in tensors {
        if t.device != first.device {
            return Err(KvTensorError::Mismatch {
                name: t.name.clone(),
                what: format!(
                    "on {}, the first layer on {}: a rank's KV lives on one device",
                    where_(t.device),
                    where_(first.device)
                ),
            });
        }
        if t.shape != first.shape || t.strides != first.strides {
            return Err(KvTensorError::Mixed {
                name: t.name.clone(),
                shape: t.shape.clone(),
                first: first.shape.clone(),
            });
        }
    }
    let unknown = || KvTensorError::Unknown {
        name: first.name.clone(),
        shape: first.shape.clone(),
        strides: first.strides.clone(),
    };
    let mismatch = |what: String| KvTensorError::Mismatch {
        name: first.name.clone(),
        what,
    };
    let dims: Vec<u32> = first
        .shape
        .iter()
        .map(|&d| u32_of(d).ok_or_else(unknown))
        .collect::<Result<_, _>>()?;
    let s = first.strides.as_slice();
    let found = match *dims.as_slice() {
        // FlashAttention: [2, num_blocks, block_size, heads, head_dim], NHD or HND strides.
        [2, nb, bs, h, hd] => Found::Split(Dims {
            rows: Rows::Planes,
            num_blocks: nb,
            block_size: bs,
            heads: h,
            head_dim: hd,
            strides: Strides {
                kv: s[0],
                block: s[1],
                token: s[2],
                head: s[3],
                dim: s[4],
            },
        }),
        // FlashInfer: [num_blocks, 2, block_size, heads, head_dim], NHD or HND strides.
        [nb, 2, bs, h, hd] => Found::Split(Dims {
            rows: Rows::Planes,
            num_blocks: nb,
            block_size: bs,
            heads: h,
            head_dim: hd,
            strides: Strides {
                block: s[0],
                kv: s[1],
                token: s[2],
                head: s[3],
                dim: s[4],
            },
        }),
        // MLA's latent cache: [num_blocks, block_size, latent] (vLLM's MLA backends, CPU and
        // GPU), or 0.33's view of it, [num_blocks, 1, block_size, latent].
        [nb, bs, hd] | [nb, 1, bs, hd] if facts.mla && hd == facts.head_dim => {
            let (block, token, dim) = match *s {
                [b, t, d] | [b, _, t, d] => (b, t, d),
                _ => return Err(unknown()),
            };
            Found::Split(Dims {
                rows: Rows::Latent,
                num_blocks: nb,
                block_size: bs,
                heads: 1,
                head_dim: hd,
                strides: Strides {
                    block,
                    token,
                    dim,
                    // One plane: no V, no heads.
                    kv: 0,
                    head: 0,
                },
            })
        }
        // vLLM 0.33's view on a GPU: [num_blocks, heads, block_size, K row | V row].
        [nb, h, bs, two_hd] if two_hd == 2 * facts.head_dim && first.device.is_some() => {
            Found::Split(Dims {
                rows: Rows::Interleaved,
                num_blocks: nb,
                block_size: bs,
                heads: h,
                head_dim: facts.head_dim,
                strides: Strides {
                    block: s[0],
                    head: s[1],
                    token: s[2],
                    dim: s[3],
                    // V's row right after K's.
                    kv: i64::from(facts.head_dim),
                },
            })
        }
        // CPU: [num_blocks, heads, block_size, 2 * head_dim], contiguous.
        [nb, h, bs, two_hd]
            if two_hd == 2 * facts.head_dim && contiguous(&first.shape, &first.strides) =>
        {
            Found::Opaque {
                num_blocks: nb,
                block_size: bs,
                heads: h,
            }
        }
        _ => return Err(unknown()),
    };
    let (heads, head_dim, block_size) = match &found {
        Found::Split(d) => (d.heads, d.head_dim, d.block_size),
        Found::Opaque {
            heads, block_size, ..
        } => (*heads, facts.head_dim, *block_size),
    };
    // vLLM's rule (`max(1, total // tp)`): with more ranks than KV heads each rank holds one
    // replicated head, which the planner reads once (`handoff_plan::Topology::pair_heads`).
    let heads_per_rank = (facts.num_kv_heads / facts.tp.max(1)).max(1);
    if heads != heads_per_rank || head_dim != facts.head_dim {
        return Err(mismatch(format!(
            "{heads} heads of {head_dim} elements, the model has {heads_per_rank} per rank of {}",
            facts.head_dim
        )));
    }
    let shape = ModelShape {
        num_layers: tensors.len() as u32,
        num_kv_heads: facts.num_kv_heads,
        head_dim,
        dtype_size: first.element_size,
    };
    let (layout, len, block_bytes, opaque_blocks) = match found {
        Found::Opaque { num_blocks, .. } => {
            if block_size != facts.block_size {
                return Err(mismatch(format!(
                    "block size {block_size}, the engine's is {}",
                    facts.block_size
                )));
            }
            let spec = KvSpec {
                shape,
                tp: facts.tp,
                block_size,
                // A head's chunk of the page, K and V together: what moves between TP sizes.
                block_layout: BlockLayout::HeadMajorInterleaved,
            };
            let plane = spec.plane_bytes();
            let layout = RankLayout::per_layer(spec, facts.rank, num_blocks, 0)?;
            let len = u64::from(num_blocks) * 2 * plane;
            (layout, len, 2 * plane, true)
        }
        Found::Split(d) => {
            let split = d.placement(facts.block_size).map_err(&mismatch)?;
            let elem = u64::from(first.element_size);
            let spec = KvSpec {
                shape,
                tp: facts.tp,
                block_size: facts.block_size,
                block_layout: split.block_layout,
            };
            let len = split.extent * elem;
            let layout = RankLayout {
                spec,
                rank: facts.rank,
                num_blocks: split.num_blocks,
                regions: (0..shape.num_layers).map(|id| Region { id, len }).collect(),
                layers: (0..shape.num_layers)
                    .map(|region| LayerPlacement {
                        k: PlaneLoc { region, offset: 0 },
                        v: PlaneLoc {
                            region,
                            offset: split.v_offset * elem,
                        },
                        block_stride: split.block_stride * elem,
                        head_stride: 0,
                    })
                    .collect(),
            };
            layout.validate()?;
            // Locked a block's plane at a time, or its planes together when their rows
            // interleave.
            (layout, len, spec.walk_bytes(), false)
        }
    };
    let (layout, regions) = share_regions(layout, tensors, len)?;
    Ok(KvTensors {
        layout,
        regions,
        block_bytes,
        opaque_blocks,
        device: first.device,
    })
}

/// One region per layer tensor, each `len` bytes from its first element; layers whose tensor is
/// an earlier layer's (vLLM's hybrid KV cache manager lets one tensor hold a layer of each KV
/// cache group, a block id belonging to one group at a time) are placed on that layer's region,
/// so the planner sees one memory and checks that no two writes touch the same bytes. Tensors
/// that overlap without being the same are refused.
#[allow(clippy::type_complexity)]
fn share_regions(
    mut layout: RankLayout,
    tensors: &[KvTensorInfo],
    len: u64,
) -> Result<(RankLayout, Vec<(u32, u64, u64)>), KvTensorError> {
    let mut regions: Vec<(u32, u64, u64)> = Vec::new();
    for (l, t) in tensors.iter().enumerate() {
        let region = match regions.iter().find(|(_, base, _)| *base == t.data_ptr) {
            Some(&(id, _, _)) => id,
            None => {
                let (start, end) = (t.data_ptr, t.data_ptr.saturating_add(len));
                if let Some((id, _, _)) = regions
                    .iter()
                    .find(|(_, base, n)| start < base.saturating_add(*n) && *base < end)
                {
                    return Err(KvTensorError::Mismatch {
                        name: t.name.clone(),
                        what: format!(
                            "its memory overlaps layer {id}'s without being the same tensor"
                        ),
                    });
                }
                regions.push((l as u32, t.data_ptr, len));
                l as u32
            }
        };
        if let Some(p) = layout.layers.get_mut(l) {
            p.k.region = region;
            p.v.region = region;
        }
    }
    layout
        .regions
        .retain(|r| regions.iter().any(|(id, _, _)| *id == r.id));
    layout.validate()?;
    Ok((layout, regions))
}

/// What a tensor's shape says it is.
enum Found {
    /// The CPU backend's pages: moved whole, their inside the kernel's business.
    Opaque {
        num_blocks: u32,
        block_size: u32,
        heads: u32,
    },
    /// K and V planes handoff can address, head by head and token by token.
    Split(Dims),
}

/// How a tensor's rows hold K and V.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// K planes and V planes apart (`strides.kv` from one to the other).
    Planes,
    /// Each token's K and V rows side by side (vLLM 0.33's views): `strides.kv` is one row, and
    /// the rows of a plane two rows apart.
    Interleaved,
    /// MLA's latent: one plane, one vector per token, no V.
    Latent,
}

/// A K/V-split tensor's sizes, and its strides in elements (as `tensor.stride()`).
struct Dims {
    rows: Rows,
    num_blocks: u32,
    block_size: u32,
    heads: u32,
    head_dim: u32,
    strides: Strides,
}

struct Strides {
    kv: i64,
    block: i64,
    token: i64,
    head: i64,
    dim: i64,
}

/// One layer as the planner addresses it, in elements from the tensor's first one.
#[derive(Debug, PartialEq, Eq)]
struct Placement {
    block_layout: BlockLayout,
    /// Logical blocks (the scheduler's).
    num_blocks: u32,
    v_offset: u64,
    block_stride: u64,
    /// Elements from the first to past the last one a block of the pool holds.
    extent: u64,
}

impl Dims {
    /// Where the planes of each of the scheduler's blocks (`logical_block_size` tokens) are, or
    /// why they cannot be addressed as planes.
    ///
    /// A kernel block smaller than the scheduler's (vLLM's `physical_blocks_per_logical`) is
    /// one logical block when its kernel blocks' planes lie back to back token-major: a logical
    /// block is then one plane of `logical_block_size` tokens. Any other arrangement would split
    /// a logical block's plane, which no peer's planner could pair with its own.
    fn placement(&self, logical_block_size: u32) -> Result<Placement, String> {
        let Strides {
            kv,
            block,
            token,
            head,
            dim,
        } = self.strides;
        let (bs, h, hd) = (
            i64::from(self.block_size),
            i64::from(self.heads),
            i64::from(self.head_dim),
        );
        if dim != 1 {
            return Err(format!(
                "head_dim stride {dim}: each head's row must be contiguous"
            ));
        }
        // From one row of a plane to the next: a row, or two when K's and V's interleave.
        let interleaved = self.rows == Rows::Interleaved;
        let pitch = if interleaved { 2 * hd } else { hd };
        // Inside a block plane: [token][head][dim] (NHD) or [head][token][dim] (HND). One head
        // is both; it is called token-major, as the peer's one-head cache will be.
        let token_major = if token == h * pitch && (head == pitch || h == 1) {
            true
        } else if token == pitch && head == bs * pitch {
            false
        } else {
            return Err(format!(
                "token stride {token} and head stride {head}: neither NHD ({} and {pitch}) nor \
                 HND ({pitch} and {})",
                h * pitch,
                bs * pitch
            ));
        };
        let block_layout = match (token_major, self.rows) {
            (_, Rows::Latent) => BlockLayout::Latent,
            (true, Rows::Planes) => BlockLayout::TokenMajor,
            (false, Rows::Planes) => BlockLayout::HeadMajor,
            (true, Rows::Interleaved) => BlockLayout::TokenMajorInterleaved,
            (false, Rows::Interleaved) => BlockLayout::HeadMajorInterleaved,
        };
        let plane = bs * h * hd;
        // What one kernel block of one layer spans: a plane, or both when their rows interleave.
        let block_span = if interleaved { 2 * plane } else { plane };
        if self.rows != Rows::Planes {
            if block < block_span {
                return Err(format!(
                    "block stride {block} overlaps blocks of {block_span} elements"
                ));
            }
        } else {
            // The pool's planes must not overlap: the smaller of the block and K/V strides
            // steps over a whole plane, the larger over every step of the smaller.
            let (inner, outer) = if block <= kv {
                ((block, i64::from(self.num_blocks)), kv)
            } else {
                ((kv, 2), block)
            };
            if inner.0 < plane || outer < inner.0.saturating_mul(inner.1) {
                return Err(format!(
                    "block stride {block} and K/V stride {kv} overlap planes of {plane} elements"
                ));
            }
        }
        let (ratio, num_blocks, block_stride) = if self.block_size == logical_block_size {
            (1, self.num_blocks, block)
        } else if logical_block_size % self.block_size == 0 && token_major && block == block_span {
            let r = logical_block_size / self.block_size;
            (i64::from(r), self.num_blocks / r, block * i64::from(r))
        } else {
            return Err(format!(
                "kernel block size {} under the scheduler's {logical_block_size}: handoff \
                 addresses such blocks only token-major (NHD, or LBNHC) with the kernel blocks \
                 of a layer back to back",
                self.block_size
            ));
        };
        let to_u64 = |v: i64| u64::try_from(v).map_err(|_| format!("negative stride {v}"));
        let last = to_u64(block_stride)?.saturating_mul(u64::from(num_blocks).saturating_sub(1));
        // Past the last block's V plane (which starts `kv` after K's; with interleaved rows,
        // the block's span covers both).
        let tail = if self.rows != Rows::Planes {
            to_u64(block_span * ratio)?
        } else {
            to_u64(kv)?.saturating_add(to_u64(plane * ratio)?)
        };
        Ok(Placement {
            block_layout,
            num_blocks,
            v_offset: to_u64(kv)?,
            block_stride: to_u64(block_stride)?,
            extent: last.saturating_add(tail),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> ModelFacts {
        ModelFacts {
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 128,
            tp: 1,
            rank: 0,
            mla: false,
        }
    }

    fn cpu(name: &str, ptr: u64) -> KvTensorInfo {
        // As observed: shape (4096, 2, 128, 128), strides (32768, 16384, 128, 1), float32.
        KvTensorInfo {
            name: name.into(),
            data_ptr: ptr,
            shape: vec![4096, 2, 128, 128],
            strides: vec![32768, 16384, 128, 1],
            element_size: 4,
            device: None,
        }
    }

    /// vLLM's hybrid manager: one tensor holds a layer of each KV cache group. Layers on one
    /// tensor share its region; a tensor overlapping another without being it is refused.
    #[test]
    fn layers_on_one_tensor_share_its_region() {
        let (a, b) = (1u64 << 30, (1u64 << 30) + (512 << 20));
        let t = derive(&[cpu("l0", a), cpu("l1", b), cpu("l2", a)], facts()).unwrap();
        assert_eq!(t.regions, vec![(0, a, 512 << 20), (1, b, 512 << 20)]);
        let regions: Vec<u32> = t.layout.layers.iter().map(|p| p.k.region).collect();
        assert_eq!(regions, vec![0, 1, 0]);
        assert_eq!(t.layout.regions.len(), 2);
        let e = derive(&[cpu("l0", a), cpu("l1", a + 4096)], facts()).unwrap_err();
        assert!(e.to_string().contains("overlaps layer 0"), "{e}");
    }

    #[test]
    fn the_cpu_backends_tensors_are_opaque_pages_per_layer() {
        let t = derive(
            &[cpu("l0", 1 << 30), cpu("l1", (1 << 30) + (512 << 20))],
            facts(),
        )
        .unwrap();
        assert!(t.opaque_blocks);
        assert_eq!(t.block_bytes, 131072, "one block of one layer, 128 KiB");
        assert_eq!(
            t.regions,
            vec![
                (0, 1 << 30, 512 << 20),
                (1, (1 << 30) + (512 << 20), 512 << 20)
            ]
        );
        assert_eq!(t.layout.num_blocks, 4096);
        assert_eq!(t.layout.spec.shape.num_layers, 2);
        for (id, _, len) in &t.regions {
            assert_eq!(t.layout.region_len(*id), Some(*len));
        }
        // Each head's part of a block is the chunk torch's strides put there, K and V together:
        // what moves between engines of other TP sizes.
        assert_eq!(
            t.layout.spec.block_layout,
            BlockLayout::HeadMajorInterleaved
        );
        let elem = 4;
        for (block, head) in [(0u32, 0u32), (0, 1), (7, 1), (4095, 0)] {
            let torch = u64::from(block) * 32768 + u64::from(head) * 16384;
            let at = |kv, token| t.layout.row_offset(1, kv, block, head, token).unwrap();
            assert_eq!(at(0, 0), torch * elem);
            // The chunk's last row ends where torch's next head (or block) begins.
            let end = at(1, 127) + t.layout.spec.shape.row_bytes();
            assert_eq!(end, (torch + 16384) * elem);
        }
    }

    /// A tensor of `shape` (logical order, as vLLM's backend names its dims) whose memory is
    /// laid out in `order` (outermost dim first, as a stride order): the strides torch gives a
    /// permuted contiguous allocation.
    fn permuted(name: &str, shape: &[i64], order: &[usize]) -> KvTensorInfo {
        let mut strides = vec![0; shape.len()];
        let mut step = 1;
        for &d in order.iter().rev() {
            strides[d] = step;
            step *= shape[d];
        }
        KvTensorInfo {
            name: name.into(),
            data_ptr: 1 << 32,
            shape: shape.to_vec(),
            strides,
            element_size: 2,
            device: Some(0),
        }
    }

    /// Every row the layout addresses is the row the tensor's strides put there: the byte
    /// offset of (kv, block, head, token) from the planner equals the one torch computes.
    fn addresses_as_torch_does(t: &KvTensorInfo, dims: [usize; 5], logical_bs: u32) {
        let facts = ModelFacts {
            num_kv_heads: t.shape[dims[3]] as u32,
            head_dim: t.shape[dims[4]] as u32,
            block_size: logical_bs,
            ..facts()
        };
        let k = derive(std::slice::from_ref(t), facts).unwrap();
        assert!(!k.opaque_blocks);
        let kernel_bs = t.shape[dims[2]] as u32;
        let ratio = logical_bs / kernel_bs;
        let elem = u64::from(t.element_size);
        for block in [0, 1, k.layout.num_blocks - 1] {
            for kv in 0..2 {
                for head in 0..t.shape[dims[3]] as u32 {
                    for token in [0, 1, logical_bs - 1] {
                        let (kb, kt) = (block * ratio + token / kernel_bs, token % kernel_bs);
                        let mut idx = [0i64; 5];
                        idx[dims[0]] = kv as i64;
                        idx[dims[1]] = i64::from(kb);
                        idx[dims[2]] = i64::from(kt);
                        idx[dims[3]] = i64::from(head);
                        let torch: i64 = idx.iter().zip(&t.strides).map(|(i, s)| i * s).sum();
                        let ours = k.layout.row_offset(0, kv, block, head, token).unwrap();
                        assert_eq!(ours, torch as u64 * elem, "{:?}", (kv, block, head, token));
                        assert!(ours + k.layout.spec.shape.row_bytes() <= k.regions[0].2);
                    }
                }
            }
        }
    }

    // Logical dims: 0 = K/V, 1 = block, 2 = token, 3 = head, 4 = head_dim.
    const FLASH: [usize; 5] = [0, 1, 2, 3, 4];
    const FLASHINFER: [usize; 5] = [1, 0, 2, 3, 4];

    #[test]
    fn flash_attention_in_nhd_and_hnd_strides_addresses_every_row_as_torch_does() {
        let shape = [2, 100, 16, 4, 64];
        let nhd = permuted("l0", &shape, &[0, 1, 2, 3, 4]);
        assert_eq!(nhd.strides, vec![100 * 16 * 256, 16 * 256, 256, 64, 1]);
        addresses_as_torch_does(&nhd, FLASH, 16);
        let hnd = permuted("l0", &shape, &[0, 1, 3, 2, 4]);
        addresses_as_torch_does(&hnd, FLASH, 16);
        let layout = |t| {
            derive(
                &[t],
                ModelFacts {
                    num_kv_heads: 4,
                    block_size: 16,
                    ..facts()
                },
            )
        };
        assert_eq!(
            layout(nhd).unwrap().layout.spec.block_layout,
            BlockLayout::TokenMajor
        );
        let hnd = layout(hnd).unwrap();
        assert_eq!(hnd.layout.spec.block_layout, BlockLayout::HeadMajor);
        // One region per layer, K planes then V planes; locked a plane at a time.
        let plane = 16 * 4 * 64 * 2;
        assert_eq!(hnd.regions, vec![(0, 1 << 32, 2 * 100 * plane)]);
        assert_eq!(hnd.block_bytes, plane);
        assert_eq!(hnd.device, Some(0));
    }

    /// A vLLM 0.33 view `[B, H, N, 2·head_dim]` on a GPU: every (kv, block, head, token) row the
    /// layout addresses is where torch's strides put it (K's row at C offset 0, V's at
    /// head_dim), and the layout says the rows interleave.
    fn view_addresses_as_torch_does(t: &KvTensorInfo, logical_bs: u32) -> KvTensors {
        let head_dim = (t.shape[3] / 2) as u32;
        let facts = ModelFacts {
            num_kv_heads: t.shape[1] as u32,
            head_dim,
            block_size: logical_bs,
            ..facts()
        };
        let k = derive(std::slice::from_ref(t), facts).unwrap();
        assert!(!k.opaque_blocks);
        assert!(k.layout.spec.block_layout.interleaved());
        let kernel_bs = t.shape[2] as u32;
        let ratio = logical_bs / kernel_bs;
        let elem = u64::from(t.element_size);
        for block in [0, 1, k.layout.num_blocks - 1] {
            for kv in 0..2 {
                for head in 0..t.shape[1] as u32 {
                    for token in [0, 1, logical_bs - 1] {
                        let (kb, kt) = (block * ratio + token / kernel_bs, token % kernel_bs);
                        let torch = i64::from(kb) * t.strides[0]
                            + i64::from(head) * t.strides[1]
                            + i64::from(kt) * t.strides[2]
                            + kv as i64 * i64::from(head_dim);
                        let ours = k.layout.row_offset(0, kv, block, head, token).unwrap();
                        assert_eq!(ours, torch as u64 * elem, "{:?}", (kv, block, head, token));
                        assert!(ours + k.layout.spec.shape.row_bytes() <= k.regions[0].2);
                    }
                }
            }
        }
        k
    }

    // A view's logical dims: 0 = block, 1 = head, 2 = token, 3 = K|V content.
    const LBHNC: [usize; 4] = [0, 1, 2, 3];
    const LBNHC: [usize; 4] = [0, 2, 1, 3];

    #[test]
    fn vllm_033_views_in_lbhnc_and_lbnhc_strides_address_every_row_as_torch_does() {
        let shape = [100, 4, 16, 128];
        let hnc = view_addresses_as_torch_does(&permuted("l0", &shape, &LBHNC), 16);
        assert_eq!(
            hnc.layout.spec.block_layout,
            BlockLayout::HeadMajorInterleaved
        );
        let nhc = view_addresses_as_torch_does(&permuted("l0", &shape, &LBNHC), 16);
        assert_eq!(
            nhc.layout.spec.block_layout,
            BlockLayout::TokenMajorInterleaved
        );
        // One region per layer; a block's K and V together are the unit locked.
        let block = 2 * 16 * 4 * 64 * 2;
        assert_eq!(nhc.regions, vec![(0, 1 << 32, 100 * block)]);
        assert_eq!(nhc.block_bytes, block);
        // A block-outermost order (BLHNC: a block holds every layer's page): the layer's view
        // steps over the other layers' pages; the region runs to the end of its last block.
        let mut blhnc = permuted("l0", &shape, &LBHNC);
        blhnc.strides[0] *= 3;
        let k = view_addresses_as_torch_does(&blhnc, 16);
        assert_eq!(k.regions[0].2, (99 * 3 + 1) * block);
        // The same shape in host memory is the CPU backend's page: opaque.
        let host = KvTensorInfo {
            device: None,
            ..permuted("l0", &shape, &LBHNC)
        };
        let facts = ModelFacts {
            num_kv_heads: 4,
            block_size: 16,
            ..facts()
        };
        assert!(derive(&[host], facts).unwrap().opaque_blocks);
    }

    /// vLLM 0.33 splits a scheduler block into kernel blocks as a pure view, which only a
    /// layer-compact order allows: under LBNHC the kernel blocks of a logical block are one
    /// token-major run; under LBHNC each kernel block's heads would cut it, refused.
    #[test]
    fn a_views_kernel_block_under_the_schedulers_is_one_logical_block_token_major_only() {
        let nhc = permuted("l0", &[400, 4, 16, 128], &LBNHC);
        let k = view_addresses_as_torch_does(&nhc, 64);
        assert_eq!(k.layout.num_blocks, 100);
        let facts = ModelFacts {
            num_kv_heads: 4,
            block_size: 64,
            ..facts()
        };
        let e = derive(&[permuted("l0", &[400, 4, 16, 128], &LBHNC)], facts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("kernel block size 16"), "{e}");
        // A view whose blocks overlap (a block stride under one page) is refused too.
        let mut overlapping = permuted("l0", &[100, 4, 16, 128], &LBHNC);
        overlapping.strides[0] /= 2;
        let e = derive(
            &[overlapping],
            ModelFacts {
                block_size: 16,
                ..facts
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("overlaps blocks"), "{e}");
    }

    /// MLA's latent cache as vLLM's MLA backends allocate it, `[num_blocks, block_size, 576]`
    /// (DeepSeek's 512 + 64), on the host (the CPU build's CPU_MLA) or a GPU, and 0.33's
    /// `[num_blocks, 1, block_size, 576]` view: one plane per block, every token's latent where
    /// torch's strides put it, the same on every rank; without vLLM's `use_mla` the shape is
    /// refused, never guessed.
    #[test]
    fn an_mla_latent_cache_is_one_plane_per_block() {
        let facts = ModelFacts {
            num_kv_heads: 1,
            head_dim: 576,
            block_size: 16,
            tp: 2,
            rank: 1,
            mla: true,
        };
        for (shape, device) in [
            (vec![100, 16, 576], None),
            (vec![100, 16, 576], Some(0)),
            (vec![100, 1, 16, 576], Some(0)),
        ] {
            let order: Vec<usize> = (0..shape.len()).collect();
            let t = KvTensorInfo {
                device,
                ..permuted("l0", &shape, &order)
            };
            let k = derive(std::slice::from_ref(&t), facts).unwrap();
            assert_eq!(k.layout.spec.block_layout, BlockLayout::Latent);
            assert!(!k.opaque_blocks);
            assert_eq!(k.layout.owned_heads(), 0..1, "every rank holds the latent");
            let (block_stride, token_stride) = (t.strides[0], t.strides[shape.len() - 2]);
            for block in [0, 1, 99] {
                for token in [0, 5, 15] {
                    let torch = (i64::from(block) * block_stride + i64::from(token) * token_stride)
                        as u64
                        * 2;
                    for kv in 0..2 {
                        assert_eq!(k.layout.row_offset(0, kv, block, 0, token), Some(torch));
                    }
                }
            }
            assert_eq!(k.block_bytes, 16 * 576 * 2);
            assert_eq!(k.regions[0].2, 100 * 16 * 576 * 2);
            let plain = derive(
                &[t],
                ModelFacts {
                    mla: false,
                    ..facts
                },
            );
            assert!(
                plain.is_err(),
                "{shape:?} taken for something else: {plain:?}"
            );
        }
    }

    /// A model with fewer KV heads than ranks: vLLM gives each rank one replicated head, and the
    /// layout says which (rank 3 of TP 4 over 2 heads holds head 1).
    #[test]
    fn a_rank_of_a_replicated_head_holds_one_head_and_says_which() {
        let t = permuted("l0", &[2, 100, 16, 1, 64], &[0, 1, 3, 2, 4]);
        let facts = ModelFacts {
            num_kv_heads: 2,
            block_size: 16,
            tp: 4,
            rank: 3,
            ..facts()
        };
        let l = derive(&[t], facts).unwrap().layout;
        assert_eq!(l.spec.heads_per_rank(), 1);
        assert_eq!(l.owned_heads(), 1..2);
    }

    #[test]
    fn flashinfer_blocks_first_in_nhd_and_hnd_strides_addresses_every_row_as_torch_does() {
        let shape = [100, 2, 16, 4, 64];
        addresses_as_torch_does(&permuted("l0", &shape, &[0, 1, 2, 3, 4]), FLASHINFER, 16);
        addresses_as_torch_does(&permuted("l0", &shape, &[0, 1, 3, 2, 4]), FLASHINFER, 16);
    }

    #[test]
    fn a_kernel_block_smaller_than_the_schedulers_is_one_logical_block_when_its_planes_follow() {
        // vLLM with kernel blocks of 16 under logical blocks of 64: 400 kernel blocks are 100
        // logical ones, each four kernel planes back to back.
        let nhd = permuted("l0", &[2, 400, 16, 4, 64], &[0, 1, 2, 3, 4]);
        addresses_as_torch_does(&nhd, FLASH, 64);
        let facts = ModelFacts {
            num_kv_heads: 4,
            block_size: 64,
            ..facts()
        };
        assert_eq!(derive(&[nhd], facts).unwrap().layout.num_blocks, 100);
        // HND, or K and V of a kernel block side by side: a logical block's plane would be in
        // pieces, so it is refused, naming the kernel block size.
        for t in [
            permuted("l0", &[2, 400, 16, 4, 64], &[0, 1, 3, 2, 4]),
            permuted("l0", &[400, 2, 16, 4, 64], &[0, 1, 2, 3, 4]),
        ] {
            let e = derive(&[t], facts).unwrap_err().to_string();
            assert!(e.contains("kernel block size 16"), "{e}");
        }
    }

    #[test]
    fn strides_that_overlap_planes_or_split_rows_are_refused() {
        let facts = ModelFacts {
            num_kv_heads: 4,
            block_size: 16,
            ..facts()
        };
        let mut overlapping = permuted("l0", &[2, 100, 16, 4, 64], &[0, 1, 2, 3, 4]);
        overlapping.strides[0] = 50 * 16 * 256;
        let e = derive(&[overlapping], facts).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
        let mut split_rows = permuted("l0", &[2, 100, 16, 4, 64], &[0, 1, 2, 4, 3]);
        split_rows.strides[4] = 4;
        let e = derive(&[split_rows], facts).unwrap_err().to_string();
        assert!(e.contains("head_dim stride"), "{e}");
        let mut odd = permuted("l0", &[2, 100, 16, 4, 64], &[0, 1, 2, 3, 4]);
        odd.strides[2] = 512;
        let e = derive(&[odd], facts).unwrap_err().to_string();
        assert!(e.contains("neither NHD"), "{e}");
    }

    #[test]
    fn an_unknown_layout_is_refused_with_its_shape() {
        let odd = KvTensorInfo {
            shape: vec![4096, 128, 2, 128],
            ..cpu("model.layers.0.self_attn.attn", 0)
        };
        let e = derive(&[odd], facts()).unwrap_err().to_string();
        assert!(
            e.contains("[4096, 128, 2, 128]") && e.contains("model.layers.0"),
            "{e}"
        );
        let strided = KvTensorInfo {
            strides: vec![65536, 16384, 128, 1],
            ..cpu("l0", 0)
        };
        assert!(matches!(
            derive(&[strided], facts()),
            Err(KvTensorError::Unknown { .. })
        ));
        let wrong_heads = derive(
            &[cpu("l0", 0)],
            ModelFacts {
                num_kv_heads: 8,
                ..facts()
            },
        );
        assert!(matches!(wrong_heads, Err(KvTensorError::Mismatch { .. })));
        assert!(matches!(derive(&[], facts()), Err(KvTensorError::None)));
        let on_gpu = KvTensorInfo {
            device: Some(1),
            ..cpu("l1", 0)
        };
        let e = derive(&[cpu("l0", 0), on_gpu], facts())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cuda:1") && e.contains("the host"), "{e}");
    }
}
