//! A tcp agent serving a READ to a peer that goes away mid-reply must see a failed send, never
//! SIGPIPE: a host process that does not ignore the signal (a C or C++ engine embedding handoff,
//! libFuzzer's `main`) would die of it. Rust's `main` ignores SIGPIPE, so this binary counts it
//! with a handler instead, in a file of its own (the handler is process-wide).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_transport::tcp::{TcpConfig, TcpTransport};
use handoff_transport::{KvRegion, Transport, XferDesc, XferOp};

const LEN: usize = 64 << 20;

#[test]
fn a_reader_that_leaves_mid_reply_raises_no_sigpipe() {
    let pipes = Arc::new(AtomicUsize::new(0));
    signal_hook::flag::register_usize(signal_hook::consts::SIGPIPE, pipes.clone(), 1)
        .expect("a SIGPIPE handler");
    let target = TcpTransport::new("sp-target", TcpConfig::default()).unwrap();
    let kv = Arc::new(KvRegion::new(LEN, 64 << 10));
    kv.write(0, &vec![0xab; LEN]).unwrap();
    target.register(0, kv).unwrap();
    let mut left_mid_reply = 0;
    let mut dead = Vec::new();
    for round in 0..4 {
        let reader =
            TcpTransport::new(&format!("sp-reader-{round}"), TcpConfig::default()).unwrap();
        let landed = Arc::new(KvRegion::new(LEN, 64 << 10));
        reader.register(0, landed.clone()).unwrap();
        reader
            .load_remote(&target.local_metadata().unwrap())
            .unwrap();
        let descs = [XferDesc {
            local_region: 0,
            local_offset: 0,
            remote_region: 0,
            remote_offset: 0,
            len: LEN as u64,
        }];
        reader
            .post(XferOp::Read, "sp-target", &descs, None)
            .unwrap();
        // Leave once the reply is under way (its first bytes landed; they land in order) and
        // the target still has most of 64 MiB to send.
        let start = Instant::now();
        let mut first = [0u8];
        while first[0] != 0xab && start.elapsed() < Duration::from_secs(10) {
            landed.read(0, &mut first).unwrap();
            std::thread::yield_now();
        }
        assert_eq!(first[0], 0xab, "round {round}: no byte of the reply landed");
        reader.shutdown();
        drop(reader);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            let d = target.drain_dead_peers();
            if !d.is_empty() {
                dead.extend(d);
                left_mid_reply += 1;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert_eq!(
        left_mid_reply, 4,
        "the target saw every reader go (dead peers: {dead:?})"
    );
    assert_eq!(
        pipes.load(Ordering::SeqCst),
        0,
        "a send to a reader that left raised SIGPIPE"
    );
}
