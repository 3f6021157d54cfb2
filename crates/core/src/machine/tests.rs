//! Unit tests of the core on a simulated clock: each drives one `ConnectorCore` through the
//! inputs of a case and checks what it asks its executor to do.

use std::time::Duration;

use handoff_plan::{BlockLayout, KvSpec, ModelShape, RankLayout};
use handoff_proto::{
    Heartbeat, HeartbeatEntry, Hello, HelloReply, KvTransferParams, MemoryKind, Message,
    ReleaseReason, TransferMode,
};

use super::*;
use crate::worker_protocol::{PushLayer, WorkerHello, WorkerOp, WorkerReport};

fn spec() -> KvSpec {
    KvSpec {
        shape: ModelShape {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype_size: 2,
        },
        tp: 1,
        block_size: 16,
        block_layout: BlockLayout::HeadMajor,
    }
}

fn core(engine: &str, role: Role) -> ConnectorCore {
    core_with(engine, role, false)
}

fn core_with(engine: &str, role: Role, kv_digest: bool) -> ConnectorCore {
    core_in(engine, role, TransferMode::Pull, kv_digest)
}

fn core_in(engine: &str, role: Role, mode: TransferMode, kv_digest: bool) -> ConnectorCore {
    core_of(engine, role, mode, kv_digest, ProducerConfig::default())
}

fn core_of(
    engine: &str,
    role: Role,
    mode: TransferMode,
    kv_digest: bool,
    producer: ProducerConfig,
) -> ConnectorCore {
    ConnectorCore::new(
        CoreConfig {
            engine_id: engine.into(),
            role,
            mode,
            model: "m".into(),
            dtype: "bf16".into(),
            advertise_host: "127.0.0.1".into(),
            side_channel_port: 7000,
            producer,
            consumer: Default::default(),
            opaque_blocks: false,
            kv_digest,
            peer_hosts: Vec::new(),
            protocol_version: handoff_proto::PROTOCOL_VERSION,
        },
        vec![WorkerHello {
            rank: 0,
            layout: RankLayout::cross_layer(spec(), 0, 64, 0).unwrap(),
            agent: format!("{engine}-r0"),
            metadata: vec![1, 2, 3],
            memory: Default::default(),
        }],
    )
    .unwrap()
}

fn t(ms: u64) -> Time {
    Duration::from_millis(ms)
}

fn hello_of(c: &ConnectorCore) -> Hello {
    c.hello.clone()
}

/// P's params for a handoff it created.
fn params(p: &mut ConnectorCore, n: u8) -> KvTransferParams {
    let mut id = [0u8; 16];
    id[0] = n;
    id[15] = 0xa5;
    p.on_prefill_finished("r", HandoffId::from_bytes(id), vec![1, 2], 32, t(0))
        .unwrap()
}

/// A D core connected to P on `conn` (what an executor would do with D's connect).
fn connected_d(p: &mut ConnectorCore, prm: &KvTransferParams, conn: ConnId) -> ConnectorCore {
    connect(p, core("d", Role::Decode), prm, conn)
}

fn connect(
    p: &mut ConnectorCore,
    mut d: ConnectorCore,
    prm: &KvTransferParams,
    conn: ConnId,
) -> ConnectorCore {
    d.on_request_arrived(1, prm, 32, t(1)).unwrap();
    let r = d.ready();
    assert_eq!(r.connects.len(), 1, "D dials P once");
    let hello = r.connects[0].hello.clone();
    let attempt = r.connects[0].attempt;
    d.advance(r);
    p.handle_accepted(100, hello, None, t(1));
    let rp = p.ready();
    let reply = rp.messages[0].1.clone();
    p.advance(rp);
    d.handle_connected("p", attempt, conn, reply, t(2));
    d
}

#[test]
fn only_the_latest_connect_attempts_failure_fails_the_peer() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let mut d = core("d", Role::Decode);
    d.on_request_arrived(1, &prm, 32, t(0)).unwrap();
    let first = d.ready().connects[0].attempt;
    // The attempt fails: the request is recomputed with the reason.
    d.handle_connect_failed("p", first, "refused".into(), t(10));
    let r = d.ready();
    assert!(
        r.events.iter().any(
            |e| matches!(e, ConnectorEvent::Recompute { requests, reason }
            if requests == &vec![1] && reason.contains("refused"))
        ),
        "{:?}",
        r.events
    );
    // A new request retries P; the first attempt's failure, arriving again late, is stale.
    d.on_request_arrived(2, &params(&mut p, 2), 32, t(20))
        .unwrap();
    let second = d.ready().connects[0].attempt;
    assert_ne!(first, second);
    d.handle_connect_failed("p", first, "timed out".into(), t(30));
    assert!(d.ready().events.is_empty(), "a stale failure fails nothing");
    // The latest attempt's own failure does.
    d.handle_connect_failed("p", second, "unreachable".into(), t(40));
    let r = d.ready();
    assert!(r.events.iter().any(
        |e| matches!(e, ConnectorEvent::Recompute { requests, reason }
        if requests == &vec![2] && reason.contains("unreachable"))
    ));
}

#[test]
fn a_connection_without_a_handshake_is_refused_and_reaches_no_ledger() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let h = prm.handoff_id.unwrap();
    p.ready();
    // Heartbeats without a hello: no grant, no reader, the connection closed.
    let hb = Message::Heartbeat(Heartbeat {
        seq: 1,
        mode: handoff_proto::TransferMode::Pull,
        entries: vec![HeartbeatEntry {
            handoff: h,
            epoch: Epoch::FIRST,
        }],
    });
    p.handle_accepted(7, hb.clone(), None, t(1));
    let r = p.ready();
    assert!(r.messages.is_empty(), "no reply to an anonymous heartbeat");
    assert_eq!(r.closes, vec![7]);
    assert!(r.observations.contains(&Observation::AnonymousRefused));
    assert_eq!(p.producer_stats().unwrap().1.heartbeats_received, 0);
    // Nor can one release: the blocks stay.
    let rel = Message::Release(handoff_proto::Release {
        handoff: h,
        epoch: Epoch::FIRST,
        reason: ReleaseReason::Aborted,
    });
    p.handle_accepted(8, rel, None, t(2));
    assert!(p.ready().events.is_empty());
    assert_eq!(p.held_blocks().0, 2);
}

/// A D of another shape is refused at the handshake, but the connection stays open a little for
/// the releases of what it came for: P ends that handoff at once, not when its lease ends. Any
/// other frame closes the connection, and so does the end of the linger.
#[test]
fn a_refused_d_releases_what_it_came_for_on_the_refused_connection() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let h = prm.handoff_id.unwrap();
    p.ready();
    assert_eq!(p.held_blocks().0, 2);
    let mut other = hello_of(&core("d", Role::Decode));
    other.memory = vec![];
    p.handle_accepted(103, Message::Hello(other.clone()), None, t(3));
    let r = p.ready();
    assert!(
        matches!(
            &r.messages[..],
            [(103, Message::HelloReply(HelloReply::Refused { .. }))]
        ),
        "{:?}",
        r.messages
    );
    assert!(r.closes.is_empty(), "closed before its peer could release");
    p.advance(r);
    let release = |reason| {
        Message::Release(handoff_proto::Release {
            handoff: h,
            epoch: Epoch::FIRST,
            reason,
        })
    };
    p.handle_frame(103, release(ReleaseReason::Rejected), t(4));
    let r = p.ready();
    assert!(
        r.events.iter().any(
            |e| matches!(e, ConnectorEvent::BlocksReleased { handoff, reason, .. } if *handoff == h && reason == "rejected")
        ),
        "{:?}",
        r.events
    );
    assert_eq!(p.held_blocks().0, 0);
    p.advance(r);
    // Anything but a release closes it.
    p.handle_frame(103, Message::Hello(other.clone()), t(5));
    assert_eq!(p.ready().closes, vec![103]);
    // A refused connection that says nothing closes when its linger ends.
    p.handle_accepted(104, Message::Hello(other), None, t(6));
    let r = p.ready();
    p.advance(r);
    assert_eq!(p.poll_timeout(), Some(t(6) + side_channel::REFUSED_LINGER));
    p.handle_timeout(t(6) + side_channel::REFUSED_LINGER);
    assert_eq!(p.ready().closes, vec![104]);
}

#[test]
fn a_peer_cannot_take_over_another_engines_agent_name() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let _d = connected_d(&mut p, &prm, 5);
    // A second engine announces D's agent name as its own.
    let mut impostor = hello_of(&core("x", Role::Decode));
    impostor.agent_metadata =
        postcard::to_allocvec(&vec![("d-r0".to_string(), vec![9u8])]).unwrap();
    p.handle_accepted(101, Message::Hello(impostor), None, t(3));
    let r = p.ready();
    assert!(
        matches!(&r.messages[..], [(101, Message::HelloReply(HelloReply::Refused { reason }))] if reason.contains("another engine")),
        "{:?}",
        r.messages
    );
    assert_eq!(r.closes, vec![101]);
    // D keeps its name: its notifications still count as D's.
    assert_eq!(p.peers.by_agent("d-r0"), p.peers.by_engine("d"));
}

/// A hello says where each rank's KV lives; one that says it for more or fewer ranks than its
/// TP is refused with the counts named, and the peer is not bound.
#[test]
fn a_hello_must_say_where_every_rank_s_kv_lives() {
    let mut p = core("p", Role::Prefill);
    let mut d_hello = hello_of(&core("d", Role::Decode));
    assert_eq!(d_hello.memory, vec![MemoryKind::Host]);
    for memory in [
        vec![],
        vec![MemoryKind::Host, MemoryKind::Cuda { device: 0 }],
    ] {
        d_hello.memory = memory;
        p.handle_accepted(103, Message::Hello(d_hello.clone()), None, t(3));
        let r = p.ready();
        assert!(
            matches!(&r.messages[..], [(103, Message::HelloReply(HelloReply::Refused { reason }))] if reason.contains("memory kinds")),
            "{:?}",
            r.messages
        );
        p.advance(r);
        assert!(p.peers.by_engine("d").is_none());
    }
}

/// With a cluster key, the side channel tells the core which engine id the caller proved; a
/// hello under another id (D's, to take over its connection and blocks) is refused.
#[test]
fn a_hello_under_an_id_the_connection_did_not_prove_is_refused() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let _d = connected_d(&mut p, &prm, 5);
    let before = p.peers.by_engine("d");
    p.handle_accepted(
        102,
        Message::Hello(hello_of(&core("d", Role::Decode))),
        Some("mallory"),
        t(3),
    );
    let r = p.ready();
    assert!(
        matches!(&r.messages[..], [(102, Message::HelloReply(HelloReply::Refused { reason }))] if reason.contains("proved")),
        "{:?}",
        r.messages
    );
    assert_eq!(r.closes, vec![102]);
    assert_eq!(p.peers.by_engine("d"), before);
    // The same hello on a connection that proved "d" is D reconnecting: accepted.
    p.advance(r);
    p.handle_accepted(
        103,
        Message::Hello(hello_of(&core("d", Role::Decode))),
        Some("d"),
        t(4),
    );
    let r = p.ready();
    assert!(
        matches!(
            &r.messages[..],
            [(103, Message::HelloReply(HelloReply::Accepted(_)))]
        ),
        "{:?}",
        r.messages
    );
}

#[test]
fn a_reply_from_another_engine_than_dialled_is_refused() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let mut d = core("d", Role::Decode);
    d.on_request_arrived(1, &prm, 32, t(0)).unwrap();
    let attempt = d.ready().connects[0].attempt;
    let other = hello_of(&core("q", Role::Prefill));
    d.handle_connected(
        "p",
        attempt,
        9,
        Message::HelloReply(HelloReply::Accepted(other)),
        t(1),
    );
    let r = d.ready();
    assert_eq!(r.closes, vec![9]);
    assert!(r.events.iter().any(
        |e| matches!(e, ConnectorEvent::Recompute { reason, .. } if reason.contains("answered as"))
    ));
}

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

/// Clients may name any engine id in `kv_transfer_params`: a peer is created for each. Peers
/// that are down and that nothing names any more are forgotten, so the table stays bounded
/// however many made-up engines requests name (it grew by one per name before).
#[test]
fn peers_named_by_requests_are_forgotten_once_down_and_unused() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 1);
    let mut d = core("d", Role::Decode);
    let mut forgotten = 0;
    for i in 0..1000u64 {
        let mut fake = prm.clone();
        fake.remote_engine_id = Some(format!("made-up-{i}"));
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&i.to_le_bytes());
        id[15] = 0x5a;
        fake.handoff_id = Some(HandoffId::from_bytes(id));
        d.on_request_arrived(i, &fake, 32, t(i)).unwrap();
        let r = d.ready();
        let connect = r.connects[0].clone();
        forgotten += r
            .worker_ops
            .iter()
            .filter(|(_, op)| matches!(op, WorkerOp::ForgetRemote { .. }))
            .count();
        d.advance(r);
        d.handle_connect_failed(&connect.engine, connect.attempt, "refused".into(), t(i));
        let r = d.ready();
        d.advance(r);
    }
    let m = d.memory();
    assert!(m.peers <= 2 * 64, "{m:?}");
    assert_eq!(m.consumer.handoffs, 0, "{m:?}");
    // The made-up engines announced no agents: nothing to forget on the workers.
    assert_eq!(forgotten, 0);
}

/// One pull between a P and a D core with `kv_digest`, their workers played by the test: P's
/// worker reports `p_share` as its digest when it grants, D's reports `d_share` when its READ
/// landed. Returns D's events and observations.
fn pull_with_digests(p_share: u64, d_share: u64) -> (Vec<ConnectorEvent>, Vec<Observation>) {
    let mut p = core_with("p", Role::Prefill, true);
    let prm = params(&mut p, 1);
    let r = p.ready();
    p.advance(r);
    let mut d = connect(&mut p, core_with("d", Role::Decode, true), &prm, 5);
    d.on_blocks_allocated(1, vec![7, 8], t(3)).unwrap();
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
            let (blocks, of) = job
                .digest
                .clone()
                .expect("D asks its worker for the digest");
            assert_eq!((blocks, of.num_tokens), (vec![7, 8], 32));
            d_report.digests.push((Digested::Job(job.job), d_share));
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
    p.on_push_prefilled(&p_leg, "r", vec![1, 2], 32, t(3))
        .unwrap();
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

/// D with `peer_hosts` dials a P only at those hosts: a request (or a reject) naming another
/// host is refused with a clear error and nothing is dialled; one naming a listed host is
/// tracked and dialled as always.
#[test]
fn d_dials_only_the_prefill_hosts_it_may() {
    let mut p = core("p", Role::Prefill);
    let prm = params(&mut p, 9);
    let mut d = core("d", Role::Decode);
    d.cfg.peer_hosts = vec!["10.0.0.7".into()];
    for host in ["127.0.0.1", "10.0.0.70", "evil.example"] {
        let named = KvTransferParams {
            remote_host: Some(host.into()),
            ..prm.clone()
        };
        let e = d.on_request_arrived(1, &named, 32, t(1)).unwrap_err();
        assert!(
            matches!(e, CoreError::PeerHostNotAllowed(ref h) if h == host),
            "{e}"
        );
        assert!(e.to_string().contains("peer_hosts"), "{e}");
        assert!(d.reject(&named, t(1)).is_err());
    }
    let r = d.ready();
    assert!(r.connects.is_empty(), "dialled {:?}", r.connects);
    assert_eq!(d.held_blocks(), (0, 0));
    d.advance(r);
    let allowed = KvTransferParams {
        remote_host: Some("10.0.0.7".into()),
        ..prm
    };
    d.on_request_arrived(2, &allowed, 32, t(2)).unwrap();
    let r = d.ready();
    assert_eq!(r.connects.len(), 1);
    assert!(
        r.connects[0].addr.starts_with("10.0.0.7:"),
        "{}",
        r.connects[0].addr
    );
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
        p.on_push_forward(&p_leg, vec![1, 2], 32, t(3)).unwrap();
    } else {
        p.on_push_prefill_start(&p_leg, vec![1, 2], 32, t(3))
            .unwrap();
        p.on_layer_saved(handoff, 0, t(3));
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
