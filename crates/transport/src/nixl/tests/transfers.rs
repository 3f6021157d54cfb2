//! Transfers between two agents in this process: bytes, notifications, refusals, chunk
//! locks and deferred posts, dead peers, prepped lists, spread posts.

use super::*;

#[test]
fn nixl_read_and_write_are_byte_exact() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 1 << 20, 4096);
    let src_b = pattern(7, 1 << 20);
    p.rb.write(0, &src_b).unwrap();
    let src_a = pattern(99, 1 << 20);
    p.ra.write(0, &src_a).unwrap();

    // READ: three scattered pieces of B into A, unaligned to chunks.
    let pieces = [
        (100u64, 5000u64, 3000u64),
        (70_000, 300_000, 65_536),
        (900_000, 1, 77),
    ];
    let descs: Vec<XferDesc> = pieces.iter().map(|&(l, r, n)| desc(l, r, n)).collect();
    let id = p.a.post(XferOp::Read, p.b.name(), &descs, None).unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
    let mut expect = src_a.clone();
    for &(l, r, n) in &pieces {
        let (l, r, n) = (l as usize, r as usize, n as usize);
        expect[l..l + n].copy_from_slice(&src_b[r..r + n]);
    }
    let mut got = vec![0; 1 << 20];
    p.ra.read(0, &mut got).unwrap();
    assert!(got == expect, "READ bytes differ");

    // WRITE: A's (now updated) memory into B, one large and one small piece.
    let pieces = [(0u64, 524_288u64, 262_144u64), (1_000_000, 3, 48_000)];
    let descs: Vec<XferDesc> = pieces.iter().map(|&(l, r, n)| desc(l, r, n)).collect();
    let id = p.a.post(XferOp::Write, p.b.name(), &descs, None).unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
    let mut expect_b = src_b.clone();
    for &(l, r, n) in &pieces {
        let (l, r, n) = (l as usize, r as usize, n as usize);
        expect_b[r..r + n].copy_from_slice(&expect[l..l + n]);
    }
    p.rb.read(0, &mut got).unwrap();
    assert!(got == expect_b, "WRITE bytes differ");

    // A transfer with no bytes completes at once; its notification still arrives.
    let id =
        p.a.post(XferOp::Read, p.b.name(), &[], Some(b"empty"))
            .unwrap();
    assert_eq!(p.a.status(id).unwrap(), XferStatus::Done);
    p.a.release(id).unwrap();
    let n = wait_notifs(&*p.b, 1);
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].msg, b"empty");
    assert!(matches!(
        p.a.release(id),
        Err(TransportError::UnknownXfer(_))
    ));
}

#[test]
fn nixl_notification_arrives_after_the_data() {
    let Some(cfg) = nixl() else { return };
    let len = 8 << 20;
    let p = pair(&cfg, len, 64 << 10);
    for round in 0..5u8 {
        let data = pattern(round, len);
        p.ra.write(0, &data).unwrap();
        let msg = format!("written {round}");
        let id =
            p.a.post(
                XferOp::Write,
                p.b.name(),
                &[desc(0, 0, len as u64)],
                Some(msg.as_bytes()),
            )
            .unwrap();
        // B looks at its memory the moment the notification shows. A keeps checking its
        // transfer meanwhile, as initiators must (NIXL sends a deferred notification from the
        // initiator's status check).
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut n = Vec::new();
        while n.is_empty() && Instant::now() < deadline {
            let _ = p.a.status(id).unwrap();
            n = p.b.drain_notifications();
        }
        assert_eq!(n.len(), 1, "round {round}");
        assert_eq!(n[0].from, p.a.name());
        assert_eq!(n[0].msg, msg.as_bytes());
        let mut got = vec![0; len];
        p.rb.read(0, &mut got).unwrap();
        assert!(got == data, "round {round}: data incomplete when notified");
        assert_eq!(wait(&*p.a, id), XferStatus::Done);
        p.a.release(id).unwrap();
    }

    // READ with a notification: the target (B) is told after A has its bytes.
    let id =
        p.a.post(
            XferOp::Read,
            p.b.name(),
            &[desc(0, 0, 4096)],
            Some(b"read done"),
        )
        .unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
    let n = wait_notifs(&*p.b, 1);
    assert_eq!(n[0].msg, b"read done");

    // Plain notifications, both ways, in order, empty and at the size limit.
    let big = vec![0xabu8; MAX_NOTIFICATION_BYTES];
    p.a.send_notification(p.b.name(), b"one").unwrap();
    p.a.send_notification(p.b.name(), b"").unwrap();
    p.a.send_notification(p.b.name(), &big).unwrap();
    p.b.send_notification(p.a.name(), b"back").unwrap();
    let n = wait_notifs(&*p.b, 3);
    let msgs: Vec<&[u8]> = n.iter().map(|n| n.msg.as_slice()).collect();
    assert_eq!(msgs, vec![&b"one"[..], &b""[..], &big[..]]);
    assert_eq!(wait_notifs(&*p.a, 1)[0].msg, b"back");
    assert!(matches!(
        p.a.send_notification(p.b.name(), &vec![0; MAX_NOTIFICATION_BYTES + 1]),
        Err(TransportError::NotificationTooLarge { .. })
    ));
    assert!(matches!(
        p.a.send_notification("nobody", b"x"),
        Err(TransportError::UnknownPeer(_))
    ));
    assert!(p.a.drain_notifications().is_empty());
}

#[test]
fn nixl_out_of_bounds_and_unknown_targets_are_refused() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 64 << 10, 4096);
    let b = p.b.name().to_string();
    let len = 64u64 << 10;
    let oob = |d: XferDesc| p.a.post(XferOp::Read, &b, &[d], None);
    assert!(matches!(
        oob(desc(0, len - 10, 11)),
        Err(TransportError::OutOfBounds { .. })
    ));
    assert!(matches!(
        oob(desc(len, 0, 1)),
        Err(TransportError::OutOfBounds { .. })
    ));
    assert!(matches!(
        oob(desc(0, u64::MAX, 2)),
        Err(TransportError::OutOfBounds { .. })
    ));
    assert!(matches!(
        oob(XferDesc {
            remote_region: 9,
            ..desc(0, 0, 1)
        }),
        Err(TransportError::UnknownRegion { region: 9 })
    ));
    assert!(matches!(
        oob(XferDesc {
            local_region: 5,
            ..desc(0, 0, 1)
        }),
        Err(TransportError::UnknownRegion { region: 5 })
    ));
    assert!(matches!(
        p.a.post(XferOp::Write, "nobody", &[desc(0, 0, 1)], None),
        Err(TransportError::UnknownPeer(_))
    ));
    // A refused post leaves nothing locked: the same span works right after.
    let id = oob(desc(0, len - 10, 10)).unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();

    // NIXL itself refuses ranges outside what the peer registered, even past our header: a
    // header claiming region 0 is twice its size lets the local check pass.
    let mut body = decode_md(&p.b.local_metadata().unwrap()).unwrap();
    body.regions[0].2 *= 2;
    p.a.load_remote(&encode_md(&body).unwrap()).unwrap();
    let r = p.a.post(XferOp::Read, &b, &[desc(0, len, 4096)], None);
    assert!(matches!(r, Err(TransportError::Io(_))), "{r:?}");
    assert!(p.a.drain_dead_peers().is_empty(), "B is alive");
    assert!(
        p.b.drain_notifications().is_empty(),
        "probes are not delivered"
    );
    // After B deregisters, reloading its metadata makes region 0 unknown.
    p.b.deregister(0).unwrap();
    p.a.load_remote(&p.b.local_metadata().unwrap()).unwrap();
    assert!(matches!(
        oob(desc(0, 0, 1)),
        Err(TransportError::UnknownRegion { region: 0 })
    ));
    assert!(matches!(
        p.a.register(0, p.ra.clone()),
        Err(TransportError::AlreadyRegistered(0))
    ));
}

/// A transfer released while in flight: NIXL may keep running it (a zombie), and the transport
/// says so until NIXL let it go, which it does in bounded time.
#[test]
fn nixl_a_transfer_released_in_flight_runs_until_nixl_lets_it_go() {
    let Some(cfg) = nixl() else { return };
    let len = 64 << 20;
    let p = pair(&cfg, len, 1 << 20);
    let b = p.b.name().to_string();
    let id =
        p.a.post(XferOp::Read, &b, &[desc(0, 0, len as u64)], None)
            .unwrap();
    p.a.release(id).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.a.still_running(id) {
        assert!(Instant::now() < deadline, "NIXL never let the transfer go");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!p.a.still_running(id));
    assert!(
        !p.a.still_running(XferId(u64::MAX)),
        "an unknown transfer does not run"
    );
}

#[test]
fn nixl_locks_local_chunks_until_release() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 64 << 10, 4096);
    let b = p.b.name().to_string();
    let id =
        p.a.post(XferOp::Read, &b, &[desc(0, 0, 4096)], None)
            .unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    // Chunk 0 is write-locked until release: the engine cannot touch it, and a second
    // transfer on it is accepted but deferred (posted once the chunk is free) rather than
    // waiting in `post`...
    let r1 =
        p.a.post(XferOp::Read, &b, &[desc(100, 0, 10)], None)
            .unwrap();
    let r2 =
        p.a.post(XferOp::Write, &b, &[desc(4000, 0, 200)], None)
            .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(p.a.status(r1).unwrap(), XferStatus::InProgress);
    assert_eq!(p.a.status(r2).unwrap(), XferStatus::InProgress);
    // (a deferred transfer released before it was posted is simply gone)
    let r3 =
        p.a.post(XferOp::Read, &b, &[desc(200, 0, 10)], None)
            .unwrap();
    p.a.release(r3).unwrap();
    assert!(matches!(
        p.a.status(r3),
        Err(TransportError::UnknownXfer(_))
    ));
    // ...while other chunks stay free.
    let id2 =
        p.a.post(XferOp::Write, &b, &[desc(8192, 0, 4096)], None)
            .unwrap();
    let id3 =
        p.a.post(XferOp::Write, &b, &[desc(8192, 4096, 4096)], None)
            .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let ra = p.ra.clone();
    let t = std::thread::spawn(move || {
        ra.write(0, &[1]).unwrap(); // waits for the write lock
        tx.send(()).unwrap();
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "chunk not locked"
    );
    p.a.release(id).unwrap();
    rx.recv_timeout(Duration::from_secs(10))
        .expect("chunk not unlocked by release");
    t.join().unwrap();
    for id in [r1, r2, id2, id3] {
        assert_eq!(wait(&*p.a, id), XferStatus::Done);
        p.a.release(id).unwrap();
    }

    // Deregistering while a transfer is posted keeps the NIXL registration until its release.
    let id =
        p.a.post(XferOp::Write, &b, &[desc(0, 0, 64 << 10)], None)
            .unwrap();
    p.a.deregister(0).unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
    assert!(matches!(
        p.a.post(XferOp::Write, &b, &[desc(0, 0, 1)], None),
        Err(TransportError::UnknownRegion { region: 0 })
    ));
    p.a.register(0, p.ra.clone()).unwrap();
}

#[test]
fn nixl_dead_peer_is_reported() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 1 << 20, 64 << 10);
    let bname = p.b.name().to_string();
    let id =
        p.a.post(XferOp::Read, &bname, &[desc(0, 0, 1 << 20)], None)
            .unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
    assert!(p.a.drain_dead_peers().is_empty());
    drop(p.b); // B's agent is destroyed: its endpoints close.

    let deadline = Instant::now() + Duration::from_secs(20);
    let mut outcome = None;
    while Instant::now() < deadline {
        match p.a.post(XferOp::Read, &bname, &[desc(0, 0, 1 << 20)], None) {
            Ok(id) => {
                let s = wait(&*p.a, id);
                p.a.release(id).unwrap();
                if let XferStatus::Failed(m) = s {
                    outcome = Some(format!("status failed: {m}"));
                    break;
                }
            }
            Err(e) => {
                outcome = Some(format!("post refused: {e}"));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let outcome = outcome.expect("transfers to a dead peer kept succeeding");
    eprintln!("dead peer: {outcome}");
    assert_eq!(p.a.drain_dead_peers(), vec![bname.clone()], "{outcome}");
    assert!(p.a.drain_dead_peers().is_empty(), "reported once");
    assert!(matches!(
        p.a.post(XferOp::Read, &bname, &[desc(0, 0, 1)], None),
        Err(TransportError::PeerDead(_))
    ));
    assert!(matches!(
        p.a.send_notification(&bname, b"x"),
        Err(TransportError::PeerDead(_))
    ));
    p.a.forget_remote(&bname);
    assert!(matches!(
        p.a.post(XferOp::Read, &bname, &[desc(0, 0, 1)], None),
        Err(TransportError::UnknownPeer(_))
    ));
}

/// Descriptors that are each one whole chunk on both sides go through lists prepped once per
/// region (`make_xfer_req`); anything else through `create_xfer_req`. Both are byte-exact, and
/// the lists follow the memory: re-registered regions and reloaded peers get fresh ones.
#[test]
fn nixl_whole_chunk_posts_use_prepped_lists_and_follow_the_memory() {
    let Some(cfg) = nixl() else { return };
    let (chunk, blocks) = (4096usize, 64usize);
    let len = chunk * blocks;
    let p = pair(&cfg, len, chunk);
    let b_name = p.b.name().to_string();
    // Scattered whole chunks: block i of A <-> block (blocks - 1 - i) of B, every other one.
    let whole: Vec<XferDesc> = (0..blocks / 2)
        .map(|i| {
            let (l, r) = (2 * i, blocks - 1 - 2 * i);
            desc((l * chunk) as u64, (r * chunk) as u64, chunk as u64)
        })
        .collect();
    let check = |ra: &KvRegion, rb: &KvRegion, descs: &[XferDesc], what: &str| {
        for d in descs {
            let (mut x, mut y) = (vec![0u8; d.len as usize], vec![0u8; d.len as usize]);
            ra.read(d.local_offset as usize, &mut x).unwrap();
            rb.read(d.remote_offset as usize, &mut y).unwrap();
            assert!(
                x == y,
                "{what}: bytes differ at local offset {}",
                d.local_offset
            );
        }
    };
    let run = |a: &NixlTransport, op: XferOp, descs: &[XferDesc]| {
        let id = a.post(op, &b_name, descs, Some(b"n")).unwrap();
        assert_eq!(wait(a, id), XferStatus::Done);
        a.release(id).unwrap();
    };
    p.rb.write(0, &pattern(1, len)).unwrap();
    run(&p.a, XferOp::Read, &whole);
    check(&p.ra, &p.rb, &whole, "READ of whole chunks");
    assert_eq!(p.a.prepped_transfers(), 1);
    p.ra.write(0, &pattern(2, len)).unwrap();
    run(&p.a, XferOp::Write, &whole);
    check(&p.ra, &p.rb, &whole, "WRITE of whole chunks");
    assert_eq!(p.a.prepped_transfers(), 2);
    // Part of a chunk: from scratch, equally exact.
    let part = vec![desc(100, 5 * chunk as u64 + 7, 3000)];
    p.rb.write(0, &pattern(3, len)).unwrap();
    run(&p.a, XferOp::Read, &part);
    check(&p.ra, &p.rb, &part, "READ of part of a chunk");
    assert_eq!(p.a.prepped_transfers(), 2);
    // B moves its region 0 to new memory; A reloads B and must not use the old list.
    p.b.deregister(0).unwrap();
    let rb2 = Arc::new(KvRegion::new(len, chunk));
    rb2.write(0, &pattern(4, len)).unwrap();
    p.b.register(0, rb2.clone()).unwrap();
    p.a.load_remote(&p.b.local_metadata().unwrap()).unwrap();
    run(&p.a, XferOp::Read, &whole);
    check(&p.ra, &rb2, &whole, "READ after B re-registered");
    // A moves its own region 0 too.
    p.a.deregister(0).unwrap();
    let ra2 = Arc::new(KvRegion::new(len, chunk));
    ra2.write(0, &pattern(5, len)).unwrap();
    p.a.register(0, ra2.clone()).unwrap();
    run(&p.a, XferOp::Write, &whole);
    check(&ra2, &rb2, &whole, "WRITE after A re-registered");
    assert_eq!(p.a.prepped_transfers(), 4);
    let notes = wait_notifs(&*p.b, 5);
    assert_eq!(notes.len(), 5, "one notification per transfer");
}

#[test]
fn nixl_few_large_descriptors_are_spread_over_the_pool_and_land_exactly() {
    let Some(cfg) = nixl() else { return };
    // 64 MiB in one region-long descriptor: 128 pieces of 512 KiB for the 2 pool threads.
    let len = 64 << 20;
    let p = pair(&cfg, len, 1 << 20);
    let b_name = p.b.name().to_string();
    let run = |op: XferOp, descs: &[XferDesc]| {
        let id = p.a.post(op, &b_name, descs, Some(b"spread")).unwrap();
        assert_eq!(wait(&*p.a, id), XferStatus::Done);
        p.a.release(id).unwrap();
    };
    let same = |what: &str| {
        let (mut x, mut y) = (vec![0u8; len], vec![0u8; len]);
        p.ra.read(0, &mut x).unwrap();
        p.rb.read(0, &mut y).unwrap();
        assert!(x == y, "{what}: the regions differ");
    };
    p.rb.write(0, &pattern(7, len)).unwrap();
    run(XferOp::Read, &[desc(0, 0, len as u64)]);
    same("READ of one 64 MiB descriptor");
    p.ra.write(0, &pattern(8, len)).unwrap();
    run(XferOp::Write, &[desc(0, 0, len as u64)]);
    same("WRITE of one 64 MiB descriptor");
    assert_eq!(p.a.spread_posts(), 2);
    // Two descriptors of 1 MiB (pieces would be under MIN_SPREAD_PIECE): posted as they are,
    // and still exact; the notifications of all three arrive once each.
    p.rb.write(0, &pattern(9, len)).unwrap();
    let two = [desc(0, 3 << 20, 1 << 20), desc(5 << 20, 0, 1 << 20)];
    run(XferOp::Read, &two);
    for d in &two {
        let (mut x, mut y) = (vec![0u8; d.len as usize], vec![0u8; d.len as usize]);
        p.ra.read(d.local_offset as usize, &mut x).unwrap();
        p.rb.read(d.remote_offset as usize, &mut y).unwrap();
        assert!(x == y, "small READ at {}", d.local_offset);
    }
    assert_eq!(p.a.spread_posts(), 2);
    let notes = wait_notifs(&*p.b, 3);
    assert_eq!(notes.len(), 3, "{notes:?}");
    // Without a pool (num_threads=0) nothing is cut.
    let mut solo = cfg.clone();
    solo.set_backend_param("num_threads", "0");
    let q = pair(&solo, len, 1 << 20);
    let id =
        q.a.post(XferOp::Read, q.b.name(), &[desc(0, 0, len as u64)], None)
            .unwrap();
    assert_eq!(wait(&*q.a, id), XferStatus::Done);
    q.a.release(id).unwrap();
    assert_eq!(q.a.spread_posts(), 0);
}
