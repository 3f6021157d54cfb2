//! The engine's KV memory: one registered region per rank, arranged by the configured
//! [`PoolLayout`] (blocks outermost, or heads outermost), and the model's reads and writes of it.
//! Rank `r` holds the KV heads `KvSpec::owned_heads(r)` of every block (`r·hpr..(r+1)·hpr`, or one
//! head replicated on `tp / heads` ranks when there are more ranks than heads), as a
//! tensor-parallel worker would.
//! Every address comes from [`RankLayout::row_offset`], the same function the planner uses, so
//! what the model writes is exactly what a transfer moves.

use std::ops::Range;
use std::sync::Arc;

use handoff_plan::{BlockLayout, KvSpec, LayoutError, PoolLayout, RankLayout};
use handoff_transport::{KvRegion, TransportError};

use crate::model;

/// Lock granularity when a layout's block stride is small (heads outermost: one head's block):
/// chunks of about this size keep a long descriptor from taking thousands of locks.
const MIN_CHUNK: usize = 64 << 10;

/// The region's lock granularity for `layout`: never one lock over two layers of a block (blocks
/// outermost), so the forward pass writing layer l+1 of a block never waits for a push WRITE
/// still sending layer l of it; otherwise whole blocks, or about [`MIN_CHUNK`] of one head's
/// blocks when a block is small (heads outermost).
fn lock_chunk(layout: &RankLayout) -> usize {
    let stride = (layout.layers[0].block_stride as usize).max(1);
    let layer_step = match &layout.layers[..] {
        [a, b, ..] => b.k.offset.abs_diff(a.k.offset) as usize,
        _ => stride,
    };
    if layer_step > 0 && layer_step < stride && stride % layer_step == 0 {
        layer_step
    } else {
        stride * (MIN_CHUNK / stride).max(1)
    }
}

/// Why the engine could not build, write or read its KV memory (a request fails with it).
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("KV layout: {0}")]
    Layout(#[from] LayoutError),
    #[error("block {block} layer {layer} is outside the KV pool")]
    OutsidePool { block: u32, layer: u32 },
    #[error("position {0} is past the allocated blocks")]
    PastBlocks(usize),
    #[error(transparent)]
    Memory(#[from] TransportError),
    #[error("KV cache groups: {0}")]
    Groups(#[from] handoff_plan::GroupError),
}

pub struct KvMemory {
    pub spec: KvSpec,
    pub layouts: Vec<RankLayout>,
    pub regions: Vec<Arc<KvRegion>>,
}

impl KvMemory {
    pub fn new(spec: KvSpec, num_blocks: u32, pool: PoolLayout) -> Result<Self, KvError> {
        let mut layouts = Vec::new();
        let mut regions = Vec::new();
        for rank in 0..spec.tp {
            let layout = pool.rank_layout(spec, rank, num_blocks, 0)?;
            let len = layout.regions[0].len as usize;
            let chunk = lock_chunk(&layout);
            regions.push(Arc::new(KvRegion::new(len, chunk)));
            layouts.push(layout);
        }
        Ok(KvMemory {
            spec,
            layouts,
            regions,
        })
    }

    fn row_bytes(&self) -> usize {
        self.spec.shape.row_bytes() as usize
    }

    /// Offset of (local head, slot) of `layer`/`kv` in block `block` of a rank's region.
    fn row_offset(
        &self,
        rank: usize,
        block: u32,
        layer: u32,
        kv: usize,
        head: u32,
        slot: u32,
    ) -> Result<usize, KvError> {
        self.layouts[rank]
            .row_offset(layer, kv, block, head, slot)
            .map(|o| o as usize)
            .ok_or(KvError::OutsidePool { block, layer })
    }

    /// Writes the KV of positions `range` (prefix hashes `prefix[i]`) into `blocks`
    /// (`blocks[i / block_size]` holds position `i`).
    pub fn write_positions(
        &self,
        prefix: &[u64],
        range: Range<usize>,
        blocks: &[u32],
    ) -> Result<(), KvError> {
        self.write_positions_layers(prefix, range, blocks, 0..self.spec.shape.num_layers)
    }

    /// [`Self::write_positions`] for some layers only (a forward pass produces one at a time).
    /// A block filled from its first slot also gets its slots past the range zeroed (nothing of
    /// this sequence lives there), so no earlier sequence's bytes survive in it.
    pub fn write_positions_layers(
        &self,
        prefix: &[u64],
        range: Range<usize>,
        blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<(), KvError> {
        self.write_run(prefix, range, blocks, 0, layers)
    }

    /// [`Self::write_positions_layers`] into a run of blocks that starts at the sequence's block
    /// `first_block` (`blocks[i / block_size - first_block]` holds position `i`): a sliding
    /// window's blocks, the earlier ones never allocated.
    pub fn write_run(
        &self,
        prefix: &[u64],
        range: Range<usize>,
        blocks: &[u32],
        first_block: usize,
        layers: Range<u32>,
    ) -> Result<(), KvError> {
        let bs = self.spec.block_size as usize;
        let hpr = self.spec.heads_per_rank();
        let row = self.row_bytes();
        // K and V, or a latent's one plane.
        let planes = self.spec.block_layout.planes() as usize;
        let mut buf = Vec::new();
        let mut pos = range.start;
        while pos < range.end {
            let bi = pos / bs;
            let block = *bi
                .checked_sub(first_block)
                .and_then(|i| blocks.get(i))
                .ok_or(KvError::PastBlocks(pos))?;
            let end = ((bi + 1) * bs).min(range.end);
            let first = pos % bs;
            // Slots written in this block: the range's, plus the zeroed rest of a fresh block.
            let last = if first == 0 { bs } else { end - bi * bs };
            let slots = first..last;
            let positions = pos..end;
            for rank in 0..self.spec.tp as usize {
                let region = &self.regions[rank];
                // The global head of this rank's local head 0 (its copy, when heads are replicated).
                let head0 = self.spec.owned_heads(rank as u32).start;
                for layer in layers.clone() {
                    for kv in 0..planes {
                        match self.spec.block_layout {
                            // K and V rows side by side: no two slots of a plane touch, so one
                            // write per row (slots past the range zeroed).
                            BlockLayout::HeadMajorInterleaved
                            | BlockLayout::TokenMajorInterleaved => {
                                buf.clear();
                                buf.resize(row, 0);
                                for h in 0..hpr {
                                    for (i, slot) in slots.clone().enumerate() {
                                        buf.fill(0);
                                        // Slot i holds position pos + i while the range lasts.
                                        if pos + i < end {
                                            model::kv_row(
                                                prefix[pos + i],
                                                layer,
                                                kv as u32,
                                                head0 + h,
                                                &mut buf,
                                            );
                                        }
                                        let off = self.row_offset(
                                            rank,
                                            block,
                                            layer,
                                            kv,
                                            h,
                                            slot as u32,
                                        )?;
                                        region.write(off, &buf)?;
                                    }
                                }
                            }
                            // A head's slots of one block are contiguous: one write per head.
                            BlockLayout::HeadMajor => {
                                for h in 0..hpr {
                                    let global = head0 + h;
                                    buf.clear();
                                    buf.resize(slots.len() * row, 0);
                                    for (i, p) in positions.clone().enumerate() {
                                        model::kv_row(
                                            prefix[p],
                                            layer,
                                            kv as u32,
                                            global,
                                            &mut buf[i * row..(i + 1) * row],
                                        );
                                    }
                                    let off = self.row_offset(
                                        rank,
                                        block,
                                        layer,
                                        kv,
                                        h,
                                        slots.start as u32,
                                    )?;
                                    region.write(off, &buf)?;
                                }
                            }
                            // Token-major (heads always inside the block), or a latent (one
                            // vector per token): the slots' rows of every head are one
                            // contiguous range.
                            BlockLayout::TokenMajor | BlockLayout::Latent => {
                                buf.clear();
                                buf.resize(slots.len() * hpr as usize * row, 0);
                                for (i, p) in positions.clone().enumerate() {
                                    for h in 0..hpr {
                                        let at = (i * hpr as usize + h as usize) * row;
                                        model::kv_row(
                                            prefix[p],
                                            layer,
                                            kv as u32,
                                            head0 + h,
                                            &mut buf[at..at + row],
                                        );
                                    }
                                }
                                let off =
                                    self.row_offset(rank, block, layer, kv, 0, slots.start as u32)?;
                                region.write(off, &buf)?;
                            }
                        }
                    }
                }
            }
            pos = end;
        }
        Ok(())
    }

    /// Folds the KV of positions `range` into `digest`, in logical order (position, layer,
    /// plane, global head) so that the result does not depend on block size, TP or layout.
    pub fn digest_positions(
        &self,
        digest: u64,
        range: Range<usize>,
        blocks: &[u32],
    ) -> Result<u64, KvError> {
        let layers: Vec<u32> = (0..self.spec.shape.num_layers).collect();
        self.digest_run(digest, range, blocks, 0, &layers)
    }

    /// [`Self::digest_positions`] of `layers` only, from a run of blocks that starts at the
    /// sequence's block `first_block` (see [`Self::write_run`]).
    pub fn digest_run(
        &self,
        mut digest: u64,
        range: Range<usize>,
        blocks: &[u32],
        first_block: usize,
        layer_list: &[u32],
    ) -> Result<u64, KvError> {
        let bs = self.spec.block_size as usize;
        let hpr = self.spec.heads_per_rank() as usize;
        let heads = self.spec.shape.num_kv_heads as usize;
        let layers = layer_list.len();
        let row = self.row_bytes();
        let planes = self.spec.block_layout.planes() as usize;
        let mut rows = Vec::new();
        let mut plane = Vec::new();
        let mut pos = range.start;
        while pos < range.end {
            let bi = pos / bs;
            let block = *bi
                .checked_sub(first_block)
                .and_then(|i| blocks.get(i))
                .ok_or(KvError::PastBlocks(pos))?;
            let end = ((bi + 1) * bs).min(range.end);
            let (first, n) = (pos % bs, end - pos);
            // This block's rows in logical order: [layer][plane][global head][slot].
            let at = |layer: usize, kv: usize, g: usize, i: usize| {
                (((layer * planes + kv) * heads + g) * n + i) * row
            };
            rows.clear();
            rows.resize(layers * planes * heads * n * row, 0);
            for (rank, region) in self.regions.iter().enumerate() {
                let head0 = self.spec.owned_heads(rank as u32).start as usize;
                for (layer, &l) in layer_list.iter().enumerate() {
                    for kv in 0..planes {
                        match self.spec.block_layout {
                            BlockLayout::HeadMajorInterleaved
                            | BlockLayout::TokenMajorInterleaved => {
                                for h in 0..hpr {
                                    for i in 0..n {
                                        let (g, slot) = (head0 + h, (first + i) as u32);
                                        let off =
                                            self.row_offset(rank, block, l, kv, h as u32, slot)?;
                                        region.read(
                                            off,
                                            &mut rows[at(layer, kv, g, i)..at(layer, kv, g, i + 1)],
                                        )?;
                                    }
                                }
                            }
                            BlockLayout::HeadMajor => {
                                for h in 0..hpr {
                                    let g = head0 + h;
                                    let off = self.row_offset(
                                        rank,
                                        block,
                                        l,
                                        kv,
                                        h as u32,
                                        first as u32,
                                    )?;
                                    region.read(
                                        off,
                                        &mut rows[at(layer, kv, g, 0)..at(layer, kv, g, n)],
                                    )?;
                                }
                            }
                            BlockLayout::TokenMajor | BlockLayout::Latent => {
                                plane.clear();
                                plane.resize(n * hpr * row, 0);
                                let off = self.row_offset(rank, block, l, kv, 0, first as u32)?;
                                region.read(off, &mut plane)?;
                                for i in 0..n {
                                    for h in 0..hpr {
                                        let src = (i * hpr + h) * row;
                                        let dst = at(layer, kv, head0 + h, i);
                                        rows[dst..dst + row]
                                            .copy_from_slice(&plane[src..src + row]);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            for i in 0..n {
                for layer in 0..layers {
                    for kv in 0..planes {
                        for g in 0..heads {
                            let a = at(layer, kv, g, i);
                            digest = model::fold(digest, &rows[a..a + row]);
                        }
                    }
                }
            }
            pos = end;
        }
        Ok(digest)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use handoff_plan::{BlockLayout, KvSpec, ModelShape, PoolLayout};

    use super::*;

    /// A small pool: 4 layers, 2 heads, 16-token blocks, 8 of them.
    pub(crate) fn memory(pool: PoolLayout) -> KvMemory {
        let spec = KvSpec {
            shape: ModelShape {
                num_layers: 4,
                num_kv_heads: 2,
                head_dim: 64,
                dtype_size: 2,
            },
            tp: 1,
            block_size: 16,
            block_layout: BlockLayout::HeadMajor,
        };
        KvMemory::new(spec, 8, pool).unwrap()
    }

    /// Push mode: while a WRITE of layer 0 of a block is still sending (it holds the read locks
    /// of what it sends), the forward pass writes layer 1 of the same block without waiting.
    #[test]
    fn the_forward_writes_the_next_layer_of_a_block_a_transfer_still_reads() {
        for pool in [
            PoolLayout::BlocksOutermost,
            PoolLayout::HeadsOutermost,
            PoolLayout::LayersOutermost,
        ] {
            let kv = Arc::new(memory(pool));
            let layer0 = kv.row_offset(0, 3, 0, 0, 0, 0).unwrap();
            let v_end = kv.row_offset(0, 3, 0, 1, 1, 15).unwrap() + kv.row_bytes();
            let in_flight = kv.regions[0]
                .lock_span_owned(layer0, v_end - layer0)
                .unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let writer = kv.clone();
            std::thread::spawn(move || {
                let prefix: Vec<u64> = (0..64).collect();
                let r = writer.write_positions_layers(&prefix, 48..64, &[0, 1, 2, 3], 1..2);
                let _ = tx.send(r);
            });
            let done = rx.recv_timeout(Duration::from_secs(2));
            drop(in_flight);
            assert!(
                matches!(done, Ok(Ok(()))),
                "{pool:?}: writing layer 1 waited for the transfer of layer 0 of its block"
            );
        }
    }
}
