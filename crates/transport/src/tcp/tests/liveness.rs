//! Peers that die, fall silent, cannot be reached or are merely slow: reported dead in bounded time, and only then.

use super::*;

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

/// Set in the environment of the child process `a_paused_host_keeps_its_connections` starts.
const PAUSED_CHILD: &str = "HANDOFF_TCP_TEST_PAUSED_CHILD";

/// A host paused for longer than `dead_after` (here: the whole process stopped for three times
/// its 400 ms) resumes with its connections alive: neither end counts against the other the
/// time it was not run itself, so the PINGs that follow the pause are heard before the silence
/// is judged. Both agents live in a child process (the test binary again, running
/// `paused_host_child`), so the pause stops their readers and writers alike, as a VM whose CPUs
/// were taken away or a SIGSTOPped engine does. Before the readers credited their own pauses
/// the child reported both peers dead the moment it resumed.
#[test]
fn a_paused_host_keeps_its_connections() {
    use std::io::BufRead;
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "tcp::tests::liveness::paused_host_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PAUSED_CHILD, "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let said = |want: &str| -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = lines.recv_timeout(left) else {
                panic!("the child never said {want:?}");
            };
            // libtest's "test … ... " may precede the child's first line.
            if let Some(at) = line.find(want) {
                return line[at..].to_string();
            }
        }
    };
    said("ready");
    let kill = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    kill("-STOP");
    std::thread::sleep(fast().dead_after * 3);
    kill("-CONT");
    child
        .stdin
        .as_mut()
        .unwrap()
        .write_all(b"resumed\n")
        .unwrap();
    let verdict = said("verdict");
    assert!(child.wait().unwrap().success());
    assert_eq!(verdict, "verdict: alive");
}

/// The child half of `a_paused_host_keeps_its_connections` (a no-op anywhere else).
#[test]
#[ignore = "run by a_paused_host_keeps_its_connections in a child process it pauses"]
fn paused_host_child() {
    if std::env::var_os(PAUSED_CHILD).is_none() {
        return;
    }
    let mut rng = Rng(12);
    let a = agent("pause-a", fast());
    let b = agent("pause-b", fast());
    regions(&a, &[4096], &mut rng);
    regions(&b, &[4096], &mut rng);
    pair(&a, &b);
    assert_eq!(try_read(&a, &b, 4096), XferStatus::Done);
    println!("ready");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    // Past one more `dead_after` after the pause: a connection judged on the pause alone is
    // reported by now.
    std::thread::sleep(fast().dead_after + Duration::from_millis(200));
    let dead = [a.drain_dead_peers(), b.drain_dead_peers()].concat();
    let read = try_read(&a, &b, 4096);
    if dead.is_empty() && read == XferStatus::Done {
        println!("verdict: alive");
    } else {
        println!("verdict: dead {dead:?}, a READ after the pause: {read:?}");
    }
}
