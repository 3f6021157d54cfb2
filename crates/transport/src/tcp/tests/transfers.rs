//! Transfers between two agents: byte-exact landing, many in flight, notifications in order, release and pauses mid-transfer.

use super::*;

/// Landing reads that never poll and ones that poll for as long as allowed land the same bytes
/// (the poll is a non-blocking read of the same socket; a short or empty one must not lose or
/// reorder a byte): the conformance suite's READs and WRITEs (byte-exact, each notification
/// after its data) over each setting. The default setting runs the whole suite in
/// `tests/conformance.rs`.
#[test]
fn landing_with_and_without_polling_is_byte_exact() {
    for spin in [Duration::ZERO, crate::tcp::MAX_LANDING_SPIN] {
        let cfg = TcpConfig {
            landing_spin: spin,
            ..TcpConfig::default()
        };
        let local = agent("spin-local", cfg.clone());
        let mut remote = InProcessRemote::new(agent("spin-remote", cfg), &[4 << 20], 0xfeed);
        let (region, peer) = connect(&*local, &mut remote, 4 << 20, 0x1234).unwrap();
        check_read_write(&*local, &mut remote, &region, &peer, 0..6, 0xfeed)
            .unwrap_or_else(|e| panic!("landing spin {spin:?}: {e}"));
    }
}

#[test]
fn many_transfers_in_flight_from_several_threads_both_ways() {
    let a = agent("ma", TcpConfig::default());
    let b = agent("mb", TcpConfig::default());
    let mut rng = Rng(77);
    // Each thread owns a disjoint 256 KiB slice of every region.
    let threads = 4usize;
    let slice = 256 * 1024;
    regions(&a, &[threads * slice], &mut rng);
    regions(&b, &[threads * slice], &mut rng);
    pair(&a, &b);
    let mut handles = Vec::new();
    for t in 0..threads {
        for (init, tgt) in [(a.clone(), b.clone()), (b.clone(), a.clone())] {
            // Each direction uses its own half of the slice (byte-exactness is checked elsewhere:
            // this is about many transfers at once, both ways, without a hang).
            let half = slice / 2;
            let base = (t * slice + if init.name() == "ma" { 0 } else { half }) as u64;
            handles.push(std::thread::spawn(move || {
                let mut ids = Vec::new();
                for k in 0..30u64 {
                    let op = if k % 2 == 0 {
                        XferOp::Read
                    } else {
                        XferOp::Write
                    };
                    let off = base + (k % 8) * 16 * 1024;
                    let d = XferDesc {
                        local_region: 0,
                        local_offset: off,
                        remote_region: 0,
                        remote_offset: off,
                        len: 16 * 1024,
                    };
                    ids.push(init.post(op, tgt.name(), &[d], None).unwrap());
                }
                for id in ids {
                    assert_eq!(wait(&*init, id, Duration::from_secs(30)), XferStatus::Done);
                    init.release(id).unwrap();
                }
            }));
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    assert!(a.drain_dead_peers().is_empty() && b.drain_dead_peers().is_empty());
}

#[test]
fn notifications_arrive_in_order_with_the_sender_name_and_are_bounded() {
    let a = agent("sa", TcpConfig::default());
    let b = agent("sb", TcpConfig::default());
    pair(&a, &b);
    for i in 0..100u32 {
        a.send_notification("sb", &i.to_le_bytes()).unwrap();
    }
    let biggest = vec![7u8; MAX_NOTIFICATION_BYTES];
    a.send_notification("sb", &biggest).unwrap();
    let too_big = vec![7u8; MAX_NOTIFICATION_BYTES + 1];
    assert_eq!(
        a.send_notification("sb", &too_big),
        Err(TransportError::NotificationTooLarge {
            len: MAX_NOTIFICATION_BYTES + 1,
            max: MAX_NOTIFICATION_BYTES
        })
    );
    assert!(matches!(
        a.post(XferOp::Read, "sb", &[], Some(&too_big)),
        Err(TransportError::NotificationTooLarge { .. })
    ));
    let mut got = Vec::new();
    wait_for(Duration::from_secs(10), || {
        got.extend(b.drain_notifications());
        (got.len() >= 101).then_some(())
    })
    .expect("all notifications");
    assert_eq!(got.len(), 101);
    for (i, n) in got[..100].iter().enumerate() {
        assert_eq!(n.from, "sa");
        assert_eq!(n.msg, (i as u32).to_le_bytes());
    }
    assert_eq!(got[100].msg, biggest);
    assert_eq!(
        a.send_notification("nobody", b"x"),
        Err(TransportError::UnknownPeer("nobody".into()))
    );
}

#[test]
fn release_aborts_and_the_connection_stays_usable() {
    let mut rng = Rng(8);
    let a = agent("xa", TcpConfig::default());
    let b = agent("xb", TcpConfig::default());
    let len = 8 << 20;
    let ra = regions(&a, &[len], &mut rng);
    let rb = regions(&b, &[len], &mut rng);
    pair(&a, &b);
    let whole = [XferDesc {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 0,
        len: len as u64,
    }];
    for _ in 0..5 {
        let r = a.post(XferOp::Read, "xb", &whole, None).unwrap();
        let w = a.post(XferOp::Write, "xb", &whole, None).unwrap();
        a.release(r).unwrap();
        a.release(w).unwrap();
        assert_eq!(a.status(r), Err(TransportError::UnknownXfer(r)));
        assert_eq!(a.release(r), Err(TransportError::UnknownXfer(r)));
    }
    // Later transfers still land byte-exact.
    rb[0].write(0, &rng.bytes(len)).unwrap();
    let id = a.post(XferOp::Read, "xb", &whole, None).unwrap();
    assert_eq!(wait(&*a, id, Duration::from_secs(20)), XferStatus::Done);
    assert!(snapshot(&ra[0]) == snapshot(&rb[0]));
    assert!(a.drain_dead_peers().is_empty());
}

/// A transfer whose far side pauses in the middle of a span (a chunk there is locked by the
/// engine) makes the near side time out inside a vectored call with part of a group moved; the
/// rest goes through the staging buffer, and every byte lands once, in place.
#[test]
fn a_span_paused_mid_group_lands_byte_exact() {
    let mut rng = Rng(12);
    let a = agent("pa", TcpConfig::default());
    let b = agent("pb", TcpConfig::default());
    // Longer than the loopback socket buffers hold, so the near side stalls too.
    let len = 32 << 20;
    let ra = regions(&a, &[len], &mut rng);
    let rb = regions(&b, &[len], &mut rng);
    pair(&a, &b);
    let span = [XferDesc {
        local_region: 0,
        local_offset: 1234,
        remote_region: 0,
        remote_offset: 777,
        len: (len - 4096) as u64,
    }];
    for op in [XferOp::Read, XferOp::Write] {
        rb[0].write(0, &rng.bytes(len)).unwrap();
        ra[0].write(0, &rng.bytes(len)).unwrap();
        let (mut want_a, mut want_b) = (vec![snapshot(&ra[0])], vec![snapshot(&rb[0])]);
        apply(op, &span, &mut want_a, &mut want_b);
        // b's chunk at 4 MiB: b cannot send (READ) or land (WRITE) past it for a while.
        let held = rb[0].lock_span_mut_owned(4 << 20, 1).unwrap();
        let id = a.post(op, "pb", &span, None).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(a.status(id), Ok(XferStatus::InProgress), "{op:?}");
        drop(held);
        assert_eq!(wait(&*a, id, Duration::from_secs(20)), XferStatus::Done);
        a.release(id).unwrap();
        assert!(snapshot(&ra[0]) == want_a[0], "{op:?}: a's memory differs");
        assert!(snapshot(&rb[0]) == want_b[0], "{op:?}: b's memory differs");
    }
    assert!(a.drain_dead_peers().is_empty());
    // a's WRITE stalled while b could not land: a staged the rest of one piece (a chunk of
    // 3000 bytes here), never the rest of a whole group (up to 2 MiB).
    let staged = a.inner.staged_peak();
    assert!(staged > 0, "the WRITE never stalled");
    assert!(staged <= 3000, "{staged} bytes staged at once");
}

/// Applies `descs` to snapshots, as the transfer should.
fn apply(op: XferOp, descs: &[XferDesc], local: &mut [Vec<u8>], remote: &mut [Vec<u8>]) {
    for d in descs {
        let (lo, ro, n) = (
            d.local_offset as usize,
            d.remote_offset as usize,
            d.len as usize,
        );
        match op {
            XferOp::Read => {
                let src = remote[d.remote_region as usize][ro..ro + n].to_vec();
                local[d.local_region as usize][lo..lo + n].copy_from_slice(&src);
            }
            XferOp::Write => {
                let src = local[d.local_region as usize][lo..lo + n].to_vec();
                remote[d.remote_region as usize][ro..ro + n].copy_from_slice(&src);
            }
        }
    }
}
