//! The engine's KV memory: one registered region per rank (block-outermost, all layers of a block
//! together), and the model's reads and writes of it. Rank `r` holds KV heads
//! `r·hpr..(r+1)·hpr` of every block, as a tensor-parallel worker would.

use std::sync::Arc;

use handoff_plan::{KvSpec, RankLayout};
use handoff_transport::KvRegion;

use crate::model;

pub struct KvMemory {
    pub spec: KvSpec,
    pub layouts: Vec<RankLayout>,
    pub regions: Vec<Arc<KvRegion>>,
}

impl KvMemory {
    pub fn new(spec: KvSpec, num_blocks: u32) -> Result<Self, String> {
        let mut layouts = Vec::new();
        let mut regions = Vec::new();
        for rank in 0..spec.tp {
            let layout =
                RankLayout::cross_layer(spec, rank, num_blocks, 0).map_err(|e| e.to_string())?;
            let len = layout.regions[0].len as usize;
            let chunk = layout.layers[0].block_stride as usize;
            regions.push(Arc::new(KvRegion::new(len, chunk.max(1))));
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
    ) -> usize {
        let p = self.layouts[rank].layers[layer as usize];
        (p.plane(kv).offset
            + block as u64 * p.block_stride
            + self.spec.row_index(head, slot) * self.spec.shape.row_bytes()) as usize
    }

    /// Writes the KV of positions `range` (prefix hashes `prefix[i]`) into `blocks`
    /// (`blocks[i / block_size]` holds position `i`).
    pub fn write_positions(
        &self,
        prefix: &[u64],
        range: std::ops::Range<usize>,
        blocks: &[u32],
    ) -> Result<(), String> {
        self.write_positions_layers(prefix, range, blocks, 0..self.spec.shape.num_layers)
    }

    /// [`Self::write_positions`] for some layers only (a forward pass produces one at a time).
    /// A block filled from its first slot is written a whole plane at a time (the slots past the
    /// range are zeroed: nothing of this sequence lives there); otherwise row by row.
    pub fn write_positions_layers(
        &self,
        prefix: &[u64],
        range: std::ops::Range<usize>,
        blocks: &[u32],
        layers: std::ops::Range<u32>,
    ) -> Result<(), String> {
        let bs = self.spec.block_size as usize;
        let hpr = self.spec.heads_per_rank();
        let row = self.row_bytes();
        let plane = self.spec.plane_bytes() as usize;
        let mut buf = vec![0u8; row];
        let mut plane_buf = vec![0u8; plane];
        let mut pos = range.start;
        while pos < range.end {
            let bi = pos / bs;
            let block = *blocks.get(bi).ok_or("position past the allocated blocks")?;
            let end = ((bi + 1) * bs).min(range.end);
            let whole = pos % bs == 0;
            for rank in 0..self.spec.tp as usize {
                for layer in layers.clone() {
                    for kv in 0..2 {
                        if whole {
                            plane_buf.fill(0);
                        }
                        for h in 0..hpr {
                            let global = rank as u32 * hpr + h;
                            for (i, p) in prefix.iter().enumerate().take(end).skip(pos) {
                                let slot = (i % bs) as u32;
                                let in_plane = self.spec.row_index(h, slot) as usize * row;
                                if whole {
                                    model::kv_row(
                                        *p,
                                        layer,
                                        kv as u32,
                                        global,
                                        &mut plane_buf[in_plane..in_plane + row],
                                    );
                                } else {
                                    model::kv_row(*p, layer, kv as u32, global, &mut buf);
                                    let off = self.row_offset(rank, block, layer, kv, h, slot);
                                    self.regions[rank]
                                        .write(off, &buf)
                                        .map_err(|e| e.to_string())?;
                                }
                            }
                        }
                        if whole {
                            let off = self.row_offset(rank, block, layer, kv, 0, 0);
                            self.regions[rank]
                                .write(off, &plane_buf)
                                .map_err(|e| e.to_string())?;
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
        mut digest: u64,
        range: std::ops::Range<usize>,
        blocks: &[u32],
    ) -> Result<u64, String> {
        let bs = self.spec.block_size as usize;
        let hpr = self.spec.heads_per_rank();
        let row = self.row_bytes();
        let stride = self.layouts[0].layers[0].block_stride as usize;
        let mut pos = range.start;
        let mut blks: Vec<Vec<u8>> = vec![vec![0u8; stride]; self.spec.tp as usize];
        while pos < range.end {
            let bi = pos / bs;
            let block = *blocks.get(bi).ok_or("position past the allocated blocks")?;
            let end = ((bi + 1) * bs).min(range.end);
            for (rank, blk) in blks.iter_mut().enumerate() {
                let base = self.row_offset(rank, block, 0, 0, 0, 0);
                self.regions[rank]
                    .read(base, blk)
                    .map_err(|e| e.to_string())?;
            }
            for i in pos..end {
                let slot = (i % bs) as u32;
                for layer in 0..self.spec.shape.num_layers {
                    for kv in 0..2 {
                        for g in 0..self.spec.shape.num_kv_heads {
                            let (rank, h) = ((g / hpr) as usize, g % hpr);
                            let base = self.row_offset(rank, block, 0, 0, 0, 0);
                            let off = self.row_offset(rank, block, layer, kv, h, slot) - base;
                            digest = model::fold(digest, &blks[rank][off..off + row]);
                        }
                    }
                }
            }
            pos = end;
        }
        Ok(digest)
    }
}
