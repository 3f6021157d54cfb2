//! Two (or more) tcp agents in one process, on 127.0.0.1, a module per topic; the helpers they
//! share are here. Every wait is bounded. The checks every backend must pass (random READs and
//! WRITEs byte-exact, notifications after their data, refusals, bad metadata, a killed peer) are
//! the conformance suite's (`tests/conformance.rs` runs it on tcp in one process and across two).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, Meta};
use super::{TcpConfig, TcpTransport};
use crate::conformance::{check_read_write, connect, InProcessRemote, Rng};
use crate::{
    KvRegion, Transport, TransportError, XferDesc, XferId, XferOp, XferStatus,
    MAX_NOTIFICATION_BYTES,
};

mod auth;
mod limits;
mod liveness;
mod refusals;
mod throughput;
mod transfers;

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
