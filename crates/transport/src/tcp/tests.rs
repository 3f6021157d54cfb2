//! Two (or more) tcp agents in one process, on 127.0.0.1. Every wait is bounded.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, Meta};
use super::{TcpConfig, TcpTransport};
use crate::{
    KvRegion, Transport, TransportError, XferDesc, XferId, XferOp, XferStatus,
    MAX_NOTIFICATION_BYTES,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn fast() -> TcpConfig {
    TcpConfig {
        keepalive: Duration::from_millis(50),
        dead_after: Duration::from_millis(400),
        ..TcpConfig::default()
    }
}

fn agent(name: &str, cfg: TcpConfig) -> Arc<TcpTransport> {
    TcpTransport::new(name, cfg).expect("bind on loopback")
}

/// Registers `lens` as regions 0.. (odd chunk sizes, so pieces straddle chunks).
fn regions(t: &TcpTransport, lens: &[usize], rng: &mut Rng) -> Vec<Arc<KvRegion>> {
    lens.iter()
        .enumerate()
        .map(|(i, len)| {
            let r = Arc::new(KvRegion::new(*len, 3000 + 1000 * i));
            r.write(0, &rng.bytes(*len)).unwrap();
            t.register(i as u32, r.clone()).unwrap();
            r
        })
        .collect()
}

/// Loads each agent's metadata into the other.
fn pair(a: &TcpTransport, b: &TcpTransport) {
    assert_eq!(
        a.load_remote(&b.local_metadata().unwrap()).unwrap(),
        b.name()
    );
    assert_eq!(
        b.load_remote(&a.local_metadata().unwrap()).unwrap(),
        a.name()
    );
}

fn wait(t: &dyn Transport, id: XferId, limit: Duration) -> XferStatus {
    let start = Instant::now();
    loop {
        let s = t.status(id).unwrap();
        if s != XferStatus::InProgress || start.elapsed() > limit {
            return s;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn snapshot(r: &KvRegion) -> Vec<u8> {
    let mut v = vec![0; r.len()];
    r.read(0, &mut v).unwrap();
    v
}

/// Random descriptors whose *destinations* never overlap (sources may), so the expected result
/// does not depend on order. `dst_local`: the destination is the local side (READ).
fn random_descs(
    rng: &mut Rng,
    local_lens: &[usize],
    remote_lens: &[usize],
    dst_local: bool,
    n: usize,
) -> Vec<XferDesc> {
    let dst_lens = if dst_local { local_lens } else { remote_lens };
    // Cut each destination region into slots of 1..=slot bytes and pick some of them.
    let slot = 1 + rng.below(70_000) as usize;
    let mut slots: Vec<(u32, u64)> = Vec::new();
    for (r, len) in dst_lens.iter().enumerate() {
        let mut o = 0;
        while o + slot <= *len {
            slots.push((r as u32, o as u64));
            o += slot;
        }
    }
    let mut out = Vec::new();
    for _ in 0..n.min(slots.len()) {
        let (dr, doff) = slots.swap_remove(rng.below(slots.len() as u64) as usize);
        let len = 1 + rng.below(slot as u64);
        let doff = doff + rng.below(slot as u64 - len + 1);
        let src_lens = if dst_local { remote_lens } else { local_lens };
        let sr = rng.below(src_lens.len() as u64) as u32;
        let soff = rng.below(src_lens[sr as usize] as u64 - len + 1);
        let (lr, lo, rr, ro) = if dst_local {
            (dr, doff, sr, soff)
        } else {
            (sr, soff, dr, doff)
        };
        out.push(XferDesc {
            local_region: lr,
            local_offset: lo,
            remote_region: rr,
            remote_offset: ro,
            len,
        });
    }
    out
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

#[test]
fn read_and_write_random_descriptor_lists_byte_exact() {
    random_rounds(TcpConfig::default(), 40);
}

/// Landing reads that never poll and ones that poll for as long as allowed land the same bytes
/// (the poll is a non-blocking read of the same socket; a short or empty one must not lose or
/// reorder a byte).
#[test]
fn landing_with_and_without_polling_is_byte_exact() {
    for spin in [Duration::ZERO, super::MAX_LANDING_SPIN] {
        random_rounds(
            TcpConfig {
                landing_spin: spin,
                ..TcpConfig::default()
            },
            12,
        );
    }
}

/// `rounds` READs and WRITEs of random descriptor lists between two agents with `cfg`, in both
/// directions, each checked byte for byte on both sides.
fn random_rounds(cfg: TcpConfig, rounds: usize) {
    let mut rng = Rng(0x5eed);
    let a = agent("a", cfg.clone());
    let b = agent("b", cfg);
    let (la, lb) = ([1 << 20, 700_000], [900_000, 1 << 20]);
    let ra = regions(&a, &la, &mut rng);
    let rb = regions(&b, &lb, &mut rng);
    pair(&a, &b);
    for round in 0..rounds {
        let op = if round % 2 == 0 {
            XferOp::Read
        } else {
            XferOp::Write
        };
        // Alternate the initiator so both directions (two connections) are used.
        let (init, tgt, li, lt, ri, rt) = if round % 4 < 2 {
            (&a, &b, &la[..], &lb[..], &ra, &rb)
        } else {
            (&b, &a, &lb[..], &la[..], &rb, &ra)
        };
        let n = 1 + rng.below(40) as usize;
        let descs = random_descs(&mut rng, li, lt, op == XferOp::Read, n);
        let mut want_i: Vec<Vec<u8>> = ri.iter().map(|r| snapshot(r)).collect();
        let mut want_t: Vec<Vec<u8>> = rt.iter().map(|r| snapshot(r)).collect();
        apply(op, &descs, &mut want_i, &mut want_t);
        let id = init.post(op, tgt.name(), &descs, None).unwrap();
        assert_eq!(wait(&**init, id, Duration::from_secs(20)), XferStatus::Done);
        init.release(id).unwrap();
        assert_eq!(init.status(id), Err(TransportError::UnknownXfer(id)));
        for (r, w) in ri.iter().zip(&want_i) {
            assert!(snapshot(r) == *w, "round {round}: initiator memory differs");
        }
        for (r, w) in rt.iter().zip(&want_t) {
            assert!(snapshot(r) == *w, "round {round}: target memory differs");
        }
    }
    // An empty descriptor list completes too.
    let id = a.post(XferOp::Read, "b", &[], Some(b"empty")).unwrap();
    assert_eq!(wait(&*a, id, Duration::from_secs(5)), XferStatus::Done);
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
fn notification_reaches_the_peer_only_after_the_data() {
    let mut rng = Rng(4242);
    let a = agent("na", TcpConfig::default());
    let b = agent("nb", TcpConfig::default());
    let len = 4 << 20;
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
    for round in 0..6u8 {
        // READ: on the notification, b checks that a's memory already holds b's bytes.
        rb[0].write(0, &rng.bytes(len)).unwrap();
        let want = snapshot(&rb[0]);
        let id = a
            .post(XferOp::Read, "nb", &whole, Some(&[b'R', round]))
            .unwrap();
        let n = wait_for(Duration::from_secs(20), || b.drain_notifications().pop())
            .expect("READ notification");
        assert!(
            snapshot(&ra[0]) == want,
            "READ notification before its data"
        );
        assert_eq!((n.from.as_str(), &n.msg[..]), ("na", &[b'R', round][..]));
        assert_eq!(wait(&*a, id, Duration::from_secs(5)), XferStatus::Done);

        // WRITE: on the notification, b checks its own memory holds a's bytes.
        ra[0].write(0, &rng.bytes(len)).unwrap();
        let want = snapshot(&ra[0]);
        let id = a
            .post(XferOp::Write, "nb", &whole, Some(&[b'W', round]))
            .unwrap();
        let n = wait_for(Duration::from_secs(20), || b.drain_notifications().pop())
            .expect("WRITE notification");
        assert!(
            snapshot(&rb[0]) == want,
            "WRITE notification before its data"
        );
        assert_eq!(n.msg, vec![b'W', round]);
        assert_eq!(wait(&*a, id, Duration::from_secs(5)), XferStatus::Done);
    }
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
            m[7..].iter_mut().for_each(|b| *b = rng.next() as u8);
        }
        let _ = wire::decode_meta(&m);
    }
}

#[test]
fn a_dropped_peer_is_reported_dead_and_its_transfers_fail() {
    let mut rng = Rng(5);
    let a = agent("da", fast());
    let b = agent("db", fast());
    regions(&a, &[1 << 16], &mut rng);
    regions(&b, &[1 << 16], &mut rng);
    pair(&a, &b);
    let d = [XferDesc {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 0,
        len: 1 << 16,
    }];
    let id = a.post(XferOp::Read, "db", &d, None).unwrap();
    assert_eq!(wait(&*a, id, Duration::from_secs(5)), XferStatus::Done);
    drop(b);
    let start = Instant::now();
    let dead = wait_for(Duration::from_secs(3), || {
        let d = a.drain_dead_peers();
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(dead, Some(vec!["db".to_string()]));
    assert!(start.elapsed() < fast().dead_after + Duration::from_millis(1500));
    assert_eq!(
        a.post(XferOp::Read, "db", &d, None),
        Err(TransportError::PeerDead("db".into()))
    );
    assert_eq!(
        a.send_notification("db", b"x"),
        Err(TransportError::PeerDead("db".into()))
    );
    // Reported once.
    std::thread::sleep(Duration::from_millis(100));
    assert!(a.drain_dead_peers().is_empty());
}

#[test]
fn forgetting_a_peer_is_not_a_death() {
    let a = agent("fa", fast());
    let b = agent("fb", fast());
    pair(&a, &b);
    a.send_notification("fb", b"hi").unwrap();
    wait_for(Duration::from_secs(5), || b.drain_notifications().pop()).unwrap();
    a.forget_remote("fb");
    assert_eq!(
        a.post(XferOp::Read, "fb", &[], None),
        Err(TransportError::UnknownPeer("fb".into()))
    );
    std::thread::sleep(fast().dead_after + Duration::from_millis(200));
    assert!(b.drain_dead_peers().is_empty());
    assert!(a.drain_dead_peers().is_empty());
    // b's own connection to a still works.
    b.send_notification("fa", b"still here").unwrap();
    let n = wait_for(Duration::from_secs(5), || a.drain_notifications().pop()).unwrap();
    assert_eq!(n.msg, b"still here");
}

/// A fake peer that completes the handshake and then never says or reads anything.
fn silent_peer(name: &'static str) -> (Meta, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut head = [0u8; 7];
        s.read_exact(&mut head).unwrap();
        let mut from = vec![0; u16::from_le_bytes([head[5], head[6]]) as usize];
        s.read_exact(&mut from).unwrap();
        let mut len = [0u8; 2];
        s.read_exact(&mut len).unwrap();
        let mut to = vec![0; u16::from_le_bytes(len) as usize];
        s.read_exact(&mut to).unwrap();
        s.write_all(&wire::ack(true, name)).unwrap();
        // Silence, until the other side gives up and closes.
        let mut buf = [0u8; 1];
        let _ = wait_for(Duration::from_secs(5), || match s.peek(&mut buf) {
            Ok(0) | Err(_) => Some(()),
            Ok(_) => {
                std::thread::sleep(Duration::from_millis(20));
                None
            }
        });
    });
    let meta = Meta {
        name: name.into(),
        host: "127.0.0.1".into(),
        port,
        regions: vec![(0, 1 << 20)],
    };
    (meta, h)
}

#[test]
fn a_silent_peer_is_reported_dead_after_dead_after() {
    let mut rng = Rng(6);
    let a = agent("qa", fast());
    regions(&a, &[1 << 16], &mut rng);
    let (meta, h) = silent_peer("quiet");
    a.load_remote(&wire::encode_meta(&meta).unwrap()).unwrap();
    let d = [XferDesc {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 0,
        len: 100,
    }];
    let start = Instant::now();
    let id = a.post(XferOp::Read, "quiet", &d, Some(b"n")).unwrap();
    let dead = wait_for(Duration::from_secs(5), || {
        let d = a.drain_dead_peers();
        (!d.is_empty()).then_some(d)
    });
    let took = start.elapsed();
    assert_eq!(dead, Some(vec!["quiet".to_string()]));
    assert!(
        took >= fast().dead_after - Duration::from_millis(50),
        "{took:?}"
    );
    assert!(
        took < fast().dead_after + Duration::from_millis(1500),
        "{took:?}"
    );
    assert!(matches!(a.status(id), Ok(XferStatus::Failed(_))));
    h.join().unwrap();
}

#[test]
fn a_silent_initiator_is_reported_dead_by_the_target() {
    let b = agent("tb", fast());
    let mut s = std::net::TcpStream::connect(b.local_addr()).unwrap();
    s.write_all(&wire::hello("mute", "tb")).unwrap();
    let start = Instant::now();
    let dead = wait_for(Duration::from_secs(5), || {
        let d = b.drain_dead_peers();
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(dead, Some(vec!["mute".to_string()]));
    assert!(start.elapsed() < fast().dead_after + Duration::from_millis(1500));
    // And a connection that never says hello is dropped without a report.
    let _t = std::net::TcpStream::connect(b.local_addr()).unwrap();
    std::thread::sleep(fast().dead_after + Duration::from_millis(300));
    assert!(b.drain_dead_peers().is_empty());
}

#[test]
fn an_unreachable_peer_is_reported_dead() {
    let a = agent("ua", fast());
    // A port nobody listens on.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let meta = Meta {
        name: "gone".into(),
        host: "127.0.0.1".into(),
        port,
        regions: vec![],
    };
    a.load_remote(&wire::encode_meta(&meta).unwrap()).unwrap();
    let dead = wait_for(Duration::from_secs(5), || {
        let d = a.drain_dead_peers();
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(dead, Some(vec!["gone".to_string()]));
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

#[test]
fn shutdown_stops_every_thread_and_fails_what_is_in_flight() {
    let mut rng = Rng(10);
    let a = agent("za", fast());
    let b = agent("zb", fast());
    regions(&a, &[1 << 20], &mut rng);
    regions(&b, &[1 << 20], &mut rng);
    pair(&a, &b);
    a.send_notification("zb", b"x").unwrap();
    wait_for(Duration::from_secs(5), || b.drain_notifications().pop()).unwrap();
    a.shutdown();
    assert_eq!(a.live_threads(), 0);
    assert!(matches!(
        a.post(XferOp::Read, "zb", &[], None),
        Err(TransportError::Io(_))
    ));
    let dead = wait_for(Duration::from_secs(3), || {
        let d = b.drain_dead_peers();
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(dead, Some(vec!["za".to_string()]));
    assert!(
        a.drain_dead_peers().is_empty(),
        "its own shutdown is no death"
    );
    drop(b);
}

#[test]
fn config_is_checked_and_defaults_match_the_spec() {
    let c = TcpConfig::default();
    assert_eq!(c.bind.to_string(), "127.0.0.1:0");
    assert_eq!(c.keepalive, Duration::from_millis(250));
    assert_eq!(c.dead_after, Duration::from_millis(1500));
    assert_eq!(c.landing_spin, Duration::from_micros(200));
    let too_long = TcpConfig {
        landing_spin: super::MAX_LANDING_SPIN + Duration::from_micros(1),
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
    assert_eq!(spin_from("10000"), super::MAX_LANDING_SPIN);
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

/// CPU seconds this process used so far (all threads, exited ones included).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}

/// Runs `f` (which moves `TOTAL` bytes and returns GB/s) and adds CPU seconds per GB moved.
fn with_cpu(f: impl FnOnce() -> f64, total: usize) -> (f64, f64) {
    let c0 = cpu_seconds();
    let gbps = f();
    (gbps, (cpu_seconds() - c0) / (total as f64 / 1e9))
}

/// Throughput against a raw std TCP loopback stream (one thread `write_all`s a buffer of the
/// block size, another `read_exact`s it), interleaved in the same run; best of 5 reps. Not a
/// pass/fail test:
/// `cargo test --release -p handoff-transport --lib tcp::tests::throughput -- --ignored --nocapture`
#[test]
#[ignore = "benchmark"]
fn throughput() {
    const TOTAL: usize = 1 << 30;
    // TCP_BENCH_REPS=n and TCP_BENCH_BLOCK_KIB=k narrow a run.
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let reps = env("TCP_BENCH_REPS").unwrap_or(5);
    let blocks: Vec<usize> = match env("TCP_BENCH_BLOCK_KIB") {
        Some(k) => vec![k << 10],
        None => vec![64 << 10, 1 << 20],
    };
    let raw = |buf_len: usize| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let rx = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = vec![0u8; buf_len];
            let mut got = 0;
            while got < TOTAL {
                s.read_exact(&mut buf).unwrap();
                got += buf_len;
            }
        });
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let buf = vec![1u8; buf_len];
        let start = Instant::now();
        let mut sent = 0;
        while sent < TOTAL {
            s.write_all(&buf).unwrap();
            sent += buf_len;
        }
        rx.join().unwrap();
        TOTAL as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    // TCP_BENCH_REGION_KIB: a small region keeps the data in cache, like the raw stream's buffer.
    let region_len = env("TCP_BENCH_REGION_KIB").map_or(256 << 20, |k| k << 10);
    // The same raw stream between two 256 MiB buffers, in blocks at scattered offsets: the
    // memory traffic a transfer of KV blocks has, without the transport.
    let mut cold_src = vec![2u8; region_len];
    let mut cold_dst = vec![1u8; region_len];
    let mut raw_cold = |block: usize, rng: &mut Rng| {
        let order = |rng: &mut Rng| {
            let mut p: Vec<usize> = (0..region_len / block).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, rng.below(i as u64 + 1) as usize);
            }
            p
        };
        let (src_order, dst_order) = (order(rng), order(rng));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (src, dst) = (&mut cold_src, &mut cold_dst);
        std::thread::scope(|sc| {
            sc.spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let mut got = 0;
                for &b in dst_order.iter().cycle() {
                    if got >= TOTAL {
                        break;
                    }
                    s.read_exact(&mut dst[b * block..(b + 1) * block]).unwrap();
                    got += block;
                }
            });
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_nodelay(true).unwrap();
            let start = Instant::now();
            let mut sent = 0;
            for &b in src_order.iter().cycle() {
                if sent >= TOTAL {
                    break;
                }
                s.write_all(&src[b * block..(b + 1) * block]).unwrap();
                sent += block;
            }
            drop(s);
            start
        })
        .elapsed()
        .as_secs_f64()
        .recip()
            * TOTAL as f64
            / 1e9
    };
    // HANDOFF_TCP_LANDING_SPIN_US applies (compare 0 with the default).
    let a = agent("ba", TcpConfig::from_env());
    let b = agent("bb", TcpConfig::from_env());
    let mut rng = Rng(11);
    for &block in &blocks {
        let ra = Arc::new(KvRegion::new(region_len, block));
        let rb = Arc::new(KvRegion::new(region_len, block));
        // Touch every page up front, so that no run pays for first-touch faults.
        ra.write(0, &rng.bytes(region_len)).unwrap();
        rb.write(0, &rng.bytes(region_len)).unwrap();
        let id = (block >> 10) as u32;
        a.register(id, ra.clone()).unwrap();
        b.register(id, rb.clone()).unwrap();
    }
    pair(&a, &b);
    // Scattered blocks (random permutations), 16 MiB per transfer, 4 transfers in flight.
    let run = |op: XferOp, block: usize, rng: &mut Rng| {
        let blocks = region_len / block;
        let id = (block >> 10) as u32;
        let perm = |rng: &mut Rng| {
            let mut p: Vec<usize> = (0..blocks).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, rng.below(i as u64 + 1) as usize);
            }
            p
        };
        let (src, dst) = (perm(rng), perm(rng));
        let descs: Vec<XferDesc> = src
            .iter()
            .zip(&dst)
            .map(|(s, d)| XferDesc {
                local_region: id,
                local_offset: (d * block) as u64,
                remote_region: id,
                remote_offset: (s * block) as u64,
                len: block as u64,
            })
            .collect();
        let per_xfer = ((16 << 20) / block).min(blocks);
        let start = Instant::now();
        let mut moved = 0usize;
        let mut inflight = std::collections::VecDeque::new();
        for chunk in descs.chunks(per_xfer).cycle() {
            if moved >= TOTAL {
                break;
            }
            while inflight.len() >= 4 {
                let x = inflight.pop_front().unwrap();
                assert_eq!(wait(&*a, x, Duration::from_secs(60)), XferStatus::Done);
                a.release(x).unwrap();
            }
            inflight.push_back(a.post(op, "bb", chunk, None).unwrap());
            moved += chunk.len() * block;
        }
        for x in inflight {
            assert_eq!(wait(&*a, x, Duration::from_secs(60)), XferStatus::Done);
        }
        moved as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    for &block in &blocks {
        let mut best = [0f64; 4];
        let mut cpu = [f64::MAX; 4];

        for rep in 0..reps {
            // TCP_BENCH_ONLY=raw|cold|read|write runs one of them (for profiling).
            let only = std::env::var("TCP_BENCH_ONLY").unwrap_or_default();
            let skip = |what: &str| !only.is_empty() && only != what;
            let got = [
                if skip("raw") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| raw(block), TOTAL)
                },
                if skip("cold") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| raw_cold(block, &mut rng), TOTAL)
                },
                if skip("read") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| run(XferOp::Read, block, &mut rng), TOTAL)
                },
                if skip("write") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| run(XferOp::Write, block, &mut rng), TOTAL)
                },
            ];
            println!(
                "block {:>4} KiB rep {rep}: GB/s (CPU s per GB): raw {:.2} ({:.2})  raw-cold {:.2} \
                 ({:.2})  READ {:.2} ({:.2})  WRITE {:.2} ({:.2})",
                block >> 10,
                got[0].0,
                got[0].1,
                got[1].0,
                got[1].1,
                got[2].0,
                got[2].1,
                got[3].0,
                got[3].1
            );
            for i in 0..4 {
                best[i] = best[i].max(got[i].0);
                cpu[i] = cpu[i].min(got[i].1);
            }
        }
        println!(
            "block {:>4} KiB least CPU s per GB: raw {:.2}  raw-cold {:.2}  READ {:.2}  WRITE {:.2}",
            block >> 10,
            cpu[0],
            cpu[1],
            cpu[2],
            cpu[3]
        );
        let [raw_hot, cold, read, write] = best;
        println!(
            "block {:>4} KiB best of {reps}: raw {raw_hot:.2}  raw-cold {cold:.2}  READ {read:.2} \
             ({:.2}x raw, {:.2}x cold)  WRITE {write:.2} ({:.2}x raw, {:.2}x cold) GB/s",
            block >> 10,
            read / raw_hot,
            read / cold,
            write / raw_hot,
            write / cold
        );
    }
}

// ----- the cluster key -----

fn keyed(key: Option<&crate::auth::ClusterKey>) -> TcpConfig {
    TcpConfig {
        key: key.cloned(),
        ..fast()
    }
}

/// Reads `region 0` of `target` from `reader`: whether the bytes arrived.
fn try_read(reader: &TcpTransport, target: &TcpTransport, len: usize) -> XferStatus {
    let local = Arc::new(KvRegion::new(len, 4096));
    let _ = reader.register(90, local);
    let Ok(id) = reader.post(
        XferOp::Read,
        target.name(),
        &[XferDesc {
            local_region: 90,
            local_offset: 0,
            remote_region: 0,
            remote_offset: 0,
            len: len as u64,
        }],
        None,
    ) else {
        return XferStatus::Failed("post refused".into());
    };
    wait(reader, id, Duration::from_secs(3))
}

#[test]
fn with_a_cluster_key_only_holders_of_it_are_served() {
    let key = crate::auth::ClusterKey::generate().unwrap();
    let mut rng = Rng(7);
    let p = agent("p-keyed", keyed(Some(&key)));
    regions(&p, &[4096], &mut rng);

    // A member with the key reads.
    let d = agent("d-keyed", keyed(Some(&key)));
    pair(&p, &d);
    assert_eq!(try_read(&d, &p, 4096), XferStatus::Done);
    assert_eq!(p.refused_connections(), 0);

    // No key, or another key: refused at the handshake, counted, nothing served.
    let outsider = agent("d-nokey", keyed(None));
    outsider.load_remote(&p.local_metadata().unwrap()).unwrap();
    assert!(matches!(
        try_read(&outsider, &p, 4096),
        XferStatus::Failed(_)
    ));
    let other = crate::auth::ClusterKey::generate().unwrap();
    let forger = agent("d-otherkey", keyed(Some(&other)));
    forger.load_remote(&p.local_metadata().unwrap()).unwrap();
    assert!(matches!(try_read(&forger, &p, 4096), XferStatus::Failed(_)));
    assert!(
        wait_for(Duration::from_secs(3), || (p.refused_connections() >= 2)
            .then_some(()))
        .is_some()
    );

    // The member is unaffected.
    assert_eq!(try_read(&d, &p, 4096), XferStatus::Done);
}

#[test]
fn a_caller_cannot_claim_a_name_it_did_not_prove() {
    let key = crate::auth::ClusterKey::generate().unwrap();
    let mut rng = Rng(8);
    let p = agent("p-named", keyed(Some(&key)));
    regions(&p, &[1024], &mut rng);
    // Proves "mallory" with the right key, then says hello as "d-victim".
    let addr = p.inner.local_addr;
    let s = std::net::TcpStream::connect(addr).unwrap();
    crate::auth::dial(
        &s,
        &key,
        "tcp",
        "mallory",
        "p-named",
        Duration::from_secs(2),
    )
    .unwrap();
    (&s).write_all(&wire::hello("d-victim", "p-named")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut head = [0u8; 6];
    (&s).read_exact(&mut head).unwrap();
    assert_eq!(&head[..4], &wire::ACK_MAGIC);
    assert_ne!(head[5], 0, "the hello under another name is refused");
    assert!(
        wait_for(Duration::from_secs(2), || (p.refused_connections() == 1)
            .then_some(()))
        .is_some()
    );
}

/// A relay on loopback to `to`: it connects on at once but passes nothing either way for
/// `delay`, as a link whose queue is full of another connection's bytes would.
fn slow_relay(to: std::net::SocketAddr, delay: Duration) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (from, _) = l.accept().unwrap();
        let upstream = std::net::TcpStream::connect(to).unwrap();
        std::thread::sleep(delay);
        let (mut up_r, mut from_w) = (upstream.try_clone().unwrap(), from.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut up_r, &mut from_w);
            let _ = from_w.shutdown(std::net::Shutdown::Both);
        });
        let (mut from_r, mut up_w) = (from, upstream);
        let _ = std::io::copy(&mut from_r, &mut up_w);
        let _ = up_w.shutdown(std::net::Shutdown::Both);
        back.join().unwrap();
    });
    port
}

/// A handshake slower than `dead_after` (its packets held back 1 s on a 400 ms dead-peer limit)
/// is not a dead peer: both ends wait for the key's proofs up to the handshake's own deadline,
/// and the READ lands. With the dead-peer limit as the handshake's deadline both ends gave up
/// ("authentication did not finish within 400ms") and the healthy peer was reported dead.
#[test]
fn a_slow_handshake_on_a_congested_link_is_not_a_dead_peer() {
    let key = crate::auth::ClusterKey::generate().unwrap();
    let mut rng = Rng(9);
    let p = agent("p-slowlink", keyed(Some(&key)));
    regions(&p, &[4096], &mut rng);
    let d = agent("d-slowlink", keyed(Some(&key)));
    let delay = fast().dead_after + Duration::from_millis(600);
    let port = slow_relay(p.local_addr(), delay);
    let meta = Meta {
        name: "p-slowlink".into(),
        host: "127.0.0.1".into(),
        port,
        regions: vec![(0, 4096)],
    };
    let start = Instant::now();
    d.load_remote(&wire::encode_meta(&meta).unwrap()).unwrap();
    assert_eq!(try_read(&d, &p, 4096), XferStatus::Done);
    assert!(
        start.elapsed() >= delay,
        "the relay held the handshake back"
    );
    assert!(d.drain_dead_peers().is_empty());
    assert!(p.drain_dead_peers().is_empty());
    assert_eq!(p.refused_connections(), 0);
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
