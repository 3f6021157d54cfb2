//! The tcp transport's frame decoder, as a target agent runs it: each input is sent, after a
//! valid hello, on a fresh connection to one long-lived agent (grants checked, one region, one
//! grant), then the connection is half-closed and drained. A panic on any of the agent's threads
//! aborts the process (libFuzzer's panic hook), so "no crash" covers every thread.

#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use handoff_transport::tcp::{TcpConfig, TcpTransport};
use handoff_transport::{Extent, GrantId, KvRegion, Transport, XferOp};
use libfuzzer_sys::fuzz_target;

const CALLER: &str = "fuzz";
const TARGET: &str = "fuzz-target";

fn target() -> &'static (Arc<TcpTransport>, SocketAddr) {
    static T: OnceLock<(Arc<TcpTransport>, SocketAddr)> = OnceLock::new();
    T.get_or_init(|| {
        let t = TcpTransport::new(
            TARGET,
            TcpConfig {
                keepalive: Duration::from_millis(50),
                dead_after: Duration::from_millis(300),
                check_grants: true,
                ..TcpConfig::default()
            },
        )
        .expect("a loopback listener");
        t.register(0, Arc::new(KvRegion::new(1 << 16, 4096)))
            .expect("register");
        t.grant(
            GrantId(1),
            XferOp::Read,
            &[CALLER.to_string()],
            &[Extent {
                region: 0,
                offset: 0,
                len: 1 << 15,
            }],
        )
        .expect("grant");
        let addr = t.local_addr();
        (t, addr)
    })
}

/// `"HOTH" version from_len:u16 from to_len:u16 to` (see the transport's wire.rs).
fn hello() -> Vec<u8> {
    let mut h = b"HOTH\x01".to_vec();
    for name in [CALLER, TARGET] {
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
    }
    h
}

fuzz_target!(|data: &[u8]| {
    let (t, addr) = target();
    // What the agent collects from fuzzed peers is drained, or it would grow with the run.
    let _ = t.drain_dead_peers();
    let _ = t.drain_notifications();
    let Ok(mut s) = TcpStream::connect(addr) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = s.write_all(&hello());
    let _ = s.write_all(data);
    let _ = s.shutdown(Shutdown::Write);
    let mut buf = [0u8; 8192];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
    }
});
