//! vLLM's KV cache tensors, as `register_kv_caches` hands them to a worker, turned into handoff's
//! [`RankLayout`]: which bytes of which tensor hold which block of which layer. Derived from each
//! tensor's shape and strides; a layout handoff does not know is refused with the shape in the
//! error, never guessed.
//!
//! Known layouts (per attention layer, one tensor each, in layer order):
//! - **CPU backend** (`cpu_attn.py`, `LBHNC`): `[num_blocks, heads_per_rank, block_size,
//!   2·head_dim]`, contiguous. Inside a block the attention kernel decides where K and V go (the
//!   "vec" kernel stores K transposed), so a block is an opaque page: moved whole, between
//!   engines of exactly the same spec ([`KvTensors::opaque_blocks`]).
//! - **FlashAttention** (`NHD`): `[2, num_blocks, block_size, heads_per_rank, head_dim]`,
//!   contiguous: K planes then V planes, each block's plane `[token][head][dim]`.

use handoff_plan::{BlockLayout, KvSpec, ModelShape, RankLayout};
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
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvTensorError {
    #[error("no KV cache tensors were registered")]
    None,
    #[error(
        "KV cache tensor {name:?} has shape {shape:?} and strides {strides:?}: not a layout \
         handoff knows (CPU [num_blocks, heads, block_size, 2*head_dim] or FlashAttention \
         [2, num_blocks, block_size, heads, head_dim], contiguous)"
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

fn u32_of(v: i64) -> Option<u32> {
    u32::try_from(v).ok().filter(|&x| x > 0)
}

/// Derives the rank's layout from its KV tensors (one per attention layer, in layer order).
pub fn derive(tensors: &[KvTensorInfo], facts: ModelFacts) -> Result<KvTensors, KvTensorError> {
    let first = tensors.first().ok_or(KvTensorError::None)?;
    for t in tensors {
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
    if !contiguous(&first.shape, &first.strides) {
        return Err(unknown());
    }
    let heads_per_rank = facts.num_kv_heads / facts.tp.max(1);
    let mismatch = |what: String| KvTensorError::Mismatch {
        name: first.name.clone(),
        what,
    };
    let dims: Vec<u32> = first
        .shape
        .iter()
        .map(|&d| u32_of(d).ok_or_else(unknown))
        .collect::<Result<_, _>>()?;
    let (num_blocks, block_size, heads, head_dim, opaque) = match *dims.as_slice() {
        // CPU: [num_blocks, heads, block_size, 2 * head_dim]
        [nb, h, bs, two_hd] if two_hd == 2 * facts.head_dim => (nb, bs, h, two_hd / 2, true),
        // FlashAttention: [2, num_blocks, block_size, heads, head_dim]
        [2, nb, bs, h, hd] => (nb, bs, h, hd, false),
        _ => return Err(unknown()),
    };
    if heads != heads_per_rank || head_dim != facts.head_dim {
        return Err(mismatch(format!(
            "{heads} heads of {head_dim} elements, the model has {heads_per_rank} per rank of {}",
            facts.head_dim
        )));
    }
    if block_size != facts.block_size {
        return Err(mismatch(format!(
            "block size {block_size}, the engine's is {}",
            facts.block_size
        )));
    }
    let spec = KvSpec {
        shape: ModelShape {
            num_layers: tensors.len() as u32,
            num_kv_heads: facts.num_kv_heads,
            head_dim,
            dtype_size: first.element_size,
        },
        tp: facts.tp,
        block_size,
        block_layout: if opaque {
            BlockLayout::HeadMajor
        } else {
            BlockLayout::TokenMajor
        },
    };
    let plane = spec.plane_bytes();
    let (layout, regions) = if opaque {
        let layout = RankLayout::per_layer(spec, facts.rank, num_blocks, 0)?;
        let len = u64::from(num_blocks) * 2 * plane;
        let regions = tensors
            .iter()
            .enumerate()
            .map(|(l, t)| (l as u32, t.data_ptr, len))
            .collect();
        (layout, regions)
    } else {
        let layout = RankLayout::split_kv(spec, facts.rank, num_blocks, 0)?;
        let len = u64::from(num_blocks) * plane;
        let regions = tensors
            .iter()
            .enumerate()
            .flat_map(|(l, t)| {
                let l = l as u32;
                [(2 * l, t.data_ptr, len), (2 * l + 1, t.data_ptr + len, len)]
            })
            .collect();
        (layout, regions)
    };
    Ok(KvTensors {
        layout,
        regions,
        block_bytes: if opaque { 2 * plane } else { plane },
        opaque_blocks: opaque,
    })
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
        }
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
    }

    #[test]
    fn flash_attentions_split_k_and_v_planes() {
        let fa = KvTensorInfo {
            name: "l0".into(),
            data_ptr: 4096,
            shape: vec![2, 100, 16, 2, 64],
            strides: vec![100 * 16 * 128, 16 * 128, 128, 64, 1],
            element_size: 2,
        };
        let t = derive(
            &[fa],
            ModelFacts {
                block_size: 16,
                ..facts()
            },
        )
        .unwrap();
        assert!(!t.opaque_blocks);
        let plane = 16 * 2 * 64 * 2;
        assert_eq!(
            t.regions,
            vec![(0, 4096, 100 * plane), (1, 4096 + 100 * plane, 100 * plane)]
        );
        assert_eq!(t.layout.spec.block_layout, BlockLayout::TokenMajor);
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
    }
}
