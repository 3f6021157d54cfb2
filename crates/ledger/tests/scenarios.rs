//! One named scenario per case of the lifecycle: each drives a P ledger and a D ledger through a
//! script on a simulated clock and checks what a P/D cluster relies on.

mod common;

use std::time::Duration;

use common::*;
use handoff_ledger::*;
use handoff_proto::{
    Epoch, Grant, GrantBatch, Heartbeat, HeartbeatEntry, Message, PullDone, PushCancel,
    PushRegister, Release, ReleaseReason, TransferMode,
};

const BLOCKS: [u32; 4] = [10, 11, 12, 13];

/// P creates `id` (pull, on `BLOCKS`), then request `req` naming it arrives at D.
/// D's `PullDone` for a handoff of one P rank read by one D rank: it read everything.
fn read_all(id: handoff_proto::HandoffId) -> Message {
    Message::PullDone(PullDone {
        handoff: id,
        epoch: Epoch::FIRST,
        p_rank: 0,
        consumer_rank: 0,
        consumers: 1,
    })
}

fn pull_arrives(pair: &mut Pair, id: handoff_proto::HandoffId, req: u64) {
    pair.p
        .create_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    let inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    pair.d
        .on_request_arrived(RequestId(req), inc, pair.now)
        .unwrap();
}

/// P creates, D arrives and is admitted: returns the read D starts.
fn start_pull(pair: &mut Pair, id: handoff_proto::HandoffId, req: u64) -> StartRead {
    pull_arrives(pair, id, req);
    pair.pump();
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
    pair.reads
        .last()
        .cloned()
        .expect("a granted, admitted handoff starts its read")
}

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

// ----- push -----

fn push_pair() -> Pair {
    let mut pair = Pair::default_pair();
    pair.d = ConsumerLedger::new(ConsumerConfig {
        push_deadline: Duration::from_secs(5),
        ..Default::default()
    });
    pair
}

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

// ----- rule 2 on D's side: when a read may start -----

/// The end of the last grant sent for `id` in direction `dir` ("P>D": P's lease on its blocks
/// to D; "D>P": D's on a push registration to P), as its sender measured it (= the pair's clock).
fn last_grant_end(pair: &Pair, dir: &str, id: handoff_proto::HandoffId) -> Option<Duration> {
    pair.log
        .iter()
        .rev()
        .filter(|(_, d, _)| *d == dir)
        .find_map(|(t, _, m)| match m {
            Message::GrantBatch(g) => g
                .grants
                .iter()
                .find(|g| g.handoff == id)
                .map(|g| *t + ms(g.lease_ms as u64)),
            _ => None,
        })
}

#[test]
fn no_read_starts_on_an_expired_grant() {
    // D got a grant, then heard nothing more from P (a partition): P's lease ran out, P fenced
    // and reused the blocks. A request admitted now must not READ them, whatever it was granted.
    let mut pair = Pair::default_pair();
    let id = hid(90);
    pull_arrives(&mut pair, id, 1);
    pair.pump();
    let grant_end = last_grant_end(&pair, "P>D", id).expect("D's first heartbeat was granted");
    pair.p_alive = false;
    let p_cfg = pair.p.config().clone();
    pair.advance_until(Duration::from_secs(60), |p| p.p_released(id).is_some());
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Expired);
    assert_eq!(pair.now, grant_end + p_cfg.fence_grace);
    // Admitted after P reused the blocks: D's grant ended long ago, so no read.
    pair.advance(ms(10));
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
    assert!(
        pair.reads.is_empty(),
        "a READ started at {:?} on a grant that ended at {grant_end:?}",
        pair.now
    );
    // The partition heals: P says the handoff is gone and D recomputes, never having read.
    pair.p_alive = true;
    pair.advance_until(Duration::from_secs(5), |p| !p.outcomes.is_empty());
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::HandoffGone,
            ..
        }]
    ));
    assert!(pair.reads.is_empty());
    assert_eq!(pair.d_releases.len(), 1, "D's blocks go back, unused");
}

#[test]
fn no_read_starts_inside_the_read_margin() {
    // D is admitted while its grant (= P's lease) still runs, but for less than the read margin:
    // a READ started now could still be running when P's lease ends. D must wait for a renewed
    // grant instead.
    let mut pair = Pair::default_pair();
    let id = hid(91);
    let margin = pair.d.config().read_margin;
    let hb = pair.d.config().heartbeat_interval;
    pair.p
        .create_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    // D learns of the request a little later, so that one of its heartbeats falls inside the
    // last `margin` of the grant.
    pair.advance(ms(450));
    let inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    pair.d
        .on_request_arrived(RequestId(1), inc, pair.now)
        .unwrap();
    pair.pump();
    let grant_end = last_grant_end(&pair, "P>D", id).expect("D's first heartbeat was granted");
    assert_eq!(grant_end, pair.p.config().initial_lease);
    // Heartbeats go every `hb` from arrival; the last before the grant ends is inside the margin.
    let arrived = pair.now;
    let hb_in_margin = arrived + hb * ((grant_end - arrived).as_millis() / hb.as_millis()) as u32;
    assert!(hb_in_margin < grant_end && hb_in_margin + margin > grant_end);
    // A partition until just before that heartbeat: P's lease is not renewed.
    pair.p_alive = false;
    let admit_at = hb_in_margin - ms(50);
    pair.advance(admit_at - pair.now);
    assert!(grant_end > pair.now && grant_end <= pair.now + margin);
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
    assert!(
        pair.reads.is_empty(),
        "a READ started at {:?} with only {:?} left on P's lease (margin {margin:?})",
        pair.now,
        grant_end - pair.now
    );
    // The partition heals: the next heartbeat renews the lease and the read starts on it.
    pair.p_alive = true;
    assert!(pair.advance_until(hb, |p| !p.reads.is_empty()));
    assert_eq!(pair.now, hb_in_margin);
    let renewed = last_grant_end(&pair, "P>D", id).unwrap();
    assert!(
        renewed > pair.now + margin,
        "read on a lease ending at {renewed:?}"
    );
    let read = pair.reads[0].clone();
    pair.complete_read(&read);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
    assert!(matches!(pair.outcomes.as_slice(), [Outcome::Ready { .. }]));
}

/// Another peer that knows a handoff id (a member of the cluster, or a stale D) says it read the
/// blocks while the reader's READ runs: P must not free under that READ (rule 2). (The same
/// reader check keeps a push registration from another peer from making P write the KV to it.)
#[test]
fn completions_from_others_than_the_reader_are_ignored() {
    let mut pair = Pair::default_pair();
    let id = hid(64);
    let _read = start_pull(&mut pair, id, 1);
    let mallory = PeerId(77);
    pair.p.handle_message(mallory, read_all(id), pair.now);
    assert!(
        pair.p.poll_release().is_none(),
        "freed under the reader's READ"
    );
    assert_eq!(pair.p.held_blocks(), BLOCKS.len());
    assert_eq!(pair.p.stats().not_from_reader, 1);
}

fn acked(p: &mut ProducerLedger) -> bool {
    std::iter::from_fn(|| p.poll_message()).any(|(_, m)| matches!(m, Message::PushCancelAck(_)))
}

/// A PushCancel ends a handoff without a fence, so it counts only for a push and only from the
/// D whose registration it cancels. From another member, or for a pull (whose reader may be
/// mid-READ), it frees nothing and is not acked.
#[test]
fn a_push_cancel_from_another_peer_or_for_a_pull_frees_nothing() {
    let mallory = PeerId(77);
    let cancel = |id| {
        Message::PushCancel(PushCancel {
            handoff: id,
            epoch: Epoch::FIRST,
        })
    };
    // Pull: the reader's READ is in flight.
    let mut pair = Pair::default_pair();
    let id = hid(65);
    let _read = start_pull(&mut pair, id, 1);
    pair.p.handle_message(mallory, cancel(id), pair.now);
    pair.p.handle_message(D_PEER, cancel(id), pair.now);
    assert!(
        pair.p.poll_release().is_none(),
        "freed under the reader's READ"
    );
    assert_eq!(pair.p.held_blocks(), BLOCKS.len());
    assert!(!acked(&mut pair.p), "a cancel of a pull was acked");
    // Push: D registered and P writes into it; mallory's cancel changes nothing.
    let mut pair = push_pair();
    let id = hid(66);
    let w = pair.push_writing(id);
    pair.p.handle_message(mallory, cancel(id), pair.now);
    assert!(pair.p.poll_release().is_none(), "freed under P's WRITE");
    assert!(pair.p.contains(id));
    assert!(!acked(&mut pair.p), "mallory's cancel was acked");
    assert_eq!(pair.p.stats().not_from_reader, 1);
    // The write ends and completes the handoff as if mallory had never spoken.
    pair.complete_write(&w);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
}

/// A push handoff ends on P's own writes: a PullDone from its D (a pull's completion) frees
/// nothing while P's WRITE may still read the blocks.
#[test]
fn a_pull_done_for_a_push_frees_nothing_under_p_s_write() {
    let mut pair = push_pair();
    let id = hid(67);
    let w = pair.push_writing(id);
    pair.p.handle_message(D_PEER, read_all(id), pair.now);
    assert!(pair.p.poll_release().is_none(), "freed under P's WRITE");
    assert!(pair.p.contains(id));
    pair.complete_write(&w);
    assert_eq!(pair.p_released(id).unwrap().reason, EndReason::Done);
}

/// A member registers pushes for many made-up handoff ids: P asks it for grants only on the
/// registrations its staging kept (its quota), not one ask per message it sent.
#[test]
fn made_up_push_registrations_cost_p_no_more_asks_than_the_staging_quota() {
    let quota = 8;
    let mut p = ProducerLedger::new(ProducerConfig {
        staging_per_peer: quota,
        ..Default::default()
    });
    let mallory = PeerId(77);
    let now = ms(0);
    for n in 0..1000u128 {
        let register = PushRegister {
            handoff: hid(100_000 + n),
            epoch: Epoch::FIRST,
            d_rank: 0,
            d_tp: 1,
            num_tokens: 16,
            block_ids: vec![8],
            cached_blocks: 0,
        };
        p.handle_message(mallory, Message::PushRegister(register), now);
    }
    let mut asked = 0;
    let mut t = now;
    for _ in 0..4 {
        t += ms(300);
        p.handle_timeout(t);
        asked += std::iter::from_fn(|| p.poll_message())
            .filter_map(|(to, m)| match m {
                Message::Heartbeat(hb) if to == mallory => Some(hb.entries.len()),
                _ => None,
            })
            .sum::<usize>();
    }
    assert!(asked > 0, "P asked nothing");
    assert!(asked <= 4 * quota, "{asked} entries asked of mallory");
}

/// A member floods P with messages for made-up handoff ids. Past its staging quota its own new
/// messages are dropped and counted (it holds at most its quota of the store); and when the
/// store is full the sender holding the most loses its oldest, never another peer's. Either way
/// D's early release (it refused the request before P's prefill ended) stays staged and applies
/// when the handoff is created.
#[test]
fn one_peers_flood_of_made_up_ids_cannot_evict_anothers_early_messages() {
    let run = |per_peer: usize| {
        let mut p = ProducerLedger::new(ProducerConfig {
            staging_capacity: 64,
            staging_per_peer: per_peer,
            ..Default::default()
        });
        let early = hid(5000);
        p.handle_message(
            D_PEER,
            Message::Release(Release {
                handoff: early,
                epoch: Epoch::FIRST,
                reason: ReleaseReason::Rejected,
            }),
            ms(0),
        );
        let mallory = PeerId(66);
        for i in 0..1000 {
            p.handle_message(
                mallory,
                Message::Release(Release {
                    handoff: hid(10_000 + i),
                    epoch: Epoch::FIRST,
                    reason: ReleaseReason::Aborted,
                }),
                ms(1),
            );
            assert!(p.staged_messages() <= 64);
        }
        let staged = p.staged_messages();
        p.create_handoff(early, vec![1, 2], TransferMode::Pull, ms(2))
            .unwrap();
        (
            p.poll_release().map(|r| r.reason),
            p.stats().staged_over_quota,
            staged,
        )
    };
    // The quota: mallory keeps 16, the rest of its flood is dropped and counted.
    let (released, over, staged) = run(16);
    assert_eq!(
        released,
        Some(EndReason::Rejected),
        "D's early release was evicted"
    );
    assert_eq!((over, staged), (1000 - 16, 1 + 16));
    // Negative control of the quota: as large as the store, mallory fills it...
    let (released, over, staged) = run(64);
    assert_eq!((over, staged), (0, 64));
    // ... and eviction takes mallory's own oldest, not D's.
    assert_eq!(released, Some(EndReason::Rejected));
}

// ----- layer-wise pull -----

/// A layer-wise pull's D: its request arrives with the proxy's handoff id and no block ids, at
/// the moment P's prefill is about to start. Blocks [100..104] are allocated at once.
fn layerwise_d_arrives(pair: &mut Pair, id: handoff_proto::HandoffId) {
    let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    inc.p_blocks = Vec::new();
    pair.d
        .on_request_arrived(RequestId(1), inc, pair.now)
        .unwrap();
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
}

/// A layer-wise pull under way: D asked, P's prefill started and saved `layers` layers.
fn layerwise_reading(pair: &mut Pair, id: handoff_proto::HandoffId, layers: u32) {
    layerwise_d_arrives(pair, id);
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), pair.now)
        .unwrap();
    pair.p.layers_saved(id, layers);
    pair.pump();
}

/// The layers D has been allowed to read so far: the first read's, then every `ReadMore`'s.
fn layers_read(pair: &Pair) -> Vec<Option<u32>> {
    let mut out: Vec<Option<u32>> = pair.reads.iter().map(|r| r.layers).collect();
    out.extend(pair.read_more.iter().map(|(_, l)| *l));
    out
}

/// D asks before P's prefill starts; P answers at its start, and D reads each layer only once P
/// said it is saved. P's blocks stay out of the pool while its forward pass writes them, even
/// after D read everything; they come back when the prefill ends.
#[test]
fn a_layerwise_pull_reads_only_saved_layers_and_p_frees_after_its_prefill() {
    let mut pair = Pair::default_pair();
    let id = hid(90);
    layerwise_d_arrives(&mut pair, id);
    assert!(pair.count("D>P", "blocks_query") >= 1);
    assert!(pair.reads.is_empty());

    // P's prefill starts: the staged heartbeat and question are answered now, with no layer yet.
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.count("P>D", "pull_blocks"), 1);
    assert!(
        pair.reads.is_empty(),
        "a read started before any layer was saved"
    );

    pair.now += ms(10);
    pair.p.layers_saved(id, 2);
    pair.pump();
    assert_eq!(layers_read(&pair), vec![Some(2)]);
    assert_eq!(pair.reads[0].src_blocks, BLOCKS.to_vec());
    // The client named no blocks: nothing was replaced.
    assert_eq!(pair.d.stats().client_blocks_replaced, 0);
    // The next stage goes on a grant that still holds.
    pair.p.layers_saved(id, 4);
    pair.pump();
    assert_eq!(layers_read(&pair), vec![Some(2), Some(4)]);
    assert!(pair.d.permit_read_more(id, pair.now));

    // D read all four layers (its last stage carried the PullDone) before P's forward ended.
    let read = pair.reads[0].clone();
    pair.complete_read(&read);
    assert_eq!(pair.outcomes.len(), 1, "{:?}", pair.outcomes);
    assert!(
        pair.p_released(id).is_none(),
        "P freed blocks its prefill still writes"
    );
    assert_eq!(pair.p.len(), 1);

    pair.p.prefill_ended(id, true, pair.now);
    pair.pump();
    let rel = pair.p_released(id).expect("freed once the prefill ended");
    assert_eq!(rel.reason, EndReason::Done);
    assert_eq!(pair.p.held_blocks(), 0);
}

/// The client leaves while P still prefills: D releases at once (no read was posted), and P
/// frees the blocks when its forward pass is done with them, not before.
#[test]
fn a_release_during_a_layerwise_prefill_takes_effect_when_it_ends() {
    let mut pair = Pair::default_pair();
    let id = hid(91);
    layerwise_d_arrives(&mut pair, id);
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), pair.now)
        .unwrap();
    pair.pump();
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    assert_eq!(pair.count("D>P", "release"), 1);
    assert!(pair.p_released(id).is_none());
    // P's next list goes to no one: the handoff is over for D.
    pair.p.layers_saved(id, 1);
    pair.pump();
    assert_eq!(pair.count("P>D", "pull_blocks"), 1);

    pair.p.prefill_ended(id, true, pair.now);
    pair.pump();
    assert_eq!(
        pair.p_released(id).map(|r| r.reason),
        Some(EndReason::Aborted)
    );
}

/// P's prefill fails after D started reading its first layers: D hears "gone" at its next
/// heartbeat, stops its read and recomputes; P frees only once D said its read ended (or after
/// the fence), never under the READ.
#[test]
fn a_failed_layerwise_prefill_stops_the_read_before_p_frees() {
    let mut pair = Pair::default_pair();
    let id = hid(92);
    layerwise_reading(&mut pair, id, 1);
    assert_eq!(pair.reads.len(), 1);

    pair.p.prefill_ended(id, false, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_none(), "freed under D's READ");
    let interval = pair.d.config().heartbeat_interval;
    pair.advance(interval);
    assert_eq!(pair.cancelled_reads, vec![id]);
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::HandoffGone,
            ..
        }]
    ));
    assert!(pair.p_released(id).is_none(), "freed under D's READ");
    // The cancelled READ ends; D tells P, which frees now.
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_some());
    assert_eq!(pair.d.held_blocks(), 0);
}

/// A P that sends a list for fewer layers than before, or for other blocks, is not believed:
/// D never reads more than P said is saved, nor other blocks than P's first answer named.
#[test]
fn a_layerwise_list_that_goes_back_or_names_other_blocks_is_ignored() {
    let mut pair = Pair::default_pair();
    let id = hid(93);
    layerwise_reading(&mut pair, id, 2);
    let list = |blocks: Vec<u32>, layers| {
        Message::PullBlocks(handoff_proto::PullBlocks {
            lists: vec![handoff_proto::BlockList {
                handoff: id,
                epoch: Epoch::FIRST,
                blocks,
                digest: None,
                layers,
            }],
        })
    };
    let ignored = pair.d.stats().ignored;
    pair.d
        .handle_message(P_PEER, list(BLOCKS.to_vec(), Some(1)), pair.now);
    pair.d
        .handle_message(P_PEER, list(vec![500, 501, 502, 503], Some(3)), pair.now);
    pair.d
        .handle_message(P_PEER, list(BLOCKS.to_vec(), Some(2)), pair.now);
    pair.pump();
    assert_eq!(pair.d.stats().ignored, ignored + 3);
    assert_eq!(layers_read(&pair), vec![Some(2)]);
}

/// P's prefill fails while the handoff is already fencing (the proxy released it: it cannot
/// know D is reading): the fence still runs to its end, never cut short by the failure.
#[test]
fn a_failed_layerwise_prefill_keeps_a_running_fence() {
    let mut pair = Pair::default_pair();
    let id = hid(94);
    layerwise_reading(&mut pair, id, 1);
    assert_eq!(pair.reads.len(), 1, "D reads the first layer");
    pair.p.release_unclaimed(
        Release {
            handoff: id,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        },
        pair.now,
    );
    pair.p.prefill_ended(id, false, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_none(), "freed under D's READ");
    // D's READ never ends (its deadline runs); P frees once its fence is over, not before.
    pair.d_alive = false;
    let fence = pair.p.config().fence_grace;
    let lease = pair.p.config().initial_lease;
    pair.advance(lease);
    assert!(pair.p_released(id).is_none(), "freed before the fence");
    pair.advance(fence + ms(1));
    assert!(pair.p_released(id).is_some());
}

/// A second request naming a layer-wise handoff whose blocks P already named is told so too
/// (an engine waiting for it before admitting would otherwise wait forever).
#[test]
fn a_sibling_after_ps_first_list_is_told_p_started() {
    let mut pair = Pair::default_pair();
    let id = hid(95);
    let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    inc.p_blocks = Vec::new();
    pair.d
        .on_request_arrived(RequestId(1), inc.clone(), pair.now)
        .unwrap();
    pair.pump();
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.d.poll_started(), Some(vec![RequestId(1)]));
    pair.d
        .on_request_arrived(RequestId(2), inc, pair.now)
        .unwrap();
    assert_eq!(pair.d.poll_started(), Some(vec![RequestId(2)]));
    assert_eq!(pair.d.poll_started(), None);
}

/// A D with many layer-wise pulls queued at P has its heartbeats and block queries staged there
/// up to its quota. Its release of one of them (the client left) still gets in, in place of a
/// question it repeats anyway: P frees that handoff when its prefill ends, not at its lease.
#[test]
fn an_early_release_gets_into_a_staging_full_of_layerwise_questions() {
    let mut pair = Pair::new(
        ProducerConfig {
            staging_per_peer: 4,
            ..ProducerConfig::default()
        },
        ConsumerConfig::default(),
    );
    let (a, b, c) = (hid(96), hid(97), hid(98));
    for (req, id) in [(1, a), (2, b), (3, c)] {
        let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
        inc.p_blocks = Vec::new();
        pair.d
            .on_request_arrived(RequestId(req), inc, pair.now)
            .unwrap();
    }
    pair.pump();
    assert_eq!(
        pair.p.staged_messages(),
        4,
        "a heartbeat and a query each, to the quota"
    );
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    pair.p
        .create_filling_handoff(a, BLOCKS.to_vec(), pair.now)
        .unwrap();
    pair.pump();
    pair.p.prefill_ended(a, true, pair.now);
    pair.pump();
    assert_eq!(
        pair.p_released(a).map(|r| r.reason),
        Some(EndReason::Aborted),
        "the early release was dropped: P holds the blocks until its lease"
    );
}

/// A pull of `bytes_per_block` × 4 blocks on a 5 s read timeout and a 1 GB/s read floor; the
/// READ lands after 12 s (past the 10 s initial grant it started on) while P keeps granting.
/// Returns D's outcomes.
fn long_read(bytes_per_block: u64) -> Vec<Outcome> {
    let d = ConsumerConfig {
        read_timeout: Duration::from_secs(5),
        read_floor_rate: 1_000_000_000,
        block_bytes: bytes_per_block,
        ..Default::default()
    };
    let mut pair = Pair::new(ProducerConfig::default(), d);
    let id = hid(91);
    let read = start_pull(&mut pair, id, 1);
    pair.advance(ms(12_000));
    if pair.outcomes.is_empty() {
        pair.complete_read(&read);
    }
    pair.outcomes
}

#[test]
fn a_read_of_a_long_prompt_gets_time_for_its_bytes_on_top_of_the_read_timeout() {
    // 8 GB on this rank: 8 s at the floor rate, so the read may take 5 + 8 s, on the grants
    // P renewed since it started.
    let outcomes = long_read(2_000_000_000);
    assert!(
        matches!(outcomes.as_slice(), [Outcome::Ready { .. }]),
        "{outcomes:?}"
    );
    // The control: the same read of small blocks is failed at the read timeout.
    let outcomes = long_read(4096);
    assert!(
        matches!(outcomes.as_slice(), [Outcome::Recompute { .. }]),
        "{outcomes:?}"
    );
}
