//! A hybrid model under vLLM's hybrid KV cache manager, through the bridges as vLLM drives them:
//! one full-attention layer and one with a sliding window of 20 tokens, both layers' KV in one
//! tensor (a block id belongs to one KV cache group at a time), each group's block list handed
//! over as vLLM hands it (a sliding group's with the null block, 0, where vLLM freed one).

mod common;

use common::*;
use handoff_vllm::scheduler::Matched;

const WINDOW: u32 = 20;

fn remote_decode() -> handoff_proto::KvTransferParams {
    serde_json::from_value(serde_json::json!({"do_remote_decode": true})).unwrap()
}

/// 40 tokens in blocks of 16: the full layer's KV in P's blocks 5, 6, 9; the window's (from
/// token 20, what the prompt's last token attends back to) in blocks 7 and 8, block 0 of that
/// group freed. D's lists cover the prompt in both groups. The READ moves the full layer's
/// three blocks and the window's two, each layer into its own group's blocks of D, with the
/// digest matched; D's first sliding block (before the window) is not written.
#[test]
fn a_pull_moves_each_groups_blocks_into_the_same_groups_blocks() {
    let mut p = hybrid_engine("hma-p", "pull", WINDOW);
    let mut d = hybrid_engine("hma-d", "pull", WINDOW);
    fill_layer(&mut p, &[5, 6, 9], 1, 1);
    fill_layer(&mut p, &[7, 8], 2, 0);
    let (keep, params) = p
        .sched
        .request_finished(
            "p-req",
            Some(&remote_decode()),
            vec![vec![5, 6, 9], vec![0, 7, 8]],
            40,
        )
        .unwrap();
    assert!(keep, "P keeps both groups' blocks for D");
    let params = params.expect("params for D");
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &params, 40),
        Matched::Remote(40)
    );
    d.sched
        .blocks_allocated_after_cached("d-req", vec![vec![11, 12, 13], vec![14, 15, 16]], 0, 40)
        .unwrap();
    resumed_and_freed(&mut p, &mut d, "p-req", "d-req");
    for (pb, db) in [(5, 11), (6, 12), (9, 13)] {
        assert_eq!(
            p.block(1, pb),
            d.block(1, db),
            "full layer, block {pb} -> {db}"
        );
    }
    for (pb, db) in [(7, 15), (8, 16)] {
        assert_eq!(p.block(0, pb), d.block(0, db), "window, block {pb} -> {db}");
    }
    assert!(d.block(0, 14).iter().all(|&x| x == 0), "before the window");
}

/// P cannot serve a window whose first block it no longer holds: listed as vLLM's null block,
/// or (35 tokens: the window starts at token 15, the last of block 0, which vLLM frees when
/// the request finishes, keeping tokens from 16 on) about to be freed. No handoff: the request
/// ends with its blocks back to vLLM and no params, and D computes the prompt.
#[test]
fn a_window_p_freed_or_frees_gives_no_handoff() {
    let mut p = hybrid_engine("hma-p2", "pull", WINDOW);
    for (name, lists, tokens) in [
        ("freed", vec![vec![5, 6, 9], vec![0, 0, 8]], 40),
        ("about to be freed", vec![vec![5, 6, 9], vec![10, 7, 8]], 35),
        ("one list", vec![vec![5, 6, 9]], 40),
    ] {
        let (keep, params) = p
            .sched
            .request_finished(name, Some(&remote_decode()), lists, tokens)
            .unwrap();
        assert!(!keep && params.is_none(), "{name}: {params:?}");
    }
    // The control: the same request with the window's blocks held hands off.
    let (keep, _) = p
        .sched
        .request_finished(
            "held",
            Some(&remote_decode()),
            vec![vec![5, 6, 9], vec![0, 7, 8]],
            40,
        )
        .unwrap();
    assert!(keep);
}
