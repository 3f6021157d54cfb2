//! Push: registrations in either order, grants and their renewal, cancels, the write watchdog, a dead writer, refusals.

use super::*;

#[test]
fn push_with_d_first() {
    let mut pair = push_pair();
    let id = hid(60);
    pair.d_registers(id);
    pair.pump();
    let asked = pair
        .last("P>D", "heartbeat")
        .expect("P asks D's grant early");
    assert_eq!(
        pair.p.staged_messages(),
        3,
        "registration, D's heartbeat and the grant D gave P's early ask staged on P"
    );
    pair.now += ms(30);
    pair.p
        .create_handoff(id, vec![1, 2], TransferMode::Push, pair.now)
        .unwrap();
    // The write starts with the handoff, on the grant already in hand: no round trip to D.
    let Some(ProducerAction::PushWrite(w)) = pair.p.poll_action() else {
        panic!("no write at creation");
    };
    pair.writes.push(w.clone());
    assert_eq!(w.dst_blocks, vec![40, 41]);
    assert!(w.grant_until > pair.now);
    assert!(
        w.grant_until <= asked + ConsumerConfig::default().registration_lease,
        "the early grant is anchored at P's ask, not at its replay"
    );
    pair.pump();
    pair.complete_write(&w);
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
    assert!(pair.d_releases.is_empty());
    assert!(pair.p.is_empty() && pair.d.is_empty());
}

/// D cancels its registration before P created the handoff: P acks at once (no write can be
/// in flight), so neither the staged registration nor the grant D gave P's early ask may come
/// back when the handoff is created.
#[test]
fn an_early_cancel_drops_the_staged_registration_and_its_early_grant() {
    let mut pair = push_pair();
    let id = hid(62);
    pair.d_registers(id);
    pair.pump();
    assert_eq!(
        pair.count("D>P", "grant_batch"),
        1,
        "D answered P's early ask"
    );
    pair.now += ms(10);
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    assert_eq!(pair.count("P>D", "push_cancel_ack"), 1);
    assert!(pair.d_releases.iter().any(|r| r.blocks == vec![40, 41]));
    pair.now += ms(10);
    pair.p
        .create_handoff(id, vec![1, 2], TransferMode::Push, pair.now)
        .unwrap();
    pair.pump();
    assert!(pair.writes.is_empty(), "a write into blocks D freed");
}

#[test]
fn push_with_p_first() {
    let mut pair = push_pair();
    let id = hid(61);
    pair.p
        .create_handoff(id, vec![1, 2], TransferMode::Push, pair.now)
        .unwrap();
    pair.now += ms(30);
    pair.d_registers(id);
    pair.pump();
    assert_eq!(pair.writes.len(), 1);
    let w = pair.writes[0].clone();
    pair.complete_write(&w);
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
    assert!(pair.p_released(id).is_some());
}

/// Issue 16's push tail: D registers while P's request still queues, and P's request is created
/// only after P's staging TTL dropped the staged registration (P's pool was full for longer than
/// that). Before D sent a registration again when P went silent on it, P's handoff never learnt
/// of D and D waited its whole push watchdog (30 s by default) before recomputing: the 31 s
/// p99 of push at 8192 tokens and concurrency 8. Now the write starts within a resend interval
/// of the handoff's creation, and what P stages meanwhile stays within its per-handoff bound.
#[test]
fn a_registration_p_dropped_while_its_request_queued_is_sent_again() {
    let p_cfg = ProducerConfig {
        staging_ttl: ms(2000),
        ..Default::default()
    };
    let d_cfg = ConsumerConfig {
        push_deadline: Duration::from_secs(30),
        ..Default::default()
    };
    let resend = d_cfg.heartbeat_interval * handoff_ledger::REGISTER_RESEND_HEARTBEATS;
    let mut pair = Pair::new(p_cfg.clone(), d_cfg);
    let id = hid(63);
    pair.d_registers(id);
    pair.pump();
    // P's request waits in its queue for 3 staging TTLs.
    let mut most_staged = 0;
    for _ in 0..60 {
        pair.advance(ms(100));
        most_staged = most_staged.max(pair.p.staged_messages());
    }
    assert!(
        pair.count("D>P", "push_register") > 1,
        "D sent its registration again while P was silent"
    );
    assert!(
        most_staged <= p_cfg.staging_per_handoff,
        "staged {most_staged}"
    );
    let created = pair.now;
    pair.p
        .create_handoff(id, vec![1, 2], TransferMode::Push, pair.now)
        .unwrap();
    let wrote = pair.advance_until(resend + ms(500), |p| !p.writes.is_empty());
    assert!(
        wrote,
        "no write {:?} after P created the handoff (D waits its watchdog out)",
        pair.now - created
    );
    let w = pair.writes[0].clone();
    pair.complete_write(&w);
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
    // Once P holds the registration it asks for grants at every heartbeat: no more resends.
    let sent = pair.count("D>P", "push_register");
    pair.advance(ms(3000));
    assert_eq!(pair.count("D>P", "push_register"), sent);
    assert!(pair.p.is_empty() && pair.d.is_empty());
}

/// P's push heartbeat can reach D after D got every `PushDone` but before P saw its own write
/// complete. D must not answer "gone": P would abort a write that succeeded and hold its blocks
/// until its lease ran out. P ends the handoff as done when its write completes.
#[test]
fn push_heartbeat_crossing_the_last_push_done_gets_no_gone() {
    let mut pair = push_pair();
    let id = hid(67);
    let w = pair.push_writing(id);
    // The data and its completions land at D; P has not polled its transfer yet.
    for n in &w.done {
        pair.d
            .handle_message(P_PEER, Message::PushDone(*n), pair.now);
    }
    pair.pump();
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
    // P heartbeats D for its registration meanwhile.
    let before = pair.count("P>D", "heartbeat");
    pair.advance(ms(1200));
    assert!(
        pair.count("P>D", "heartbeat") > before,
        "P asked D for grants"
    );
    assert!(
        pair.aborted_writes.is_empty(),
        "a write that landed was aborted: {:?}",
        pair.aborted_writes
    );
    pair.p.on_push_write_done(id, w.d_rank, true, pair.now);
    pair.pump();
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
}

/// D lost the handoff (here: D restarted under the same name) and answers P's heartbeat with
/// "gone". P aborts its write and frees its blocks as soon as the aborted write drains, not at
/// lease end.
#[test]
fn push_gone_from_d_ends_the_handoff_on_p_at_once() {
    let mut pair = push_pair();
    let id = hid(68);
    let w = pair.push_writing(id);
    pair.d = ConsumerLedger::new(ConsumerConfig::default());
    pair.advance_until(ms(2000), |p| !p.aborted_writes.is_empty());
    assert_eq!(
        pair.aborted_writes,
        vec![(id, w.d_rank)],
        "P aborts its write"
    );
    assert!(
        pair.p_released(id).is_none(),
        "not while the write may still run"
    );
    pair.p.on_push_write_done(id, w.d_rank, false, pair.now);
    pair.pump();
    let r = pair
        .p_released(id)
        .expect("freed once the aborted write drained");
    assert_eq!(r.reason, EndReason::Cancelled);
    assert!(
        r.held_for < ms(3000),
        "held {:?}; the lease is 10 s",
        r.held_for
    );
}

/// P's push heartbeat, and the grant (or "gone") that answers it, by hand.
fn push_grants(p: &mut ProducerLedger, id: handoff_proto::HandoffId, now: Duration, gone: bool) {
    let seq = std::iter::from_fn(|| p.poll_message())
        .filter_map(|(_, m)| match m {
            Message::Heartbeat(hb) => Some(hb.seq),
            _ => None,
        })
        .last()
        .expect("P heartbeats its registrations");
    let entry = HeartbeatEntry {
        handoff: id,
        epoch: Epoch::FIRST,
    };
    let (grants, gone) = if gone {
        (vec![], vec![entry])
    } else {
        let grant = Grant {
            handoff: id,
            epoch: Epoch::FIRST,
            lease_ms: 1000,
        };
        (vec![grant], vec![])
    };
    p.handle_message(
        D_PEER,
        Message::GrantBatch(GrantBatch { seq, grants, gone }),
        now,
    );
}

/// Rule 3, found by the property test: P acks D's cancel (D may free its blocks at once), then a
/// registration for another D rank arrives late, with a grant. P must not write into it.
#[test]
fn no_write_starts_after_p_acked_a_cancel() {
    let mut p = ProducerLedger::new(ProducerConfig::default());
    let id = hid(69);
    let mut now = Duration::ZERO;
    p.create_handoff(id, vec![1], TransferMode::Push, now)
        .unwrap();
    let register = |d_rank: u16| {
        Message::PushRegister(PushRegister {
            handoff: id,
            epoch: Epoch::FIRST,
            d_rank,
            d_tp: 3,
            num_tokens: 16,
            block_ids: vec![8],
            cached_blocks: 0,
        })
    };
    p.handle_message(D_PEER, register(0), now);
    p.handle_message(D_PEER, register(1), now);
    let writes = |p: &mut ProducerLedger| -> Vec<u16> {
        std::iter::from_fn(|| p.poll_action())
            .filter_map(|a| match a {
                ProducerAction::PushWrite(w) => Some(w.d_rank),
                _ => None,
            })
            .collect()
    };
    now += ms(600);
    p.handle_timeout(now);
    push_grants(&mut p, id, now, false);
    assert_eq!(
        writes(&mut p),
        vec![0, 1],
        "both registered ranks are written"
    );
    p.on_push_write_done(id, 0, true, now);
    // D gave up on the handoff: its next grant reply says gone. Rank 1's write is aborted; once
    // it ends, P acks.
    now += ms(600);
    p.handle_timeout(now);
    push_grants(&mut p, id, now, true);
    p.on_push_write_done(id, 1, false, now);
    let acked = std::iter::from_fn(|| p.poll_message())
        .any(|(_, m)| matches!(m, Message::PushCancelAck(_)));
    assert!(acked, "no write in flight: P acks");
    // A late registration (reordered) and a late grant: nothing may be written any more.
    p.handle_message(D_PEER, register(2), now);
    now += ms(600);
    p.handle_timeout(now);
    // Whatever P asks for now, D grants it.
    let asked = std::iter::from_fn(|| p.poll_message()).filter_map(|(_, m)| match m {
        Message::Heartbeat(hb) => Some(hb.seq),
        _ => None,
    });
    for seq in asked.collect::<Vec<_>>() {
        let grant = Grant {
            handoff: id,
            epoch: Epoch::FIRST,
            lease_ms: 1000,
        };
        let batch = GrantBatch {
            seq,
            grants: vec![grant],
            gone: vec![],
        };
        p.handle_message(D_PEER, Message::GrantBatch(batch), now);
    }
    assert!(writes(&mut p).is_empty(), "a write started after the ack");
    assert!(p.write_permit(id, 2, now).is_err());
}

#[test]
fn push_watchdog_with_ack_frees_on_the_ack() {
    let mut pair = push_pair();
    let id = hid(62);
    pair.push_writing(id);
    // The write hangs; the watchdog fires.
    pair.advance_until(Duration::from_secs(10), |p| !p.outcomes.is_empty());
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::WatchdogExpired,
            ..
        }]
    ));
    assert_eq!(
        pair.aborted_writes,
        vec![(id, 0)],
        "P was asked to abort the write"
    );
    assert!(
        pair.d_releases.is_empty(),
        "a WRITE may still land: no free before P's ack"
    );
    // P's connector reports the aborted write ended: P acks, D frees at once.
    pair.p.on_push_write_done(id, 0, false, pair.now);
    pair.pump();
    assert_eq!(pair.count("P>D", "push_cancel_ack"), 1);
    assert_eq!(pair.d_releases.len(), 1);
    assert!(pair.p_released(id).is_some());
    assert_eq!(
        pair.p.write_permit(id, 0, pair.now),
        Err(WriteRefused::UnknownHandoff)
    );
}

#[test]
fn push_watchdog_without_ack_frees_after_grant_plus_grace() {
    let mut pair = push_pair();
    let id = hid(63);
    pair.push_writing(id);
    // P heartbeats D's registration (D grants), then goes silent just before the watchdog
    // while writing: no ack will ever come.
    pair.advance(Duration::from_millis(4900));
    pair.p_alive = false;
    let last_grant_end = last_grant_end(&pair, "D>P", id).expect("D granted the registration");
    pair.advance_until(Duration::from_secs(10), |p| !p.outcomes.is_empty());
    assert!(
        pair.d_releases.is_empty(),
        "cancelled, but a WRITE may still be in flight"
    );
    freed_after_grant_plus_grace(&mut pair, last_grant_end);
}

/// Runs the pair until D frees a block, which must be exactly when the last grant D issued,
/// plus the write grace, has passed (the grant's ms are rounded down on the wire, so D's own
/// end can be up to 1 ms later).
fn freed_after_grant_plus_grace(pair: &mut Pair, last_grant_end: Duration) {
    pair.advance_until(Duration::from_secs(10), |p| !p.d_releases.is_empty());
    let earliest = last_grant_end + pair.d.config().write_grace;
    assert!(
        pair.now >= earliest && pair.now <= earliest + ms(1),
        "freed at {:?}, expected {:?}",
        pair.now,
        earliest
    );
}

/// D learns that P died (its side channel closed) while P may be writing: the requests fail at
/// once, but the blocks wait out the last grant D issued + the write grace — a WRITE posted
/// before the death may still land, and "dead" may only mean cut off (rule 3).
#[test]
fn push_writer_declared_dead_frees_d_s_blocks_only_after_grant_plus_grace() {
    let mut pair = push_pair();
    let id = hid(68);
    pair.push_writing(id);
    pair.advance(Duration::from_millis(700));
    pair.p_alive = false;
    let last_grant_end = last_grant_end(&pair, "D>P", id).expect("D granted the registration");
    pair.d.handle_peer_dead(P_PEER, pair.now);
    pair.pump();
    assert!(
        matches!(pair.outcomes.as_slice(), [Outcome::Recompute { .. }]),
        "the request is told at once: {:?}",
        pair.outcomes
    );
    assert!(
        pair.d_releases.is_empty(),
        "freed under a WRITE that may still land"
    );
    freed_after_grant_plus_grace(&mut pair, last_grant_end);
    assert_eq!(pair.d_releases[0].reason, EndReason::PeerDead);
    assert!(pair.d.is_empty());
}

#[test]
fn write_on_an_expired_registration_is_refused() {
    let mut pair = push_pair();
    let id = hid(64);
    let w = pair.push_writing(id);
    assert!(pair.p.write_permit(id, 0, pair.now).is_ok());
    // D stops answering P's heartbeats: P's grant runs out and no more writes may be posted.
    pair.d_alive = false;
    pair.advance(pair.d.config().registration_lease + ms(1));
    assert_eq!(
        pair.p.write_permit(id, 0, pair.now),
        Err(WriteRefused::GrantExpired)
    );
    assert!(pair.now > w.grant_until);
    assert_eq!(
        pair.p.write_permit(id, 3, pair.now),
        Err(WriteRefused::NotRegistered)
    );
}

#[test]
fn push_failed_write_is_reported_to_d_at_once() {
    let mut pair = push_pair();
    let id = hid(65);
    pair.push_writing(id);
    pair.p.on_push_write_done(id, 0, false, pair.now);
    pair.pump();
    assert_eq!(pair.count("P>D", "push_failed"), 1);
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::WriteFailed,
            ..
        }]
    ));
    // P's ack to D's cancel comes right away (nothing in flight), so D frees at once.
    assert_eq!(pair.d_releases.len(), 1);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Failed);
}

#[test]
fn push_rejected_before_reservation_releases_p_at_once() {
    let mut pair = push_pair();
    let id = hid(66);
    pair.d_push_arrives(id);
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Rejected, pair.now);
    pair.pump();
    // P had not even started: the release is staged and applied at creation.
    pair.p
        .create_handoff(id, vec![1], TransferMode::Push, pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Rejected);
}

#[test]
fn a_delayed_grant_is_anchored_at_the_heartbeat_send_time() {
    // A grant reply that spends seconds in the network must not stretch D's view of the lease
    // past P's: D measures the grant from the moment it *sent* the heartbeat (rule 2).
    let d_cfg = ConsumerConfig {
        read_timeout: Duration::from_secs(600),
        ..Default::default()
    };
    let mut p = ProducerLedger::new(ProducerConfig::default());
    let mut d = ConsumerLedger::new(d_cfg.clone());
    let id = hid(70);
    let t0 = ms(1000);
    p.create_handoff(id, vec![1, 2], TransferMode::Pull, t0)
        .unwrap();
    let inc = IncomingHandoff {
        handoff: id,
        epoch: Epoch::FIRST,
        peer: P_PEER,
        p_tp: 1,
        mode: TransferMode::Pull,
        p_blocks: vec![1, 2],
        num_tokens: 20,
    };
    d.on_request_arrived(RequestId(1), inc, t0).unwrap();
    d.on_blocks_allocated(id, vec![8, 9], t0).unwrap();
    d.handle_timeout(t0);
    let (_, hb) = d.poll_message().expect("heartbeat sent on arrival");
    let (_, query) = d.poll_message().expect("D asks P for the blocks");
    assert!(matches!(query, Message::BlocksQuery(_)), "{query:?}");
    p.handle_message(D_PEER, hb, t0);
    p.handle_message(D_PEER, query, t0);
    let (_, reply) = p.poll_message().expect("grant");
    let Message::GrantBatch(g) = &reply else {
        panic!("expected a grant, got {reply:?}")
    };
    let (_, blocks) = p.poll_message().expect("P names the blocks");
    d.handle_message(P_PEER, blocks, t0);
    let lease = ms(g.grants[0].lease_ms as u64);
    // The reply arrives 4 s late.
    let late = t0 + Duration::from_secs(4);
    d.handle_message(P_PEER, reply, late);
    let Some(ConsumerAction::StartRead(read)) = d.poll_action() else {
        panic!("the grant is still valid: the read starts")
    };
    assert_eq!(read.deadline, t0 + lease + d_cfg.read_grace);
}

#[test]
fn a_release_from_someone_other_than_the_reader_only_ends_the_lease() {
    // The proxy thinks D never got the request, but D did and is reading: P must fence.
    let mut pair = Pair::default_pair();
    let id = hid(80);
    let read = start_pull(&mut pair, id, 1);
    let proxy = PeerId(99);
    pair.p.handle_message(
        proxy,
        Message::Release(Release {
            handoff: id,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        }),
        pair.now,
    );
    assert!(pair.p.poll_release().is_none(), "a READ may be in flight");
    // The read completes: now nothing is in flight.
    pair.complete_read(&read);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Aborted);
    // Without a reader, the same release frees at once.
    let other = hid(81);
    pair.p
        .create_handoff(other, vec![50], TransferMode::Pull, pair.now)
        .unwrap();
    pair.p.handle_message(
        proxy,
        Message::Release(Release {
            handoff: other,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        }),
        pair.now,
    );
    assert_eq!(pair.p.poll_release().unwrap().handoff, other);
}
