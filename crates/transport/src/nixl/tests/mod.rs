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

mod baseline;
mod config;
mod device_memory;
mod metadata;
mod transfers;
