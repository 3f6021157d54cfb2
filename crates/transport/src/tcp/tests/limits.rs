//! Configuration and the bounds a hostile or overloaded peer meets: descriptor counts, backlogs, connection caps.

use super::*;

#[test]
fn config_is_checked_and_defaults_match_the_spec() {
    let c = TcpConfig::default();
    assert_eq!(c.bind.to_string(), "127.0.0.1:0");
    assert_eq!(c.keepalive, Duration::from_millis(250));
    assert_eq!(c.dead_after, Duration::from_millis(1500));
    assert_eq!(c.landing_spin, Duration::from_micros(200));
    let too_long = TcpConfig {
        landing_spin: crate::tcp::MAX_LANDING_SPIN + Duration::from_micros(1),
        ..TcpConfig::default()
    };
    assert!(TcpTransport::new("x", too_long).is_err());
    // HANDOFF_TCP_LANDING_SPIN_US: a number of µs up to the maximum, else the default.
    let spin_from = |v: &str| {
        TcpConfig::from_lookup(|k| (k == "HANDOFF_TCP_LANDING_SPIN_US").then(|| v.to_string()))
            .landing_spin
    };
    assert_eq!(spin_from("0"), Duration::ZERO);
    assert_eq!(spin_from(" 50 "), Duration::from_micros(50));
    assert_eq!(spin_from("10000"), crate::tcp::MAX_LANDING_SPIN);
    assert_eq!(spin_from("10001"), c.landing_spin);
    assert_eq!(spin_from("fast"), c.landing_spin);
    assert_eq!(TcpConfig::from_lookup(|_| None), c);
    let bounds = TcpConfig::from_lookup(|k| match k {
        "HANDOFF_TCP_MAX_DESCS" => Some("64".into()),
        "HANDOFF_TCP_MAX_QUEUED_DESCS" => Some(" 128 ".into()),
        "HANDOFF_TCP_MAX_CONNECTIONS" => Some("many".into()),
        _ => None,
    });
    assert_eq!(
        (
            bounds.max_descs,
            bounds.max_queued_descs,
            bounds.max_connections
        ),
        (64, 128, c.max_connections)
    );
    // HANDOFF_TCP_DEAD_AFTER_MS: ms; one not above the keepalive fails at `new`.
    let dead_from = |v: &str| {
        TcpConfig::from_lookup(|k| (k == "HANDOFF_TCP_DEAD_AFTER_MS").then(|| v.to_string()))
    };
    assert_eq!(dead_from(" 6000").dead_after, Duration::from_secs(6));
    assert_eq!(dead_from("slow").dead_after, c.dead_after);
    assert!(TcpTransport::new("x", dead_from("100")).is_err());
    let bad = TcpConfig {
        dead_after: Duration::from_millis(100),
        keepalive: Duration::from_millis(100),
        ..TcpConfig::default()
    };
    assert!(TcpTransport::new("x", bad).is_err());
    assert!(TcpTransport::new("", TcpConfig::default()).is_err());
    assert_eq!(
        (c.max_descs, c.max_queued_descs, c.max_connections),
        (1 << 18, 1 << 20, 1024)
    );
    for (max_descs, max_queued_descs, max_connections) in [
        (0, 1 << 20, 1),
        ((1 << 20) + 1, 1 << 21, 1),
        (64, 63, 1),
        (64, 64, 0),
    ] {
        let bad = TcpConfig {
            max_descs,
            max_queued_descs,
            max_connections,
            ..TcpConfig::default()
        };
        assert!(
            TcpTransport::new("x", bad).is_err(),
            "{max_descs} {max_queued_descs} {max_connections}"
        );
    }
    let t = agent(
        "adv",
        TcpConfig {
            advertise_host: Some("localhost".into()),
            ..TcpConfig::default()
        },
    );
    let m = wire::decode_meta(&t.local_metadata().unwrap()).unwrap();
    assert_eq!(
        (m.host.as_str(), m.port),
        ("localhost", t.local_addr().port())
    );
    assert_eq!(t.backend(), "tcp");
}

// ----- bounds -----

/// `n` one-byte descriptors covering bytes 0..n of region 0 on both sides.
fn ones(n: usize) -> Vec<XferDesc> {
    (0..n as u64)
        .map(|i| XferDesc {
            local_region: 0,
            local_offset: i,
            remote_region: 0,
            remote_offset: i,
            len: 1,
        })
        .collect()
}

/// A request over the target's descriptor limit is refused and counted without holding it or
/// losing the connection: a refused WRITE lands no byte, and the next request inside the limit
/// is served. The initiator refuses to post over its own limit. (The negative control is the
/// served request: the same connection, the same descriptors, one fewer.)
#[test]
fn requests_over_the_descriptor_limit_are_refused_and_counted() {
    let mut rng = Rng(21);
    let target = agent(
        "d-target",
        TcpConfig {
            max_descs: 8,
            max_queued_descs: 8,
            ..fast()
        },
    );
    let reader = agent("d-reader", fast());
    let t = regions(&target, &[64], &mut rng);
    let r = regions(&reader, &[64], &mut rng);
    pair(&target, &reader);
    let before = snapshot(&t[0]);
    for op in [XferOp::Read, XferOp::Write] {
        let id = reader.post(op, "d-target", &ones(9), Some(b"n")).unwrap();
        match wait(&*reader, id, Duration::from_secs(3)) {
            XferStatus::Failed(e) => assert!(e.contains("limit of 8"), "{e}"),
            s => panic!("{op:?} over the limit: {s:?}"),
        }
    }
    assert_eq!(target.refused_transfers(), 2);
    assert_eq!(snapshot(&t[0]), before, "a refused WRITE landed bytes");
    assert!(target.drain_notifications().is_empty());
    // Same connection, inside the limit: served.
    let id = reader
        .post(XferOp::Read, "d-target", &ones(8), None)
        .unwrap();
    assert_eq!(wait(&*reader, id, Duration::from_secs(3)), XferStatus::Done);
    assert_eq!(snapshot(&r[0])[..8], before[..8]);
    assert!(target.drain_dead_peers().is_empty() && reader.drain_dead_peers().is_empty());
    // The initiator's own limit.
    let small = agent(
        "d-small",
        TcpConfig {
            max_descs: 4,
            max_queued_descs: 4,
            ..fast()
        },
    );
    regions(&small, &[64], &mut rng);
    pair(&small, &target);
    assert_eq!(
        small.post(XferOp::Read, "d-target", &ones(5), None),
        Err(TransportError::TooManyDescriptors { count: 5, max: 4 })
    );
}

/// Answers queued for one connection's writer never hold more descriptors than the backlog
/// allows (the reader waits instead), and waiting loses nothing: many reads posted at once
/// through a backlog of one request all land byte-exact.
#[test]
fn a_connections_backlog_is_bounded_and_backpressure_loses_nothing() {
    let mut rng = Rng(22);
    let target = agent(
        "b-target",
        TcpConfig {
            max_descs: 16,
            max_queued_descs: 16,
            ..fast()
        },
    );
    let reader = agent("b-reader", fast());
    let t = regions(&target, &[1 << 20], &mut rng);
    let r = regions(&reader, &[1 << 20], &mut rng);
    pair(&target, &reader);
    // 64 reads of 16 descriptors of 1 KiB each: 1 MiB, all posted before any is answered.
    let ids: Vec<XferId> = (0..64u64)
        .map(|k| {
            let descs: Vec<XferDesc> = (0..16u64)
                .map(|i| {
                    let off = (k * 16 + i) * 1024;
                    XferDesc {
                        local_region: 0,
                        local_offset: off,
                        remote_region: 0,
                        remote_offset: off,
                        len: 1024,
                    }
                })
                .collect();
            reader.post(XferOp::Read, "b-target", &descs, None).unwrap()
        })
        .collect();
    for id in ids {
        assert_eq!(
            wait(&*reader, id, Duration::from_secs(10)),
            XferStatus::Done
        );
    }
    assert_eq!(snapshot(&r[0]), snapshot(&t[0]));
    let peak = target.inner.backlog_peak();
    assert!(peak <= 16, "{peak} descriptors queued past a backlog of 16");
    assert!(peak > 0);
}

/// Past the inbound connection cap a connection is closed before it costs a thread, and
/// counted; once the others go, a peer connects again.
#[test]
fn inbound_connections_past_the_cap_are_closed_and_counted() {
    use std::io::Read as _;
    let target = agent(
        "c-target",
        TcpConfig {
            max_connections: 2,
            ..fast()
        },
    );
    let addr = target.local_addr();
    let idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    // The two idle ones are held (their handshake waits); wait until the listener took both.
    wait_for(Duration::from_secs(3), || {
        (target.inner.inbound.lock().len() == 2).then_some(())
    })
    .expect("both accepted");
    let mut third = std::net::TcpStream::connect(addr).unwrap();
    third
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut b = [0u8; 1];
    // Closed at once: EOF or reset, well before the handshake's own timeout would close it.
    let start = Instant::now();
    assert!(matches!(third.read(&mut b), Ok(0) | Err(_)));
    assert!(start.elapsed() < Duration::from_millis(350));
    assert_eq!(target.refused_connections(), 1);
    drop(idle);
    let mut rng = Rng(23);
    let peer = agent("c-peer", fast());
    regions(&target, &[64], &mut rng);
    regions(&peer, &[64], &mut rng);
    wait_for(Duration::from_secs(3), || {
        target.inner.inbound.lock().is_empty().then_some(())
    })
    .expect("the idle ones closed");
    pair(&target, &peer);
    let id = peer.post(XferOp::Read, "c-target", &ones(4), None).unwrap();
    assert_eq!(wait(&*peer, id, Duration::from_secs(3)), XferStatus::Done);
}
