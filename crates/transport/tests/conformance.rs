//! The conformance suite, run against every backend: in one process (mem, tcp, nixl) and across
//! two processes (tcp, nixl), the remote side being `handoff-transport-peer`.
//!
//! NIXL is skipped with a message when it is not installed, unless `HANDOFF_REQUIRE_NIXL=1`
//! (set by CI after `scripts/install-nixl`): then a missing NIXL fails the run.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use handoff_transport::conformance::*;
use handoff_transport::device::fake::FakeDevice;
use handoff_transport::device::MemoryKind;
use handoff_transport::mem::{MemFabric, MemTransport};
use handoff_transport::{open_backend, RegionId, Transport, TransportError};

const LOCAL_LEN: usize = 8 << 20;
const REMOTE_LEN: usize = 8 << 20;
const REMOTE_SEED: u64 = 0xfeed;

/// A remote agent in a child process, driven over its stdin/stdout.
struct ChildRemote {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    name: String,
    md: Vec<u8>,
}

impl ChildRemote {
    fn spawn(backend: &str, name: &str) -> Result<Self, String> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_handoff-transport-peer"))
            .args([
                backend,
                name,
                &REMOTE_SEED.to_string(),
                &REMOTE_LEN.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line).map_err(|e| e.to_string())?;
        let md = line
            .trim()
            .strip_prefix("MD ")
            .and_then(from_hex)
            .ok_or_else(|| format!("peer said {line:?}"))?;
        Ok(ChildRemote {
            child,
            stdin,
            stdout,
            name: name.into(),
            md,
        })
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").expect("peer stdin");
        self.stdin.flush().expect("peer stdin");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("peer stdout");
        line.trim().to_string()
    }
}

impl Remote for ChildRemote {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn metadata(&self) -> Vec<u8> {
        self.md.clone()
    }
    fn load(&mut self, md: &[u8]) -> Result<(), String> {
        let r = self.ask(&format!("LOAD {}", to_hex(md)));
        r.starts_with("OK").then_some(()).ok_or(r)
    }
    fn hash(&mut self, region: RegionId, offset: u64, len: u64) -> u64 {
        let r = self.ask(&format!("HASH {region} {offset} {len}"));
        r.strip_prefix("HASH ")
            .and_then(|h| h.parse().ok())
            .unwrap_or_else(|| panic!("peer said {r:?}"))
    }
    fn notifications(&mut self) -> Vec<Seen> {
        let head = self.ask("NOTIFS");
        let n: usize = head
            .strip_prefix("NOTIFS ")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        (0..n)
            .map(|_| {
                let mut line = String::new();
                self.stdout.read_line(&mut line).expect("peer stdout");
                let w: Vec<&str> = line.split_whitespace().collect();
                Seen {
                    from: w.get(1).unwrap_or(&"").to_string(),
                    check_ok: match w.get(2) {
                        Some(&"ok") => Some(true),
                        Some(&"bad") => Some(false),
                        _ => None,
                    },
                    msg: w.get(3).and_then(|h| from_hex(h)).unwrap_or_default(),
                }
            })
            .collect()
    }
    fn refill(&mut self, seed: u64) {
        assert_eq!(self.ask(&format!("REFILL {seed}")), "OK");
    }
    fn send_notification(&mut self, to: &str, msg: &[u8]) -> Result<(), String> {
        let r = self.ask(&format!("SEND {to} {}", to_hex(msg)));
        (r == "OK").then_some(()).ok_or(r)
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
    fn region_len(&self, region: RegionId) -> u64 {
        if region == 0 {
            REMOTE_LEN as u64
        } else {
            0
        }
    }
}

impl Drop for ChildRemote {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The whole suite against one local agent and one remote.
fn suite(local: &dyn Transport, remote: &mut dyn Remote, seeds: std::ops::Range<u64>) {
    let (region, peer) = connect(local, remote, LOCAL_LEN, 0x1234).expect("connect");
    check_read_write(local, remote, &region, &peer, seeds, REMOTE_SEED).expect("read/write");
    check_reads_into_one_chunk(local, remote, &region, &peer, REMOTE_SEED).expect("one chunk");
    check_refusals(local, remote, &peer).expect("refusals");
    // A notification with no transfer, the other way.
    remote
        .send_notification(local.name(), b"hello")
        .expect("send");
    let mut got = vec![];
    for _ in 0..2000 {
        got.extend(local.drain_notifications());
        if got.iter().any(|n| n.msg == b"hello") {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let n = got
        .iter()
        .find(|n| n.msg == b"hello")
        .expect("notification received");
    assert_eq!(n.from, remote.name());
    check_bad_metadata(local, &remote.metadata()).expect("bad metadata");
    let took =
        check_killed_peer(local, remote, &peer, Duration::from_secs(10)).expect("killed peer");
    eprintln!(
        "{}: killed peer reported dead after {took:?}",
        local.backend()
    );
}

fn nixl_or_skip(name: &str) -> Option<Arc<dyn Transport>> {
    match open_backend("nixl", name) {
        Ok(t) => Some(t),
        Err(e) => {
            if std::env::var("HANDOFF_REQUIRE_NIXL").is_ok_and(|v| v == "1") {
                panic!("HANDOFF_REQUIRE_NIXL=1 but NIXL is unavailable: {e}");
            }
            eprintln!("skipping NIXL conformance: {e}");
            None
        }
    }
}

#[test]
fn mem_in_one_process() {
    let fabric = MemFabric::new();
    let local = MemTransport::new(&fabric, "local").unwrap();
    let remote_t = MemTransport::new(&fabric, "remote").unwrap();
    let f = fabric.clone();
    let mut remote = InProcessRemote::new(remote_t, &[REMOTE_LEN], REMOTE_SEED)
        .on_kill(move || f.kill("remote"));
    suite(&*local, &mut remote, 0..12);
}

#[test]
fn tcp_in_one_process() {
    let local = open_backend("tcp", "tcp-local").expect("tcp");
    let remote_t = open_backend("tcp", "tcp-remote").expect("tcp");
    let keep = remote_t.clone();
    let mut remote = InProcessRemote::new(remote_t, &[REMOTE_LEN], REMOTE_SEED)
        .on_kill(move || keep.forget_remote("tcp-local"));
    // In one process a "kill" can only cut the connection from the remote's side.
    let (region, peer) = connect(&*local, &mut remote, LOCAL_LEN, 0x1234).expect("connect");
    check_read_write(&*local, &mut remote, &region, &peer, 0..8, REMOTE_SEED).expect("rw");
    check_reads_into_one_chunk(&*local, &mut remote, &region, &peer, REMOTE_SEED).expect("chunk");
    check_refusals(&*local, &mut remote, &peer).expect("refusals");
    check_bad_metadata(&*local, &remote.metadata()).expect("bad metadata");
}

#[test]
fn tcp_across_two_processes() {
    let local = open_backend("tcp", "tcp-initiator").expect("tcp");
    let mut remote = ChildRemote::spawn("tcp", "tcp-peer").expect("peer process");
    suite(&*local, &mut remote, 0..10);
}

#[test]
fn nixl_in_one_process() {
    let (Some(local), Some(remote_t)) = (nixl_or_skip("nixl-local"), nixl_or_skip("nixl-remote"))
    else {
        return;
    };
    let mut remote = InProcessRemote::new(remote_t, &[REMOTE_LEN], REMOTE_SEED);
    let (region, peer) = connect(&*local, &mut remote, LOCAL_LEN, 0x1234).expect("connect");
    check_read_write(&*local, &mut remote, &region, &peer, 0..6, REMOTE_SEED).expect("rw");
    check_reads_into_one_chunk(&*local, &mut remote, &region, &peer, REMOTE_SEED).expect("chunk");
    check_refusals(&*local, &mut remote, &peer).expect("refusals");
    check_bad_metadata(&*local, &remote.metadata()).expect("bad metadata");
}

#[test]
fn nixl_across_two_processes() {
    let Some(local) = nixl_or_skip("nixl-initiator") else {
        return;
    };
    let mut remote = ChildRemote::spawn("nixl", "nixl-peer").expect("peer process");
    suite(&*local, &mut remote, 0..6);
}

#[test]
fn unknown_backend_is_a_clear_error() {
    match open_backend("carrier-pigeon", "x") {
        Err(TransportError::Unavailable { reason, .. }) => {
            assert!(reason.contains("carrier-pigeon"))
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("opened a backend that does not exist"),
    }
}

/// Regions in (fake) device memory on both sides, with `transport` making the agents: every
/// byte goes through the device's copies (a fake device's addresses fault on any host access),
/// and the suite's checks pass unchanged: byte-exact READs and WRITEs, each notification after
/// its bytes, refusals.
fn on_device_memory(local: Arc<dyn Transport>, remote_t: Arc<dyn Transport>) {
    let (dev_p, dev_d) = (FakeDevice::new(0), FakeDevice::new(1));
    let on = |dev: Arc<FakeDevice>| move |len| Arc::new(dev.region(len, 64 * 1024));
    let mut remote = InProcessRemote::new_in(remote_t, &[REMOTE_LEN], REMOTE_SEED, &on(dev_d));
    let (region, peer) =
        connect_in(&*local, &mut remote, LOCAL_LEN, 0x1234, &on(dev_p)).expect("connect");
    assert_eq!(region.memory(), MemoryKind::Cuda { device: 0 });
    check_read_write(&*local, &mut remote, &region, &peer, 0..6, REMOTE_SEED).expect("rw");
    check_reads_into_one_chunk(&*local, &mut remote, &region, &peer, REMOTE_SEED).expect("chunk");
    check_refusals(&*local, &mut remote, &peer).expect("refusals");
}

#[test]
fn tcp_on_device_memory() {
    on_device_memory(
        open_backend("tcp", "tcp-dev-local").expect("tcp"),
        open_backend("tcp", "tcp-dev-remote").expect("tcp"),
    );
}

#[test]
fn mem_on_device_memory() {
    let fabric = MemFabric::new();
    on_device_memory(
        MemTransport::new(&fabric, "mem-dev-local").unwrap(),
        MemTransport::new(&fabric, "mem-dev-remote").unwrap(),
    );
}
