//! The scheduler's bookkeeping of blocks around the connector's events.

use handoff_plan::PoolLayout;

use super::*;

fn scheduler() -> Scheduler {
    let kv = crate::kv::tests::memory(PoolLayout::BlocksOutermost);
    let cfg = EngineConfig {
        num_blocks: 8,
        block_size: 16,
        decode_step_ms: 0.0,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    };
    let metrics = EngineMetrics::new(&mut prometheus_client::registry::Registry::default());
    Scheduler::new(cfg, Arc::new(kv), None, metrics)
}

/// Request `id` (8 prompt tokens, one to generate) admitted and waiting for its KV, holding
/// `prompt_blocks` (the connector's) and a generation block; its events come out of the
/// receiver.
fn awaiting_kv(
    s: &mut Scheduler,
    id: u64,
    prompt_blocks: Vec<u32>,
) -> tokio::sync::mpsc::UnboundedReceiver<SeqEvent> {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let gen_blocks = vec![s.pool.alloc(1).unwrap()];
    let sub = Submission {
        id,
        external_id: format!("r{id}"),
        prompt: (0..8).collect(),
        max_tokens: 1,
        n: 1,
        kind: Kind::Local,
        events,
    };
    let r = Request {
        sub,
        arrived: Instant::now(),
        admitted: Some(Instant::now()),
        gen_blocks,
        prompt_blocks,
        recompute: false,
        handed_over: false,
        prefilling: false,
        awaits_remote_start: false,
    };
    s.awaiting_kv.insert(id, r);
    rx
}

/// The KV of a handoff lands for requests none of which still waits for it (the client of
/// the one admitted left after the connector queued the event; a second request naming the
/// same handoff was recomputed on its own): its blocks go back to the pool, where before
/// nobody freed them. One request still waiting takes them and decodes.
#[test]
fn kv_that_lands_for_no_waiting_request_goes_back_to_the_pool() {
    let mut s = scheduler();
    let blocks = s.pool.alloc(3).unwrap();
    s.kv_landed(vec![7, 8], blocks);
    assert_eq!(s.pool.used_count(), 0, "blocks nobody took were kept");

    let prompt_blocks = s.pool.alloc(2).unwrap();
    let mut rx = awaiting_kv(&mut s, 9, Vec::new());
    s.kv_landed(vec![8, 9], prompt_blocks);
    assert!(matches!(rx.try_recv(), Ok(SeqEvent::Token { .. })));
    // One token asked: the request finished and gave back every block it held.
    assert_eq!(s.pool.used_count(), 0);
    assert_eq!(s.pool.double_frees, 0);
}

/// A transfer fails under policy `fail`: the request gets its error and its generation
/// blocks back at once, but its prompt blocks only when the connector releases them (a READ
/// may still land in them); then each block is freed exactly once.
#[test]
fn a_failed_transfer_leaves_the_prompt_blocks_to_the_connector() {
    let mut s = scheduler();
    let prompt_blocks = s.pool.alloc(2).unwrap();
    let mut rx = awaiting_kv(&mut s, 9, prompt_blocks.clone());
    s.transfer_failed(vec![9], "read_failed");
    assert!(matches!(
        rx.try_recv(),
        Ok(SeqEvent::Error { status: 502, .. })
    ));
    assert_eq!(
        s.pool.used_count(),
        2,
        "the prompt blocks left before the connector let go"
    );
    s.pool.free(&prompt_blocks); // BlocksReleased
    assert_eq!(s.pool.used_count(), 0);
    assert_eq!(s.pool.double_frees, 0);
}
