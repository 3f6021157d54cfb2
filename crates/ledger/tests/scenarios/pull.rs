//! Pull: the lifecycle, leases and heartbeats, notifications early, late and twice, epochs and retries, aborts, siblings, TP mismatch, prefix-cache hits.

use super::*;

#[test]
fn normal_pull() {
    let mut pair = Pair::default_pair();
    let id = hid(1);
    let read = start_pull(&mut pair, id, 1);
    assert_eq!(read.src_blocks, BLOCKS.to_vec());
    assert_eq!(read.dst_blocks, vec![100, 101, 102, 103]);
    assert!(
        pair.p_released(id).is_none(),
        "P keeps the blocks while the read runs"
    );
    pair.advance(ms(5));
    pair.complete_read(&read);
    let rel = pair
        .p_released(id)
        .expect("P frees as soon as the read is done");
    assert_eq!(rel.reason, EndReason::Done);
    assert_eq!(rel.blocks, BLOCKS.to_vec());
    assert_eq!(
        pair.outcomes,
        vec![Outcome::Ready {
            handoff: id,
            requests: vec![RequestId(1)],
            blocks: vec![100, 101, 102, 103],
            waited: WaitTimeline {
                blocks_answer: Some(ms(0)),
                admission: ms(0),
                to_transfer: Some(ms(0)),
                transfer: ms(5),
            },
            p_digest: None,
            num_tokens: 64,
            peer: P_PEER,
            cached: vec![],
        }]
    );
    assert!(
        pair.d_releases.is_empty(),
        "D's blocks now belong to the decoding request"
    );
    assert!(pair.p.is_empty() && pair.d.is_empty());
    assert_eq!(pair.p.held_blocks(), 0);
}

#[test]
fn the_ready_outcome_says_where_the_wait_went() {
    let mut pair = Pair::default_pair();
    let id = hid(2);
    pull_arrives(&mut pair, id, 1);
    // D asks P at once; P's block list comes back with its grant.
    pair.advance(ms(3));
    // The request waits in D's queue a while longer before it gets blocks.
    pair.advance(ms(9));
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
    let read = pair.reads.last().cloned().expect("read started");
    pair.advance(ms(4));
    pair.complete_read(&read);
    let Some(Outcome::Ready { waited, .. }) = pair.outcomes.first() else {
        panic!("{:?}", pair.outcomes);
    };
    let answer = waited.blocks_answer.expect("pull: P's answer timed");
    assert!(answer <= ms(3), "{waited:?}");
    assert_eq!(waited.admission, ms(12));
    assert_eq!(
        waited.to_transfer,
        Some(ms(0)),
        "a valid grant: read at once"
    );
    assert_eq!(waited.transfer, ms(4));
}

#[test]
fn heartbeat_keeps_lease_alive_past_first_expiry() {
    let mut pair = Pair::default_pair();
    let id = hid(2);
    let initial = pair.p.config().initial_lease;
    pair.p
        .create_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    // D has the request queued (not admitted): it heartbeats from its own timer.
    let inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    pair.d
        .on_request_arrived(RequestId(1), inc, pair.now)
        .unwrap();
    pair.advance(initial * 3);
    assert!(
        pair.p_released(id).is_none(),
        "heartbeats extended the lease"
    );
    assert!(pair.count("D>P", "heartbeat") >= 50);
    // Once admitted the read starts at once on the renewed grant.
    pair.d.on_blocks_allocated(id, vec![7], pair.now).unwrap();
    pair.pump();
    assert_eq!(pair.reads.len(), 1);
}

#[test]
fn d_crash_reclaims_after_lease_plus_grace_and_not_before() {
    let mut pair = Pair::default_pair();
    let id = hid(3);
    pull_arrives(&mut pair, id, 1);
    pair.advance(Duration::from_secs(20));
    // D crashes silently (no transport event): its last heartbeat was at most one interval ago.
    pair.d_alive = false;
    let last_hb = pair.last("D>P", "heartbeat").unwrap();
    let cfg = pair.p.config().clone();
    let not_before = last_hb + cfg.heartbeat_extension + cfg.fence_grace;
    let released = pair.advance_until(Duration::from_secs(60), |p| p.p_released(id).is_some());
    assert!(released);
    assert!(
        pair.now + ms(1) >= not_before,
        "released at {:?}, before lease + grace {:?}",
        pair.now,
        not_before
    );
    assert!(
        pair.now <= not_before + cfg.heartbeat_extension,
        "released too late: {:?}",
        pair.now
    );
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Expired);
}

#[test]
fn d_crash_never_releases_during_the_fence() {
    let mut pair = Pair::default_pair();
    let id = hid(4);
    pair.advance(ms(100));
    let read = start_pull(&mut pair, id, 1);
    pair.advance(Duration::from_secs(4));
    assert!(pair.p_released(id).is_none());
    // D crashed right after a heartbeat, with a read in flight: P must wait for the lease and
    // then the whole fence grace, never less.
    pair.d_alive = false;
    let cfg = pair.p.config().clone();
    let last_hb = pair.last("D>P", "heartbeat").unwrap();
    let lease_end = (ms(100) + cfg.initial_lease).max(last_hb + cfg.heartbeat_extension);
    pair.advance_until(Duration::from_secs(60), |p| p.p_released(id).is_some());
    assert_eq!(pair.now, lease_end + cfg.fence_grace);
    // D's read deadline always ends before P's fence.
    let d_cfg = pair.d.config();
    assert!(read.deadline < ms(100) + cfg.initial_lease + cfg.fence_grace);
    assert!(d_cfg.read_grace < cfg.fence_grace);
}

#[test]
fn peer_dead_reclaims_at_once() {
    let mut pair = Pair::default_pair();
    let id = hid(5);
    let _read = start_pull(&mut pair, id, 1);
    pair.advance(ms(3));
    pair.p.handle_peer_dead(D_PEER, pair.now);
    pair.pump();
    let rel = pair
        .p_released(id)
        .expect("released on the dead-peer event");
    assert_eq!(rel.reason, EndReason::PeerDead);
    assert_eq!(rel.held_for, ms(3));
}

#[test]
fn hard_cap_reclaims_a_d_that_heartbeats_but_never_pulls() {
    let p_cfg = ProducerConfig {
        hard_cap: Duration::from_secs(20),
        ..Default::default()
    };
    let d_cfg = ConsumerConfig {
        wait_deadline: Duration::from_secs(600),
        ..Default::default()
    };
    let mut pair = Pair::new(p_cfg.clone(), d_cfg);
    let id = hid(6);
    pull_arrives(&mut pair, id, 1);
    pair.advance(p_cfg.hard_cap - ms(1));
    assert!(pair.p_released(id).is_none());
    pair.advance(p_cfg.fence_grace + ms(2));
    let rel = pair.p_released(id).expect("capped");
    assert_eq!(rel.reason, EndReason::Capped);
    // D learns at its next heartbeat that P is gone and gives up at once.
    pair.advance(Duration::from_secs(1));
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::HandoffGone,
            ..
        }]
    ));
    assert!(pair.d.is_empty());
}

#[test]
fn notification_before_registration_settles_on_registration() {
    let mut pair = Pair::default_pair();
    // A release (D rejected the request) and a "read completion" arrive before P created them.
    let (a, b) = (hid(7), hid(8));
    pair.p.handle_message(
        D_PEER,
        Message::Release(Release {
            handoff: a,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Rejected,
        }),
        pair.now,
    );
    pair.p.handle_message(D_PEER, read_all(b), pair.now);
    assert_eq!(pair.p.staged_messages(), 2);
    pair.now += ms(40);
    pair.p
        .create_handoff(a, vec![1], TransferMode::Pull, pair.now)
        .unwrap();
    pair.p
        .create_handoff(b, vec![2], TransferMode::Pull, pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.p_released(a).unwrap().reason, EndReason::Rejected);
    // A completion can only come from the reader P named the blocks to, which cannot happen
    // before the handoff exists: this one is no read's, and frees nothing.
    assert!(pair.p_released(b).is_none());
    assert_eq!(pair.p.stats().not_from_reader, 1);
    assert_eq!(pair.p.staged_messages(), 0);
    assert_eq!(pair.p.held_blocks(), 1);
}

#[test]
fn early_notifications_are_bounded_by_count_and_age() {
    let cfg = ProducerConfig {
        staging_capacity: 8,
        staging_ttl: Duration::from_secs(1),
        ..Default::default()
    };
    let mut p = ProducerLedger::new(cfg);
    for i in 0..100 {
        p.handle_message(
            D_PEER,
            Message::Release(Release {
                handoff: hid(1000 + i),
                epoch: Epoch::FIRST,
                reason: ReleaseReason::Aborted,
            }),
            ms(i as u64),
        );
        assert!(p.staged_messages() <= 8);
    }
    p.handle_timeout(Duration::from_secs(5));
    assert_eq!(p.staged_messages(), 0, "staged messages expire");
    // An expired early release no longer applies: the handoff lives on its lease.
    p.create_handoff(
        hid(1099),
        vec![1],
        TransferMode::Pull,
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(p.poll_release().is_none());
}

#[test]
fn duplicate_and_late_notifications_change_nothing() {
    let mut pair = Pair::default_pair();
    let id = hid(9);
    let read = start_pull(&mut pair, id, 1);
    // A duplicated completion before the real end counts once.
    pair.complete_read(&read);
    assert_eq!(pair.p_releases.len(), 1);
    let late_before = pair.p.stats().late_notifications;
    // Late duplicates of everything D ever sent.
    for n in &read.done {
        pair.p
            .handle_message(D_PEER, Message::PullDone(*n), pair.now);
    }
    pair.p.handle_message(
        D_PEER,
        Message::Release(Release {
            handoff: id,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        }),
        pair.now,
    );
    pair.p.handle_message(
        D_PEER,
        Message::Heartbeat(Heartbeat {
            seq: 99,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![HeartbeatEntry {
                handoff: id,
                epoch: Epoch::FIRST,
            }],
        }),
        pair.now,
    );
    pair.pump();
    assert_eq!(pair.p_releases.len(), 1, "still exactly one release");
    assert_eq!(
        pair.p.staged_messages(),
        0,
        "late messages are not staged as early"
    );
    assert!(pair.p.stats().late_notifications > late_before);
    assert!(pair
        .p
        .create_handoff(id, vec![1], TransferMode::Pull, pair.now)
        .is_err());
    // The late heartbeat was answered "gone", which D ignores (request already served).
    assert_eq!(pair.outcomes.len(), 1);
}

#[test]
fn stale_epoch_is_ignored() {
    let mut pair = Pair::default_pair();
    let id = hid(10);
    pair.p
        .create_handoff(id, vec![1], TransferMode::Pull, pair.now)
        .unwrap();
    pair.p.handle_message(
        D_PEER,
        Message::Release(Release {
            handoff: id,
            epoch: Epoch(7),
            reason: ReleaseReason::Aborted,
        }),
        pair.now,
    );
    assert!(pair.p.poll_release().is_none());
    assert_eq!(pair.p.stats().stale_epoch, 1);
}

#[test]
fn rejection_and_abort_before_admission_release_at_once() {
    for (req, reason, end) in [
        (1, ReleaseReason::Rejected, EndReason::Rejected),
        (2, ReleaseReason::Aborted, EndReason::Aborted),
    ] {
        let mut pair = Pair::default_pair();
        let id = hid(20 + req as u128);
        pull_arrives(&mut pair, id, req);
        pair.pump();
        pair.now += ms(2);
        pair.d.on_request_ended(RequestId(req), reason, pair.now);
        pair.pump();
        let rel = pair
            .p_released(id)
            .expect("released without waiting for any lease");
        assert_eq!(rel.reason, end);
        assert_eq!(rel.held_for, ms(2));
        assert!(pair.reads.is_empty());
        assert!(pair.d.is_empty());
    }
}

#[test]
fn abort_during_read_cancels_the_read_and_frees_both_sides_once_it_ended() {
    let mut pair = Pair::default_pair();
    let id = hid(23);
    start_pull(&mut pair, id, 1);
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    assert_eq!(
        pair.cancelled_reads,
        vec![id],
        "nobody wants the KV: the READ is cancelled at once, not left to run to its end"
    );
    assert!(
        pair.p_released(id).is_none(),
        "the READ may still be in flight: P must not free yet"
    );
    assert!(
        pair.d_releases.is_empty(),
        "D's blocks may still be written by the READ"
    );
    // The transport reports the cancelled READ ended (nothing landed, no PullDone rode on it).
    pair.now += ms(3);
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    let p_rel = pair.p_released(id).expect("P frees once the READ ended");
    assert_eq!(p_rel.reason, EndReason::Aborted);
    assert_eq!(pair.d_releases.len(), 1);
    assert_eq!(pair.d_releases[0].reason, EndReason::Aborted);
    assert!(
        pair.outcomes.is_empty(),
        "an aborted request gets no outcome"
    );
    assert!(pair.d.is_empty());
}

#[test]
fn abort_during_a_read_that_lands_anyway_frees_both_sides_once() {
    let mut pair = Pair::default_pair();
    let id = hid(24);
    let read = start_pull(&mut pair, id, 1);
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_none());
    // The READ had landed before the cancel reached it.
    pair.complete_read(&read);
    assert!(pair.p_released(id).is_some());
    assert_eq!(pair.p_releases.len(), 1, "P frees once");
    assert_eq!(pair.d_releases.len(), 1);
    assert!(pair.outcomes.is_empty());
}

#[test]
fn n8_siblings_cause_one_pull_and_one_release() {
    let mut pair = Pair::default_pair();
    let id = hid(30);
    pair.p
        .create_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    for r in 0..8 {
        let inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
        pair.d
            .on_request_arrived(RequestId(r), inc, pair.now)
            .unwrap();
    }
    pair.pump();
    pair.d
        .on_blocks_allocated(id, vec![5, 6, 7, 8], pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.reads.len(), 1, "one pull for eight siblings");
    let read = pair.reads[0].clone();
    // One sibling is aborted mid-read; the others still get the KV.
    pair.d
        .on_request_ended(RequestId(3), ReleaseReason::Aborted, pair.now);
    pair.complete_read(&read);
    assert_eq!(pair.p_releases.len(), 1, "one release on P");
    match &pair.outcomes[..] {
        [Outcome::Ready { requests, .. }] => {
            assert_eq!(requests.len(), 7);
            assert!(!requests.contains(&RequestId(3)));
        }
        other => panic!("unexpected outcomes {other:?}"),
    }
    assert_eq!(pair.p.stats().created, 1);
}

#[test]
fn d_tp4_p_tp2_needs_two_consumers_per_p_rank() {
    let mut pair = Pair::new(
        ProducerConfig {
            tp: 2,
            ..Default::default()
        },
        ConsumerConfig {
            tp: 4,
            ..Default::default()
        },
    );
    let id = hid(40);
    let read = start_pull(&mut pair, id, 1);
    assert_eq!(read.done.len(), 4);
    assert!(read.done.iter().all(|n| n.consumers == 2));
    // Three of four consumers done (one of them twice): not yet.
    for n in &read.done[..3] {
        pair.p
            .handle_message(D_PEER, Message::PullDone(*n), pair.now);
    }
    pair.p
        .handle_message(D_PEER, Message::PullDone(read.done[0]), pair.now);
    assert!(
        pair.p.poll_release().is_none(),
        "P rank 1 still has a reader"
    );
    pair.p
        .handle_message(D_PEER, Message::PullDone(read.done[3]), pair.now);
    assert_eq!(pair.p.poll_release().unwrap().reason, EndReason::Done);
}

#[test]
fn p_tp4_d_tp2_needs_one_consumer_on_each_p_rank() {
    let mut pair = Pair::new(
        ProducerConfig {
            tp: 4,
            ..Default::default()
        },
        ConsumerConfig {
            tp: 2,
            ..Default::default()
        },
    );
    let id = hid(41);
    let read = start_pull(&mut pair, id, 1);
    assert_eq!(read.done.len(), 4);
    let ranks: std::collections::BTreeSet<u16> = read.done.iter().map(|n| n.p_rank).collect();
    assert_eq!(ranks.len(), 4);
    for n in &read.done[..3] {
        pair.p
            .handle_message(D_PEER, Message::PullDone(*n), pair.now);
    }
    assert!(pair.p.poll_release().is_none());
    pair.complete_read(&read);
    assert_eq!(pair.p_releases.len(), 1);
}

#[test]
fn read_finishing_after_grant_plus_grace_is_a_failure() {
    let mut pair = Pair::default_pair();
    let id = hid(50);
    let read = start_pull(&mut pair, id, 1);
    // The read ends past its deadline (grant + grace), with no timer tick in between.
    pair.now = read.deadline + ms(1);
    for n in &read.done {
        pair.p
            .handle_message(D_PEER, Message::PullDone(*n), pair.now);
    }
    pair.d.on_read_done(id, 0, true, pair.now);
    pair.pump();
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::ReadAfterGrace,
            ..
        }]
    ));
    assert_eq!(pair.d_releases.len(), 1, "D's blocks go back, unused");
}

#[test]
fn read_that_hangs_is_cancelled_and_its_blocks_quarantined() {
    let d_cfg = ConsumerConfig {
        failure_policy: FailurePolicy::Fail,
        ..Default::default()
    };
    let mut pair = Pair::new(ProducerConfig::default(), d_cfg);
    let id = hid(51);
    let read = start_pull(&mut pair, id, 1);
    pair.advance_until(Duration::from_secs(10), |p| !p.outcomes.is_empty());
    assert!(pair.now >= read.deadline);
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Failed {
            reason: FailReason::ReadTimedOut,
            ..
        }]
    ));
    assert_eq!(pair.cancelled_reads, vec![id]);
    assert!(
        pair.d_releases.is_empty(),
        "the READ may still land: blocks stay quarantined"
    );
    // The transport confirms the read ended: now D frees and tells P.
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    assert_eq!(pair.d_releases.len(), 1);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Failed);
}

/// A read the transport reported failed is tried once more under the next epoch. The first
/// attempt's `PullDone` may still be on its way to P (it rides on the READ, which can land while
/// D's side of the transfer reports an error): arriving during the retry, it must not make P
/// free blocks the retry is reading (rule 2), and a grant of the old epoch must not start it.
#[test]
fn a_failed_read_is_retried_under_the_next_epoch_and_old_messages_do_not_count() {
    let mut pair = Pair::default_pair();
    let id = hid(60);
    let first = start_pull(&mut pair, id, 1);
    assert_eq!(first.epoch, Epoch::FIRST);
    let old_grant = pair
        .log
        .iter()
        .rev()
        .find_map(|(_, dir, m)| match m {
            Message::GrantBatch(g) if *dir == "P>D" && !g.grants.is_empty() => Some(m.clone()),
            _ => None,
        })
        .expect("the first read started on a grant");
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    assert!(
        pair.outcomes.is_empty(),
        "the request waits for the retry, it is not recomputed yet"
    );
    assert!(pair.d_releases.is_empty() && pair.p_released(id).is_none());
    assert_eq!(pair.d.stats().read_retries, 1);
    let retry = pair.reads.last().cloned().unwrap();
    assert_eq!(
        pair.reads.len(),
        2,
        "P adopted the new epoch and granted it"
    );
    assert_eq!(retry.epoch, Epoch::FIRST.next());
    assert!(retry.done.iter().all(|n| n.epoch == retry.epoch));

    // The first attempt's completion arrives now: stale, counted, nothing freed.
    for n in &first.done {
        pair.p
            .handle_message(D_PEER, Message::PullDone(*n), pair.now);
    }
    pair.pump();
    assert!(
        pair.p_released(id).is_none(),
        "a completion of the failed attempt freed P's blocks under the retry's READ"
    );
    assert_eq!(pair.p.stats().stale_epoch, first.done.len() as u64);
    // An old grant is stale too and starts nothing.
    pair.d.handle_message(P_PEER, old_grant, pair.now);
    pair.pump();
    assert_eq!(pair.reads.len(), 2);
    assert_eq!(pair.d.stats().stale_epoch, 1);

    pair.advance(ms(5));
    pair.complete_read(&retry);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
    assert!(pair.p.is_empty() && pair.d.is_empty());
}

/// One retry only: a second failure recomputes, and D's release (under the new epoch) frees P.
#[test]
fn a_read_that_fails_again_is_recomputed_and_released_under_its_epoch() {
    let mut pair = Pair::default_pair();
    let id = hid(61);
    start_pull(&mut pair, id, 1);
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    let retry = pair.reads.last().cloned().unwrap();
    assert_eq!(retry.epoch, Epoch::FIRST.next());
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::ReadFailed,
            ..
        }]
    ));
    assert_eq!(pair.reads.len(), 2, "no third attempt");
    assert_eq!(pair.d_releases.len(), 1);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Failed);
    assert_eq!(pair.p.stats().stale_epoch, 0);
}

/// Only the reader moves a handoff's epoch, one step at a time: anyone else's heartbeat under a
/// new epoch is stale and renews nothing.
#[test]
fn only_the_reader_moves_the_epoch() {
    let mut pair = Pair::default_pair();
    let id = hid(62);
    start_pull(&mut pair, id, 1);
    let other = PeerId(77);
    for epoch in [Epoch::FIRST.next(), Epoch(9)] {
        pair.p.handle_message(
            other,
            Message::Heartbeat(Heartbeat {
                seq: 1,
                mode: handoff_proto::TransferMode::Pull,
                entries: vec![HeartbeatEntry { handoff: id, epoch }],
            }),
            pair.now,
        );
    }
    assert_eq!(pair.p.stats().stale_epoch, 2);
    while pair.p.poll_message().is_some() {}
    // The reader skipping an epoch (or moving to one P cannot follow) is told "gone" at once,
    // rather than left waiting for a grant that will never come.
    pair.p.handle_message(
        D_PEER,
        Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![HeartbeatEntry {
                handoff: id,
                epoch: Epoch(3),
            }],
        }),
        pair.now,
    );
    assert_eq!(pair.p.stats().stale_epoch, 2);
    let Some((_, Message::GrantBatch(g))) = pair.p.poll_message() else {
        panic!("the reader gets an answer");
    };
    assert!(g.grants.is_empty());
    assert_eq!(g.gone.len(), 1);
}

/// A retry that finds the handoff already ended (the first attempt's completions reached P
/// although D's side reported failure) hears "gone" at once instead of waiting its deadline.
#[test]
fn a_retry_of_a_handoff_p_already_freed_hears_gone() {
    let mut pair = Pair::default_pair();
    let id = hid(65);
    let first = start_pull(&mut pair, id, 1);
    for n in &first.done {
        pair.p
            .handle_message(D_PEER, Message::PullDone(*n), pair.now);
    }
    pair.pump();
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    assert!(
        matches!(
            pair.outcomes.as_slice(),
            [Outcome::Recompute {
                reason: FailReason::HandoffGone,
                ..
            }]
        ),
        "{:?}",
        pair.outcomes
    );
    assert_eq!(pair.d_releases.len(), 1);
}

/// A client can write any `remote_block_ids` into its request to D (another request's blocks,
/// to read that KV). D reads only the blocks P names for the handoff, and P names them only to
/// the D that reads it.
#[test]
fn d_reads_the_blocks_p_names_not_those_the_client_claims() {
    let mut pair = Pair::default_pair();
    let id = hid(63);
    pair.p
        .create_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    inc.p_blocks = vec![500, 501, 502, 503]; // someone else's KV
    pair.d
        .on_request_arrived(RequestId(1), inc, pair.now)
        .unwrap();
    pair.pump();
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
    let read = pair.reads.last().cloned().expect("the read starts");
    assert_eq!(
        read.src_blocks,
        BLOCKS.to_vec(),
        "D read the client's block ids"
    );
    assert_eq!(pair.d.stats().client_blocks_replaced, 1);

    // Another D that knows the handoff id asks for its blocks: no answer.
    let other = PeerId(77);
    pair.p.handle_message(
        other,
        Message::BlocksQuery(handoff_proto::BlocksQuery {
            entries: vec![HeartbeatEntry {
                handoff: id,
                epoch: Epoch::FIRST,
            }],
        }),
        pair.now,
    );
    assert!(pair.p.poll_message().is_none());
    assert_eq!(pair.p.stats().blocks_refused, 1);
}

/// No read starts on the client's word alone: until P's answer comes, D waits (and asks again
/// with every heartbeat, so a lost answer costs one interval, not the request).
#[test]
fn no_read_starts_before_p_names_the_blocks() {
    let mut pair = Pair::default_pair();
    let id = hid(64);
    pull_arrives(&mut pair, id, 1);
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    // Deliver D's heartbeat and let P's grant through, but lose P's answer naming the blocks.
    pair.d.handle_timeout(pair.now);
    let mut asked = 0;
    while let Some((_, m)) = pair.d.poll_message() {
        asked += matches!(m, Message::BlocksQuery(_)) as usize;
        pair.p.handle_message(D_PEER, m, pair.now);
    }
    assert_eq!(asked, 1);
    while let Some((_, m)) = pair.p.poll_message() {
        if !matches!(m, Message::PullBlocks(_)) {
            pair.d.handle_message(P_PEER, m, pair.now);
        }
    }
    assert!(
        pair.d.poll_action().is_none(),
        "a read started on the client's block ids"
    );
    // The next heartbeat asks again; this time the answer arrives and the read starts.
    let interval = pair.d.config().heartbeat_interval;
    pair.advance(interval);
    assert_eq!(pair.reads.len(), 1);
    assert_eq!(pair.reads[0].src_blocks, BLOCKS.to_vec());
}

#[test]
fn p_dead_fails_waiting_requests_per_policy() {
    let mut pair = Pair::default_pair();
    let id = hid(52);
    pull_arrives(&mut pair, id, 1);
    pair.pump();
    pair.d.handle_peer_dead(P_PEER, pair.now);
    pair.pump();
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::PeerDead,
            ..
        }]
    ));
    assert!(pair.d.is_empty());
}

#[test]
fn silent_p_ends_the_request_within_its_wait_deadline() {
    let mut pair = Pair::default_pair();
    pair.p_alive = false;
    let id = hid(53);
    let inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    pair.d
        .on_request_arrived(RequestId(1), inc, pair.now)
        .unwrap();
    pair.d
        .on_blocks_allocated(id, vec![1, 2], pair.now)
        .unwrap();
    let deadline = pair.d.config().wait_deadline;
    pair.advance(deadline - ms(1));
    assert!(pair.outcomes.is_empty());
    pair.advance(ms(2));
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::DeadlineExceeded,
            ..
        }]
    ));
    assert_eq!(pair.d_releases.len(), 1);
}

/// D's ledger never handed `block` (a prefix-cache block) back to the engine.
fn d_never_gave_back(pair: &Pair, block: u32) {
    let d_blocks: Vec<u32> = pair
        .d_releases
        .iter()
        .flat_map(|r| r.blocks.clone())
        .collect();
    assert!(
        !d_blocks.contains(&block),
        "D's ledger gave back a cached block: {d_blocks:?}"
    );
}

/// D's prefix cache holds the prompt's first block: the read names it as cached (never a
/// destination), and only the request's own blocks come back when the handoff ends.
#[test]
fn a_read_after_a_prefix_cache_hit_never_targets_the_cached_blocks() {
    let mut pair = Pair::default_pair();
    let id = hid(90);
    pull_arrives(&mut pair, id, 1);
    pair.pump();
    pair.d
        .on_blocks_allocated_after_cached(id, vec![70], vec![71, 72], pair.now)
        .unwrap();
    pair.pump();
    let read = pair.reads.last().cloned().expect("a read");
    assert_eq!(read.cached_blocks, vec![70]);
    assert_eq!(read.dst_blocks, vec![71, 72]);
    pair.complete_read(&read);
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
    d_never_gave_back(&pair, 70);
}

/// Push after a prefix-cache hit on D: D registers only the request's own blocks and says how
/// many of the prompt's blocks it holds already; P's write carries that count (so it writes from
/// the token after them), never names the cached block, and D's ledger never gives it back.
#[test]
fn a_push_after_a_prefix_cache_hit_registers_and_writes_only_the_rest() {
    let mut pair = push_pair();
    let id = hid(91);
    pair.p
        .create_handoff(id, vec![1, 2], TransferMode::Push, pair.now)
        .unwrap();
    pair.d_push_arrives(id);
    pair.d
        .on_blocks_allocated_after_cached(id, vec![70], vec![71], pair.now)
        .unwrap();
    pair.pump();
    let registered: Vec<(Vec<u32>, u32)> = pair
        .log
        .iter()
        .filter_map(|(_, dir, m)| match m {
            Message::PushRegister(r) if *dir == "D>P" => {
                Some((r.block_ids.clone(), r.cached_blocks))
            }
            _ => None,
        })
        .collect();
    assert_eq!(registered, vec![(vec![71], 1)]);
    let write = pair.writes.last().cloned().expect("a granted write");
    assert_eq!(
        (write.dst_blocks.clone(), write.cached_blocks),
        (vec![71], 1)
    );
    pair.complete_write(&write);
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Ready { blocks, cached, .. }] if blocks == &vec![71] && cached == &vec![70]
    ));
    d_never_gave_back(&pair, 70);
}
