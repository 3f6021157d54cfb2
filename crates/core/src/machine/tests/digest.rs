//! The KV digest: a pulled or pushed handoff is ready only when D's digest equals P's; a differing or missing one fails the request.

use super::*;

/// One pull between a P and a D core with `kv_digest`, their workers played by the test: P's
/// worker reports `p_share` as its digest when it grants, D's reports `d_share` when its READ
/// landed. Returns D's events and observations.
fn pull_with_digests(p_share: u64, d_share: u64) -> (Vec<ConnectorEvent>, Vec<Observation>) {
    pull_with_digests_after(Vec::new(), p_share, d_share)
}

/// [`pull_with_digests`] where D's prefix cache holds the prompt's first blocks, `cached`
/// (the request's own blocks follow them to 7, 8 in all).
fn pull_with_digests_after(
    cached: Vec<u32>,
    p_share: u64,
    d_share: u64,
) -> (Vec<ConnectorEvent>, Vec<Observation>) {
    let mut p = core_with("p", Role::Prefill, true);
    let prm = params(&mut p, 1);
    let r = p.ready();
    p.advance(r);
    let mut d = connect(&mut p, core_with("d", Role::Decode, true), &prm, 5);
    let own: Vec<u32> = [7, 8].into_iter().skip(cached.len()).collect();
    d.on_blocks_allocated_after_cached(1, cached.clone(), own, t(3))
        .unwrap();
    let (mut events, mut observations) = (Vec::new(), Vec::new());
    for step in 0..40u64 {
        let now = t(4 + 50 * step);
        for c in [&mut p, &mut d] {
            if c.poll_timeout().is_some_and(|at| at <= now) {
                c.handle_timeout(now);
            }
        }
        let rd = d.ready();
        let to_p: Vec<Message> = rd.messages.iter().map(|(_, m)| m.clone()).collect();
        let mut d_report = WorkerReport::default();
        for (_, job) in &rd.transfers_to_post {
            if cached.is_empty() {
                let (blocks, of) = job
                    .digest
                    .clone()
                    .expect("D asks its worker for the digest");
                assert_eq!((blocks, of.num_tokens), (vec![7, 8], 32));
                d_report.digests.push((Digested::Job(job.job), d_share));
            } else {
                assert!(
                    job.digest.is_none(),
                    "a digest that cannot be compared is asked for"
                );
            }
            d_report.ended.push((job.job, true));
        }
        events.extend(rd.events.iter().cloned());
        observations.extend(rd.observations.iter().cloned());
        d.advance(rd);
        for m in to_p {
            p.handle_frame(100, m, now);
        }
        let rp = p.ready();
        let to_d: Vec<Message> = rp.messages.iter().map(|(_, m)| m.clone()).collect();
        let mut p_report = WorkerReport::default();
        for (_, op) in &rp.worker_ops {
            if let WorkerOp::Grant { grant, digest, .. } = op {
                let of = digest.expect("P asks its worker for the digest");
                assert_eq!(of.num_tokens, 32);
                p_report.digests.push((Digested::Grant(*grant), p_share));
                p_report.granted.push((*grant, true));
            }
        }
        p.advance(rp);
        p.handle_worker_report(p_report, now);
        for m in to_d {
            d.handle_frame(5, m, now);
        }
        d.handle_worker_report(d_report, now);
    }
    (events, observations)
}

/// Request 1 got its KV, checked against P's digest.
fn assert_ready_after_a_matching_digest(events: &[ConnectorEvent], observations: &[Observation]) {
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ConnectorEvent::Ready { requests, .. } if requests == &vec![1])),
        "{events:?}"
    );
    assert!(observations.contains(&Observation::DigestChecked { matched: true }));
}

/// Request 1 was failed (or recomputed) for a digest mismatch and never handed its KV.
fn assert_failed_on_the_digest(events: &[ConnectorEvent], observations: &[Observation]) {
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ConnectorEvent::Ready { .. })),
        "damaged KV was handed to the request: {events:?}"
    );
    assert!(
        events.iter().any(|e| matches!(e,
            ConnectorEvent::Recompute { requests, reason } | ConnectorEvent::Failed { requests, reason }
            if requests == &vec![1] && reason.contains("kv_digest_mismatch"))),
        "{events:?}"
    );
    assert!(observations.contains(&Observation::DigestChecked { matched: false }));
}

#[test]
fn a_pulled_handoff_whose_digest_matches_p_s_is_ready() {
    let (events, observations) = pull_with_digests(0xabc, 0xabc);
    assert_ready_after_a_matching_digest(&events, &observations);
}

/// The negative control of the check: the same pull, with what landed on D differing from P's
/// KV, is never handed to the request.
#[test]
fn a_pulled_handoff_whose_digest_differs_fails_and_is_never_ready() {
    let (events, observations) = pull_with_digests(0xabc, 0xabd);
    assert_failed_on_the_digest(&events, &observations);
}

/// D's prefix cache held the prompt's first block, which D did not read and which may hold D's
/// own computation of those tokens (right, not bit for bit P's): P's digest, over the whole
/// prompt, cannot be compared with anything D has. The request gets its KV (the READ of the
/// rest landed), counted as not compared, neither matched nor failed. (Compared, as before,
/// this request failed `kv_digest_mismatch` in a vLLM run whose D had generated the tokens of
/// that block itself: a false alarm, answered 500.)
#[test]
fn a_pull_after_a_prefix_cache_hit_is_ready_and_its_digest_not_compared() {
    let (events, observations) = pull_with_digests_after(vec![7], 0xabc, 0xabd);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ConnectorEvent::Ready { requests, .. } if requests == &vec![1])),
        "{events:?}"
    );
    assert!(observations.contains(&Observation::DigestNotCompared));
    assert!(!observations
        .iter()
        .any(|o| matches!(o, Observation::DigestChecked { .. })));
}

/// One push between a P and a D core with `kv_digest`, their workers played by the test: every
/// WRITE lands (its notification reaches D), P's worker reports `p_share` as the digest of
/// P's blocks, D's reports `d_share` for what landed. Returns D's events and observations, and
/// whether P posted a last-layer WRITE before its digest was known.
/// A push with P's and D's workers answering the digest with these shares (`None`: D's worker
/// never answers). Runs 0.8 s of simulated time, or 8 s when D's worker is silent.
fn push_with_digests(
    p_share: u64,
    d_share: Option<u64>,
) -> (Vec<ConnectorEvent>, Vec<Observation>, bool) {
    let mut p = core_in("p", Role::Prefill, TransferMode::Push, true);
    let mut id = [0u8; 16];
    id[0] = 9;
    let handoff = HandoffId::from_bytes(id);
    let p_leg: KvTransferParams = serde_json::from_value(serde_json::json!({
        "do_remote_decode": true, "transfer_mode": "push", "handoff_id": handoff.to_string(),
    }))
    .unwrap();
    let d_leg: KvTransferParams = serde_json::from_value(serde_json::json!({
        "do_remote_prefill": true, "transfer_mode": "push", "handoff_id": handoff.to_string(),
        "remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 7000,
        "tp_size": 1, "epoch": 1,
    }))
    .unwrap();
    let d = core_in("d", Role::Decode, TransferMode::Push, true);
    let mut d = connect(&mut p, d, &d_leg, 5);
    d.on_blocks_allocated(1, vec![7, 8], t(3)).unwrap();
    {
        let p = at(&mut p, t(3));
        p.prefill_started("r", &p_leg, handoff, vec![1, 2], 32)
            .unwrap();
        p.prefill_ended("r", crate::PrefillOutcome::Finished)
            .unwrap();
    }
    let (mut events, mut observations, mut early) = (Vec::new(), Vec::new(), false);
    let mut digest_known = false;
    let steps = if d_share.is_some() { 40 } else { 400 };
    for step in 0..steps {
        let now = t(4 + 20 * step);
        for c in [&mut p, &mut d] {
            if c.poll_timeout().is_some_and(|at| at <= now) {
                c.handle_timeout(now);
            }
        }
        let rd = d.ready();
        let to_p: Vec<Message> = rd.messages.iter().map(|(_, m)| m.clone()).collect();
        let mut d_report = WorkerReport::default();
        for (_, op) in &rd.worker_ops {
            match op {
                WorkerOp::Digest { blocks, of, .. } => {
                    assert_eq!((blocks.clone(), of.num_tokens), (vec![7, 8], 32));
                    if let Some(share) = d_share {
                        d_report.digests.push((Digested::Handoff(handoff), share));
                    }
                }
                // D's registration leaves once its worker let P write into the blocks.
                WorkerOp::Grant { grant, .. } => d_report.granted.push((*grant, true)),
                _ => {}
            }
        }
        events.extend(rd.events.iter().cloned());
        observations.extend(rd.observations.iter().cloned());
        d.advance(rd);
        for m in to_p {
            p.handle_frame(100, m, now);
        }
        let rp = p.ready();
        let to_d: Vec<Message> = rp.messages.iter().map(|(_, m)| m.clone()).collect();
        let mut p_report = WorkerReport::default();
        for (_, op) in &rp.worker_ops {
            if let WorkerOp::Digest { blocks, of, .. } = op {
                assert_eq!((blocks.clone(), of.num_tokens), (vec![1, 2], 32));
                p_report.digests.push((Digested::Handoff(handoff), p_share));
            }
        }
        for (_, job) in &rp.transfers_to_post {
            p_report.ended.push((job.job, true));
            for part in &job.parts {
                if let Some(n) = &part.notification {
                    early |= !digest_known;
                    d_report.notifications.push(("p-r0".into(), n.clone()));
                }
            }
        }
        digest_known |= !p_report.digests.is_empty();
        p.advance(rp);
        p.handle_worker_report(p_report, now);
        for m in to_d {
            d.handle_frame(5, m, now);
        }
        d.handle_worker_report(d_report, now);
    }
    (events, observations, early)
}

#[test]
fn a_pushed_handoff_whose_digest_matches_p_s_is_ready() {
    let (events, observations, early) = push_with_digests(0x5eed, Some(0x5eed));
    assert!(!early, "P's last WRITE left before its digest was known");
    assert_ready_after_a_matching_digest(&events, &observations);
}

/// The negative control: what landed on D differs from P's KV, and the request never decodes it.
#[test]
fn a_pushed_handoff_whose_digest_differs_fails_and_is_never_ready() {
    let (events, observations, _) = push_with_digests(0x5eed, Some(0x5eee));
    assert_failed_on_the_digest(&events, &observations);
    assert_push_blocks_back(&events);
}

/// D's blocks of a push nobody decodes go back to the engine, once.
fn assert_push_blocks_back(events: &[ConnectorEvent]) {
    let back: Vec<&Vec<u32>> = events
        .iter()
        .filter_map(|e| match e {
            ConnectorEvent::BlocksReleased { blocks, .. } => Some(blocks),
            _ => None,
        })
        .collect();
    assert_eq!(back, vec![&vec![7, 8]], "D's blocks: {events:?}");
}

/// D's worker never answers the digest of a push that landed (it stopped): the request still
/// ends, failed or recomputed once D's read timeout passed, never decoded unchecked, and the
/// check is gone (rules 6 and 7).
#[test]
fn a_push_digest_no_worker_answers_ends_the_request_after_the_read_timeout() {
    let (events, _, _) = push_with_digests(0x5eed, None);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ConnectorEvent::Ready { .. })),
        "unchecked KV was handed to the request: {events:?}"
    );
    assert!(
        events.iter().any(|e| matches!(e,
            ConnectorEvent::Recompute { requests, reason } | ConnectorEvent::Failed { requests, reason }
            if requests == &vec![1] && reason.contains("kv_digest_timeout"))),
        "{events:?}"
    );
    assert_push_blocks_back(&events);
}
