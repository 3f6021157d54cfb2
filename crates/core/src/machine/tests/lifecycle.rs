//! A handoff's life through the core: rejects, ended requests, heartbeats on an engine with both ledgers, block names only under a grant, and every input's kind of answer.

use super::*;

#[test]
fn a_reject_tells_p_only_when_d_does_not_track_the_handoff() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let mut d = connected_d(&mut p, &prm, 5);
    d.ready();
    // The same handoff arrives again (a retried request) and is refused: D still tracks it
    // for request 1, so P must not be told to release.
    d.reject(&prm, t(5)).unwrap();
    let r = d.ready();
    assert!(
        !r.messages
            .iter()
            .any(|(_, m)| matches!(m, Message::Release(_))),
        "{:?}",
        r.messages
    );
    assert!(r
        .observations
        .contains(&Observation::RejectOfTrackedHandoff));
    // A handoff D does not track: P is told at once.
    let other = params(&mut p, 2);
    d.reject(&other, t(6)).unwrap();
    let r = d.ready();
    assert!(r.messages.iter().any(|(c, m)| *c == 5
        && matches!(m, Message::Release(rel) if Some(rel.handoff) == other.handoff_id)));
}

#[test]
fn ended_requests_leave_nothing_behind() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let mut d = connected_d(&mut p, &prm, 5);
    // Siblings arrive and all leave before admission: the handoff ends, nothing stays tracked.
    d.on_request_arrived(2, &prm, 32, t(3)).unwrap();
    d.on_request_ended(1, ReleaseReason::Aborted, t(4));
    d.on_request_ended(2, ReleaseReason::Aborted, t(4));
    let m = d.memory();
    assert_eq!(m.consumer.handoffs, 0, "{m:?}");
    assert_eq!((m.reads, m.pushes, m.jobs), (0, 0, 0));
    assert!(d.on_blocks_allocated(1, vec![3], t(5)).is_err());
}

#[test]
fn an_engine_with_both_ledgers_answers_a_pull_heartbeat_with_a_grant_only() {
    // vLLM's kv_both engines run both ledgers. A D's heartbeat for a handoff this engine
    // produced must get a grant, and no "gone" from the consumer ledger (which never heard of
    // the handoff): D fails a request on "gone".
    let mut p = core("p", Role::Both);
    let prm = params(&mut p, 1);
    let _ = p.ready();
    let handoff = prm.handoff_id.unwrap();
    p.handle_accepted(
        100,
        Message::Hello(hello_of(&core("d", Role::Decode))),
        None,
        t(1),
    );
    let r = p.ready();
    p.advance(r);
    p.handle_frame(
        100,
        Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![HeartbeatEntry {
                handoff,
                epoch: Epoch::FIRST,
            }],
        }),
        t(2),
    );
    let r = p.ready();
    let batches: Vec<_> = r
        .messages
        .iter()
        .filter_map(|(_, m)| match m {
            Message::GrantBatch(g) => Some(g.clone()),
            _ => None,
        })
        .collect();
    assert!(
        batches
            .iter()
            .any(|g| g.grants.iter().any(|x| x.handoff == handoff)),
        "{batches:?}"
    );
    assert!(batches.iter().all(|g| g.gone.is_empty()), "{batches:?}");
}

/// The other direction: a push P's heartbeat asks D to keep a registration. An engine with both
/// ledgers hands it to its consumer, which answers "gone" for a registration it does not hold,
/// so P stops at once. (Routed by the ids, as before heartbeats said their flow, an unknown id
/// went to the producer, which staged it and said nothing: P waited out its grant.)
#[test]
fn an_engine_with_both_ledgers_answers_a_push_heartbeat_from_its_consumer() {
    let mut d = core("d", Role::Both);
    d.handle_accepted(
        100,
        Message::Hello(hello_of(&core("p", Role::Prefill))),
        None,
        t(1),
    );
    let r = d.ready();
    d.advance(r);
    let unknown = HandoffId::from_bytes([9; 16]);
    d.handle_frame(
        100,
        Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Push,
            entries: vec![HeartbeatEntry {
                handoff: unknown,
                epoch: Epoch::FIRST,
            }],
        }),
        t(2),
    );
    let r = d.ready();
    let gone: Vec<_> = r
        .messages
        .iter()
        .filter_map(|(_, m)| match m {
            Message::GrantBatch(g) => Some(g.gone.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(
        gone.iter().any(|e| e.handoff == unknown),
        "{:?}",
        r.messages
    );
    assert_eq!(
        d.staged_messages(),
        0,
        "nothing staged for a handoff to come"
    );
}

/// P tells a reader where a handoff's blocks are only once every worker's transport serves them
/// to that reader's agents, and closes them again when the blocks are released: a READ never
/// reaches a transport that would refuse it, and none is served after the handoff ended.
#[test]
fn p_names_blocks_only_once_granted_and_revokes_at_release() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let handoff = prm.handoff_id.unwrap();
    let entry = HeartbeatEntry {
        handoff,
        epoch: Epoch::FIRST,
    };
    let r = p.ready();
    p.advance(r);
    p.handle_accepted(
        100,
        Message::Hello(hello_of(&core("d", Role::Decode))),
        None,
        t(1),
    );
    let r = p.ready();
    p.advance(r);
    let query = |p: &mut ConnectorCore, at: u64| {
        p.handle_frame(
            100,
            Message::Heartbeat(Heartbeat {
                seq: at,
                mode: handoff_proto::TransferMode::Pull,
                entries: vec![entry],
            }),
            t(at),
        );
        p.handle_frame(
            100,
            Message::BlocksQuery(handoff_proto::BlocksQuery {
                entries: vec![entry],
            }),
            t(at),
        );
        p.ready()
    };
    let names_blocks = |r: &Ready| {
        r.messages
            .iter()
            .any(|(_, m)| matches!(m, Message::PullBlocks(b) if b.lists.iter().any(|l| l.handoff == handoff)))
    };
    let r = query(&mut p, 2);
    assert!(
        !names_blocks(&r),
        "blocks named before the grant is in force"
    );
    let grant = r
        .worker_ops
        .iter()
        .find_map(|(rank, op)| match op {
            WorkerOp::Grant {
                grant,
                op,
                agents,
                blocks,
                ..
            } => {
                assert_eq!(*rank, 0);
                assert_eq!(*op, handoff_proto::xfer::XferOp::Read);
                assert_eq!(agents, &["d-r0".to_string()]);
                assert_eq!(blocks, &[1, 2]);
                Some(*grant)
            }
            _ => None,
        })
        .expect("a grant to the reader's agents");
    p.advance(r);
    // Asked again before the worker confirmed: still held, and no second grant.
    let r = query(&mut p, 3);
    assert!(!names_blocks(&r));
    assert!(r.worker_ops.is_empty(), "{:?}", r.worker_ops);
    p.advance(r);
    p.handle_worker_report(
        WorkerReport {
            rank: 0,
            granted: vec![(grant, true)],
            ..Default::default()
        },
        t(4),
    );
    let r = p.ready();
    assert!(names_blocks(&r), "the held answer leaves once confirmed");
    p.advance(r);
    let r = query(&mut p, 5);
    assert!(names_blocks(&r), "later queries are answered at once");
    p.advance(r);
    p.handle_frame(
        100,
        Message::Release(handoff_proto::Release {
            handoff,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        }),
        t(6),
    );
    let r = p.ready();
    assert!(r
        .events
        .iter()
        .any(|e| matches!(e, ConnectorEvent::BlocksReleased { .. })));
    assert!(
        r.worker_ops
            .iter()
            .any(|(_, op)| *op == WorkerOp::Revoke { grant }),
        "{:?}",
        r.worker_ops
    );
    assert_eq!(p.memory().grants, 0);
}

/// `Hooks` relies on it: each input has one kind of answer (a refusal aside).
#[test]
fn every_input_gets_its_kind_of_answer() {
    let mut p = core("p", Role::Prefill);
    let leg = KvTransferParams::for_prefill_leg();
    let started = p.handle(
        Input::PrefillStarted {
            request_id: "r".into(),
            params: leg.clone(),
            handoff: HandoffId::from_bytes([3; 16]),
            blocks: vec![1],
            num_tokens: 8,
        },
        t(0),
    );
    assert!(
        matches!(started, Ok(crate::Answer::Holding(None))),
        "{started:?}"
    );
    let saved = Input::LayersSaved {
        request_id: "r".into(),
        through: 1,
    };
    assert!(matches!(p.handle(saved, t(0)), Ok(crate::Answer::Done)));
    let ended = p.handle(
        Input::PrefillEnded {
            request_id: "r".into(),
            outcome: crate::PrefillOutcome::Finished,
        },
        t(0),
    );
    let Ok(crate::Answer::Ended {
        params: Some(prm),
        holding: Some(_),
    }) = ended
    else {
        panic!("{ended:?}");
    };
    let mut d = core("d", Role::Decode);
    let arrived = Input::RequestArrived {
        request: 1,
        params: *prm,
        prompt_tokens: 8,
    };
    assert!(matches!(
        d.handle(arrived, t(1)),
        Ok(crate::Answer::Arrived(crate::Arrival {
            reserve_now: false,
            after_remote_start: false
        }))
    ));
    assert!(matches!(
        d.handle(Input::Timeout, t(2)),
        Ok(crate::Answer::Done)
    ));
    // The same prefill cannot start twice, nor end when it never started.
    let again = Input::PrefillEnded {
        request_id: "r".into(),
        outcome: crate::PrefillOutcome::Finished,
    };
    assert!(matches!(
        p.handle(again, t(3)),
        Err(CoreError::UnknownPrefill(_))
    ));
}

/// A layer-wise pull asked of an engine that does not serve them is refused: its D would wait
/// for layers this engine never announces.
#[test]
fn a_layerwise_pull_is_refused_where_the_engine_takes_none() {
    let mut p = core("p", Role::Prefill);
    let leg = KvTransferParams {
        do_remote_decode: true,
        handoff_id: Some(HandoffId::from_bytes([4; 16])),
        layerwise: Some(true),
        ..Default::default()
    };
    let r = at(&mut p, t(0)).prefill_started("r", &leg, HandoffId::from_bytes([5; 16]), vec![1], 8);
    assert!(matches!(r, Err(CoreError::BadParams(_))), "{r:?}");
    p.cfg.layerwise_pull = true;
    let r = at(&mut p, t(0)).prefill_started("r", &leg, HandoffId::from_bytes([5; 16]), vec![1], 8);
    assert_eq!(
        r.unwrap(),
        leg.handoff_id,
        "held under the router's id from the start"
    );
}
