//! The cases and their memory: deterministic (the peer process builds the same ones), filled
//! and checked by hash on both sides.

use anyhow::{anyhow, bail};
use handoff_plan::{plan_pair, plan_pair_layers, BlockLayout, KvSpec, ModelShape, RankLayout};
use handoff_transport::{KvRegion, RegionId, XferDesc};

use super::{MIB, SCATTERED_BLOCKS};

pub(super) struct Case {
    pub(super) key: &'static str,
    pub(super) label: &'static str,
    /// Index of the region (one per block size) the case uses, on both sides.
    pub(super) class: usize,
    /// Granularity of the blocks.
    pub(super) block: usize,
    pub(super) descs: Vec<XferDesc>,
    /// What raw NIXL moves for the comparison: (block size, blocks), per stage.
    pub(super) raw: (usize, usize),
    /// Posts per repetition, each waited for before the next: `descs` split evenly (1: the whole
    /// case in one post; the layer-wise case: one per layer).
    pub(super) stages: usize,
}

impl Case {
    pub(super) fn bytes(&self) -> u64 {
        self.descs.iter().map(|d| d.len).sum()
    }

    /// The descriptors of each post, in order.
    pub(super) fn stage_descs(&self) -> std::slice::Chunks<'_, XferDesc> {
        self.descs
            .chunks(self.descs.len().div_ceil(self.stages.max(1)).max(1))
    }
}

pub(super) struct Layout {
    /// Chunk (= block) size of each region class.
    pub(super) chunks: Vec<usize>,
    /// Length of each region class.
    pub(super) lens: Vec<usize>,
    pub(super) cases: Vec<Case>,
    pub(super) model_block: usize,
    pub(super) model_layer_block: u64,
}

fn model_spec() -> KvSpec {
    KvSpec {
        shape: ModelShape {
            num_layers: 32,
            num_kv_heads: 8,
            head_dim: 128,
            dtype_size: 2,
        },
        tp: 1,
        block_size: 16,
        block_layout: BlockLayout::HeadMajor,
    }
}

/// The splitmix64 finaliser: a byte pattern that depends on its position (what a fill wrote and
/// a check expects), so any misplaced byte shows.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `0..n` in an order fixed by `seed` (the same blocks every run, so runs compare).
pub(super) fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut p: Vec<usize> = (0..n).collect();
    p.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    p
}

pub(super) fn build(total_mib: usize) -> anyhow::Result<Layout> {
    let total = total_mib * MIB;
    let mut chunks = Vec::new();
    let mut lens = Vec::new();
    let mut cases = Vec::new();
    let keys = [("4k", "4 KiB"), ("64k", "64 KiB"), ("1m", "1 MiB")];
    for (class, (&b, (key, label))) in SCATTERED_BLOCKS.iter().zip(keys).enumerate() {
        let n = total / b;
        let (l, r) = (
            shuffled(n, 11 + class as u64),
            shuffled(n, 101 + class as u64),
        );
        let descs = l
            .iter()
            .zip(&r)
            .map(|(&l, &r)| XferDesc {
                local_region: class as RegionId,
                local_offset: (l * b) as u64,
                remote_region: class as RegionId,
                remote_offset: (r * b) as u64,
                len: b as u64,
            })
            .collect();
        chunks.push(b);
        lens.push(n * b);
        cases.push(Case {
            key,
            label,
            class,
            block: b,
            descs,
            raw: (b, n),
            stages: 1,
        });
    }

    // The model: one region per rank, block-outermost, as the engine lays it out.
    let spec = model_spec();
    let probe = RankLayout::cross_layer(spec, 0, 1, 0)?;
    let block = probe.layers[0].block_stride as usize;
    let n = (total / block).max(1);
    let layout = RankLayout::cross_layer(spec, 0, n as u32, 0)?;
    let class = chunks.len();
    chunks.push(block);
    lens.push(n * block);
    let tokens = n as u32 * spec.block_size;
    let contiguous: Vec<u32> = (0..n as u32).collect();
    let (p_frag, d_frag): (Vec<u32>, Vec<u32>) = (
        shuffled(n, 7).into_iter().map(|b| b as u32).collect(),
        shuffled(n, 8).into_iter().map(|b| b as u32).collect(),
    );
    // P is the peer, D this process: a READ is D's pull, a WRITE pushes the same bytes back.
    let to_descs = |p: &[u32], d: &[u32]| -> anyhow::Result<Vec<XferDesc>> {
        let plan = plan_pair(&layout, &layout, p, d, tokens)?;
        Ok(plan
            .descriptors
            .iter()
            .map(|x| XferDesc {
                local_region: class as RegionId,
                local_offset: x.dst_offset,
                remote_region: class as RegionId,
                remote_offset: x.src_offset,
                len: x.len,
            })
            .collect())
    };
    cases.push(Case {
        key: "model_contig",
        label: "model contig",
        class,
        block,
        descs: to_descs(&contiguous, &contiguous)?,
        raw: (n * block, 1),
        stages: 1,
    });
    cases.push(Case {
        key: "model_frag",
        label: "model frag",
        class,
        block,
        descs: to_descs(&p_frag, &d_frag)?,
        raw: (block, n),
        stages: 1,
    });

    // The model again, layers outermost, its contiguous run moved one layer at a time.
    let lo = RankLayout::layers_outermost(spec, 0, n as u32, 0)?;
    let class_lw = chunks.len();
    let layer_block = spec.block_bytes() as usize;
    chunks.push(layer_block);
    lens.push(lo.regions[0].len as usize);
    let mut lw = Vec::new();
    for layer in 0..spec.shape.num_layers {
        let plan = plan_pair_layers(&lo, &lo, &contiguous, &contiguous, tokens, layer..layer + 1)?;
        lw.extend(plan.descriptors.iter().map(|x| XferDesc {
            local_region: class_lw as RegionId,
            local_offset: x.dst_offset,
            remote_region: class_lw as RegionId,
            remote_offset: x.src_offset,
            len: x.len,
        }));
    }
    if lw.len() != spec.shape.num_layers as usize {
        bail!(
            "the layer-wise case plans {} descriptors for {} layers, not one per layer",
            lw.len(),
            spec.shape.num_layers
        );
    }
    cases.push(Case {
        key: "model_layerwise",
        label: "model layer-wise",
        class: class_lw,
        block: layer_block,
        descs: lw,
        raw: (n * layer_block, 1),
        stages: spec.shape.num_layers as usize,
    });
    Ok(Layout {
        chunks,
        lens,
        cases,
        model_block: block,
        model_layer_block: spec.block_bytes(),
    })
}

// ---------------------------------------------------------------------------------------------
// Filling and checking memory.

/// Writes `mix(seed ^ offset)` into every 8-byte word.
pub(super) fn fill(region: &KvRegion, seed: u64) -> anyhow::Result<()> {
    let mut pos = 0u64;
    region
        .with_span_mut(0, region.len(), |piece| {
            for w in piece.chunks_exact_mut(8) {
                w.copy_from_slice(&mix(seed ^ pos).to_le_bytes());
                pos += 8;
            }
            Ok::<(), ()>(())
        })?
        .map_err(|_| anyhow!("fill"))
}

pub(super) fn fill_slice(buf: &mut [u8], seed: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&mix(seed ^ (i as u64 * 8)).to_le_bytes());
    }
}

/// A word-wise FNV over the ranges, in order (every range is a multiple of 8 bytes long).
pub(super) fn hash_ranges(
    region: &KvRegion,
    ranges: impl Iterator<Item = (u64, u64)>,
) -> anyhow::Result<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (off, len) in ranges {
        region
            .with_span(off as usize, len as usize, |piece| {
                for w in piece.chunks_exact(8) {
                    let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                    h = (h ^ w).wrapping_mul(0x100_0000_01b3);
                }
                Ok::<(), ()>(())
            })?
            .map_err(|_| anyhow!("hash"))?;
    }
    Ok(h)
}

pub(super) fn local_hash(region: &KvRegion, case: &Case) -> anyhow::Result<u64> {
    hash_ranges(region, case.descs.iter().map(|d| (d.local_offset, d.len)))
}

pub(super) fn remote_hash(region: &KvRegion, case: &Case) -> anyhow::Result<u64> {
    hash_ranges(region, case.descs.iter().map(|d| (d.remote_offset, d.len)))
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub(super) fn gbps(bytes: u64, secs: Vec<f64>) -> f64 {
    bytes as f64 / median(secs) / 1e9
}
