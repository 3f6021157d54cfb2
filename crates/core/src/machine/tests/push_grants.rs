//! A push's grants on P's side: registrations for ended requests, writes held for their forward pass, live renewals, and time left for a write's bytes.

use super::*;

/// D, push: the registration of a request whose P was still being dialled waits in the
/// connection's queue. When the request ends before the connection is up (its blocks go back to
/// the pool), the flush drops it: no WRITE grant opens on blocks that may be another request's
/// by then, and P never hears of it.
#[test]
fn a_registration_queued_for_a_request_that_ended_opens_no_grant() {
    let mut p = core_in("p", Role::Prefill, TransferMode::Push, false);
    let d_leg: KvTransferParams = serde_json::from_value(serde_json::json!({
        "do_remote_prefill": true, "transfer_mode": "push",
        "handoff_id": HandoffId::from_bytes([7; 16]).to_string(),
        "remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 7000,
        "tp_size": 1, "epoch": 1,
    }))
    .unwrap();
    let mut d = core_in("d", Role::Decode, TransferMode::Push, false);
    d.on_request_arrived(1, &d_leg, 32, t(1)).unwrap();
    let r = d.ready();
    let (hello, attempt) = (r.connects[0].hello.clone(), r.connects[0].attempt);
    d.advance(r);
    d.on_blocks_allocated(1, vec![7, 8], t(2)).unwrap();
    d.on_request_ended(1, ReleaseReason::Aborted, t(3));
    let r = d.ready();
    assert!(
        r.events.iter().any(
            |e| matches!(e, ConnectorEvent::BlocksReleased { blocks, .. } if blocks == &vec![7, 8])
        ),
        "{:?}",
        r.events
    );
    d.advance(r);
    p.handle_accepted(100, hello, None, t(4));
    let rp = p.ready();
    let reply = rp.messages[0].1.clone();
    p.advance(rp);
    d.handle_connected("p", attempt, 5, reply, t(5));
    let r = d.ready();
    assert!(
        !r.worker_ops
            .iter()
            .any(|(_, op)| matches!(op, WorkerOp::Grant { .. })),
        "a WRITE grant on blocks back in the pool: {:?}",
        r.worker_ops
    );
    assert!(!r
        .messages
        .iter()
        .any(|(_, m)| matches!(m, Message::PushRegister(_))));
}

/// P's push of a 32-token prompt to a connected D, run on the simulated clock for `ms`; P's
/// worker never reports its write of layer 0 ended (it is held for the forward pass). Until
/// `d_stops_at`, D's messages reach P. Returns the `RenewWrites` P's core sent, with their time.
fn held_push(before_forward: bool, ms: u64, d_stops_at: u64) -> Vec<(u64, u16, WorkerOp)> {
    let (renewals, held) = held_push_at(ProducerConfig::default(), before_forward, ms, d_stops_at);
    assert_eq!(held.len(), 1, "one write planned (layer 0), held all along");
    let planned = held[0].expect("a push write carries its layer");
    assert_eq!(
        (planned.handoff, planned.d_rank, planned.layer),
        (HandoffId::from_bytes([7; 16]), 0, 0)
    );
    renewals
}

/// [`held_push`] with P's producer settings `producer`; also returns the writes P posted.
#[allow(clippy::type_complexity)]
fn held_push_at(
    producer: ProducerConfig,
    before_forward: bool,
    ms: u64,
    d_stops_at: u64,
) -> (Vec<(u64, u16, WorkerOp)>, Vec<Option<PushLayer>>) {
    let mut p = core_of("p", Role::Prefill, TransferMode::Push, false, producer);
    let handoff = HandoffId::from_bytes([7; 16]);
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
    let d = core_in("d", Role::Decode, TransferMode::Push, false);
    let mut d = connect(&mut p, d, &d_leg, 5);
    d.on_blocks_allocated(1, vec![7, 8], t(3)).unwrap();
    if before_forward {
        p.cfg.layer_reports = crate::LayerReports::Planned;
    }
    {
        let p = at(&mut p, t(3));
        p.prefill_started("r", &p_leg, handoff, vec![1, 2], 32)
            .unwrap();
        // Planned: the step about to run computes every layer; saved: layer 0 is.
        p.layers_saved("r", if before_forward { 2 } else { 1 });
    }
    let mut renewals = Vec::new();
    let mut held = Vec::new();
    for step in 0..ms / 20 {
        let at = 4 + 20 * step;
        let now = t(at);
        for c in [&mut p, &mut d] {
            if c.poll_timeout().is_some_and(|x| x <= now) {
                c.handle_timeout(now);
            }
        }
        let rd = d.ready();
        let to_p: Vec<Message> = rd.messages.iter().map(|(_, m)| m.clone()).collect();
        let mut d_report = WorkerReport::default();
        for (_, op) in &rd.worker_ops {
            if let WorkerOp::Grant { grant, .. } = op {
                d_report.granted.push((*grant, true));
            }
        }
        d.advance(rd);
        if at < d_stops_at {
            for m in to_p {
                p.handle_frame(100, m, now);
            }
        }
        let rp = p.ready();
        let to_d: Vec<Message> = rp.messages.iter().map(|(_, m)| m.clone()).collect();
        for (rank, op) in &rp.worker_ops {
            if matches!(op, WorkerOp::RenewWrites { .. }) {
                renewals.push((at, *rank, op.clone()));
            }
        }
        held.extend(rp.transfers_to_post.iter().map(|(_, j)| j.push_layer));
        p.advance(rp);
        for m in to_d {
            d.handle_frame(5, m, now);
        }
        d.handle_worker_report(d_report, now);
    }
    (renewals, held)
}

fn post_within(op: &WorkerOp) -> u32 {
    match op {
        WorkerOp::RenewWrites { post_within_ms, .. } => *post_within_ms,
        other => unreachable!("{other:?}"),
    }
}

/// A push WRITE starts only while D's grant has time left for its bytes at P's floor rate: a
/// layer of 2,048 bytes at 4,096 B/s needs 500 ms beside the margin, so every window the
/// worker gets is 500 ms shorter than with no floor; at 1,024 B/s it needs 2 s, more than any
/// grant D gives, and the write is never posted.
#[test]
fn a_push_write_starts_only_with_time_left_for_its_bytes() {
    let with = |rate: u64| ProducerConfig {
        write_floor_rate: rate,
        ..ProducerConfig::default()
    };
    let (free, held) = held_push_at(with(0), true, 4_000, u64::MAX);
    assert_eq!(held.len(), 1);
    let (slow, held) = held_push_at(with(4_096), true, 4_000, u64::MAX);
    assert_eq!(held.len(), 1);
    assert_eq!(free.len(), slow.len());
    for ((at, _, a), (_, _, b)) in free.iter().zip(&slow) {
        assert_eq!(
            post_within(a),
            post_within(b) + 500,
            "at {at} ms: the bytes' 500 ms come off the window"
        );
    }
    let (none, held) = held_push_at(with(1_024), true, 4_000, u64::MAX);
    assert!(
        held.is_empty() && none.is_empty(),
        "a write whose bytes outlast every grant was posted: {held:?} {none:?}"
    );
}

#[test]
fn d_s_renewed_grants_reach_the_worker_that_holds_a_write_for_its_forward_pass() {
    // Ten default registration grants (2 s each) while the forward holds layer 0's write.
    let renewals = held_push(true, 20_000, u64::MAX);
    let lease = ConsumerConfig::default().registration_lease;
    let margin = ProducerConfig::default().write_margin;
    assert!(
        renewals.len() >= 30,
        "one renewal per P heartbeat D answers: {}",
        renewals.len()
    );
    let handoff = HandoffId::from_bytes([7; 16]);
    for (at, rank, op) in &renewals {
        let WorkerOp::RenewWrites {
            handoff: h,
            d_rank,
            post_within_ms,
        } = op
        else {
            unreachable!()
        };
        assert_eq!((*h, *d_rank, *rank), (handoff, 0, 0));
        assert!(
            u128::from(*post_within_ms) <= (lease - margin).as_millis(),
            "at {at} ms: never past D's grant less the margin ({post_within_ms} ms)"
        );
        assert!(*post_within_ms > 0);
    }
    // Renewals never stop while D grants: the longest gap between two is one heartbeat or so.
    let gaps = renewals.windows(2).map(|w| w[1].0 - w[0].0).max().unwrap();
    assert!(gaps <= 600, "a gap of {gaps} ms between renewals");
}

#[test]
fn no_renewal_reaches_a_worker_once_d_stops_granting_or_when_nothing_is_held() {
    let renewals = held_push(true, 6_000, 2_000);
    assert!(!renewals.is_empty());
    assert!(
        renewals.iter().all(|(at, _, _)| *at < 2_000),
        "a renewal after D went silent: {:?}",
        renewals.last()
    );
    // Writes planned as each layer is saved (the reference engine) are posted at once: the
    // workers hold nothing, and no renewal is sent.
    assert!(held_push(false, 4_000, u64::MAX).is_empty());
}
