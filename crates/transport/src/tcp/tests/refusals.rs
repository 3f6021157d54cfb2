//! What an agent refuses: descriptors outside what it or its peer registered, metadata that lies or does not parse, bytes no grant covers.

use super::*;

#[test]
fn local_descriptors_are_checked_at_post() {
    let mut rng = Rng(1);
    let a = agent("la", TcpConfig::default());
    let b = agent("lb", TcpConfig::default());
    regions(&a, &[1000], &mut rng);
    regions(&b, &[1000], &mut rng);
    pair(&a, &b);
    let d = |lr, lo, rr, ro, len| XferDesc {
        local_region: lr,
        local_offset: lo,
        remote_region: rr,
        remote_offset: ro,
        len,
    };
    for op in [XferOp::Read, XferOp::Write] {
        assert_eq!(
            a.post(op, "lb", &[d(5, 0, 0, 0, 1)], None),
            Err(TransportError::UnknownRegion { region: 5 })
        );
        assert!(matches!(
            a.post(op, "lb", &[d(0, 990, 0, 0, 11)], None),
            Err(TransportError::OutOfBounds { region: 0, .. })
        ));
        assert!(matches!(
            a.post(op, "lb", &[d(0, u64::MAX - 5, 0, 0, 64)], None),
            Err(TransportError::OutOfBounds { .. })
        ));
        // Remote descriptors are checked against the peer's metadata too.
        assert!(matches!(
            a.post(op, "lb", &[d(0, 0, 0, 995, 6)], None),
            Err(TransportError::OutOfBounds { .. })
        ));
        assert_eq!(
            a.post(op, "lb", &[d(0, 0, 9, 0, 1)], None),
            Err(TransportError::UnknownRegion { region: 9 })
        );
        assert_eq!(
            a.post(op, "nobody", &[], None),
            Err(TransportError::UnknownPeer("nobody".into()))
        );
    }
}

#[test]
fn the_peer_refuses_what_it_did_not_register() {
    let mut rng = Rng(9);
    let a = agent("ra", TcpConfig::default());
    let b = agent("rb", TcpConfig::default());
    regions(&a, &[1 << 20], &mut rng);
    let rb = regions(&b, &[10_000], &mut rng);
    // Metadata that lies: region 0 is bigger, and region 7 exists.
    let mut meta = wire::decode_meta(&b.local_metadata().unwrap()).unwrap();
    meta.regions = vec![(0, 1 << 20), (7, 1 << 20)];
    a.load_remote(&wire::encode_meta(&meta).unwrap()).unwrap();
    let before = snapshot(&rb[0]);
    let bad = [
        (0, 9_990, 64),
        (0, 10_000, 1),
        (0, 0, 10_001),
        (7, 0, 1),
        (0, 1 << 19, 1 << 19),
    ];
    for (region, offset, len) in bad {
        for op in [XferOp::Write, XferOp::Read] {
            // A good descriptor first: the whole request is refused, not only the bad piece.
            let descs = [
                XferDesc {
                    local_region: 0,
                    local_offset: 0,
                    remote_region: 0,
                    remote_offset: 0,
                    len: 100,
                },
                XferDesc {
                    local_region: 0,
                    local_offset: 1000,
                    remote_region: region,
                    remote_offset: offset,
                    len,
                },
            ];
            let id = a.post(op, "rb", &descs, Some(b"never")).unwrap();
            match wait(&*a, id, Duration::from_secs(10)) {
                XferStatus::Failed(msg) => assert!(msg.contains("refused"), "{msg}"),
                s => panic!("{op:?} of {region}:{offset}+{len} ended {s:?}"),
            }
        }
    }
    assert!(snapshot(&rb[0]) == before, "a refused WRITE changed memory");
    assert!(
        b.drain_notifications().is_empty(),
        "refused transfers notified"
    );
    // The connection is still in step: a good transfer goes through.
    let ok = [XferDesc {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 5,
        len: 9_995,
    }];
    let id = a.post(XferOp::Write, "rb", &ok, Some(b"fine")).unwrap();
    assert_eq!(wait(&*a, id, Duration::from_secs(10)), XferStatus::Done);
    let n = wait_for(Duration::from_secs(5), || b.drain_notifications().pop()).unwrap();
    assert_eq!(n.msg, b"fine");
    assert!(b.drain_dead_peers().is_empty() && a.drain_dead_peers().is_empty());
}

#[test]
fn a_peer_that_is_not_who_the_metadata_says_is_refused() {
    let a = agent("wa", fast());
    let b = agent("wb", fast());
    let mut meta = wire::decode_meta(&b.local_metadata().unwrap()).unwrap();
    meta.name = "impostor".into();
    a.load_remote(&wire::encode_meta(&meta).unwrap()).unwrap();
    let dead = wait_for(Duration::from_secs(5), || {
        let d = a.drain_dead_peers();
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(dead, Some(vec!["impostor".to_string()]));
    assert_eq!(
        a.post(XferOp::Read, "impostor", &[], None),
        Err(TransportError::PeerDead("impostor".into()))
    );
}

#[test]
fn bad_metadata_is_rejected_without_panic() {
    let a = agent("ma0", TcpConfig::default());
    let good = a.local_metadata().unwrap();
    let meta = wire::decode_meta(&good).unwrap();
    let mut wrong_version = good.clone();
    wrong_version[wire::META_MAGIC.len()] = 99;
    let mut trailing = good.clone();
    trailing.push(0);
    let mut oversized = good.clone();
    oversized.resize(wire::MAX_METADATA_BYTES + 1, 0);
    let enc = |m: &Meta| wire::encode_meta(m).unwrap();
    let cases = vec![
        vec![],
        b"HOTCPM".to_vec(),
        b"garbage".to_vec(),
        wrong_version,
        trailing,
        oversized,
        good[..good.len() - 1].to_vec(),
        enc(&Meta {
            name: String::new(),
            ..meta.clone()
        }),
        enc(&Meta {
            port: 0,
            ..meta.clone()
        }),
        enc(&Meta {
            regions: vec![(1, 5), (1, 6)],
            ..meta.clone()
        }),
        enc(&Meta {
            host: "h".repeat(300),
            ..meta.clone()
        }),
    ];
    for c in &cases {
        assert!(
            matches!(a.load_remote(c), Err(TransportError::BadMetadata(_))),
            "accepted {:?}",
            &c[..c.len().min(12)]
        );
    }
    // Random bytes and bit flips: errors or peers, never a panic.
    let mut rng = Rng(3);
    for _ in 0..2000 {
        let n = rng.below(64) as usize;
        let mut m = if rng.below(2) == 0 {
            rng.bytes(n)
        } else {
            good.clone()
        };
        if !m.is_empty() {
            let i = rng.below(m.len() as u64) as usize;
            m[i] ^= 1 << rng.below(8);
        }
        if m.len() > 8 && rng.below(4) == 0 {
            m[7..].iter_mut().for_each(|b| *b = rng.next_u64() as u8);
        }
        let _ = wire::decode_meta(&m);
    }
}

// ----- grants -----

fn post_one(
    from: &TcpTransport,
    op: XferOp,
    to: &TcpTransport,
    remote_offset: u64,
    len: u64,
) -> XferStatus {
    let local = Arc::new(KvRegion::new(len as usize, 4096));
    local.write(0, &vec![0xee; len as usize]).unwrap();
    let _ = from.deregister(91);
    from.register(91, local).unwrap();
    let id = from
        .post(
            op,
            to.name(),
            &[XferDesc {
                local_region: 91,
                local_offset: 0,
                remote_region: 0,
                remote_offset,
                len,
            }],
            None,
        )
        .unwrap();
    wait(from, id, Duration::from_secs(3))
}

/// With grants checked, a peer reads or writes only bytes granted to the name it proved, for
/// the op granted, while the grant lives; everything else is refused, counted, and a refused
/// WRITE lands no byte. A negative control: the same requests without grant checks succeed.
#[test]
fn with_grants_checked_only_granted_bytes_are_served_to_their_peer() {
    let key = crate::auth::ClusterKey::generate().unwrap();
    let mut rng = Rng(9);
    let p = agent(
        "p-granting",
        TcpConfig {
            check_grants: true,
            ..keyed(Some(&key))
        },
    );
    let mine = regions(&p, &[8192], &mut rng);
    let d = agent("d-granted", keyed(Some(&key)));
    let m = agent("mallory-r0", keyed(Some(&key)));
    pair(&p, &d);
    pair(&p, &m);
    let ext = |offset, len| crate::Extent {
        region: 0,
        offset,
        len,
    };
    p.grant(
        crate::GrantId(1),
        XferOp::Read,
        &["d-granted".into()],
        &[ext(1024, 2048)],
    )
    .unwrap();
    p.grant(
        crate::GrantId(2),
        XferOp::Write,
        &["d-granted".into()],
        &[ext(4096, 1024)],
    )
    .unwrap();
    assert_eq!(post_one(&d, XferOp::Read, &p, 1024, 2048), XferStatus::Done);
    assert_eq!(
        post_one(&d, XferOp::Write, &p, 4096, 1024),
        XferStatus::Done
    );
    let before = snapshot(&mine[0]);
    let refused = [
        post_one(&d, XferOp::Read, &p, 1000, 64), // starts before the grant
        post_one(&d, XferOp::Read, &p, 3000, 100), // runs past it
        post_one(&d, XferOp::Read, &p, 4096, 64), // granted for WRITE only
        post_one(&d, XferOp::Write, &p, 1024, 64), // granted for READ only
        post_one(&m, XferOp::Read, &p, 1024, 64), // another peer
        post_one(&m, XferOp::Write, &p, 4096, 64), // another peer
    ];
    for (i, s) in refused.iter().enumerate() {
        assert!(
            matches!(s, XferStatus::Failed(e) if e.contains("grant")),
            "case {i}: {s:?}"
        );
    }
    assert_eq!(snapshot(&mine[0]), before, "a refused WRITE landed bytes");
    assert_eq!(p.refused_transfers(), 6);
    p.revoke(crate::GrantId(1));
    assert!(matches!(
        post_one(&d, XferOp::Read, &p, 1024, 64),
        XferStatus::Failed(_)
    ));
    assert_eq!(p.refused_transfers(), 7);
    // The connection survives refusals: the live grant still serves.
    assert_eq!(post_one(&d, XferOp::Write, &p, 4096, 512), XferStatus::Done);
    // Negative control: a target that does not check grants serves all of it.
    let open = agent("p-open", keyed(Some(&key)));
    regions(&open, &[8192], &mut rng);
    pair(&open, &m);
    assert_eq!(post_one(&m, XferOp::Read, &open, 0, 8192), XferStatus::Done);
    assert_eq!(open.refused_transfers(), 0);
}
