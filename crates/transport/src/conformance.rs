//! The conformance suite every backend must pass, and the pieces it shares with the peer
//! process (`handoff-transport-peer`) that plays the remote side across a process boundary.
//!
//! The checks:
//! - random descriptor lists READ and WRITE byte-exact;
//! - a notification reaches the peer strictly after the bytes of its transfer: on a READ's
//!   notification the peer scrubs the source range at once (as P would reuse a freed block), so
//!   a notification that raced its data shows up as scrubbed bytes at the reader; on a WRITE's
//!   notification the peer hashes the destination range at once;
//! - descriptors outside what the peer registered are refused and change nothing;
//! - bad metadata is an error, never a panic;
//! - a killed peer is reported dead in bounded time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{KvRegion, RegionId, Transport, XferDesc, XferOp, XferStatus};

/// The byte at `offset` of region `region` filled with `seed`.
pub fn pattern(seed: u64, region: RegionId, offset: u64) -> u8 {
    let mut x = seed ^ ((region as u64) << 48) ^ offset.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 32) as u8
}

pub fn fill(region: &KvRegion, seed: u64, id: RegionId) {
    let bytes: Vec<u8> = (0..region.len() as u64)
        .map(|o| pattern(seed, id, o))
        .collect();
    // Filling a region we just made cannot go out of bounds.
    region.write(0, &bytes).expect("fill within bounds");
}

/// FNV-1a, to compare ranges across processes.
pub fn fnv(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

pub fn expected(seed: u64, region: RegionId, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len)
        .map(|o| pattern(seed, region, o))
        .collect()
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The workspace's deterministic generator: the suite must replay from a seed.
pub use handoff_plan::testing::Rng;

/// `n` descriptors of 1..=`max_len` bytes that overlap neither locally nor remotely.
pub fn random_descs(
    rng: &mut Rng,
    local: (RegionId, u64),
    remote: (RegionId, u64),
    n: usize,
    max_len: u64,
) -> Vec<XferDesc> {
    let slots = |len: u64, rng: &mut Rng| {
        let mut s: Vec<u64> = (0..len / max_len).collect();
        for i in (1..s.len()).rev() {
            s.swap(i, rng.below(i as u64 + 1) as usize);
        }
        s
    };
    let ls = slots(local.1, rng);
    let rs = slots(remote.1, rng);
    let n = n.min(ls.len()).min(rs.len());
    (0..n)
        .map(|i| {
            let len = 1 + rng.below(max_len);
            let slack = max_len - len;
            XferDesc {
                local_region: local.0,
                local_offset: ls[i] * max_len + rng.below(slack + 1),
                remote_region: remote.0,
                remote_offset: rs[i] * max_len + rng.below(slack + 1),
                len,
            }
        })
        .collect()
}

/// What a peer saw when a notification arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub from: String,
    pub msg: Vec<u8>,
    /// For a `CHK` notification: whether the bytes were all there on arrival.
    pub check_ok: Option<bool>,
}

/// Answers notifications the moment they arrive: `CHK r:off:len:hash,...` hashes the ranges,
/// `SCRUB r:off:len,...` overwrites them with 0xEE. Runs in the peer (thread or process).
pub struct Responder {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Seen>>>,
    thread: Option<JoinHandle<()>>,
}

impl Responder {
    pub fn start(t: Arc<dyn Transport>, regions: HashMap<RegionId, Arc<KvRegion>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (s2, seen2) = (stop.clone(), seen.clone());
        let thread = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                for n in t.drain_notifications() {
                    let check_ok = respond(&regions, &n.msg);
                    seen2.lock().push(Seen {
                        from: n.from,
                        msg: n.msg,
                        check_ok,
                    });
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        Responder {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    pub fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.seen.lock())
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ranges(s: &str) -> Vec<Vec<u64>> {
    s.split(',')
        .map(|r| r.split(':').filter_map(|x| x.parse().ok()).collect())
        .collect()
}

fn respond(regions: &HashMap<RegionId, Arc<KvRegion>>, msg: &[u8]) -> Option<bool> {
    let text = std::str::from_utf8(msg).ok()?;
    if let Some(rest) = text.strip_prefix("CHK ") {
        let mut ok = true;
        for r in ranges(rest) {
            let [id, off, len, hash] = r[..] else {
                return Some(false);
            };
            let Some(region) = regions.get(&(id as RegionId)) else {
                return Some(false);
            };
            let mut buf = vec![0; len as usize];
            ok &= region.read(off as usize, &mut buf).is_ok() && fnv(&buf) == hash;
        }
        Some(ok)
    } else if let Some(rest) = text.strip_prefix("SCRUB ") {
        for r in ranges(rest) {
            if let [id, off, len] = r[..] {
                if let Some(region) = regions.get(&(id as RegionId)) {
                    let _ = region.write(off as usize, &vec![0xEE; len as usize]);
                }
            }
        }
        None
    } else {
        None
    }
}

/// The remote side of a conformance run: in this process or in a child process.
pub trait Remote {
    fn name(&self) -> String;
    fn metadata(&self) -> Vec<u8>;
    /// Makes the remote load our metadata (so it can send us notifications).
    fn load(&mut self, md: &[u8]) -> Result<(), String>;
    fn hash(&mut self, region: RegionId, offset: u64, len: u64) -> u64;
    fn notifications(&mut self) -> Vec<Seen>;
    fn refill(&mut self, seed: u64);
    fn send_notification(&mut self, to: &str, msg: &[u8]) -> Result<(), String>;
    fn kill(&mut self);
    fn region_len(&self, region: RegionId) -> u64;
}

/// A remote agent in this process.
pub struct InProcessRemote {
    pub transport: Arc<dyn Transport>,
    pub regions: HashMap<RegionId, Arc<KvRegion>>,
    responder: Option<Responder>,
    on_kill: Option<Box<dyn FnOnce() + Send>>,
}

/// Makes a region of the given length: host memory ([`host_region`]) or a device's.
pub type MakeRegion<'a> = &'a dyn Fn(usize) -> Arc<KvRegion>;

/// A host region of `len` bytes in chunks of 64 KiB.
pub fn host_region(len: usize) -> Arc<KvRegion> {
    Arc::new(KvRegion::new(len, 64 * 1024))
}

impl InProcessRemote {
    /// Registers regions of the given lengths (ids 0..), filled with `seed`.
    pub fn new(transport: Arc<dyn Transport>, lens: &[usize], seed: u64) -> Self {
        InProcessRemote::new_in(transport, lens, seed, &host_region)
    }

    /// [`InProcessRemote::new`] with regions made by `make` (device memory, say).
    pub fn new_in(
        transport: Arc<dyn Transport>,
        lens: &[usize],
        seed: u64,
        make: MakeRegion,
    ) -> Self {
        let mut regions = HashMap::new();
        for (i, len) in lens.iter().enumerate() {
            let r = make(*len);
            fill(&r, seed, i as RegionId);
            transport
                .register(i as RegionId, r.clone())
                .expect("fresh registration");
            regions.insert(i as RegionId, r);
        }
        let responder = Some(Responder::start(transport.clone(), regions.clone()));
        InProcessRemote {
            transport,
            regions,
            responder,
            on_kill: None,
        }
    }

    /// What `kill` does besides stopping to answer (e.g. `MemFabric::kill`, dropping a socket).
    pub fn on_kill(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.on_kill = Some(Box::new(f));
        self
    }
}

impl Remote for InProcessRemote {
    fn name(&self) -> String {
        self.transport.name().to_string()
    }
    fn metadata(&self) -> Vec<u8> {
        self.transport.local_metadata().expect("metadata")
    }
    fn load(&mut self, md: &[u8]) -> Result<(), String> {
        self.transport
            .load_remote(md)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    fn hash(&mut self, region: RegionId, offset: u64, len: u64) -> u64 {
        let mut buf = vec![0; len as usize];
        self.regions[&region]
            .read(offset as usize, &mut buf)
            .expect("in bounds");
        fnv(&buf)
    }
    fn notifications(&mut self) -> Vec<Seen> {
        self.responder
            .as_ref()
            .map(|r| r.take())
            .unwrap_or_default()
    }
    fn refill(&mut self, seed: u64) {
        for (id, r) in &self.regions {
            fill(r, seed, *id);
        }
    }
    fn send_notification(&mut self, to: &str, msg: &[u8]) -> Result<(), String> {
        self.transport
            .send_notification(to, msg)
            .map_err(|e| e.to_string())
    }
    fn kill(&mut self) {
        self.responder = None;
        if let Some(f) = self.on_kill.take() {
            f();
        }
    }
    fn region_len(&self, region: RegionId) -> u64 {
        self.regions.get(&region).map_or(0, |r| r.len() as u64)
    }
}

fn wait_done(t: &dyn Transport, id: crate::XferId, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    loop {
        match t.status(id).map_err(|e| e.to_string())? {
            XferStatus::Done => return Ok(()),
            XferStatus::Failed(e) => return Err(format!("transfer failed: {e}")),
            XferStatus::InProgress if start.elapsed() > limit => {
                return Err(format!("transfer not done after {limit:?}"))
            }
            XferStatus::InProgress => std::thread::sleep(Duration::from_micros(100)),
        }
    }
}

fn range_list(descs: &[XferDesc], with_hash: impl Fn(&XferDesc) -> Option<u64>) -> String {
    descs
        .iter()
        .map(|d| match with_hash(d) {
            Some(h) => format!("{}:{}:{}:{}", d.remote_region, d.remote_offset, d.len, h),
            None => format!("{}:{}:{}", d.remote_region, d.remote_offset, d.len),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Sets up the pair: our region 0 of `local_len` bytes filled with `local_seed`, metadata
/// exchanged both ways. Returns our region and the peer's name.
pub fn connect(
    local: &dyn Transport,
    remote: &mut dyn Remote,
    local_len: usize,
    local_seed: u64,
) -> Result<(Arc<KvRegion>, String), String> {
    connect_in(local, remote, local_len, local_seed, &host_region)
}

/// [`connect`] with our region made by `make`.
pub fn connect_in(
    local: &dyn Transport,
    remote: &mut dyn Remote,
    local_len: usize,
    local_seed: u64,
    make: MakeRegion,
) -> Result<(Arc<KvRegion>, String), String> {
    let region = make(local_len);
    fill(&region, local_seed, 0);
    local
        .register(0, region.clone())
        .map_err(|e| e.to_string())?;
    let peer = local
        .load_remote(&remote.metadata())
        .map_err(|e| e.to_string())?;
    if peer != remote.name() {
        return Err(format!(
            "metadata names {peer:?}, peer is {:?}",
            remote.name()
        ));
    }
    let md = local.local_metadata().map_err(|e| e.to_string())?;
    remote.load(&md)?;
    Ok((region, peer))
}

/// READs and WRITEs of random descriptor lists, byte-exact, with the notification-after-data
/// checks. `remote_seed` is what the remote's regions were filled with.
pub fn check_read_write(
    local: &dyn Transport,
    remote: &mut dyn Remote,
    region: &KvRegion,
    peer: &str,
    seeds: std::ops::Range<u64>,
    remote_seed: u64,
) -> Result<(), String> {
    let local_seed = 0x1234;
    for seed in seeds {
        let mut rng = Rng(seed * 7919 + 1);
        // Every third seed posts a long list (64 to 200 descriptors of up to 64 KiB): backends
        // may take those another way (NIXL's UCX splits lists of 64 or more between its worker
        // threads).
        let (max_len, n) = if seed % 3 == 2 {
            (
                [512, 4096, 65536][rng.below(3) as usize],
                64 + rng.below(137) as usize,
            )
        } else {
            (
                [512, 4096, 65536, 300_000][rng.below(4) as usize],
                1 + rng.below(24) as usize,
            )
        };
        let remote_len = remote.region_len(0);
        // READ: remote bytes into ours; the peer scrubs its source when notified.
        let descs = random_descs(
            &mut rng,
            (0, region.len() as u64),
            (0, remote_len),
            n,
            max_len,
        );
        let note = format!("SCRUB {}", range_list(&descs, |_| None));
        let id = local
            .post(XferOp::Read, peer, &descs, Some(note.as_bytes()))
            .map_err(|e| format!("post READ: {e}"))?;
        wait_done(local, id, Duration::from_secs(20))?;
        local.release(id).map_err(|e| e.to_string())?;
        for d in &descs {
            let (got, want) = landed_and_wanted(region, d, remote_seed)?;
            if got != want {
                let scrubbed = got.iter().zip(&want).any(|(g, w)| *g == 0xEE && *w != 0xEE);
                return Err(format!(
                    "seed {seed}: READ {d:?} not byte-exact{}",
                    if scrubbed {
                        " (the notification reached the peer before the data landed)"
                    } else {
                        ""
                    }
                ));
            }
        }
        // The notification arrived (and was acted on).
        let deadline = Instant::now() + Duration::from_secs(5);
        while !remote
            .notifications()
            .iter()
            .any(|s| s.msg == note.as_bytes())
        {
            if Instant::now() > deadline {
                return Err(format!("seed {seed}: READ notification never arrived"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        remote.refill(remote_seed);
        // The READ overwrote parts of our region: restore what the WRITE will send.
        fill(region, local_seed, 0);

        // WRITE: our bytes into the remote's; the peer hashes the range when notified.
        let descs = random_descs(
            &mut rng,
            (0, region.len() as u64),
            (0, remote_len),
            n,
            max_len,
        );
        let note = format!(
            "CHK {}",
            range_list(&descs, |d| Some(fnv(&expected(
                local_seed,
                0,
                d.local_offset,
                d.len
            ))))
        );
        let id = local
            .post(XferOp::Write, peer, &descs, Some(note.as_bytes()))
            .map_err(|e| format!("post WRITE: {e}"))?;
        wait_done(local, id, Duration::from_secs(20))?;
        local.release(id).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let seen = remote.notifications();
            if let Some(s) = seen.iter().find(|s| s.msg == note.as_bytes()) {
                if s.check_ok != Some(true) {
                    return Err(format!(
                        "seed {seed}: WRITE notification arrived before its data landed"
                    ));
                }
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("seed {seed}: WRITE notification never arrived"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        for d in &descs {
            let want = fnv(&expected(local_seed, 0, d.local_offset, d.len));
            if remote.hash(d.remote_region, d.remote_offset, d.len) != want {
                return Err(format!("seed {seed}: WRITE {d:?} not byte-exact"));
            }
        }
        remote.refill(remote_seed);
    }
    Ok(())
}

/// What a READ `d` left in `region`, and what the peer's region (filled with `remote_seed`)
/// holds there.
fn landed_and_wanted(
    region: &KvRegion,
    d: &XferDesc,
    remote_seed: u64,
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut got = vec![0; d.len as usize];
    region
        .read(d.local_offset as usize, &mut got)
        .map_err(|e| e.to_string())?;
    let want = expected(remote_seed, d.remote_region, d.remote_offset, d.len);
    Ok((got, want))
}

/// Two READs in flight at once into disjoint bytes of one local chunk (a D rank reading the
/// heads of one block from two P ranks, as TP 2 → 1 does): both are accepted and both land
/// byte-exact, whichever order the backend serves them in. Needs the peer's region 0 filled
/// with `remote_seed` and at least 12 KiB; `region`'s first 8 KiB are one chunk.
pub fn check_reads_into_one_chunk(
    local: &dyn Transport,
    remote: &mut dyn Remote,
    region: &KvRegion,
    peer: &str,
    remote_seed: u64,
) -> Result<(), String> {
    if region.chunk_size() < 8192 || remote.region_len(0) < 12288 {
        return Err("the check needs a local chunk of 8 KiB and a peer region of 12 KiB".into());
    }
    let halves = [
        XferDesc {
            local_region: 0,
            local_offset: 0,
            remote_region: 0,
            remote_offset: 0,
            len: 4096,
        },
        XferDesc {
            local_region: 0,
            local_offset: 4096,
            remote_region: 0,
            remote_offset: 8192,
            len: 4096,
        },
    ];
    let mut ids = Vec::new();
    for d in &halves {
        let id = local
            .post(XferOp::Read, peer, std::slice::from_ref(d), None)
            .map_err(|e| format!("a READ into one chunk beside another in flight: {e}"))?;
        ids.push(id);
    }
    for id in ids {
        wait_done(local, id, Duration::from_secs(20))?;
        local.release(id).map_err(|e| e.to_string())?;
    }
    for d in &halves {
        let (got, want) = landed_and_wanted(region, d, remote_seed)?;
        if got != want {
            return Err(format!(
                "READ {d:?} beside another into its chunk not byte-exact"
            ));
        }
    }
    Ok(())
}

/// Descriptors outside what the peer registered are refused and change nothing.
pub fn check_refusals(
    local: &dyn Transport,
    remote: &mut dyn Remote,
    peer: &str,
) -> Result<(), String> {
    let remote_len = remote.region_len(0);
    let before = remote.hash(0, 0, remote_len);
    let bad = [
        XferDesc {
            local_region: 0,
            local_offset: 0,
            remote_region: 0,
            remote_offset: remote_len - 10,
            len: 64,
        },
        XferDesc {
            local_region: 0,
            local_offset: 0,
            remote_region: 77,
            remote_offset: 0,
            len: 64,
        },
        XferDesc {
            local_region: 0,
            local_offset: u64::MAX - 5,
            remote_region: 0,
            remote_offset: 0,
            len: 64,
        },
    ];
    for d in bad {
        for op in [XferOp::Write, XferOp::Read] {
            match local.post(op, peer, &[d], None) {
                Err(_) => {}
                Ok(id) => {
                    if wait_done(local, id, Duration::from_secs(10)).is_ok() {
                        return Err(format!("{op:?} of {d:?} was served"));
                    }
                    let _ = local.release(id);
                }
            }
        }
    }
    if remote.hash(0, 0, remote_len) != before {
        return Err("a refused WRITE changed the peer's memory".into());
    }
    Ok(())
}

/// Bad metadata is an error, never a panic.
pub fn check_bad_metadata(local: &dyn Transport, good: &[u8]) -> Result<(), String> {
    let mut rng = Rng(99);
    let mut cases: Vec<Vec<u8>> = vec![vec![], vec![0], b"garbage".to_vec()];
    cases.push((0..200).map(|_| rng.next_u64() as u8).collect());
    for cut in [1, good.len() / 2, good.len().saturating_sub(1)] {
        cases.push(good[..cut.min(good.len())].to_vec());
    }
    for case in &cases {
        if local.load_remote(case).is_ok() {
            return Err(format!(
                "metadata {:?} was accepted",
                &case[..case.len().min(16)]
            ));
        }
    }
    // Flipped bytes may still parse (a name byte); they must not panic.
    for _ in 0..64 {
        let mut m = good.to_vec();
        if m.is_empty() {
            break;
        }
        let i = rng.below(m.len() as u64) as usize;
        m[i] ^= 1 << rng.below(8);
        let _ = local.load_remote(&m);
    }
    Ok(())
}

/// After the peer is killed, it is reported dead within `limit`.
pub fn check_killed_peer(
    local: &dyn Transport,
    remote: &mut dyn Remote,
    peer: &str,
    limit: Duration,
) -> Result<Duration, String> {
    remote.kill();
    let start = Instant::now();
    let probe = [XferDesc {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 0,
        len: 16,
    }];
    let mut last_probe = Instant::now() - Duration::from_secs(1);
    loop {
        if local.drain_dead_peers().iter().any(|p| p == peer) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            return Err(format!("killed peer not reported dead after {limit:?}"));
        }
        // Some backends only notice on use (NIXL): keep using the peer, as a connector would.
        if last_probe.elapsed() > Duration::from_millis(100) {
            last_probe = Instant::now();
            if let Ok(id) = local.post(XferOp::Read, peer, &probe, None) {
                let _ = wait_done(local, id, Duration::from_millis(200));
                let _ = local.release(id);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
