//! What a peer's hello carries besides its fingerprint: its ranks' KV layouts and its agents'
//! names and metadata, postcard-encoded (`Hello::layout`, `Hello::agent_metadata`). Decoded and
//! checked as the connector checks them (`RankLayout::validate`, `check_compatible`), then, for
//! layouts that pass, planned against: D plans its READs over a hostile P's layout. No input may
//! panic; a plan must stay inside both sides' regions.

#![no_main]

use handoff_plan::{
    check_compatible, plan_layers, BlockLayout, KvSpec, ModelShape, RankLayout,
};
use libfuzzer_sys::fuzz_target;

/// An input that starts with 0xff describes a real engine's layouts (shape, TP, block size,
/// pool layout) and byte flips of their encoding: from-scratch bytes rarely decode into layouts
/// that pass validation, and the planner is past that gate.
fn structured(d: &[u8]) -> Option<Vec<u8>> {
    let h = d.get(..8)?;
    let spec = KvSpec {
        shape: ModelShape {
            num_layers: 1 + u32::from(h[0] % 8),
            num_kv_heads: 1 + u32::from(h[1] % 8),
            head_dim: 1 + u32::from(h[2] % 16),
            dtype_size: [1, 2, 4][usize::from(h[3] % 3)],
        },
        tp: 1 + u32::from(h[4] % 4),
        block_size: 1 << (h[5] % 6),
        block_layout: if h[6] & 1 == 0 {
            BlockLayout::HeadMajor
        } else {
            BlockLayout::TokenMajor
        },
    };
    let make = match (h[6] >> 1) % 3 {
        0 => RankLayout::cross_layer,
        1 => RankLayout::layers_outermost,
        _ => RankLayout::heads_outermost,
    };
    let layouts = (0..spec.tp)
        .map(|r| make(spec.clone(), r, 1 + u32::from(h[7] % 16), 0))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let mut bytes = postcard::to_allocvec(&layouts).ok()?;
    for flip in d[8..].chunks_exact(2) {
        let i = usize::from(flip[0]) % bytes.len().max(1);
        if let Some(b) = bytes.get_mut(i) {
            *b ^= flip[1];
        }
    }
    Some(bytes)
}

fuzz_target!(|data: &[u8]| {
    let _ = postcard::from_bytes::<Vec<(String, Vec<u8>)>>(data);
    let owned;
    let data = match data.split_first() {
        Some((0xff, rest)) => match structured(rest) {
            Some(b) => {
                owned = b;
                &owned[..]
            }
            None => return,
        },
        _ => data,
    };
    let Ok(layouts) = postcard::from_bytes::<Vec<RankLayout>>(data) else {
        return;
    };
    if layouts.is_empty() || layouts.len() > 64 {
        return;
    }
    for (i, l) in layouts.iter().enumerate() {
        if l.validate().is_err() || l.rank as usize != i || l.spec != layouts[0].spec {
            return;
        }
    }
    let p = &layouts[0];
    // Keep the planning small: a hostile layout may claim a huge model.
    if p.spec.shape.num_layers > 64 || p.num_blocks == 0 {
        return;
    }
    let d_spec = KvSpec { tp: 1, ..p.spec.clone() };
    let Ok(d) = RankLayout::cross_layer(d_spec, 0, 64, 0) else {
        return;
    };
    if check_compatible(&p.spec, &d.spec).is_err() {
        return;
    }
    let blocks = p.num_blocks.min(4);
    let p_blocks: Vec<u32> = (0..blocks).collect();
    let tokens = blocks * p.spec.block_size.min(d.spec.block_size);
    let needed = tokens.div_ceil(d.spec.block_size);
    let d_blocks: Vec<u32> = (0..needed.min(64)).collect();
    let layers = p.spec.shape.num_layers;
    let within = |l: &RankLayout, region: u32, offset: u64, len: u64| {
        let end = offset.checked_add(len).expect("no overflow");
        l.regions.iter().any(|r| r.id == region && end <= r.len)
    };
    if let Ok(plan) = plan_layers(&layouts, &[d.clone()], &p_blocks, &d_blocks, tokens, 0..layers) {
        for pair in &plan.pairs {
            let p_rank = &layouts[pair.p_rank as usize];
            for desc in &pair.descriptors {
                assert!(within(p_rank, desc.src_region, desc.src_offset, desc.len), "past P's region");
                assert!(within(&d, desc.dst_region, desc.dst_offset, desc.len), "past D's region");
            }
        }
    }
});
