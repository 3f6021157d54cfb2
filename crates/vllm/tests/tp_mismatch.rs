//! P and D of other TP sizes through the vLLM hooks, over vLLM's CPU pages (`[num_blocks,
//! heads, block_size, 2·head_dim]` a rank): each KV head's chunk of a block, its K and V rows as
//! the attention kernel keeps them, moves whole from the rank that holds it to the rank that
//! needs it, and the KV digest (compared on every handoff here) adds up alike on both sides.
//! Pages that cannot be mapped (another block size) are refused at the handshake.

use std::time::{Duration, Instant};

mod common;

use common::*;
use handoff_vllm::scheduler::Matched;

/// Every head's chunk of each of P's blocks is in D's block of the same index, on the rank
/// that holds that head; D's other blocks (10, 14) were not touched.
fn landed_by_head(p: &Engine, d: &Engine, p_blocks: &[u32], d_blocks: &[u32]) {
    for l in 0..LAYERS {
        for (pb, db) in p_blocks.iter().zip(d_blocks) {
            for head in 0..HEADS as usize {
                assert_eq!(
                    p.head_chunk(l, *pb, head),
                    d.head_chunk(l, *db, head),
                    "layer {l} head {head} block {pb} -> {db}"
                );
            }
        }
    }
    for kv in &d.kvs {
        for b in [10, 14] {
            let start = b * d.block_bytes();
            assert!(kv.read(start, d.block_bytes()).iter().all(|&x| x == 0));
        }
    }
}

/// D's request ends once decoded; nothing is left on either side.
fn all_end(p: &mut Engine, d: &mut Engine, d_blocks: Vec<u32>) {
    let (keep, _) = d
        .sched
        .request_finished("d-req", None, vec![d_blocks], 40)
        .unwrap();
    assert!(!keep);
    for _ in 0..20 {
        p.step();
        d.step();
    }
    assert!(!p.sched.has_pending_work() && !d.sched.has_pending_work());
}

fn pull(p_tp: usize, d_tp: usize) {
    let mut p = engine_tp(&format!("tp-pull-p{p_tp}"), "pull", p_tp);
    let mut d = engine_tp(&format!("tp-pull-d{d_tp}"), "pull", d_tp);
    let p_blocks = vec![5u32, 6, 9];
    fill_heads(&mut p, &p_blocks, 3);
    let request: handoff_proto::KvTransferParams =
        serde_json::from_value(serde_json::json!({"do_remote_decode": true})).unwrap();
    let (keep, params) = p
        .sched
        .request_finished("p-req", Some(&request), vec![p_blocks.clone()], 40)
        .unwrap();
    assert!(keep);
    let params = params.expect("params for D");
    assert_eq!(params.tp_size, Some(p_tp as u16));
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &params, 40),
        Matched::Remote(40)
    );
    let d_blocks = vec![11u32, 12, 13];
    d.sched.blocks_allocated("d-req", d_blocks.clone()).unwrap();
    resumed_and_freed(&mut p, &mut d, "p-req", "d-req");
    landed_by_head(&p, &d, &p_blocks, &d_blocks);
    all_end(&mut p, &mut d, d_blocks);
}

#[test]
fn a_pull_from_p_at_tp_2_lands_each_head_whole_in_d_at_tp_1() {
    pull(2, 1);
}

#[test]
fn a_pull_from_p_at_tp_1_lands_each_head_whole_in_d_at_tp_2() {
    pull(1, 2);
}

fn push(p_tp: usize, d_tp: usize) {
    let (p_id, d_id) = (format!("tp-push-p{p_tp}"), format!("tp-push-d{d_tp}"));
    let mut p = engine_tp(&p_id, "push", p_tp);
    let mut d = engine_tp(&d_id, "push", d_tp);
    let handoff = "00112233445566778899aabbccddeef0";
    let p_leg: handoff_proto::KvTransferParams = serde_json::from_value(serde_json::json!({
        "do_remote_decode": true, "transfer_mode": "push", "handoff_id": handoff,
    }))
    .unwrap();
    let d_leg = serde_json::from_value(serde_json::json!({
        "do_remote_prefill": true, "transfer_mode": "push", "handoff_id": handoff,
        "remote_engine_id": p_id, "remote_host": "127.0.0.1",
        "remote_port": p.sched.side_channel_port(), "tp_size": p_tp, "epoch": 1,
    }))
    .unwrap();
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &d_leg, 40),
        Matched::Remote(40)
    );
    let d_blocks = vec![11u32, 12, 13];
    d.sched.blocks_allocated("d-req", d_blocks.clone()).unwrap();
    for _ in 0..5 {
        d.step();
        p.step();
    }
    let p_blocks = vec![5u32, 6, 9];
    fill_heads(&mut p, &p_blocks, 5);
    let (keep, _) = p
        .sched
        .request_finished("p-req", Some(&p_leg), vec![p_blocks.clone()], 40)
        .unwrap();
    assert!(keep);
    resumed_and_freed(&mut p, &mut d, "p-req", "d-req");
    landed_by_head(&p, &d, &p_blocks, &d_blocks);
    all_end(&mut p, &mut d, d_blocks);
}

#[test]
fn a_push_from_p_at_tp_2_writes_each_head_whole_into_d_at_tp_1() {
    push(2, 1);
}

#[test]
fn a_push_from_p_at_tp_1_writes_each_head_whole_into_d_at_tp_2() {
    push(1, 2);
}

/// Another block size would need the rows inside a head's chunk, which only the kernel
/// knows: the handshake refuses it, D's request fails instead of decoding other bytes, and
/// P gets its blocks back.
#[test]
fn pages_of_another_block_size_are_refused_and_nothing_is_held() {
    let mut p = engine_tp_bs("tp-bs-p", "pull", 2, 2 * BS);
    let mut d = engine_tp("tp-bs-d", "pull", 1);
    let request: handoff_proto::KvTransferParams =
        serde_json::from_value(serde_json::json!({"do_remote_decode": true})).unwrap();
    let (keep, params) = p
        .sched
        .request_finished("p-req", Some(&request), vec![vec![5, 6]], 40)
        .unwrap();
    assert!(keep);
    let params = params.unwrap();
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &params, 40),
        Matched::Remote(40)
    );
    d.sched.blocks_allocated("d-req", vec![11, 12, 13]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut failed, mut freed) = (false, false);
    while !(failed && freed) {
        assert!(Instant::now() < deadline, "failed {failed} freed {freed}");
        let dm = d.step();
        assert!(dm.finished_recving.is_empty(), "{dm:?}");
        failed |= dm.failed_recving.contains(&"d-req".to_string());
        freed |= p.step().finished_sending.contains(&"p-req".to_string());
    }
}
