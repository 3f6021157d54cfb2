//! Rule 2 on D's side: when a read may start (never on an expired grant nor inside the read margin), and what made-up or misdirected messages from a hostile peer cannot change.

use super::*;

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
