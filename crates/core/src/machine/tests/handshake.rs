//! Connections and handshakes: who may dial whom, what a hello must prove and say, and what a refused or impostor peer gets (nothing from a ledger).

use super::*;

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

/// `engine`'s core with its two layers in KV cache groups: layer 1 full, layer 0 a window.
fn hybrid_core(engine: &str, role: Role, window: u32) -> ConnectorCore {
    let base = core(engine, role);
    let mut ranks = base.ranks.clone();
    ranks[0].groups = handoff_plan::testing::hybrid_groups(&[1], window, 2);
    ConnectorCore::new(base.cfg.clone(), ranks).unwrap()
}

/// What P answers `d`'s hello with.
fn p_answers(p: &mut ConnectorCore, d: Hello, conn: ConnId) -> HelloReply {
    p.handle_accepted(conn, Message::Hello(d), None, t(3));
    let r = p.ready();
    let reply = match &r.messages[..] {
        [(c, Message::HelloReply(reply))] if *c == conn => reply.clone(),
        other => panic!("no reply: {other:?}"),
    };
    p.advance(r);
    reply
}

/// A hybrid model's groups ride in the hello after the layouts: engines with the same groups
/// pair, any other groups are refused with both named, and groups that do not decode or do not
/// cover the layers are refused as a bad layout. A build before groups reads the layouts and
/// nothing after them.
#[test]
fn engines_pair_only_with_the_same_kv_cache_groups() {
    let mut p = hybrid_core("p", Role::Prefill, 20);
    let same = hello_of(&hybrid_core("d", Role::Decode, 20));
    assert!(matches!(
        p_answers(&mut p, same.clone(), 101),
        HelloReply::Accepted(_)
    ));
    // An earlier build's reader takes the same bytes as the layouts alone.
    let layouts: Vec<RankLayout> = postcard::from_bytes(&same.layout).unwrap();
    assert_eq!(layouts.len(), 1);

    let mut p = hybrid_core("p", Role::Prefill, 20);
    for (conn, d, want) in [
        (
            102,
            hello_of(&core("d", Role::Decode)),
            "KV cache groups differ",
        ),
        (
            103,
            hello_of(&hybrid_core("d", Role::Decode, 21)),
            "window 21",
        ),
    ] {
        match p_answers(&mut p, d, conn) {
            HelloReply::Refused { reason } => assert!(reason.contains(want), "{reason}"),
            other => panic!("accepted: {other:?}"),
        }
        assert!(p.peers.by_engine("d").is_none());
    }
    // Bytes after the groups, and groups naming a layer twice.
    let mut trailing = same.clone();
    trailing.layout.push(0);
    let mut forged = same.clone();
    let n = postcard::to_allocvec(&layouts).unwrap().len();
    forged.layout.truncate(n);
    forged
        .layout
        .extend(postcard::to_allocvec(&(vec![(0u8, vec![0u32, 1]), (0u8, vec![1u32])],)).unwrap());
    for (conn, d, want) in [(104, trailing, "bad layout"), (105, forged, "groups")] {
        match p_answers(&mut p, d, conn) {
            HelloReply::Refused { reason } => assert!(reason.contains(want), "{reason}"),
            other => panic!("accepted: {other:?}"),
        }
    }
}
