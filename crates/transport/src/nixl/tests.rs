//! Tests of the nixl backend. Those that need NIXL skip (with a line on stderr) when it is not
//! installed, unless `HANDOFF_REQUIRE_NIXL=1`, which turns a missing NIXL into a failure. Two
//! agents live in this one process and talk over loopback; every wait is bounded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::{KvRegion, Transport, TransportError, XferDesc, XferOp, XferStatus};

fn nixl() -> Option<NixlConfig> {
    let cfg = NixlConfig::from_env();
    match locate(&cfg) {
        Ok(_) => Some(cfg),
        Err(e) => {
            if std::env::var("HANDOFF_REQUIRE_NIXL").as_deref() == Ok("1") {
                panic!("HANDOFF_REQUIRE_NIXL=1 but NIXL is missing: {e}");
            }
            eprintln!("skipping: NIXL is not installed ({e})");
            None
        }
    }
}

fn unique(prefix: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

struct Pair {
    a: Arc<NixlTransport>,
    b: Arc<NixlTransport>,
    ra: Arc<KvRegion>,
    rb: Arc<KvRegion>,
}

/// Two agents, region 0 of `len` bytes (chunks of `chunk`) on each, metadata exchanged.
fn pair(cfg: &NixlConfig, len: usize, chunk: usize) -> Pair {
    let a = NixlTransport::open(&unique("a"), cfg.clone()).expect("open a");
    let b = NixlTransport::open(&unique("b"), cfg.clone()).expect("open b");
    let ra = Arc::new(KvRegion::new(len, chunk));
    let rb = Arc::new(KvRegion::new(len, chunk));
    a.register(0, ra.clone()).unwrap();
    b.register(0, rb.clone()).unwrap();
    assert_eq!(
        a.load_remote(&b.local_metadata().unwrap()).unwrap(),
        b.name()
    );
    assert_eq!(
        b.load_remote(&a.local_metadata().unwrap()).unwrap(),
        a.name()
    );
    Pair { a, b, ra, rb }
}

fn wait(t: &dyn Transport, id: XferId) -> XferStatus {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = t.status(id).unwrap();
        if s != XferStatus::InProgress || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn wait_notifs(t: &dyn Transport, n: usize) -> Vec<Notification> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        got.extend(t.drain_notifications());
        std::thread::sleep(Duration::from_micros(200));
    }
    got
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn desc(local_offset: u64, remote_offset: u64, len: u64) -> XferDesc {
    XferDesc {
        local_region: 0,
        local_offset,
        remote_region: 0,
        remote_offset,
        len,
    }
}

// --- Without NIXL -------------------------------------------------------------------------

#[test]
fn backend_params_parse_and_replace_defaults_key_by_key() {
    assert_eq!(
        parse_backend_params(" num_threads=4 , split_batch_size=128,").unwrap(),
        vec![
            ("num_threads".to_string(), "4".to_string()),
            ("split_batch_size".to_string(), "128".to_string())
        ]
    );
    assert_eq!(parse_backend_params("").unwrap(), vec![]);
    for bad in ["num_threads", "=2", "a=1,b"] {
        let e = parse_backend_params(bad).unwrap_err();
        assert!(e.contains("key=value"), "{bad}: {e}");
    }

    // UCX's thread pool is on by default; a setting replaces its key and keeps the others.
    let mut cfg = NixlConfig::default();
    assert_eq!(cfg.backend, "UCX");
    assert!(cfg
        .backend_params
        .contains(&("num_threads".to_string(), "2".to_string())));
    cfg.set_backend_param("num_threads", "0");
    cfg.set_backend_param("ucx_error_handling_mode", "peer");
    let get = |k: &str| {
        cfg.backend_params
            .iter()
            .filter(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(get("num_threads"), ["0"]);
    assert_eq!(get("split_batch_size"), ["64"]);
    assert_eq!(get("ucx_error_handling_mode"), ["peer"]);
}

#[test]
fn nixl_open_with_bogus_path_is_unavailable_in_one_line() {
    let cfg = NixlConfig {
        lib_path: Some("/nonexistent/dir/libnixl_capi.so".into()),
        ..NixlConfig::default()
    };
    match NixlTransport::open("x", cfg) {
        Err(TransportError::Unavailable { backend, reason }) => {
            assert_eq!(backend, "nixl");
            assert!(!reason.contains('\n'), "{reason}");
            assert!(
                reason.contains("/nonexistent/dir/libnixl_capi.so"),
                "{reason}"
            );
            assert!(reason.contains("install-nixl"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }

    // A file with the right name that is not a shared library.
    let dir = std::env::temp_dir().join(unique("handoff-nixl-bogus"));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join(LIB_NAME);
    std::fs::write(&fake, b"not an ELF file\n").unwrap();
    let cfg = NixlConfig {
        lib_path: Some(fake.clone()),
        ..NixlConfig::default()
    };
    let r = NixlTransport::open("x", cfg);
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Err(TransportError::Unavailable { reason, .. }) => {
            assert!(!reason.contains('\n'), "{reason}");
            assert!(reason.contains("cannot load"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn nixl_config_defaults() {
    let c = NixlConfig::default();
    assert_eq!(c.progress_delay_us, 100);
    assert_eq!(c.backend, "UCX");
    assert!(c.lib_path.is_none());
    assert_eq!(c.backend_params.len(), UCX_DEFAULT_PARAMS.len());
}

#[test]
fn nixl_bad_backend_parameter_is_unavailable_and_names_the_parameter() {
    let Some(mut cfg) = nixl() else { return };
    cfg.set_backend_param("num_threads", "many");
    match NixlTransport::open(&unique("badparam"), cfg) {
        Err(TransportError::Unavailable { reason, .. }) => {
            assert!(!reason.contains('\n'), "{reason}");
            assert!(reason.contains("num_threads=many"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn nixl_metadata_header_round_trips_and_rejects_garbage() {
    let body = MdBody {
        name: "p0".into(),
        regions: vec![(0, 0x1000, 4096, 4096), (7, 0x9000, 64, 16)],
        nixl: vec![1, 2, 3],
        devices: Vec::new(),
    };
    let bytes = encode_md(&body).unwrap();
    assert_eq!(decode_md(&bytes).unwrap(), body);
    for cut in 0..bytes.len() {
        assert!(matches!(
            decode_md(&bytes[..cut]),
            Err(TransportError::BadMetadata(_))
        ));
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(decode_md(&long).is_err());
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for n in 0..2000 {
        let mut junk: Vec<u8> = (0..(n % 97))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(decode_md(&junk).is_err());
        // Valid magic and version, junk body.
        let mut framed = bytes[..9].to_vec();
        framed.append(&mut junk);
        let _ = decode_md(&framed); // must not panic
    }
    let twice = MdBody {
        regions: vec![(1, 0, 1, 1), (1, 8, 1, 1)],
        ..body.clone()
    };
    assert!(decode_md(&encode_md(&twice).unwrap()).is_err());
    let wraps = MdBody {
        regions: vec![(1, u64::MAX - 1, 8, 8)],
        ..body.clone()
    };
    assert!(decode_md(&encode_md(&wraps).unwrap()).is_err());
    let no_chunk = MdBody {
        regions: vec![(1, 0x1000, 8, 0)],
        ..body
    };
    assert!(decode_md(&encode_md(&no_chunk).unwrap()).is_err());
}

/// Host memory only is written as version 2, byte for byte what the previous release wrote
/// (and reads): the bytes below are its encoding of this body. Device regions need version 3,
/// which names each one's device; a peer's list of them is checked like the rest.
#[test]
fn nixl_metadata_names_device_regions_and_stays_version_2_without_them() {
    let host = MdBody {
        name: "p0".into(),
        regions: vec![(0, 0x1000, 4096, 4096), (7, 0x9000, 64, 16)],
        nixl: vec![1, 2, 3],
        devices: Vec::new(),
    };
    let previous_release =
        "484e44464e49584c0259ce32cfb690b06202703002008020802080200780a002401003010203";
    let bytes = encode_md(&host).unwrap();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, previous_release);
    assert_eq!(decode_md(&bytes).unwrap(), host);
    assert_eq!(host.memory_of(7), MemoryKind::Host);

    let gpu = MemoryKind::Cuda { device: 3 };
    let device = MdBody {
        devices: vec![(7, gpu)],
        ..host.clone()
    };
    let bytes = encode_md(&device).unwrap();
    assert_eq!(bytes[8], 3, "version 3");
    let back = decode_md(&bytes).unwrap();
    assert_eq!(back, device);
    assert_eq!(
        (back.memory_of(0), back.memory_of(7)),
        (MemoryKind::Host, gpu)
    );
    for (devices, why) in [
        (vec![(9, gpu)], "not listed"),
        (vec![(7, gpu), (7, gpu)], "twice"),
        (vec![(0, MemoryKind::Host)], "as host memory"),
    ] {
        let m = encode_md(&MdBody {
            devices,
            ..host.clone()
        })
        .unwrap();
        match decode_md(&m) {
            Err(TransportError::BadMetadata(e)) => assert!(e.contains(why), "{e}"),
            other => panic!("{why}: {other:?}"),
        }
    }
}

// --- With NIXL ----------------------------------------------------------------------------

/// A device region: its device's context is made current on the registering thread before
/// NIXL sees it, and NIXL registers it as VRAM, or (as here, where NIXL's UCX has no CUDA
/// device) refuses it with a message saying so, leaving nothing registered: the id takes a
/// host region afterwards. Registered, the agent's metadata names it as device memory.
#[test]
fn a_device_region_is_registered_as_vram_with_its_context_current_or_refused_clearly() {
    let Some(cfg) = nixl() else { return };
    let t = NixlTransport::open(&unique("gpu"), cfg).unwrap();
    let fake = crate::device::fake::FakeDevice::new(0);
    let region = Arc::new(fake.region(1 << 16, 4096));
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            let r = t.register(0, region.clone());
            (r, fake.is_current_here())
        })
        .join()
        .unwrap()
    });
    assert!(
        got.1,
        "the registering thread made the device's context current first"
    );
    assert!(!fake.is_current_here(), "and only that thread");
    match got.0 {
        Ok(()) => {
            let md = decode_md(&t.local_metadata().unwrap()).unwrap();
            assert_eq!(md.memory_of(0), MemoryKind::Cuda { device: 0 });
        }
        Err(TransportError::Io(e)) => {
            assert!(e.contains("as VRAM") && e.contains("CUDA device 0"), "{e}");
            t.register(0, Arc::new(KvRegion::new(4096, 4096))).unwrap();
            let md = decode_md(&t.local_metadata().unwrap()).unwrap();
            assert_eq!(md.devices, Vec::new());
        }
        Err(other) => panic!("unexpected refusal: {other:?}"),
    }
}

/// NIXL types a descriptor list as a whole: a post whose remote side spans host memory and a
/// peer's device memory is refused before NIXL sees it, and the agent posts on.
#[test]
fn a_post_across_two_kinds_of_memory_is_refused() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 8192, 4096);
    let mut body = decode_md(&p.b.local_metadata().unwrap()).unwrap();
    let &(_, addr, len, chunk) = &body.regions[0];
    body.regions.push((1, addr + len, len, chunk));
    body.devices = vec![(1, MemoryKind::Cuda { device: 0 })];
    p.a.load_remote(&encode_md(&body).unwrap()).unwrap();
    let mixed = [
        desc(0, 0, 4096),
        XferDesc {
            remote_region: 1,
            ..desc(4096, 0, 4096)
        },
    ];
    match p.a.post(XferOp::Read, p.b.name(), &mixed, None) {
        Err(TransportError::Io(e)) => {
            assert!(
                e.contains("host memory") && e.contains("CUDA device 0"),
                "{e}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let id =
        p.a.post(XferOp::Read, p.b.name(), &[desc(0, 0, 4096)], None)
            .unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
}

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

#[test]
fn nixl_bad_metadata_is_rejected() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 4096, 4096);
    let good = p.b.local_metadata().unwrap();
    let bad = |m: &[u8]| match p.a.load_remote(m) {
        Err(TransportError::BadMetadata(_)) => true,
        other => panic!("expected BadMetadata, got {other:?}"),
    };
    assert!(bad(b""));
    assert!(bad(b"garbage"));
    for cut in [1, 9, 17, good.len() / 2, good.len() - 1] {
        assert!(bad(&good[..cut]));
    }
    for at in [9, 20, good.len() / 2, good.len() - 1] {
        let mut m = good.clone();
        m[at] ^= 0x40;
        assert!(bad(&m), "flipped byte {at}");
    }
    // Our own metadata.
    assert!(bad(&p.a.local_metadata().unwrap()));

    // Well-framed metadata whose NIXL part is junk reaches NIXL, which refuses it. (A damaged
    // blob of an agent already loaded could wedge NIXL's state for that agent, hence the
    // checksum above; this uses a third agent that was never loaded.)
    let c = NixlTransport::open(&unique("c"), cfg.clone()).unwrap();
    let cbody = decode_md(&c.local_metadata().unwrap()).unwrap();
    let n = cbody.nixl.len();
    for nixl in [
        b"\x00\x01\x02junk".to_vec(),
        cbody.nixl[..n / 2].to_vec(),
        vec![0xff; 600],
    ] {
        let m = encode_md(&MdBody {
            nixl,
            ..cbody.clone()
        })
        .unwrap();
        assert!(bad(&m));
    }
    // A header naming another agent than NIXL's part: refused, and B stays loaded.
    let body = decode_md(&good).unwrap();
    let m = encode_md(&MdBody {
        name: "someone-else".into(),
        ..body
    })
    .unwrap();
    assert!(bad(&m));
    let id =
        p.a.post(XferOp::Read, p.b.name(), &[desc(0, 0, 4096)], None)
            .unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
    // And both still load fine.
    assert_eq!(p.a.load_remote(&good).unwrap(), p.b.name());
    assert_eq!(
        p.a.load_remote(&c.local_metadata().unwrap()).unwrap(),
        c.name()
    );
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
fn nixl_raw_baseline_moves_blocks() {
    let Some(cfg) = nixl() else { return };
    for op in [XferOp::Read, XferOp::Write] {
        let r = raw::measure(
            &cfg,
            &raw::RawSpec {
                op,
                block_size: 4096,
                blocks: 64,
                iters: 3,
                notify: true,
                poll: std::time::Duration::ZERO,
                memory: raw::RawMemory::Dram,
            },
        )
        .unwrap();
        assert_eq!(r.bytes_per_xfer, 4096 * 64);
        assert_eq!(r.secs.len(), 3);
        assert!(r.gbps > 0.0);
    }
}

/// GPU memory through the same baseline: on a machine with a GPU the bytes land (checked by
/// copying both buffers back); without one, a clear error naming the CUDA driver, no panic.
#[test]
fn nixl_raw_baseline_on_gpu_memory_moves_blocks_or_says_why_not() {
    let Some(cfg) = nixl() else { return };
    let spec = raw::RawSpec {
        op: XferOp::Read,
        block_size: 4096,
        blocks: 16,
        iters: 2,
        notify: false,
        poll: std::time::Duration::ZERO,
        memory: raw::RawMemory::Vram,
    };
    match raw::measure(&cfg, &spec) {
        Ok(r) => assert_eq!(r.bytes_per_xfer, 4096 * 16),
        Err(e) => assert!(e.to_string().contains("cuda"), "{e}"),
    }
}

/// `cargo test -p handoff-transport --lib nixl_throughput -- --ignored --nocapture`: the
/// transport and the raw baseline on the same scattered blocks, 64 MiB per transfer, in
/// alternating rounds (the host is shared and noisy), median over all rounds.
#[test]
#[ignore]
fn nixl_throughput_vs_raw() {
    let Some(cfg) = nixl() else { return };
    let (rounds, per_round) = (8, 5);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "progress delay {} us, 64 MiB per transfer with a notification, median of {rounds}x{per_round} \
         (alternating nixl/raw rounds); loadavg {}",
        cfg.progress_delay_us,
        load.trim()
    );
    println!(
        "{:<6} {:>6} {:>15} {:>15} {:>13}",
        "op", "block", "nixl GB/s", "raw GB/s", "nixl/raw"
    );
    println!(
        "{:<6} {:>6} {:>15} {:>15} {:>13}",
        "", "", "median / best", "median / best", "median / best"
    );
    for block in [4usize << 10, 64 << 10, 1 << 20] {
        let blocks = (64usize << 20) / block;
        let len = raw::region_len(blocks, block);
        let p = pair(&cfg, len, block);
        p.rb.write(0, &pattern(3, len)).unwrap();
        p.ra.write(0, &pattern(5, len)).unwrap();
        let descs: Vec<XferDesc> = raw::scattered_pairs(blocks, block)
            .into_iter()
            .map(|(l, r)| desc(l, r, block as u64))
            .collect();
        for op in [XferOp::Read, XferOp::Write] {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                for i in 0..=per_round {
                    let t0 = Instant::now();
                    let id = p.a.post(op, p.b.name(), &descs, Some(b"n")).unwrap();
                    // Busy-poll, as the raw baseline does.
                    while p.a.status(id).unwrap() == XferStatus::InProgress {}
                    assert_eq!(p.a.status(id).unwrap(), XferStatus::Done);
                    p.a.release(id).unwrap();
                    if i > 0 {
                        ours.push(t0.elapsed().as_secs_f64());
                    }
                }
                assert_eq!(wait_notifs(&*p.b, per_round + 1).len(), per_round + 1);
                let r = raw::measure(
                    &cfg,
                    &raw::RawSpec {
                        op,
                        block_size: block,
                        blocks,
                        iters: per_round,
                        notify: true,
                        poll: std::time::Duration::ZERO,
                        memory: raw::RawMemory::Dram,
                    },
                )
                .unwrap();
                theirs.extend(r.secs);
            }
            let bytes = (blocks * block) as u64;
            let (o, t) = (
                raw::median_gbps(bytes, &ours),
                raw::median_gbps(bytes, &theirs),
            );
            let best = |v: &[f64]| bytes as f64 / v.iter().copied().fold(f64::MAX, f64::min) / 1e9;
            let (ob, tb) = (best(&ours), best(&theirs));
            println!(
                "{:<6} {:>5}K {:>6.2} / {:>5.2} {:>6.2} / {:>5.2} {:>5.2} / {:>5.2}",
                format!("{op:?}"),
                block >> 10,
                o,
                ob,
                t,
                tb,
                o / t,
                ob / tb
            );
        }
    }
}

/// Per-transfer cost with almost no bytes: 1024 scattered 64-byte blocks, READ, µs per
/// transfer (post to release), transport vs raw baseline.
#[test]
#[ignore]
fn nixl_throughput_overhead() {
    let Some(cfg) = nixl() else { return };
    let (block, blocks, iters) = (64usize, 1024usize, 200usize);
    let len = raw::region_len(blocks, block);
    let p = pair(&cfg, len, block);
    let descs: Vec<XferDesc> = raw::scattered_pairs(blocks, block)
        .into_iter()
        .map(|(l, r)| desc(l, r, block as u64))
        .collect();
    let mut ours = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        let id = p.a.post(XferOp::Read, p.b.name(), &descs, None).unwrap();
        while p.a.status(id).unwrap() == XferStatus::InProgress {}
        p.a.release(id).unwrap();
        ours.push(t0.elapsed().as_secs_f64());
    }
    let r = raw::measure(
        &cfg,
        &raw::RawSpec {
            op: XferOp::Read,
            block_size: block,
            blocks,
            iters,
            notify: false,
            poll: std::time::Duration::ZERO,
            memory: raw::RawMemory::Dram,
        },
    )
    .unwrap();
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2] * 1e6
    };
    let mut theirs = r.secs;
    println!(
        "1024 x 64 B READ: nixl {:.0} us, raw {:.0} us per transfer",
        med(&mut ours),
        med(&mut theirs)
    );
}

#[test]
fn spread_follows_the_backend_parameters() {
    let cfg = |params: &[(&str, &str)]| NixlConfig {
        backend_params: params
            .iter()
            .map(|&(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..NixlConfig::default()
    };
    assert_eq!(
        Spread::of(&NixlConfig::default()),
        Some(Spread {
            threads: 2,
            batch: 64
        })
    );
    // NIXL's own split_batch_size default.
    assert_eq!(
        Spread::of(&cfg(&[("num_threads", "4")])),
        Some(Spread {
            threads: 4,
            batch: 1024
        })
    );
    // No pool, one thread, an unreadable value, another backend: nothing to spread over.
    assert_eq!(Spread::of(&cfg(&[])), None);
    assert_eq!(Spread::of(&cfg(&[("num_threads", "1")])), None);
    assert_eq!(Spread::of(&cfg(&[("num_threads", "two")])), None);
    let other = NixlConfig {
        backend: "GDS".into(),
        ..NixlConfig::default()
    };
    assert_eq!(Spread::of(&other), None);
}

#[test]
fn spread_cuts_cover_the_same_bytes_in_order() {
    let s = Spread {
        threads: 2,
        batch: 64,
    };
    // One 256 MiB run and a 3 MiB + 5 KiB one: cut into pieces of (total / 128) whole pages.
    let local = [(1 << 30, 256 << 20), (5 << 30, (3 << 20) + 5120)];
    let remote = [(7 << 30, 256 << 20), (9 << 30, (3 << 20) + 5120)];
    let (l, r) = s
        .cut(&local, &remote)
        .expect("few large descriptors are cut");
    assert!(l.len() >= s.wanted(), "{} pieces", l.len());
    assert_eq!(l.len(), r.len());
    let total: usize = local.iter().map(|d| d.1).sum();
    let piece = (total / s.wanted()) & !4095;
    assert!(piece >= MIN_SPREAD_PIECE);
    // Walking the pieces in order rebuilds every descriptor exactly, on both sides.
    let mut at = 0;
    for (&(la, len), &(ra, _)) in local.iter().zip(&remote) {
        let mut off = 0;
        while off < len {
            let (pl, pr) = (l[at], r[at]);
            assert_eq!(pl, (la + off, piece.min(len - off)));
            assert_eq!(pr, (ra + off, pl.1));
            off += pl.1;
            at += 1;
        }
    }
    assert_eq!(at, l.len());
    // Long enough already, or too little to be worth a second thread: left alone.
    let many: Vec<(usize, usize)> = (0..128).map(|i| (i << 24, 1 << 20)).collect();
    assert_eq!(s.cut(&many, &many), None);
    let small = [(0, (s.wanted() * MIN_SPREAD_PIECE) - 4096)];
    assert_eq!(s.cut(&small, &small), None);
    // A post a copy on the caller's thread finishes inside post_xfer_req stays there, though
    // its pieces would be long enough (a layer-wise stage).
    let stage = [(0, MIN_SPREAD_TOTAL - 4096)];
    assert!((MIN_SPREAD_TOTAL - 4096) / s.wanted() >= MIN_SPREAD_PIECE);
    assert_eq!(s.cut(&stage, &stage), None);
    assert_eq!(s.cut(&[], &[]), None);
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
