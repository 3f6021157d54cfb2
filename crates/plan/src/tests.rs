//! Unit tests, one per case; the byte-level property test lives in tests/prop.rs.
//!
//! Over 1,000 lines, one topic: the plan crate's unit tests (specs and layouts, the planner's
//! descriptors, grant spans, topologies), each a named case; split by module it would repeat
//! the fixtures every case shares.

use super::*;

const ROW: u64 = 16; // head_dim 8 × bf16

fn spec(heads: u32, tp: u32, bs: u32, layout: BlockLayout) -> KvSpec {
    KvSpec {
        shape: ModelShape {
            num_layers: 1,
            num_kv_heads: heads,
            head_dim: 8,
            dtype_size: 2,
        },
        tp,
        block_size: bs,
        block_layout: layout,
    }
}

fn layers(mut s: KvSpec, n: u32) -> KvSpec {
    s.shape.num_layers = n;
    s
}

fn ranks(s: KvSpec, num_blocks: u32) -> Vec<RankLayout> {
    (0..s.tp)
        .map(|r| RankLayout::per_layer(s, r, num_blocks, 100).unwrap())
        .collect()
}

fn desc(src_offset: u64, dst_offset: u64, len: u64) -> Descriptor {
    Descriptor {
        src_region: 100,
        src_offset,
        dst_region: 100,
        dst_offset,
        len,
    }
}

use BlockLayout::{HeadMajor, HeadMajorInterleaved, TokenMajor, TokenMajorInterleaved};

#[test]
fn spec_helpers() {
    let s = spec(8, 4, 16, HeadMajor);
    assert_eq!(s.heads_per_rank(), 2);
    assert_eq!(s.owned_heads(3), 6..8);
    assert_eq!(s.plane_bytes(), 2 * 16 * ROW);
    assert_eq!(s.block_bytes(), 2 * 2 * 16 * ROW);
    assert_eq!(s.blocks_for(0), 0);
    assert_eq!(s.blocks_for(16), 1);
    assert_eq!(s.blocks_for(17), 2);
    assert_eq!(s.row_index(1, 3), 16 + 3);
    assert_eq!(spec(8, 4, 16, TokenMajor).row_index(1, 3), 3 * 2 + 1);
}

#[test]
fn topology_equal_tp() {
    let t = Topology::new(2, 2, 8).unwrap();
    let pairs = t.pairs();
    assert_eq!(pairs.len(), 2);
    assert_eq!(
        pairs[1],
        RankPair {
            d_rank: 1,
            p_rank: 1,
            heads: 4..8
        }
    );
    assert_eq!(t.consumers(0), 1);
    assert_eq!(t.sources(1), 1..2);
    assert_eq!(t.readers(1), 1..2);
}

#[test]
fn topology_p_wider_than_d() {
    let t = Topology::new(4, 2, 8).unwrap();
    assert_eq!(t.sources(1), 2..4);
    assert_eq!(t.readers(3), 1..2);
    assert_eq!(t.consumers(3), 1);
    assert_eq!(t.pair_heads(1, 2), Some(4..6));
    assert_eq!(t.pair_heads(0, 2), None);
    assert_eq!(t.pairs().len(), 4);
}

#[test]
fn topology_d_wider_than_p() {
    let t = Topology::new(1, 4, 4).unwrap();
    assert_eq!(t.sources(3), 0..1);
    assert_eq!(t.readers(0), 0..4);
    assert_eq!(t.consumers(0), 4);
    assert_eq!(t.pair_heads(2, 0), Some(2..3));
    assert_eq!(t.sources(4), 0..0);
    assert_eq!(t.consumers(1), 0);
}

/// More ranks than KV heads (vLLM replicates each head on `tp / heads` ranks): D reads each
/// head it needs once, from the first of its sources that holds it; a source holding only copies
/// already read is a pair that moves nothing and only confirms, so the pairs are still the
/// ledgers' (`rank_pairs`), who count on every source to hear from D.
/// Opaque pages (vLLM's CPU backend) pair when they are the same bytes (equal specs, or one KV
/// head replicated on every rank of both sides whatever their TP sizes), or when each head's part
/// of a block is one chunk (head-major, K and V rows together), whatever the TP sizes: the chunk
/// moves whole. Another block size or layout would need the rows inside a chunk.
#[test]
fn opaque_pages_pair_when_each_head_s_part_of_a_page_moves_whole() {
    let one = |tp| spec(1, tp, 16, HeadMajor);
    assert!(one(2).opaque_pages_pair(&one(1)) && one(1).opaque_pages_pair(&one(4)));
    assert!(spec(2, 2, 16, HeadMajor).opaque_pages_pair(&spec(2, 2, 16, HeadMajor)));
    // Two heads: TP 2 holds one per rank, TP 1 both. Planes apart (all heads' K, then all
    // heads' V) would cut a head's part in two, at a place only the kernel knows.
    assert!(!spec(2, 2, 16, HeadMajor).opaque_pages_pair(&spec(2, 1, 16, HeadMajor)));
    let chunks = |tp, bs| spec(4, tp, bs, HeadMajorInterleaved);
    assert!(chunks(2, 16).opaque_pages_pair(&chunks(1, 16)));
    assert!(chunks(1, 16).opaque_pages_pair(&chunks(4, 16)));
    assert!(
        chunks(8, 16).opaque_pages_pair(&chunks(2, 16)),
        "replicated heads too"
    );
    assert!(!chunks(2, 16).opaque_pages_pair(&chunks(1, 32)));
    assert!(!chunks(1, 16).opaque_pages_pair(&spec(4, 1, 16, TokenMajorInterleaved)));
    assert!(!chunks(2, 16).opaque_pages_pair(&spec(4, 1, 16, HeadMajor)));
    assert!(!one(2).opaque_pages_pair(&spec(1, 1, 32, HeadMajor)));
    assert!(!one(1).opaque_pages_pair(&spec(1, 1, 16, TokenMajor)));
    assert!(!one(1).opaque_pages_pair(&layers(one(1), 2)));
}

#[test]
fn replicated_heads_are_read_once_and_their_other_copies_only_confirm() {
    let pair = |d_rank, p_rank, heads| RankPair {
        d_rank,
        p_rank,
        heads,
    };
    // One head on P's two ranks, D tp 1: read from P rank 0; P rank 1 confirms.
    let t = Topology::new(2, 1, 1).unwrap();
    assert_eq!(t.pairs(), vec![pair(0, 0, 0..1), pair(0, 1, 1..1)]);
    assert_eq!((t.consumers(0), t.consumers(1)), (1, 1));
    // Two heads on P's four ranks (0, 1: head 0; 2, 3: head 1), D tp 2.
    let t = Topology::new(4, 2, 2).unwrap();
    let want = [(0, 0, 0..1), (0, 1, 1..1), (1, 2, 1..2), (1, 3, 2..2)];
    assert_eq!(t.pairs(), want.map(|(d, p, h)| pair(d, p, h)));
    // Copies on D: every D rank reads its own copy (its memory is its own).
    let t = Topology::new(1, 2, 1).unwrap();
    assert_eq!(t.pairs(), vec![pair(0, 0, 0..1), pair(1, 0, 0..1)]);
    assert_eq!(t.consumers(0), 2);
    // Copies on both sides: D ranks 0, 1 read P rank 0's copy, 2, 3 P rank 1's.
    let t = Topology::new(2, 4, 1).unwrap();
    let want = [(0, 0, 0..1), (1, 0, 0..1), (2, 1, 0..1), (3, 1, 0..1)];
    assert_eq!(t.pairs(), want.map(|(d, p, h)| pair(d, p, h)));
    for (p_tp, d_tp, heads) in [
        (2, 1, 1),
        (4, 2, 2),
        (1, 2, 1),
        (2, 4, 1),
        (8, 2, 2),
        (4, 8, 2),
    ] {
        let t = Topology::new(p_tp, d_tp, heads).unwrap();
        let pairs: Vec<(u16, u16)> = t
            .pairs()
            .iter()
            .map(|x| (x.d_rank as u16, x.p_rank as u16))
            .collect();
        assert_eq!(
            pairs,
            rank_pairs(p_tp as u16, d_tp as u16),
            "{p_tp} -> {d_tp}"
        );
        // Every D rank gets every head it owns exactly once.
        for d in 0..d_tp {
            let mut got: Vec<u32> = t
                .pairs()
                .iter()
                .filter(|x| x.d_rank == d)
                .flat_map(|x| x.heads.clone())
                .collect();
            got.sort_unstable();
            let want: Vec<u32> = crate::layout::owned_heads(d_tp, heads, d).collect();
            assert_eq!(got, want, "{p_tp} -> {d_tp}, D rank {d}");
        }
    }
    // A plan moves one copy: P tp 2 to D tp 1 moves what P tp 1 to D tp 1 moves.
    let one = |tp| ranks(layers(spec(1, tp, 16, HeadMajor), 2), 8);
    let blocks = [3, 5];
    let via = |p_tp: u32| plan(&one(p_tp), &one(1), &blocks, &blocks, 32).unwrap();
    let (two, single) = (via(2), via(1));
    assert_eq!(two.bytes(), single.bytes());
    assert!(
        two.pairs[1].descriptors.is_empty(),
        "P rank 1's copy is not read"
    );
}

#[test]
fn equal_tp_contiguous_is_one_descriptor_per_layer() {
    let s = layers(spec(4, 2, 16, HeadMajor), 2);
    let bb = s.block_bytes();
    let plan = plan(&ranks(s, 10), &ranks(s, 10), &[2, 3, 4], &[5, 6, 7], 48).unwrap();
    assert_eq!(plan.pairs.len(), 2);
    for pp in &plan.pairs {
        assert_eq!(pp.d_rank, pp.p_rank);
        assert_eq!(
            pp.descriptors,
            vec![
                desc(2 * bb, 5 * bb, 3 * bb),
                Descriptor {
                    src_region: 101,
                    dst_region: 101,
                    ..desc(2 * bb, 5 * bb, 3 * bb)
                },
            ]
        );
    }
    assert_eq!(plan.bytes(), 2 * 2 * 3 * bb);
}

#[test]
fn p_wider_than_d_gathers_head_slices() {
    let (p, d) = (spec(4, 2, 16, HeadMajor), spec(4, 1, 16, HeadMajor));
    let plan = plan(&ranks(p, 1), &ranks(d, 1), &[0], &[0], 16).unwrap();
    let slice = 2 * 16 * ROW; // two heads × one block of tokens
    let d_plane = d.plane_bytes();
    assert_eq!(
        plan.pair(0, 0).unwrap().descriptors,
        vec![desc(0, 0, slice), desc(slice, d_plane, slice)]
    );
    assert_eq!(
        plan.pair(0, 1).unwrap().descriptors,
        vec![desc(0, slice, slice), desc(slice, d_plane + slice, slice)]
    );
}

#[test]
fn d_wider_than_p_reads_head_slices() {
    let (p, d) = (spec(4, 1, 16, HeadMajor), spec(4, 2, 16, HeadMajor));
    let plan = plan(&ranks(p, 1), &ranks(d, 1), &[0], &[0], 16).unwrap();
    let slice = 2 * 16 * ROW;
    let p_plane = p.plane_bytes();
    assert_eq!(plan.topology.consumers(0), 2);
    assert_eq!(
        plan.pair(0, 0).unwrap().descriptors,
        vec![desc(0, 0, slice), desc(p_plane, slice, slice)]
    );
    assert_eq!(
        plan.pair(1, 0).unwrap().descriptors,
        vec![desc(slice, 0, slice), desc(p_plane + slice, slice, slice)]
    );
}

#[test]
fn block_ratio_p16_d32_head_major() {
    let (p, d) = (spec(2, 1, 16, HeadMajor), spec(2, 1, 32, HeadMajor));
    let pp = plan_pair(&ranks(p, 4)[0], &ranks(d, 2)[0], &[0, 1, 2, 3], &[0, 1], 64).unwrap();
    // Every (P block, plane, head) is its own range (4 × 2 × 2), except one seam: the last
    // head of P block 1's V ends where P block 2 starts, and lands at the end of D block 0,
    // where D block 1 (P block 2's destination) starts.
    assert_eq!(pp.descriptors.len(), 15);
    let half = 16 * ROW;
    // P block 1, K, head 1 → D block 0, K, head 1, tokens 16..32.
    let src = p.block_bytes() + half;
    let x = pp.descriptors.iter().find(|x| x.src_offset == src).unwrap();
    assert_eq!(*x, desc(src, (32 + 16) * ROW, half));
}

#[test]
fn block_ratio_p32_d16_head_major() {
    let (p, d) = (spec(2, 1, 32, HeadMajor), spec(2, 1, 16, HeadMajor));
    let pp = plan_pair(&ranks(p, 2)[0], &ranks(d, 4)[0], &[1, 0], &[3, 2, 1, 0], 64).unwrap();
    assert_eq!(pp.descriptors.len(), 16);
    // Token 16 of head 1's K is in P block 1 (the list's first), at row 1·32 + 16; it lands in
    // D block 2 (the list's second), row 1·16 + 0.
    let src = p.block_bytes() + (32 + 16) * ROW;
    let x = pp.descriptors.iter().find(|x| x.src_offset == src).unwrap();
    assert_eq!(*x, desc(src, 2 * d.block_bytes() + 16 * ROW, 16 * ROW));
}

#[test]
fn block_ratio_token_major_split_kv_is_one_range_per_plane() {
    let (p, d) = (spec(2, 1, 16, TokenMajor), spec(2, 1, 32, TokenMajor));
    let pl = RankLayout::split_kv(p, 0, 8, 0).unwrap();
    let dl = RankLayout::split_kv(d, 0, 4, 0).unwrap();
    let pp = plan_pair(&pl, &dl, &[4, 5, 6, 7], &[1, 2], 64).unwrap();
    let len = 4 * p.plane_bytes();
    let (src, dst) = (4 * p.plane_bytes(), d.plane_bytes());
    assert_eq!(
        pp.descriptors,
        vec![
            Descriptor {
                src_region: 0,
                src_offset: src,
                dst_region: 0,
                dst_offset: dst,
                len
            },
            Descriptor {
                src_region: 1,
                src_offset: src,
                dst_region: 1,
                dst_offset: dst,
                len
            },
        ]
    );
    // The same blocks into P-sized D blocks the other way round.
    let pp = plan_pair(&dl, &pl, &[1, 2], &[4, 5, 6, 7], 64).unwrap();
    assert_eq!(pp.descriptors.len(), 2);
}

#[test]
fn shuffled_but_address_contiguous_blocks_coalesce() {
    let s = spec(2, 1, 16, HeadMajor);
    // Token order says P5→D10, P3→D8, P4→D9: in address order 3,4,5 → 8,9,10, one range.
    let pp = plan_pair(
        &ranks(s, 16)[0],
        &ranks(s, 16)[0],
        &[5, 3, 4],
        &[10, 8, 9],
        48,
    )
    .unwrap();
    let bb = s.block_bytes();
    assert_eq!(pp.descriptors, vec![desc(3 * bb, 8 * bb, 3 * bb)]);
}

#[test]
fn partial_last_block_moves_only_its_tokens() {
    let s = spec(2, 1, 16, HeadMajor);
    let bb = s.block_bytes();
    let pp = plan_pair(&ranks(s, 2)[0], &ranks(s, 5)[0], &[0, 1], &[3, 4], 20).unwrap();
    let four = 4 * ROW;
    // Block 0 whole, then 4 tokens of each (plane, head) of block 1; the first of those
    // continues block 0 on both sides and merges with it.
    assert_eq!(
        pp.descriptors,
        vec![
            desc(0, 3 * bb, bb + four),
            desc(bb + 16 * ROW, 4 * bb + 16 * ROW, four),
            desc(bb + 32 * ROW, 4 * bb + 32 * ROW, four),
            desc(bb + 48 * ROW, 4 * bb + 48 * ROW, four),
        ]
    );
    assert_eq!(pp.bytes(), 20 * 2 * 2 * ROW);
    let tail = 12 * ROW;
    assert_eq!(
        uncovered_dst(&ranks(s, 5)[0], &[3, 4], 20).unwrap(),
        [4, 20, 36, 52]
            .iter()
            .map(|&r| Span {
                region: 100,
                offset: 4 * bb + r * ROW,
                len: tail
            })
            .collect::<Vec<_>>()
    );
    assert_eq!(uncovered_dst(&ranks(s, 5)[0], &[3, 4], 32).unwrap(), vec![]);
    let tm = RankLayout::per_layer(spec(2, 1, 16, TokenMajor), 0, 5, 100).unwrap();
    assert_eq!(
        uncovered_dst(&tm, &[3, 4], 20).unwrap(),
        vec![
            Span {
                region: 100,
                offset: 4 * bb + 8 * ROW,
                len: 24 * ROW
            },
            Span {
                region: 100,
                offset: 4 * bb + s.plane_bytes() + 8 * ROW,
                len: 24 * ROW
            },
        ]
    );
}

#[test]
fn zero_tokens_plan_nothing() {
    let s = spec(2, 1, 16, HeadMajor);
    let plan = plan(&ranks(s, 2), &ranks(s, 2), &[], &[], 0).unwrap();
    assert_eq!(plan.descriptor_count(), 0);
}

#[test]
fn block_ids_are_checked() {
    let s = spec(2, 1, 16, HeadMajor);
    let (p, d) = (ranks(s, 4), ranks(s, 4));
    let err = plan(&p, &d, &[0, 4], &[0, 1], 32).unwrap_err();
    assert_eq!(
        err,
        PlanError::BlockOutOfPool {
            side: Side::Prefill,
            rank: 0,
            index: 1,
            block: 4,
            num_blocks: 4
        }
    );
    assert_eq!(
        err.to_string(),
        "P rank 0: block id 4 (list index 1) is outside the pool of 4 blocks"
    );
    assert!(matches!(
        plan(&p, &d, &[0, 1], &[u32::MAX, 1], 32),
        Err(PlanError::BlockOutOfPool {
            side: Side::Decode,
            block: u32::MAX,
            ..
        })
    ));
    assert_eq!(
        plan(&p, &d, &[0, 0], &[0, 1], 32),
        Err(PlanError::DuplicateBlock {
            side: Side::Prefill,
            block: 0
        })
    );
    let err = plan(&p, &d, &[0, 1], &[0], 32).unwrap_err();
    assert_eq!(
        err.to_string(),
        "D block list has 1 blocks but 32 tokens in blocks of 16 need exactly 2"
    );
    assert!(matches!(
        plan_layers(&p, &d, &[0], &[0], 16, 0..2),
        Err(PlanError::LayerRange { .. })
    ));
}

#[test]
fn rank_sets_and_pairs_are_checked() {
    let s = spec(4, 2, 16, HeadMajor);
    let (p, d) = (ranks(s, 2), ranks(s, 2));
    assert_eq!(
        plan(&p[..1], &d, &[0], &[0], 16),
        Err(PlanError::MissingRank {
            side: Side::Prefill,
            rank: 1
        })
    );
    let swapped = vec![d[1].clone(), d[0].clone()];
    assert!(matches!(
        plan(&p, &swapped, &[0], &[0], 16),
        Err(PlanError::RankOrder { index: 0, .. })
    ));
    assert_eq!(
        plan_pair(&p[1], &d[0], &[0], &[0], 16),
        Err(PlanError::NotAPair {
            d_rank: 0,
            p_rank: 1
        })
    );
    let mut other = d.clone();
    other[1].spec.block_size = 32;
    assert_eq!(
        plan(&p, &other, &[0], &[0], 16),
        Err(PlanError::SpecDiffers {
            side: Side::Decode,
            rank: 1
        })
    );
}

#[test]
fn bad_layouts_are_errors() {
    let s = spec(2, 1, 16, HeadMajor);
    let good = ranks(s, 4).remove(0);
    let mut short = good.clone();
    short.regions[0].len -= 1;
    let err = plan_pair(&good, &short, &[0], &[0], 16).unwrap_err();
    assert!(matches!(
        err,
        PlanError::Layout {
            side: Side::Decode,
            source: LayoutError::OutsideRegion { .. },
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        format!(
            "D rank 0: layer 0 V: the pool's blocks end at byte {} but region 100 is only {} bytes",
            4 * s.block_bytes(),
            4 * s.block_bytes() - 1
        )
    );
    let mut l = good.clone();
    l.layers[0].block_stride = u64::MAX;
    assert!(matches!(
        l.validate(),
        Err(LayoutError::OutsideRegion { end: u64::MAX, .. })
    ));
    let mut l = good.clone();
    l.layers[0].v.region = 7;
    assert_eq!(
        l.validate(),
        Err(LayoutError::UnknownRegion {
            layer: 0,
            region: 7
        })
    );
    let mut l = good.clone();
    l.regions.push(l.regions[0]);
    assert_eq!(l.validate(), Err(LayoutError::DuplicateRegion { id: 100 }));
    let mut l = good.clone();
    l.layers[0].block_stride = 8;
    assert!(matches!(
        l.validate(),
        Err(LayoutError::StrideTooSmall { .. })
    ));
    let mut l = good.clone();
    l.rank = 1;
    assert_eq!(
        l.validate().unwrap_err().to_string(),
        "rank 1 is out of range for tensor-parallel size 1"
    );
    let mut l = good.clone();
    l.layers.clear();
    assert_eq!(
        l.validate(),
        Err(LayoutError::LayerCount {
            expected: 1,
            got: 0
        })
    );
    // K and V planes at the same address: valid on their own, caught once planned.
    let mut l = good;
    l.layers[0].v = l.layers[0].k;
    let other = ranks(s, 4).remove(0);
    assert!(matches!(
        plan_pair(&l, &other, &[0], &[0], 16),
        Err(PlanError::Aliased {
            side: Side::Prefill,
            ..
        })
    ));
    assert!(matches!(
        plan_pair(&other, &l, &[0], &[0], 16),
        Err(PlanError::Aliased {
            side: Side::Decode,
            ..
        })
    ));
}

#[test]
fn bounds_check_rejects_ranges_outside_regions() {
    let l = ranks(spec(2, 1, 16, HeadMajor), 1).remove(0);
    let len = l.regions[0].len;
    assert!(planner::bounds(Side::Prefill, &l, 100, 0, len).is_ok());
    assert!(matches!(
        planner::bounds(Side::Prefill, &l, 100, 1, len),
        Err(PlanError::OutOfRegion { region_len, .. }) if region_len == len
    ));
    assert!(planner::bounds(Side::Prefill, &l, 100, u64::MAX, 2).is_err());
    assert!(planner::bounds(Side::Prefill, &l, 5, 0, 1).is_err());
}

#[test]
fn incompatible_messages_say_why() {
    let base = spec(8, 2, 16, HeadMajor);
    let check = |p: KvSpec, d: KvSpec| check_compatible(&p, &d).unwrap_err().to_string();
    let with = |f: &dyn Fn(&mut KvSpec)| {
        let mut s = base;
        f(&mut s);
        s
    };
    assert_eq!(
        check(base, with(&|s| s.shape.num_layers = 2)),
        "model shape differs: num_layers is 1 on P but 2 on D"
    );
    assert_eq!(
        check(base, with(&|s| s.shape.num_kv_heads = 4)),
        "model shape differs: num_kv_heads is 8 on P but 4 on D"
    );
    assert_eq!(
        check(base, with(&|s| s.shape.head_dim = 4)),
        "model shape differs: head_dim is 8 on P but 4 on D"
    );
    assert_eq!(
        check(base, with(&|s| s.shape.dtype_size = 1)),
        "KV dtype size differs: 2 bytes per element on P but 1 on D (no conversion is done)"
    );
    assert_eq!(
        check(with(&|s| s.tp = 12), base),
        "P engine: tensor-parallel size 12 exceeds the model's 8 KV heads and is not a multiple \
         of it: each head is replicated on tp / num_kv_heads ranks (as vLLM does), which must be \
         a whole number"
    );
    assert_eq!(
        check(base, with(&|s| s.tp = 3)),
        "D engine: 8 KV heads do not split evenly over tensor-parallel size 3: every rank must own \
         the same whole number of heads"
    );
    assert_eq!(
        check(base, with(&|s| s.block_size = 0)),
        "D engine: block_size is 0; it must be at least 1"
    );
    assert_eq!(
        check(base, with(&|s| s.shape.head_dim = u32::MAX))
            .split(':')
            .next(),
        Some("model shape differs")
    );
    let huge = with(&|s| {
        s.shape.head_dim = u32::MAX;
        s.shape.dtype_size = u32::MAX;
        s.block_size = u32::MAX;
    });
    assert_eq!(
        check(huge, huge),
        format!(
            "P engine: one block plane (4 heads × {} tokens × {} bytes) overflows u64",
            u32::MAX,
            u64::from(u32::MAX) * u64::from(u32::MAX)
        )
    );
    let six = |tp| KvSpec {
        tp,
        shape: ModelShape {
            num_kv_heads: 6,
            ..base.shape
        },
        ..base
    };
    assert_eq!(
        check(six(2), six(3)),
        "tensor-parallel sizes do not divide each other: P tp 2, D tp 3"
    );
    assert_eq!(
        check(base, with(&|s| s.block_size = 48)),
        "block sizes 16 (P) and 48 (D) are not a power-of-two multiple of each other; only \
         power-of-two block-size ratios are supported"
    );
    assert!(matches!(
        check_compatible(&base, &with(&|s| s.block_size = 24)),
        Err(Incompatible::BlockSizeRatio { p: 16, d: 24 })
    ));
    assert_eq!(
        check(base, with(&|s| s.block_layout = TokenMajor)),
        "block layouts differ: P is HeadMajor but D is TokenMajor; engines pair when their rows \
         are in the same order (K and V interleaved or not), and a latent (MLA) only with a latent"
    );
    // What may differ does.
    let t = check_compatible(
        &base,
        &with(&|s| {
            s.tp = 8;
            s.block_size = 64;
        }),
    )
    .unwrap();
    assert_eq!((t.p_tp(), t.d_tp(), t.num_kv_heads()), (2, 8, 8));
    // The planner refuses the same things.
    let p = ranks(base, 1);
    let d = ranks(with(&|s| s.block_layout = TokenMajor), 1);
    assert!(matches!(
        plan(&p, &d, &[0], &[0], 16),
        Err(PlanError::Incompatible(Incompatible::LayoutMismatch { .. }))
    ));
}

/// With contiguous allocations, equal TP and block size, the descriptor count per pair per layer
/// does not grow with the prompt; heterogeneous cases are linear in the blocks (one range per
/// block per plane, per head slice) but not worse.
#[test]
fn contiguous_allocations_do_not_grow_descriptor_count() {
    for layout in [HeadMajor, TokenMajor] {
        let s = layers(spec(8, 2, 16, layout), 3);
        let per_layer = |blocks: u32, build: &dyn Fn(KvSpec, u32) -> RankLayout| {
            let (p, d) = (build(s, 300), build(s, 300));
            let pb: Vec<u32> = (7..7 + blocks).collect();
            let db: Vec<u32> = (40..40 + blocks).collect();
            (0..3)
                .map(|l| {
                    plan_pair_layers(&p, &d, &pb, &db, blocks * 16, l..l + 1)
                        .unwrap()
                        .descriptors
                        .len()
                })
                .collect::<Vec<_>>()
        };
        let by_layer = |s, n| RankLayout::per_layer(s, 1, n, 0).unwrap();
        let split = |s, n| RankLayout::split_kv(s, 1, n, 0).unwrap();
        for blocks in [1, 2, 16, 256] {
            assert_eq!(
                per_layer(blocks, &by_layer),
                vec![1, 1, 1],
                "{layout:?} {blocks}"
            );
            assert_eq!(
                per_layer(blocks, &split),
                vec![2, 2, 2],
                "{layout:?} {blocks}"
            );
            // Cross-layer regions: one range per run for the whole model.
            let cl = RankLayout::cross_layer(s, 1, 300, 0).unwrap();
            let pb: Vec<u32> = (7..7 + blocks).collect();
            let db: Vec<u32> = (40..40 + blocks).collect();
            assert_eq!(
                plan_pair(&cl, &cl, &pb, &db, blocks * 16)
                    .unwrap()
                    .descriptors
                    .len(),
                1
            );
        }
    }
    // Heterogeneous TP, head-major: one range per block per plane per pair.
    let (p, d) = (spec(8, 2, 16, HeadMajor), spec(8, 4, 16, HeadMajor));
    for blocks in [1u32, 16, 256] {
        let pl = RankLayout::per_layer(p, 0, 300, 0).unwrap();
        let dl = RankLayout::per_layer(d, 1, 300, 0).unwrap();
        let pb: Vec<u32> = (0..blocks).collect();
        let n = plan_pair(&pl, &dl, &pb, &pb, blocks * 16)
            .unwrap()
            .descriptors
            .len();
        assert_eq!(n, 2 * blocks as usize);
    }
}

/// Heads outside the blocks: for a contiguous allocation, every pair costs one descriptor per
/// (layer, K|V, head it moves), whatever the number of blocks, the TP sizes and the block sizes
/// (a head's tokens are one range on both sides). Whole-model ranges merge further when the
/// request covers the whole pool.
#[test]
fn heads_outermost_costs_a_constant_number_of_descriptors() {
    let shape = ModelShape {
        num_layers: 3,
        num_kv_heads: 8,
        head_dim: 8,
        dtype_size: 2,
    };
    for (ptp, dtp) in [(1u32, 1u32), (2, 4), (4, 2), (1, 8), (8, 1)] {
        for (pbs, dbs) in [(16u32, 16u32), (16, 32), (32, 16)] {
            let mk = |tp, bs| KvSpec {
                shape,
                tp,
                block_size: bs,
                block_layout: HeadMajor,
            };
            let (ps, ds) = (mk(ptp, pbs), mk(dtp, dbs));
            let p: Vec<_> = (0..ptp)
                .map(|r| RankLayout::heads_outermost(ps, r, 600, 0).unwrap())
                .collect();
            let d: Vec<_> = (0..dtp)
                .map(|r| RankLayout::heads_outermost(ds, r, 600, 0).unwrap())
                .collect();
            let mut counts = Vec::new();
            for tokens in [16u32 * 3, 16 * 64, 4096] {
                let pb: Vec<u32> = (5..5 + ps.blocks_for(tokens)).collect();
                let db: Vec<u32> = (9..9 + ds.blocks_for(tokens)).collect();
                let plan = plan(&p, &d, &pb, &db, tokens).unwrap();
                for pair in &plan.pairs {
                    let heads = pair.heads.end - pair.heads.start;
                    assert_eq!(
                        pair.descriptors.len() as u32,
                        3 * 2 * heads,
                        "tp {ptp}->{dtp} bs {pbs}->{dbs} tokens {tokens} pair {}/{}",
                        pair.p_rank,
                        pair.d_rank
                    );
                }
                counts.push(plan.descriptor_count());
            }
            assert!(counts.windows(2).all(|w| w[0] == w[1]), "{counts:?}");
        }
    }
}

#[test]
fn heads_outermost_addresses_and_refusals() {
    let s = layers(spec(4, 2, 16, HeadMajor), 2);
    let l = RankLayout::heads_outermost(s, 1, 10, 7).unwrap();
    // [layer][K|V][head][block][token][row]: 2 heads × 10 blocks × 16 tokens per plane.
    let head_stride = 10 * 16 * ROW;
    assert_eq!(
        l.regions,
        vec![Region {
            id: 7,
            len: 2 * 2 * 2 * head_stride
        }]
    );
    assert_eq!(l.row_offset(0, 0, 0, 0, 0), Some(0));
    assert_eq!(
        l.row_offset(0, 0, 3, 1, 5),
        Some(head_stride + 3 * 16 * ROW + 5 * ROW)
    );
    assert_eq!(
        l.row_offset(1, 1, 0, 0, 0),
        Some(2 * 2 * head_stride + 2 * head_stride)
    );
    assert_eq!(l.row_offset(2, 0, 0, 0, 0), None, "no such layer");
    // The cross-layer layout agrees with its own formula too.
    let cl = RankLayout::cross_layer(s, 1, 10, 7).unwrap();
    assert_eq!(
        cl.row_offset(1, 1, 3, 1, 5),
        Some(3 * 4 * s.plane_bytes() + 3 * s.plane_bytes() + (16 + 5) * ROW)
    );
    // Token-major blocks cannot put heads outside them.
    let tm = layers(spec(4, 2, 16, TokenMajor), 2);
    assert!(matches!(
        RankLayout::heads_outermost(tm, 0, 10, 0),
        Err(LayoutError::HeadStrideNeedsHeadMajor { layer: 0 })
    ));
    // Heads that overlap, and a pool past its region, are refused.
    let mut bad = l.clone();
    bad.layers[1].head_stride = 16 * ROW - 1;
    assert!(matches!(
        bad.validate(),
        Err(LayoutError::HeadStrideTooSmall { layer: 1, .. })
    ));
    let mut bad = l.clone();
    bad.regions[0].len -= 1;
    let err = bad.validate().unwrap_err();
    assert!(
        matches!(err, LayoutError::OutsideRegion { layer: 1, .. }),
        "{err}"
    );
    // A peer that predates head strides sends no such field: it reads as 0 (heads inside).
    let json = serde_json::to_string(&cl)
        .unwrap()
        .replace(",\"head_stride\":0", "");
    assert!(!json.contains("head_stride"));
    let back: RankLayout = serde_json::from_str(&json).unwrap();
    assert_eq!(back, cl);
}

/// A 4096-token prompt of a 32-layer, 8-head model (256 blocks of 16), in the costly shapes:
/// heterogeneous TP and a block-size ratio. Linear work: this runs in milliseconds.
#[test]
fn plans_a_long_prompt() {
    let shape = ModelShape {
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        dtype_size: 2,
    };
    let p = KvSpec {
        shape,
        tp: 1,
        block_size: 16,
        block_layout: HeadMajor,
    };
    let d = KvSpec {
        tp: 2,
        block_size: 32,
        ..p
    };
    let pl: Vec<_> = (0..1)
        .map(|r| RankLayout::per_layer(p, r, 1024, 0).unwrap())
        .collect();
    let dl: Vec<_> = (0..2)
        .map(|r| RankLayout::per_layer(d, r, 512, 0).unwrap())
        .collect();
    let pb: Vec<u32> = (0..256).rev().collect();
    let db: Vec<u32> = (0..128).map(|i| i * 3).collect();
    let start = std::time::Instant::now();
    let plan = plan(&pl, &dl, &pb, &db, 4096).unwrap();
    let took = start.elapsed();
    // Per pair: 256 P blocks × 32 layers × 2 planes × 4 heads.
    assert_eq!(plan.descriptor_count(), 2 * 256 * 32 * 2 * 4);
    assert_eq!(plan.bytes(), 4096 * 32 * 2 * 8 * 128 * 2);
    eprintln!(
        "planned {} descriptors in {took:?}",
        plan.descriptor_count()
    );
}

#[test]
fn layouts_travel_as_json() {
    let s = spec(4, 2, 16, TokenMajor);
    let l = RankLayout::cross_layer(layers(s, 2), 1, 8, 3).unwrap();
    let back: RankLayout = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
    assert_eq!(back, l);
    let plan = plan(&ranks(s, 2), &ranks(s, 2), &[1], &[0], 10).unwrap();
    let back: Plan = serde_json::from_str(&serde_json::to_string(&plan).unwrap()).unwrap();
    assert_eq!(back, plan);
    let bad = r#"{"p_tp":0,"d_tp":2,"num_kv_heads":4}"#;
    let err = serde_json::from_str::<Topology>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("P engine: tp is 0"), "{err}");
}

/// A transport's grant for a handoff covers exactly its blocks: every row of every listed block
/// on every layer, plane and head, and no byte of any other block.
#[test]
fn block_spans_cover_exactly_the_listed_blocks() {
    let s = layers(spec(4, 2, 16, HeadMajor), 3);
    let layouts = [
        RankLayout::per_layer(s, 1, 6, 10).unwrap(),
        RankLayout::split_kv(s, 1, 6, 10).unwrap(),
        RankLayout::cross_layer(s, 1, 6, 10).unwrap(),
        RankLayout::heads_outermost(s, 1, 6, 10).unwrap(),
        RankLayout::per_layer(layers(spec(4, 2, 16, TokenMajor), 3), 1, 6, 10).unwrap(),
    ];
    let granted = [4u32, 1, 2, 4];
    for l in &layouts {
        let spans = block_spans(l, &granted).unwrap();
        let inside = |region: u32, off: u64| {
            spans
                .iter()
                .any(|x| x.region == region && x.offset <= off && off < x.offset + x.len)
        };
        let total: u64 = spans.iter().map(|x| x.len).sum();
        assert_eq!(
            total,
            3 * u64::from(s.shape.num_layers) * s.block_bytes(),
            "{l:?}"
        );
        for layer in 0..s.shape.num_layers {
            for kv in 0..2 {
                let region = l.layers[layer as usize].plane(kv).region;
                for b in 0..6 {
                    for h in 0..s.heads_per_rank() {
                        for t in 0..16 {
                            let off = l.row_offset(layer, kv, b, h, t).unwrap();
                            let want = granted.contains(&b);
                            // The row's first and last byte.
                            for byte in [off, off + s.shape.row_bytes() - 1] {
                                assert_eq!(inside(region, byte), want, "{l:?} block {b}");
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(matches!(
        block_spans(&layouts[0], &[6]),
        Err(PlanError::BlockOutOfPool { block: 6, .. })
    ));
}

/// Layers outside the blocks, equal TP and block size: a layer range of a contiguous run of
/// blocks (what a layer-wise pull READs, and a push WRITEs, per stage) is one descriptor per
/// layer moved, whatever the prompt's length; the whole model is one per layer. Blocks-outermost
/// (a block holds every layer) cuts the same layer range at every block.
#[test]
fn layers_outermost_moves_a_layer_range_in_one_descriptor_per_layer() {
    for layout in [HeadMajor, TokenMajor] {
        let s = layers(spec(8, 1, 16, layout), 6);
        let lo = RankLayout::layers_outermost(s, 0, 600, 0).unwrap();
        let bo = RankLayout::cross_layer(s, 0, 600, 0).unwrap();
        for blocks in [1u32, 2, 64, 256] {
            let pb: Vec<u32> = (5..5 + blocks).collect();
            let db: Vec<u32> = (300..300 + blocks).collect();
            let tokens = blocks * 16;
            for range in [0..1, 2..5, 0..6] {
                let moved = range.end - range.start;
                let n = |l: &RankLayout| {
                    plan_pair_layers(l, l, &pb, &db, tokens, range.clone())
                        .unwrap()
                        .descriptors
                        .len() as u32
                };
                assert_eq!(
                    n(&lo),
                    moved,
                    "{layout:?} {blocks} blocks, layers {range:?}"
                );
                if moved < 6 && blocks > 1 {
                    assert_eq!(n(&bo), blocks, "blocks-outermost: one per block");
                }
            }
        }
    }
    // Its addresses: layer l's blocks back to back, from l × num_blocks × block.
    let s = layers(spec(4, 2, 16, HeadMajor), 3);
    let l = RankLayout::layers_outermost(s, 1, 10, 7).unwrap();
    let block = 2 * s.plane_bytes();
    assert_eq!(
        l.regions,
        vec![Region {
            id: 7,
            len: 3 * 10 * block
        }]
    );
    assert_eq!(l.row_offset(0, 0, 0, 0, 0), Some(0));
    assert_eq!(
        l.row_offset(2, 1, 4, 1, 3),
        Some(2 * 10 * block + 4 * block + s.plane_bytes() + (16 + 3) * ROW)
    );
    assert_eq!(l.row_offset(3, 0, 0, 0, 0), None, "no such layer");
}

/// vLLM 0.33's `[B, H, N, C]` views put each token's K and V rows side by side. Between two
/// such engines a block of one layer is one `2 × plane` range on both sides (one descriptor for
/// a run of contiguous blocks, as with planes); against an engine with planes of their own each
/// row is its own descriptor; a placement that does not interleave what its spec says is refused.
#[test]
fn interleaved_rows_pair_with_each_other_and_with_planes() {
    for (il, plain) in [
        (HeadMajorInterleaved, HeadMajor),
        (TokenMajorInterleaved, TokenMajor),
    ] {
        let s = spec(2, 1, 16, il);
        assert_eq!((il.order(), il.interleaved()), (plain, true));
        assert_eq!(s.row_pitch(), 2 * ROW);
        let a = ranks(s, 4).remove(0);
        // K's row (head 1, token 3) and V's, one row apart.
        let k = a.row_offset(0, 0, 2, 1, 3).unwrap();
        assert_eq!(k, 2 * s.block_bytes() + 2 * ROW * s.row_index(1, 3));
        assert_eq!(a.row_offset(0, 1, 2, 1, 3).unwrap(), k + ROW);
        // Both interleaved: blocks 1..3 of one layer, one descriptor.
        let p = plan_pair(&a, &a, &[1, 2], &[1, 2], 32).unwrap();
        assert_eq!(
            p.descriptors,
            vec![desc(s.block_bytes(), s.block_bytes(), 2 * s.block_bytes())]
        );
        // Planes on D: one descriptor per row (2 heads × 32 tokens × K and V), same bytes (D's
        // blocks out of order, so that no row ends where the next begins on both sides).
        let d = ranks(spec(2, 1, 16, plain), 4).remove(0);
        let mixed = plan_pair(&a, &d, &[1, 2], &[3, 1], 32).unwrap();
        assert_eq!(mixed.bytes(), p.bytes());
        assert_eq!(mixed.descriptors.len(), 2 * 32 * 2);
        // The tail of a half-filled last block: one range per head (K and V rows together), or
        // one range token-major.
        let tail = uncovered_dst(&a, &[1, 2], 20).unwrap();
        let want = if plain == HeadMajor { 2 } else { 1 };
        assert_eq!(tail.len(), want);
        assert_eq!(tail.iter().map(|t| t.len).sum::<u64>(), 2 * 2 * 12 * ROW);
        assert_eq!(
            block_spans(&a, &[2, 1]).unwrap(),
            vec![Span {
                region: 100,
                offset: s.block_bytes(),
                len: 2 * s.block_bytes()
            }]
        );
        // V anywhere but one row after K is not what the spec says.
        let mut bad = a.clone();
        bad.layers[0].v.offset = s.plane_bytes();
        assert_eq!(
            bad.validate(),
            Err(LayoutError::NotInterleaved {
                layer: 0,
                row_bytes: ROW
            })
        );
        assert!(RankLayout::split_kv(s, 0, 4, 0).is_err());
    }
    // Rows in different orders still do not pair, interleaved or not.
    let hm = ranks(spec(2, 1, 16, HeadMajorInterleaved), 4).remove(0);
    let tm = ranks(spec(2, 1, 16, TokenMajor), 4).remove(0);
    assert!(matches!(
        plan_pair(&hm, &tm, &[0], &[0], 16),
        Err(PlanError::Incompatible(Incompatible::LayoutMismatch { .. }))
    ));
}

/// MLA's latent: one plane of one vector per token, the same on every rank. A block is one
/// plane (no V); D reads it from one P rank however many hold a copy, and every D rank reads its
/// own; it pairs with nothing but a latent, and a latent spec has exactly one "head".
#[test]
fn a_latent_is_one_plane_read_once_per_d_rank_and_pairs_only_with_a_latent() {
    use BlockLayout::Latent;
    let s = spec(1, 2, 16, Latent);
    assert_eq!(s.block_bytes(), s.plane_bytes());
    assert_eq!(s.plane_bytes(), 16 * ROW);
    let p = ranks(s, 4);
    let l = &p[0];
    assert_eq!(l.layers[0].v, l.layers[0].k);
    assert_eq!(l.layers[0].block_stride, 16 * ROW);
    let d = ranks(spec(1, 1, 16, Latent), 4);
    let moved = plan(&p, &d, &[1, 2], &[2, 3], 20).unwrap();
    // P rank 0 gives D the latent (20 rows, blocks 1 and 2 of P to 2 and 3 of D: one run);
    // P rank 1 holds a copy and only confirms.
    assert_eq!(moved.pairs.len(), 2);
    assert_eq!(
        moved.pairs[0].descriptors,
        vec![desc(16 * ROW, 32 * ROW, 20 * ROW)]
    );
    assert!(moved.pairs[1].descriptors.is_empty());
    // D at TP 2: each rank reads its own copy.
    let d2 = ranks(spec(1, 2, 16, Latent), 4);
    assert_eq!(plan(&d, &d2, &[0], &[0], 16).unwrap().bytes(), 2 * 16 * ROW);
    assert_eq!(
        uncovered_dst(&d[0], &[2, 3], 20).unwrap(),
        vec![Span {
            region: 100,
            offset: 3 * 16 * ROW + 4 * ROW,
            len: 12 * ROW
        }]
    );
    assert_eq!(
        block_spans(&d[0], &[3])
            .unwrap()
            .iter()
            .map(|s| s.len)
            .sum::<u64>(),
        16 * ROW
    );
    // A V plane elsewhere than K's, more than one head, or K/V planes on the other side: refused.
    let mut bad = d[0].clone();
    bad.layers[0].v.offset += ROW;
    assert_eq!(bad.validate(), Err(LayoutError::LatentV { layer: 0 }));
    assert_eq!(
        spec(2, 1, 16, Latent).validate(),
        Err(SpecError::LatentHeads { num_kv_heads: 2 })
    );
    let planes = ranks(spec(1, 1, 16, TokenMajor), 4).remove(0);
    let e = plan_pair(&d[0], &planes, &[0], &[0], 16).unwrap_err();
    assert!(matches!(
        e,
        PlanError::Incompatible(Incompatible::LayoutMismatch { .. })
    ));
}
