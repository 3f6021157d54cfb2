//! The KV digest: a checksum of a handoff's KV that P computes over its blocks before D reads
//! them and D computes over its own blocks after the READ landed. D compares the two (P's rides
//! in its `PullBlocks` answer); a mismatch fails the transfer, and the KV is never decoded.
//!
//! The digest is defined on the KV's logical content, not on where it sits: it is the wrapping
//! sum, over every row (layer, K or V, global KV head, prompt token), of a hash of the row's
//! bytes keyed by those coordinates. A sum does not depend on which rank holds which head or on
//! how tokens are cut into blocks, so the digests of P's ranks add up to the same value as those
//! of D's ranks whatever the two engines' TP sizes and block sizes (the sum of each side's
//! ranks is compared). A head several ranks hold a copy of (more ranks than heads, MLA's latent
//! on every rank) counts once, on the first of them. Rows past the prompt's last token are left
//! out: their bytes are stale on P and zeroed on D.
//!
//! Engines whose blocks are opaque pages (vLLM's CPU backend: the kernel decides what is where
//! inside a head's part of a block) pair only where those parts move whole
//! (`KvSpec::opaque_pages_pair`), and move whole blocks; there a unit is one head's chunk of one
//! layer's block, keyed by (the block's index in the handoff, layer, global head), or one layer's
//! whole block where the page is not cut by head, and a chunk or page several ranks hold a copy
//! of counts on the first.
//!
//! It catches blocks damaged or misplaced on the way (a wrong block id, a short or shifted copy,
//! a race with reuse); it is a checksum, not a MAC: the cluster key is what keeps strangers out.

use std::sync::Arc;

pub use handoff_core::digest::{DigestOf, Shares};
use handoff_plan::{BlockLayout, BlockRun, KvGroups, RankLayout};
use handoff_transport::{KvRegion, RegionId, TransportError};

use crate::ConnectorError;

/// This rank's share of the digest of `blocks` (the handoff's blocks in token order; for a
/// hybrid model, each KV cache group's moved blocks in group order, as `groups` cut them: a
/// layer's rows are read from its own group's blocks only).
pub fn rank_digest(
    layout: &RankLayout,
    groups: &KvGroups,
    regions: &[(RegionId, Arc<KvRegion>)],
    blocks: &[u32],
    of: DigestOf,
) -> Result<u64, ConnectorError> {
    let region = |id: RegionId| {
        regions
            .iter()
            .find(|(r, _)| *r == id)
            .map(|(_, r)| r)
            .ok_or(TransportError::UnknownRegion { region: id })
    };
    let spec = &layout.spec;
    // A replicated head (an MLA latent, or more ranks than heads) counts once over the engine:
    // on the first rank that holds it. So does a page every rank holds a copy of.
    if !spec.first_holder(layout.rank) {
        return Ok(0);
    }
    let num_layers = spec.shape.num_layers;
    let bs = spec.block_size;
    let runs = if groups.is_single() {
        vec![BlockRun {
            kind: handoff_plan::GroupKind::Full,
            layers: (0..num_layers).collect(),
            first_block: 0,
            blocks: blocks.to_vec(),
        }]
    } else {
        groups
            .runs(blocks, num_layers, of.num_tokens, bs, 0, 0)
            .map_err(|e| ConnectorError::DigestGroups(e.to_string()))?
    };
    let mut sum = 0u64;
    if of.whole_blocks {
        // Where a head's part of a page is one chunk (head-major, its K and V rows together),
        // a unit is that chunk, keyed by its global head, so that ranks of other TP sizes add
        // up alike; otherwise one layer's whole block.
        let chunks = spec.block_layout == BlockLayout::HeadMajorInterleaved;
        let chunk = u64::from(bs) * spec.row_pitch();
        let heads = layout.owned_heads();
        let mut index = 0u64;
        for run in &runs {
            for &block in &run.blocks {
                // Only the run's layers: another group's layers at this block id are another
                // request's, or the same bytes again (vLLM's groups share memory).
                for &layer in &run.layers {
                    if chunks {
                        let r = layout
                            .layers
                            .get(layer as usize)
                            .map(|p| p.k.region)
                            .ok_or(ConnectorError::Digest { layer })?;
                        let r = region(r)?;
                        for (local, head) in heads.clone().enumerate() {
                            let off = layout
                                .row_offset(layer, 0, block, local as u32, 0)
                                .ok_or(ConnectorError::Digest { layer })?;
                            let h = hash_span(r, off, chunk)?;
                            let key = [index, u64::from(layer), u64::from(head)];
                            sum = sum.wrapping_add(keyed(h, &key));
                        }
                        continue;
                    }
                    let spans = handoff_plan::layer_block_spans(layout, layer, &[block])
                        .map_err(ConnectorError::Plan)?;
                    for (n, s) in spans.iter().enumerate() {
                        let h = hash_span(region(s.region)?, s.offset, s.len)?;
                        sum = sum.wrapping_add(keyed(h, &[index, u64::from(layer), n as u64]));
                    }
                }
                index += 1;
            }
        }
        return Ok(sum);
    }
    let row = spec.shape.row_bytes();
    let heads = layout.owned_heads();
    for run in &runs {
        for &layer in &run.layers {
            // K and V, or a latent's one plane.
            for kv in 0..spec.block_layout.planes() as usize {
                let plane = layout
                    .layers
                    .get(layer as usize)
                    .map(|p| p.plane(kv).region)
                    .ok_or(ConnectorError::Digest { layer })?;
                let r = region(plane)?;
                // Where the run's slots end (a state: slot 0 of its one block).
                let end = u64::from(run.first_block) * bs as u64
                    + u64::from(run.tokens(of.num_tokens, bs));
                for (index, &block) in run.blocks.iter().enumerate() {
                    let first = (u64::from(run.first_block) + index as u64) * bs as u64;
                    let tokens = end.saturating_sub(first).min(bs as u64) as u32;
                    for (local, head) in heads.clone().enumerate() {
                        for t in 0..tokens {
                            let off = layout
                                .row_offset(layer, kv, block, local as u32, t)
                                .ok_or(ConnectorError::Digest { layer })?;
                            let h = hash_span(r, off, row)?;
                            let key = [layer as u64, kv as u64, head as u64, first + t as u64];
                            sum = sum.wrapping_add(keyed(h, &key));
                        }
                    }
                }
            }
        }
    }
    Ok(sum)
}

/// A 64-bit hash of `len` bytes of `region` at `offset` (device memory: copied to the host a
/// piece at a time; the hash is the same as over the same bytes in host memory).
fn hash_span(region: &KvRegion, offset: u64, len: u64) -> Result<u64, TransportError> {
    let mut h = Hasher::default();
    if region.device().is_some() {
        const PIECE: u64 = 1 << 20;
        let mut buf = vec![0u8; len.min(PIECE) as usize];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(PIECE) as usize;
            region.read((offset + at) as usize, &mut buf[..n])?;
            h.write(&buf[..n]);
            at += n as u64;
        }
        return Ok(h.finish(len));
    }
    region
        .with_span(offset as usize, len as usize, |bytes| {
            h.write(bytes);
            Ok::<(), TransportError>(())
        })?
        .map(|()| h.finish(len))
}

/// `h` mixed with a row's coordinates, so equal bytes in two places count differently.
fn keyed(h: u64, key: &[u64]) -> u64 {
    let mut k = 0x9e37_79b9_7f4a_7c15u64;
    for &x in key {
        k = mix(k ^ x);
    }
    mix(h ^ k)
}

/// splitmix64's finaliser: every input bit reaches every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Multiply–rotate over 8-byte words, fed in pieces (a span may cross region chunks); the
/// pieces' boundaries do not change the result.
#[derive(Default)]
struct Hasher {
    state: u64,
    tail: [u8; 8],
    tail_len: usize,
}

impl Hasher {
    fn word(&mut self, w: u64) {
        self.state = (self.state ^ w)
            .wrapping_mul(0x9fb2_1c65_1e98_df25)
            .rotate_left(29);
    }

    fn write(&mut self, mut bytes: &[u8]) {
        if self.tail_len > 0 {
            let n = (8 - self.tail_len).min(bytes.len());
            self.tail[self.tail_len..self.tail_len + n].copy_from_slice(&bytes[..n]);
            self.tail_len += n;
            bytes = &bytes[n..];
            if self.tail_len < 8 {
                return;
            }
            self.word(u64::from_le_bytes(self.tail));
            self.tail_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            self.word(u64::from_le_bytes(a));
        }
        let rest = words.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.tail_len = rest.len();
    }

    fn finish(mut self, len: u64) -> u64 {
        if self.tail_len > 0 {
            self.tail[self.tail_len..].fill(0);
            self.word(u64::from_le_bytes(self.tail));
        }
        mix(self.state ^ len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_plan::{BlockLayout, KvSpec, ModelShape};

    const HEADS: u32 = 4;
    const LAYERS: u32 = 3;

    fn spec(tp: u32, block_size: u32) -> KvSpec {
        spec_of(HEADS, tp, block_size)
    }

    fn spec_of(heads: u32, tp: u32, block_size: u32) -> KvSpec {
        KvSpec {
            shape: ModelShape {
                num_layers: LAYERS,
                num_kv_heads: heads,
                head_dim: 8,
                dtype_size: 2,
            },
            tp,
            block_size,
            block_layout: BlockLayout::HeadMajor,
        }
    }

    /// The rows of one engine's ranks, filled with the same logical KV: a row's bytes are a
    /// function of (layer, kv, global head, global token) only.
    type Regions = Vec<(RegionId, Arc<KvRegion>)>;

    struct Engine {
        ranks: Vec<(RankLayout, Regions)>,
        blocks: Vec<u32>,
    }

    fn engine(tp: u32, block_size: u32, blocks: Vec<u32>, tokens: u32) -> Engine {
        engine_in(tp, block_size, blocks, tokens, &|len| {
            KvRegion::new(len, 4096)
        })
    }

    /// [`engine`] with its regions made by `make` (a device's memory, say).
    fn engine_in(
        tp: u32,
        block_size: u32,
        blocks: Vec<u32>,
        tokens: u32,
        make: &dyn Fn(usize) -> KvRegion,
    ) -> Engine {
        engine_of(spec(tp, block_size), blocks, tokens, make)
    }

    /// [`engine_in`] of any spec.
    fn engine_of(
        spec: KvSpec,
        blocks: Vec<u32>,
        tokens: u32,
        make: &dyn Fn(usize) -> KvRegion,
    ) -> Engine {
        let block_size = spec.block_size;
        let ranks = (0..spec.tp)
            .map(|rank| {
                let l = RankLayout::per_layer(spec, rank, 16, 0).unwrap();
                let regions: Regions = l
                    .regions
                    .iter()
                    .map(|r| (r.id, Arc::new(make(r.len as usize))))
                    .collect();
                // Stale bytes everywhere first: the digest must ignore the tail.
                for (_, r) in &regions {
                    r.write(0, &vec![0xee; r.len()]).unwrap();
                }
                for layer in 0..LAYERS {
                    for kv in 0..2 {
                        for (local, head) in l.owned_heads().enumerate() {
                            for t in 0..tokens {
                                let block = blocks[(t / block_size) as usize];
                                let off = l
                                    .row_offset(layer, kv, block, local as u32, t % block_size)
                                    .unwrap();
                                let region = l.layers[layer as usize].plane(kv).region;
                                let row: Vec<u8> = (0..16u32)
                                    .map(|i| (layer * 31 + kv as u32 * 7 + head * 5 + t + i) as u8)
                                    .collect();
                                let r = &regions.iter().find(|(id, _)| *id == region).unwrap().1;
                                r.write(off as usize, &row).unwrap();
                            }
                        }
                    }
                }
                (l, regions)
            })
            .collect();
        Engine { ranks, blocks }
    }

    fn digest(e: &Engine, of: DigestOf) -> u64 {
        e.ranks.iter().fold(0u64, |sum, (l, regions)| {
            sum.wrapping_add(rank_digest(l, &KvGroups::single(), regions, &e.blocks, of).unwrap())
        })
    }

    fn rows(tokens: u32) -> DigestOf {
        DigestOf {
            num_tokens: tokens,
            whole_blocks: false,
        }
    }

    /// The digest of KV in (fake) device memory, staged through the host, equals the digest of
    /// the same KV in host memory, and a changed byte in device memory changes it.
    #[test]
    fn device_memory_digests_as_host_memory_does() {
        use handoff_transport::device::fake::FakeDevice;
        let tokens = 37;
        let dev = FakeDevice::new(0);
        let host = engine(2, 16, vec![5, 2, 9], tokens);
        let on_device = engine_in(2, 16, vec![5, 2, 9], tokens, &|len| dev.region(len, 4096));
        assert!(on_device.ranks[0].1[0].1.device().is_some());
        let want = digest(&host, rows(tokens));
        assert_eq!(digest(&on_device, rows(tokens)), want);
        let (l, regions) = &on_device.ranks[1];
        let off = l.row_offset(1, 1, 9, 0, 3).unwrap() as usize;
        regions[1].1.write(off, &[0x42]).unwrap();
        assert_ne!(digest(&on_device, rows(tokens)), want);
    }

    #[test]
    fn equal_kv_has_one_digest_whatever_the_tp_size_and_block_size() {
        let tokens = 37;
        let p = engine(1, 16, vec![5, 2, 9], tokens);
        let d = engine(2, 8, vec![1, 0, 3, 7, 4], tokens);
        let d4 = engine(4, 32, vec![11, 6], tokens);
        assert_eq!(digest(&p, rows(tokens)), digest(&d, rows(tokens)));
        assert_eq!(digest(&p, rows(tokens)), digest(&d4, rows(tokens)));
        // Eight ranks over four heads: each head on two ranks, counted once.
        let d8 = engine(8, 16, vec![3, 1, 2], tokens);
        assert_eq!(digest(&p, rows(tokens)), digest(&d8, rows(tokens)));
    }

    #[test]
    fn one_changed_byte_or_a_swapped_block_changes_the_digest() {
        let tokens = 40;
        let p = engine(2, 16, vec![5, 2, 9], tokens);
        let clean = digest(&p, rows(tokens));
        // One byte of one row of the last token, on rank 1.
        let (l, regions) = &p.ranks[1];
        let off = l.row_offset(2, 1, 9, 1, 7).unwrap();
        let region = l.layers[2].plane(1).region;
        let r = &regions.iter().find(|(id, _)| *id == region).unwrap().1;
        let mut b = [0u8; 1];
        r.read(off as usize + 3, &mut b).unwrap();
        r.write(off as usize + 3, &[b[0] ^ 1]).unwrap();
        assert_ne!(
            digest(&p, rows(tokens)),
            clean,
            "a flipped bit went unnoticed"
        );
        r.write(off as usize + 3, &b).unwrap();
        assert_eq!(digest(&p, rows(tokens)), clean);
        // The same bytes, but two blocks read in the wrong order.
        let swapped = Engine {
            ranks: p.ranks.clone(),
            blocks: vec![2, 5, 9],
        };
        assert_ne!(digest(&swapped, rows(tokens)), clean);
        // Stale bytes past the prompt do not count.
        r.write(l.row_offset(2, 1, 9, 1, 9).unwrap() as usize, &[0; 16])
            .unwrap();
        assert_eq!(digest(&p, rows(tokens)), clean);
    }

    #[test]
    fn whole_blocks_cover_every_byte_of_each_block() {
        let p = engine(1, 16, vec![5, 2], 20);
        let of = DigestOf {
            num_tokens: 20,
            whole_blocks: true,
        };
        let clean = digest(&p, of);
        // A byte in the tail of the last block: opaque pages are compared whole.
        let (l, regions) = &p.ranks[0];
        let off = l.row_offset(0, 0, 2, 0, 15).unwrap();
        regions[0].1.write(off as usize, &[0]).unwrap();
        assert_ne!(digest(&p, of), clean);
    }

    /// One KV head on every rank (vLLM's rule when TP exceeds the heads): the pages of P at
    /// TP 2 and of D at TP 1 are the same, and each counts once whichever side holds copies.
    #[test]
    fn a_page_every_rank_holds_counts_once() {
        let of = DigestOf {
            num_tokens: 20,
            whole_blocks: true,
        };
        let host = |len| KvRegion::new(len, 4096);
        let one = engine_of(spec_of(1, 1, 16), vec![5, 2], 20, &host);
        let two = engine_of(spec_of(1, 2, 16), vec![3, 7], 20, &host);
        assert_eq!(digest(&two, of), digest(&one, of));
        // The copy on rank 1 is not read: rank 0's is the one compared.
        let (l, regions) = &two.ranks[0];
        let off = l.row_offset(0, 1, 7, 0, 2).unwrap();
        regions[0].1.write(off as usize, &[0]).unwrap();
        assert_ne!(digest(&two, of), digest(&one, of));
    }

    /// vLLM's CPU pages, one chunk per head (K and V rows together, the kernel's inside): P at
    /// TP 2 (a head per rank) and D at TP 1 (both heads) digest alike over whole blocks, tails
    /// included; a byte changed in a chunk's tail, or the heads' chunks swapped, changes it.
    #[test]
    fn head_chunks_of_opaque_pages_digest_alike_across_tp_sizes() {
        let of = DigestOf {
            num_tokens: 20,
            whole_blocks: true,
        };
        let host = |len| KvRegion::new(len, 4096);
        let chunked = |tp| KvSpec {
            block_layout: BlockLayout::HeadMajorInterleaved,
            ..spec_of(2, tp, 16)
        };
        let d = engine_of(chunked(1), vec![5, 2], 20, &host);
        let p = engine_of(chunked(2), vec![3, 7], 20, &host);
        let clean = digest(&d, of);
        assert_eq!(digest(&p, of), clean);
        // Head 1's chunk of block 7 (P rank 1), its last row: past the prompt, still compared.
        let (l, regions) = &p.ranks[1];
        let off = l.row_offset(1, 1, 7, 0, 15).unwrap();
        regions[1].1.write(off as usize, &[0]).unwrap();
        assert_ne!(digest(&p, of), clean);
        // D with its two heads' chunks swapped in block 5 of layer 0.
        let (l, regions) = &d.ranks[0];
        let chunk = 16 * l.spec.row_pitch() as usize;
        let (h0, h1) = (
            l.row_offset(0, 0, 5, 0, 0).unwrap() as usize,
            l.row_offset(0, 0, 5, 1, 0).unwrap() as usize,
        );
        let r = &regions[0].1;
        let (mut a, mut b) = (vec![0; chunk], vec![0; chunk]);
        r.read(h0, &mut a).unwrap();
        r.read(h1, &mut b).unwrap();
        r.write(h0, &b).unwrap();
        r.write(h1, &a).unwrap();
        assert_ne!(digest(&d, of), clean);
    }

    #[test]
    fn the_hash_does_not_depend_on_how_a_span_is_cut() {
        let bytes: Vec<u8> = (0..203u32).map(|i| (i * 7) as u8).collect();
        let mut whole = Hasher::default();
        whole.write(&bytes);
        let mut cut = Hasher::default();
        for piece in bytes.chunks(13) {
            cut.write(piece);
        }
        assert_eq!(whole.finish(203), cut.finish(203));
    }

    /// A hybrid model (layers 1 and 2 full, layer 0 a window of 10 tokens): each engine
    /// writes a layer's KV into its own group's blocks (the window's only where D needs it),
    /// and the handoff's list is the full group's blocks and then the window's tail. P at TP 1
    /// and D at TP 2, with other block ids, digest alike; a changed byte in the window counts,
    /// a byte of the window layer in a full-group block (another request's there) does not.
    #[test]
    fn a_hybrid_models_digest_reads_each_layer_from_its_groups_blocks() {
        use handoff_plan::{GroupKind, KvGroup};
        let groups = KvGroups::new(
            vec![
                KvGroup {
                    kind: GroupKind::Full,
                    layers: vec![1, 2],
                },
                KvGroup {
                    kind: GroupKind::Sliding { window: 10 },
                    layers: vec![0],
                },
            ],
            LAYERS,
        )
        .unwrap();
        let tokens = 40;
        let of = rows(tokens);
        // 40 tokens in blocks of 16: 3 blocks; the window (tokens 30..40) in blocks 1 and 2.
        let side = |tp, full: Vec<u32>, sliding: Vec<u32>| {
            let e = engine(tp, 16, full.clone(), tokens);
            let list = groups
                .clip(&[full, sliding.clone()], tokens, 16, None)
                .unwrap();
            assert_eq!(list.len(), 3 + 2);
            // Layer 0's rows move to the window's blocks: copy them there, then spoil them in
            // the full group's blocks, as another request would.
            for (l, regions) in &e.ranks {
                let row = l.spec.shape.row_bytes() as usize;
                for kv in 0..2 {
                    let region = l.layers[0].plane(kv).region;
                    let r = &regions.iter().find(|(id, _)| *id == region).unwrap().1;
                    for (i, &b) in e.blocks.iter().enumerate().skip(1) {
                        for h in 0..l.owned_heads().count() as u32 {
                            for t in 0..16 {
                                let from = l.row_offset(0, kv, b, h, t).unwrap() as usize;
                                let to = l.row_offset(0, kv, sliding[i], h, t).unwrap() as usize;
                                let mut bytes = vec![0u8; row];
                                r.read(from, &mut bytes).unwrap();
                                r.write(to, &bytes).unwrap();
                                r.write(from, &vec![0x11; row]).unwrap();
                            }
                        }
                    }
                }
            }
            Engine {
                ranks: e.ranks,
                blocks: list,
            }
        };
        let digest_of = |e: &Engine| {
            e.ranks.iter().fold(0u64, |sum, (l, regions)| {
                sum.wrapping_add(rank_digest(l, &groups, regions, &e.blocks, of).unwrap())
            })
        };
        let p = side(1, vec![5, 2, 9], vec![0, 11, 12]);
        let d = side(2, vec![1, 0, 3], vec![0, 7, 6]);
        let clean = digest_of(&p);
        assert_eq!(digest_of(&d), clean);
        // Read as one group, the window layer's rows come from the full group's blocks, where
        // they were spoiled.
        let single = p.ranks.iter().fold(0u64, |sum, (l, regions)| {
            let list = [5, 2, 9];
            sum.wrapping_add(rank_digest(l, &KvGroups::single(), regions, &list, of).unwrap())
        });
        assert_ne!(single, clean);
        // A byte of layer 0 in a window block of D's counts.
        let (l, regions) = &d.ranks[1];
        let region = l.layers[0].plane(1).region;
        let r = &regions.iter().find(|(id, _)| *id == region).unwrap().1;
        let off = l.row_offset(0, 1, 6, 0, 3).unwrap() as usize;
        r.write(off, &[0x42]).unwrap();
        assert_ne!(digest_of(&d), clean);
        // A list one block short is refused, not digested.
        assert!(rank_digest(&p.ranks[0].0, &groups, &p.ranks[0].1, &p.blocks[1..], of).is_err());
    }
}
