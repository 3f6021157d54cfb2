//! The vLLM bridges driven as vLLM drives them, without Python: a P and a D engine, each a
//! scheduler side and one worker over CPU-backend-shaped KV tensors (opaque pages), hooks
//! called in vLLM's order, step metadata and worker reports carried between them as vLLM
//! carries them (serialised bytes).

use std::time::{Duration, Instant};

mod common;

use common::*;
use handoff_vllm::engine_socket::{ask, Verb};
use handoff_vllm::scheduler::{Matched, SchedulerConfig, SchedulerSide, StepMeta};

#[test]
fn a_pull_through_the_vllm_hooks_lands_whole_pages_and_frees_p() {
    let mut p = engine("vllm-p");
    let mut d = engine("vllm-d");
    // P prefilled 40 tokens into blocks 5, 6, 9: fill every byte of them (whole pages, tails
    // too: the kernel's layout is not handoff's, so nothing may be zeroed or skipped).
    let p_blocks = vec![5u32, 6, 9];
    fill(&mut p, &p_blocks, 0);
    let request: handoff_proto::KvTransferParams =
        serde_json::from_value(serde_json::json!({"do_remote_decode": true})).unwrap();
    let (keep, params) = p
        .sched
        .request_finished("cmpl-p-1", Some(&request), vec![p_blocks.clone()], 40)
        .unwrap();
    assert!(keep, "P keeps the blocks for D");
    let params = params.expect("params for D");
    assert!(params.do_remote_prefill && params.handoff_id.is_some());
    // What the client and the proxy see, and hand to D.
    let json = serde_json::to_value(&params).unwrap();
    let params: handoff_proto::KvTransferParams = serde_json::from_value(json).unwrap();

    let n = d.sched.remote_prefill_arrived("cmpl-d-1", &params, 40);
    assert_eq!(n, Matched::Remote(40));
    let d_blocks = vec![11u32, 12, 13];
    d.sched
        .blocks_allocated("cmpl-d-1", d_blocks.clone())
        .unwrap();

    lands_whole(
        &mut p,
        &mut d,
        ("cmpl-p-1", &p_blocks),
        ("cmpl-d-1", &d_blocks),
    );
    // D's request decodes and ends (its blocks are vLLM's): nothing is left on either side.
    all_end(&mut p, &mut d, &[("cmpl-d-1", d_blocks, 40)]);
}

/// D's vLLM prefix cache already holds the prompt's first block (block 20: computed on D and
/// shared with other requests, which may be reading it right now). The READ fills only the
/// request's own blocks: block 20 keeps D's bytes (here a marker that differs from P's, and no
/// digest, so that a write into it would show), the rest is P's.
#[test]
fn a_pull_never_writes_a_block_d_s_prefix_cache_shares() {
    let (mut p, mut d) = cached_prefix_pull("vllm-p-cache", "vllm-d-cache", false);
    let cached = mark_cached_block(&p, &mut d);
    d.sched
        .blocks_allocated_after_cached("d-req", vec![vec![20, 12, 13]], 1, 40)
        .unwrap();
    resumed_and_freed(&mut p, &mut d, "p-req", "d-req");
    kept_cached_and_landed_the_rest(&mut p, &mut d, &cached);
}

/// With the digest on, D's cached prefix may hold D's own computation of those tokens (the KV of
/// tokens it generated for an earlier request, cached once their block filled): right, but not
/// bit for bit what P computed (here a marker that differs from P's bytes). P's digest covers
/// the whole prompt and D did not read the prefix, so nothing can be compared: the request gets
/// its KV, the rest landed as P's. (Compared, such a request failed `kv_digest_mismatch`: one in
/// 36 of a vLLM load with repeated text, a false alarm answered 500.)
#[test]
fn a_pull_after_a_prefix_cache_hit_lands_with_its_digest_not_compared() {
    let (mut p, mut d) = cached_prefix_pull("vllm-p-cache2", "vllm-d-cache2", true);
    let cached = mark_cached_block(&p, &mut d);
    d.sched
        .blocks_allocated_after_cached("d-req", vec![vec![20, 12, 13]], 1, 40)
        .unwrap();
    resumed_and_freed(&mut p, &mut d, "p-req", "d-req");
    kept_cached_and_landed_the_rest(&mut p, &mut d, &cached);
}

/// P prefilled a 40-token prompt into its blocks 5, 6 and 9 (`p-req`); the same prompt arrived
/// at D (`d-req`), whose blocks are not allocated yet.
fn cached_prefix_pull(p_id: &str, d_id: &str, kv_digest: bool) -> (Engine, Engine) {
    let mut p = engine(p_id);
    let mut d = engine_with(d_id, "pull", kv_digest);
    fill(&mut p, &[5, 6, 9], 0);
    let params = prefilled(&mut p, "p-req", vec![5, 6, 9], 40);
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &params, 40),
        Matched::Remote(40)
    );
    (p, d)
}

/// Fills D's block 20 (its prefix cache hit in these tests) with a marker that differs from
/// P's bytes for the same tokens, and returns it per layer.
fn mark_cached_block(p: &Engine, d: &mut Engine) -> Vec<Vec<u8>> {
    fill(d, &[20], 99);
    let cached: Vec<Vec<u8>> = (0..LAYERS).map(|l| d.block(l, 20).to_vec()).collect();
    assert_ne!(
        cached[0],
        p.block(0, 5),
        "the marker differs from P's bytes"
    );
    cached
}

/// D's block 20 still holds `cached` in every layer, its blocks 12 and 13 hold P's 6 and 9, and
/// both engines end clean.
fn kept_cached_and_landed_the_rest(p: &mut Engine, d: &mut Engine, cached: &[Vec<u8>]) {
    for (l, bytes) in cached.iter().enumerate() {
        assert_eq!(
            &d.block(l, 20),
            bytes,
            "layer {l}: the cached block was written"
        );
        for (pb, db) in [(6u32, 12u32), (9, 13)] {
            assert_eq!(
                p.block(l, pb),
                d.block(l, db),
                "layer {l} block {pb} -> {db}"
            );
        }
    }
    all_end(p, d, &[("d-req", vec![20, 12, 13], 40)]);
}

/// D allocates blocks 12 and 13 after its hit on block 20 and registers them; P's prefill of
/// `p-req` (blocks 5, 6, 9) ends and its writes land.
fn push_after_the_hit(p: &mut Engine, d: &mut Engine, p_leg: &handoff_proto::KvTransferParams) {
    d.sched
        .blocks_allocated_after_cached("d-req", vec![vec![20, 12, 13]], 1, 40)
        .unwrap();
    for _ in 0..5 {
        d.step();
        p.step();
    }
    push_prefill_finished(p, p_leg, &[5, 6, 9]);
    resumed_and_freed(p, d, "p-req", "d-req");
}

/// Steps both engines until D's request resumed and P's gave its blocks back (10 s at most),
/// then checks that every byte of P's blocks landed in D's, and nothing else of D's memory
/// (blocks 10 and 14) was touched.
fn lands_whole(
    p: &mut Engine,
    d: &mut Engine,
    (p_req, p_blocks): (&str, &[u32]),
    (d_req, d_blocks): (&str, &[u32]),
) {
    resumed_and_freed(p, d, p_req, d_req);
    for l in 0..LAYERS {
        for (pb, db) in p_blocks.iter().zip(d_blocks) {
            assert_eq!(
                p.block(l, *pb),
                d.block(l, *db),
                "layer {l} block {pb} -> {db}"
            );
        }
    }
    assert!(d.block(0, 10).iter().all(|&x| x == 0));
    assert!(d.block(1, 14).iter().all(|&x| x == 0));
}

#[test]
fn a_client_abort_on_d_before_its_kv_landed_frees_p_at_once() {
    let mut p = engine("vllm-p2");
    let mut d = engine("vllm-d2");
    let params = prefilled(&mut p, "p-req", vec![1, 2], 20);
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &params, 20),
        Matched::Remote(20)
    );
    // The client leaves while the request still waits in D's queue: it has no blocks to keep.
    let (keep, _) = d
        .sched
        .request_finished("d-req", None, vec![vec![]], 0)
        .unwrap();
    assert!(!keep);
    p_frees_within_2s(&mut p, &mut d, "p-req", "P still holds the blocks");
}

#[test]
fn a_request_d_aborts_while_its_read_may_land_keeps_its_blocks_until_the_read_ended() {
    let mut p = engine("vllm-p3");
    let mut d = engine("vllm-d3");
    let request: handoff_proto::KvTransferParams =
        serde_json::from_value(serde_json::json!({"do_remote_decode": true})).unwrap();
    let (_, params) = p
        .sched
        .request_finished("p-req", Some(&request), vec![vec![3, 4]], 20)
        .unwrap();
    let params = params.unwrap();
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &params, 20),
        Matched::Remote(20)
    );
    d.sched.blocks_allocated("d-req", vec![7, 8]).unwrap();
    // D's worker posts the READ but is not polled (vLLM polls once per engine step): as far as
    // the scheduler side knows, the READ may still be writing into blocks 7 and 8.
    let t0 = Instant::now();
    loop {
        p.step();
        let meta = d.sched.build_meta();
        d.workers[0].apply(&meta);
        let posted = meta.steps[0]
            .ops
            .iter()
            .any(|op| matches!(op, handoff_connector::WorkerOp::Post(_)));
        if posted {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "D never posted its READ"
        );
    }
    // The client leaves: vLLM must not free blocks 7 and 8 yet.
    let (keep, _) = d
        .sched
        .request_finished("d-req", None, vec![vec![7, 8]], 0)
        .unwrap();
    assert!(
        keep,
        "D's blocks were handed back to vLLM under a READ in flight"
    );
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(20));
        let meta = d.sched.build_meta();
        assert!(!meta.finished_sending.contains(&"d-req".to_string()));
    }
    // Once the worker reports the READ ended, vLLM may free them.
    let t0 = Instant::now();
    while !d.step().finished_sending.contains(&"d-req".to_string()) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "D's blocks never came back"
        );
    }
}

/// D's requests end (their blocks are vLLM's) and both engines step a while: nothing may be
/// left on either side.
fn all_end(p: &mut Engine, d: &mut Engine, requests: &[(&str, Vec<u32>, u32)]) {
    for (name, blocks, tokens) in requests {
        let (keep, _) = d
            .sched
            .request_finished(name, None, vec![blocks.clone()], *tokens)
            .unwrap();
        assert!(!keep, "{name}: nothing to keep once decoded");
    }
    for _ in 0..20 {
        p.step();
        d.step();
    }
    assert!(!p.sched.has_pending_work());
    assert!(!d.sched.has_pending_work());
}

/// Steps both engines until P gives `name`'s blocks back; fails after 2 s.
fn p_frees_within_2s(p: &mut Engine, d: &mut Engine, name: &str, what: &str) {
    let t0 = Instant::now();
    loop {
        d.step();
        if p.step().finished_sending.contains(&name.to_string()) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "{what}");
    }
}

/// P prefilled `blocks` for one request that D decodes: the params D's requests carry.
fn prefilled(
    p: &mut Engine,
    name: &str,
    blocks: Vec<u32>,
    tokens: u32,
) -> handoff_proto::KvTransferParams {
    let request: handoff_proto::KvTransferParams =
        serde_json::from_value(serde_json::json!({"do_remote_decode": true})).unwrap();
    let (keep, params) = p
        .sched
        .request_finished(name, Some(&request), vec![blocks], tokens)
        .unwrap();
    assert!(keep);
    params.unwrap()
}

#[test]
fn n2_children_on_d_cause_one_transfer_and_the_second_waits_for_the_prefix_cache() {
    // vLLM fans n=2 out into two children with blocks of their own and the same params.
    let mut p = engine("vllm-p4");
    let mut d = engine("vllm-d4");
    let params = prefilled(&mut p, "p-req", vec![1, 2], 20);
    assert_eq!(
        d.sched.remote_prefill_arrived("0_cmpl", &params, 20),
        Matched::Remote(20)
    );
    assert_eq!(
        d.sched.remote_prefill_arrived("1_cmpl", &params, 20),
        Matched::Later,
        "the second child waits: a second READ of P's blocks would race their release"
    );
    d.sched.blocks_allocated("0_cmpl", vec![7, 8]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut posts, mut p_freed, mut landed) = (0, 0, false);
    while !landed {
        assert!(
            Instant::now() < deadline,
            "the first child's KV never landed"
        );
        // vLLM asks again for the waiting child every step until it is told to go on.
        assert_eq!(
            d.sched.remote_prefill_arrived("1_cmpl", &params, 20),
            Matched::Later
        );
        let meta = d.step();
        posts += meta.steps[0]
            .ops
            .iter()
            .filter(|op| matches!(op, handoff_connector::WorkerOp::Post(_)))
            .count();
        assert!(meta.failed_recving.is_empty(), "{meta:?}");
        assert!(!meta.finished_recving.contains(&"1_cmpl".to_string()));
        landed = meta.finished_recving.contains(&"0_cmpl".to_string());
        p_freed += p.step().finished_sending.len();
    }
    // The first child's KV landed (vLLM caches its blocks as it resumes it): the second child
    // computes its prompt locally, from vLLM's prefix cache.
    assert_eq!(
        d.sched.remote_prefill_arrived("1_cmpl", &params, 20),
        Matched::Local
    );
    for _ in 0..50 {
        posts += d.step().steps[0]
            .ops
            .iter()
            .filter(|op| matches!(op, handoff_connector::WorkerOp::Post(_)))
            .count();
        p_freed += p.step().finished_sending.len();
        if p_freed > 0 {
            break;
        }
    }
    assert_eq!(posts, 1, "one transfer for both children");
    assert_eq!(p_freed, 1, "P freed once");
    all_end(
        &mut p,
        &mut d,
        &[("0_cmpl", vec![7, 8], 20), ("1_cmpl", vec![9, 10], 20)],
    );
}

#[test]
fn params_the_connector_refuses_make_a_local_request_not_an_error() {
    // An exception in a scheduler hook stops vLLM's engine: a client's params never cause one.
    let mut p = engine("vllm-p5");
    let mut d = engine("vllm-d5");
    let params = prefilled(&mut p, "p-req", vec![1], 10);
    // Params no P could have sent (a P of tensor-parallel size 0).
    let mut bogus = params.clone();
    bogus.tp_size = Some(0);
    assert_eq!(
        d.sched.remote_prefill_arrived("bogus", &bogus, 10),
        Matched::Local
    );
    // The real request still gets its KV.
    assert_eq!(
        d.sched.remote_prefill_arrived("real", &params, 10),
        Matched::Remote(10)
    );
    d.sched.blocks_allocated("real", vec![3]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "the real request never got its KV"
        );
        p.step();
        if d.step().finished_recving.contains(&"real".to_string()) {
            break;
        }
    }
    // The same params again once their handoff ended on D (a client replaying them): D
    // refuses to track an ended handoff, and vLLM computes the prompt itself.
    let (keep, _) = d
        .sched
        .request_finished("real", None, vec![vec![3]], 10)
        .unwrap();
    assert!(!keep);
    assert_eq!(
        d.sched.remote_prefill_arrived("replayed", &params, 10),
        Matched::Local
    );
}

#[test]
fn a_request_vllm_refused_before_admission_frees_p_through_the_engine_socket() {
    let mut p = engine("vllm-p6");
    let mut d = engine("vllm-d6");
    let params = prefilled(&mut p, "p-req", vec![1, 2], 20);
    // What D's API server middleware sends for a request vLLM answered 400.
    let bad = ask("vllm-d6", Verb::Refuse, b"{\"handoff_id\": 7").unwrap();
    assert!(bad.starts_with("error: kv_transfer_params"), "{bad}");
    let json = serde_json::to_vec(&params).unwrap();
    assert_eq!(ask("vllm-d6", Verb::Refuse, &json).unwrap(), "ok");
    p_frees_within_2s(
        &mut p,
        &mut d,
        "p-req",
        "P still holds the blocks of a request D refused",
    );
    // An engine that is not running has no socket.
    assert!(ask("no-such-engine", Verb::Refuse, &json).is_err());
}

#[test]
fn the_engine_socket_answers_what_a_push_proxy_needs_to_know_of_p() {
    let p = engine_in("vllm-p7", "push");
    let info: serde_json::Value =
        serde_json::from_str(&ask("vllm-p7", Verb::Info, b"").unwrap()).unwrap();
    // The side channel D must register with: the one P's connector listens on.
    assert_eq!(info["engine_id"], "vllm-p7");
    assert_eq!(info["remote_host"], "127.0.0.1");
    assert_eq!(info["remote_port"], p.sched.side_channel_port());
    assert_eq!(info["tp_size"], 1);
    assert_eq!(info["role"], "both");
    assert_eq!(info["transfer_mode"], "push");
}

/// What a proxy sends in push mode: P's leg (prefill, then write into D's registered blocks)
/// and D's leg (reserve blocks, register them with P), under one fresh handoff id.
fn push_legs(
    p: &Engine,
    p_id: &str,
) -> (
    handoff_proto::KvTransferParams,
    handoff_proto::KvTransferParams,
) {
    let handoff = "00112233445566778899aabbccddeeff";
    let p_leg = serde_json::from_value(serde_json::json!({
        "do_remote_decode": true, "transfer_mode": "push", "handoff_id": handoff,
    }))
    .unwrap();
    let d_leg = serde_json::from_value(serde_json::json!({
        "do_remote_prefill": true, "transfer_mode": "push", "handoff_id": handoff,
        "remote_engine_id": p_id, "remote_host": "127.0.0.1",
        "remote_port": p.sched.side_channel_port(), "tp_size": 1, "epoch": 1,
    }))
    .unwrap();
    (p_leg, d_leg)
}

/// vLLM's `request_finished` for P's push request "p-req" of 40 tokens: P keeps its blocks
/// until its writes landed and answers with push params.
fn push_prefill_finished(p: &mut Engine, p_leg: &handoff_proto::KvTransferParams, blocks: &[u32]) {
    let (keep, out) = p
        .sched
        .request_finished("p-req", Some(p_leg), vec![blocks.to_vec()], 40)
        .unwrap();
    assert!(keep, "P keeps its blocks until its writes landed");
    assert_eq!(
        out.and_then(|o| o.transfer_mode),
        Some(handoff_proto::TransferMode::Push)
    );
}

#[test]
fn a_push_through_the_vllm_hooks_writes_whole_pages_into_d_s_registered_blocks() {
    let mut p = engine_in("vllm-push-p", "push");
    let mut d = engine_in("vllm-push-d", "push");
    let (p_leg, d_leg) = push_legs(&p, "vllm-push-p");
    // Both legs leave the proxy at once: D reserves and registers its blocks while P prefills.
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
    // P's prefill ends (vLLM's request_finished): every layer is in its blocks.
    let p_blocks = vec![5u32, 6, 9];
    fill(&mut p, &p_blocks, 0);
    push_prefill_finished(&mut p, &p_leg, &p_blocks);
    lands_whole(&mut p, &mut d, ("p-req", &p_blocks), ("d-req", &d_blocks));
    all_end(&mut p, &mut d, &[("d-req", d_blocks, 40)]);
}

/// Push legs for a 40-token prompt: D's (`d-req`) arrived, its blocks not allocated yet; P's
/// blocks 5, 6 and 9 hold the prompt (P's prefill not finished yet).
fn cached_prefix_push(
    p_id: &str,
    d_id: &str,
    kv_digest: bool,
) -> (Engine, Engine, handoff_proto::KvTransferParams) {
    let mut p = engine_with(p_id, "push", kv_digest);
    let mut d = engine_with(d_id, "push", kv_digest);
    let (p_leg, d_leg) = push_legs(&p, p_id);
    assert_eq!(
        d.sched.remote_prefill_arrived("d-req", &d_leg, 40),
        Matched::Remote(40)
    );
    fill(&mut p, &[5, 6, 9], 0);
    (p, d, p_leg)
}

/// The push counterpart of `a_pull_never_writes_a_block_d_s_prefix_cache_shares`: D registers
/// only its own blocks, P writes from the first token after D's hit, and block 20 keeps D's
/// bytes (a marker that differs from P's; no digest, so a write into it would show).
#[test]
fn a_push_never_writes_a_block_d_s_prefix_cache_shares() {
    let (mut p, mut d, p_leg) = cached_prefix_push("vllm-p-pcache", "vllm-d-pcache", false);
    let cached = mark_cached_block(&p, &mut d);
    push_after_the_hit(&mut p, &mut d, &p_leg);
    kept_cached_and_landed_the_rest(&mut p, &mut d, &cached);
}

/// The push counterpart of `a_pull_after_a_prefix_cache_hit_lands_with_its_digest_not_compared`:
/// D's cached prefix differs from P's bytes for the same tokens, the digest is on, and the
/// request still gets its KV, what P wrote in D's own blocks.
#[test]
fn a_push_after_a_prefix_cache_hit_lands_with_its_digest_not_compared() {
    let (mut p, mut d, p_leg) = cached_prefix_push("vllm-p-pcache2", "vllm-d-pcache2", true);
    let cached = mark_cached_block(&p, &mut d);
    push_after_the_hit(&mut p, &mut d, &p_leg);
    kept_cached_and_landed_the_rest(&mut p, &mut d, &cached);
}

#[test]
fn a_push_streams_each_layer_from_the_forward_pass_that_saves_it() {
    let mut p = engine_in("vllm-stream-p", "push");
    let mut d = engine_in("vllm-stream-d", "push");
    let (p_leg, d_leg) = push_legs(&p, "vllm-stream-p");
    d.sched.remote_prefill_arrived("d-req", &d_leg, 40);
    let d_blocks = vec![11u32, 12, 13];
    d.sched.blocks_allocated("d-req", d_blocks.clone()).unwrap();
    // D's registration (and its grant) reaches P over the side channel meanwhile.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        d.step();
        p.step();
    }
    // vLLM's build_connector_meta: the step being built completes P's prompt. Its forward
    // pass has not run: P's blocks hold nothing yet.
    let p_blocks = vec![5u32, 6, 9];
    assert!(
        p.sched
            .prefill_planned("p-req", &p_leg, vec![p_blocks.clone()], 40)
            .unwrap(),
        "a push holds P's blocks from its last step on"
    );
    let meta = StepMeta::from_bytes(&p.sched.build_meta().to_bytes()).unwrap();
    assert_eq!(meta.forward, vec![p_leg.handoff_id.unwrap()]);
    p.workers[0].apply(&meta);
    assert!(
        p.workers[0].waits_for_layer(0),
        "layer 0's writes wait for the forward to save it"
    );
    // The forward pass: layer 0 is saved and leaves for D while layer 1 computes.
    fill_layer(&mut p, &p_blocks, 0, 0);
    p.workers[0].layer_saved(0, None);
    assert!(!p.workers[0].waits_for_layer(0));
    let t0 = Instant::now();
    while d.block(0, 13) != p.block(0, 9) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "layer 0 never landed"
        );
        d.step();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        d.block(1, 11).iter().all(|&x| x == 0),
        "layer 1 went before the forward saved it"
    );
    fill_layer(&mut p, &p_blocks, 0, 1);
    p.workers[0].layer_saved(1, None);
    p.workers[0].forward_done(None);
    // vLLM's update_from_output: one token sampled, the request finishes.
    push_prefill_finished(&mut p, &p_leg, &p_blocks);
    // The last layer and the digest (over both layers, taken after the forward) follow.
    lands_whole(&mut p, &mut d, ("p-req", &p_blocks), ("d-req", &d_blocks));
    all_end(&mut p, &mut d, &[("d-req", d_blocks, 40)]);
}

/// A forward pass five times as long as D's registration grant: the write of its first layer,
/// planned before the forward under the grant of that moment, waits in the worker for the whole
/// forward; D's renewals (P heartbeats all along, from its executor) reach the worker on the
/// grant line, and the layer leaves and lands when it is saved. With the planned grant alone
/// it would fail unposted and D would give up on the request.
#[test]
fn a_push_streams_through_a_forward_pass_five_times_d_s_registration_grant() {
    const GRANT_MS: u64 = 1000;
    let mut p = engine_in("vllm-long-p", "push");
    let mut d = engine_configured(
        "vllm-long-d",
        "push",
        true,
        serde_json::json!({ "registration_lease_ms": GRANT_MS }),
    );
    let (p_leg, d_leg) = push_legs(&p, "vllm-long-p");
    d.sched.remote_prefill_arrived("d-req", &d_leg, 40);
    let d_blocks = vec![11u32, 12, 13];
    d.sched.blocks_allocated("d-req", d_blocks.clone()).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        d.step();
        p.step();
    }
    let p_blocks = vec![5u32, 6, 9];
    assert!(
        p.sched
            .prefill_planned("p-req", &p_leg, vec![p_blocks.clone()], 40)
            .unwrap(),
        "a push holds P's blocks from its last step on"
    );
    let meta = StepMeta::from_bytes(&p.sched.build_meta().to_bytes()).unwrap();
    p.workers[0].apply(&meta);
    assert!(p.workers[0].waits_for_layer(0));
    // The forward computes layer 0 for five grants. Neither engine steps (vLLM's EngineCore
    // waits for the forward); only the connectors' own threads run.
    std::thread::sleep(Duration::from_millis(5 * GRANT_MS));
    fill_layer(&mut p, &p_blocks, 0, 0);
    p.workers[0].layer_saved(0, None);
    let t0 = Instant::now();
    while d.block(0, 13) != p.block(0, 9) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "layer 0 never landed: its write failed at the grant it was planned on"
        );
        d.step();
        std::thread::sleep(Duration::from_millis(2));
    }
    fill_layer(&mut p, &p_blocks, 0, 1);
    p.workers[0].layer_saved(1, None);
    p.workers[0].forward_done(None);
    push_prefill_finished(&mut p, &p_leg, &p_blocks);
    lands_whole(&mut p, &mut d, ("p-req", &p_blocks), ("d-req", &d_blocks));
    all_end(&mut p, &mut d, &[("d-req", d_blocks, 40)]);
}

#[test]
fn a_p_that_dies_before_its_writes_land_fails_d_s_request_only_after_grant_and_grace() {
    let mut p = engine_in("vllm-push-p2", "push");
    let mut d = engine_in("vllm-push-d2", "push");
    let (p_leg, d_leg) = push_legs(&p, "vllm-push-p2");
    d.sched.remote_prefill_arrived("d-req", &d_leg, 20);
    d.sched.blocks_allocated("d-req", vec![7, 8]).unwrap();
    for _ in 0..5 {
        d.step();
        p.step();
    }
    let (keep, _) = p
        .sched
        .request_finished("p-req", Some(&p_leg), vec![vec![1, 2]], 20)
        .unwrap();
    assert!(keep);
    // P's scheduler side runs (it asks D for a grant and is given one) but its worker never
    // posts the writes it is told to: as far as D knows, they may land at any moment.
    let created = Instant::now();
    let mut writes_told = false;
    while created.elapsed() < Duration::from_millis(300) {
        let pm = p.sched.build_meta();
        writes_told |= pm.steps[0]
            .ops
            .iter()
            .any(|op| matches!(op, handoff_connector::WorkerOp::Post(_)));
        let dm = d.step();
        assert!(dm.failed_recving.is_empty() && dm.finished_recving.is_empty());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        writes_told,
        "P was granted D's blocks and told its worker to write"
    );
    // P dies.
    p.sched.shutdown();
    drop(p);
    let killed = Instant::now();
    let failed = loop {
        let dm = d.step();
        assert!(dm.finished_recving.is_empty());
        if dm.failed_recving.contains(&"d-req".to_string()) {
            break Instant::now();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "D never gave up on a dead P"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    // Not before the first grant D gave (1.5 s registration lease) and the write grace (0.8 s)
    // are over: a WRITE P posted just before dying may land until then.
    let (after_grant, after_kill) = (failed - created, failed - killed);
    assert!(
        after_grant >= Duration::from_millis(2300),
        "{after_grant:?}"
    );
    assert!(after_kill < Duration::from_secs(5), "{after_kill:?}");
    // vLLM then fails (or recomputes) the request: its blocks are vLLM's at once.
    let (keep, _) = d
        .sched
        .request_finished("d-req", None, vec![vec![7, 8]], 0)
        .unwrap();
    assert!(!keep);
}

#[test]
fn timings_that_cannot_work_are_refused_with_their_name() {
    let worker = engine("vllm-timings").workers.remove(0);
    for (key, value, says) in [
        (
            "registration_lease_ms",
            500,
            "registration_lease_ms must exceed 700 ms",
        ),
        ("push_deadline_ms", 0, "push_deadline_ms must be at least 1"),
        (
            "hard_cap_ms",
            1000,
            "hard_cap_ms must be at least initial_lease_ms",
        ),
    ] {
        let mut cfg = serde_json::json!({
            "engine_id": "vllm-timings-s", "model": "tiny", "dtype": "float32",
            "opaque_blocks": true,
        });
        cfg[key] = value.into();
        let cfg: SchedulerConfig = serde_json::from_value(cfg).unwrap();
        let err = SchedulerSide::start(cfg, vec![worker.hello().unwrap()])
            .err()
            .expect("refused");
        assert!(err.to_string().contains(says), "{key}: {err}");
    }
}

#[test]
fn an_unknown_kv_load_failure_policy_is_refused_with_its_name() {
    let e = engine("vllm-policy");
    let cfg: SchedulerConfig = serde_json::from_value(serde_json::json!({
        "engine_id": "vllm-policy-2", "model": "tiny", "dtype": "float32",
        "failure_policy": "retry-forever",
    }))
    .unwrap();
    let err = SchedulerSide::start(cfg, vec![e.workers[0].hello().unwrap()])
        .err()
        .expect("refused");
    assert!(err.to_string().contains("retry-forever"), "{err}");
}
