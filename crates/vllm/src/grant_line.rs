//! The grant line: renewed push grants from EngineCore's connector to each worker process while
//! a forward pass runs.
//!
//! vLLM hands the connector's work to its workers once per step (`build_connector_meta`), before
//! the step's forward pass. A streamed push plans every layer's write in that metadata and the
//! worker holds each until the forward saved its layer (`handoff_connector::forward_gate`). D
//! renews its registration grants on every P heartbeat, but a renewal that reaches the scheduler
//! side during the forward would reach the workers only with the next step's metadata: too late
//! for a forward longer than one grant. So renewals
//! ([`handoff_connector::WorkerOp::RenewWrites`]) take this line instead, at once.
//!
//! One Unix datagram socket per worker rank, bound by the worker in the runtime directory under
//! the engine's id and the rank, readable and writable by this user only. A datagram is one
//! renewal (postcard). A renewal lost costs only a write that fails once its grant ended and no
//! other renewal came (D recomputes). A renewal late (the worker's reading thread starved by the
//! forward pass, on a small host) stretches nothing past the grant D issued: it carries the
//! grant's end (less the write margin) on the host's monotonic clock, which every process reads
//! alike, not a time left that the worker would count from when it reads the datagram.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_connector::forward_gate::WriteGrants;
use handoff_proto::HandoffId;
use serde::{Deserialize, Serialize};

use crate::engine_socket::runtime_path;

/// One renewal: writes into (`handoff`, `d_rank`) may be posted until `until_ns` on the host's
/// monotonic clock ([`monotonic_ns`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewal {
    pub handoff: HandoffId,
    pub d_rank: u16,
    pub until_ns: u64,
}

impl Renewal {
    /// Writes may be posted for `post_within_ms` from now.
    pub fn within(handoff: HandoffId, d_rank: u16, post_within_ms: u32) -> Self {
        Renewal {
            handoff,
            d_rank,
            until_ns: monotonic_ns().saturating_add(u64::from(post_within_ms) * 1_000_000),
        }
    }

    /// The instant, on this process's clock, until which the writes may be posted; `None`
    /// once that has passed. `now` is read before the monotonic clock, so the instant errs
    /// early, never late.
    fn until(&self, now: Instant) -> Option<Instant> {
        let left = self.until_ns.checked_sub(monotonic_ns())?;
        // No grant is longer than a lease: anything past an hour is not a grant.
        (left > 0 && left <= 3_600_000_000_000).then(|| now + Duration::from_nanos(left))
    }
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host (of one time
/// namespace), unlike `Instant`, which cannot leave its process.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// A datagram is one renewal: anything longer is not one.
const MAX_DATAGRAM: usize = 64;

/// Where worker `rank` of engine `engine_id` listens.
pub fn socket_path(engine_id: &str, rank: u16) -> PathBuf {
    runtime_path(engine_id, &format!("r{rank}.grants"))
}

/// EngineCore's end: sends each renewal to the worker that holds the writes.
pub struct GrantLine {
    socket: UnixDatagram,
    workers: Vec<PathBuf>,
}

impl GrantLine {
    /// A line to the `ranks` workers of engine `engine_id`.
    pub fn new(engine_id: &str, ranks: u16) -> std::io::Result<Self> {
        let socket = UnixDatagram::unbound()?;
        // A worker that does not read (stuck, gone) must not stall the connector's executor.
        socket.set_nonblocking(true)?;
        Ok(GrantLine {
            socket,
            workers: (0..ranks).map(|r| socket_path(engine_id, r)).collect(),
        })
    }

    /// Sends `renewal` to worker `rank`; false when it could not be sent (its writes then fail
    /// at the grant they were planned on).
    pub fn send(&self, rank: u16, renewal: &Renewal) -> bool {
        let Some(path) = self.workers.get(rank as usize) else {
            return false;
        };
        let Ok(bytes) = postcard::to_allocvec(renewal) else {
            return false;
        };
        match self.socket.send_to(&bytes, path) {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(rank, error = %e, "a push grant renewal did not reach its worker");
                false
            }
        }
    }
}

/// A worker's end: a thread that files every renewal it reads into the worker's gate; stops
/// (and removes its socket) when dropped.
pub struct GrantLineReceiver {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

/// How often the reading thread looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(200);

impl GrantLineReceiver {
    pub fn start(path: &Path, grants: Arc<WriteGrants>) -> std::io::Result<Self> {
        // A socket left by a worker that died is stale: no one else uses this engine's name.
        let _ = std::fs::remove_file(path);
        let socket = UnixDatagram::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        socket.set_read_timeout(Some(STOP_POLL))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("handoff-grant-line".into())
            .spawn(move || {
                let mut buf = [0u8; MAX_DATAGRAM + 1];
                while !flag.load(Ordering::Relaxed) {
                    let n = match socket.recv(&mut buf) {
                        Ok(n) => n,
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            continue
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "grant line closed: held push writes keep the grant they were planned on");
                            break;
                        }
                    };
                    let now = Instant::now();
                    match decode(&buf[..n]) {
                        Some(r) => match r.until(now) {
                            Some(by) => grants.renew(r.handoff, r.d_rank, by, now),
                            None => tracing::debug!(handoff = %r.handoff, "a push grant renewal arrived after its end: ignored"),
                        },
                        None => tracing::warn!(bytes = n, "not a push grant renewal: ignored"),
                    }
                }
            })?;
        Ok(GrantLineReceiver {
            path: path.to_path_buf(),
            stop,
        })
    }
}

fn decode(bytes: &[u8]) -> Option<Renewal> {
    if bytes.len() > MAX_DATAGRAM {
        return None;
    }
    postcard::from_bytes(bytes).ok()
}

impl Drop for GrantLineReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_sent_on_the_line_reaches_the_worker_s_gate_and_garbage_does_not() {
        let engine = format!("grant-line-test-{}", std::process::id());
        let grants = Arc::new(WriteGrants::default());
        let _rx = GrantLineReceiver::start(&socket_path(&engine, 1), grants.clone()).unwrap();
        let line = GrantLine::new(&engine, 2).unwrap();
        let handoff: HandoffId = "ab".repeat(16).parse().unwrap();
        // Garbage and a datagram to a rank nobody listens on change nothing.
        UnixDatagram::unbound()
            .unwrap()
            .send_to(&[0xff; 40], socket_path(&engine, 1))
            .unwrap();
        // One that ended before it was read is dropped.
        assert!(line.send(
            1,
            &Renewal {
                handoff,
                d_rank: 2,
                until_ns: monotonic_ns() - 1,
            }
        ));
        let r = Renewal::within(handoff, 3, 60_000);
        assert!(!line.send(0, &r), "rank 0 has no worker listening");
        assert!(!line.send(7, &r), "no rank 7");
        assert!(line.send(1, &r));
        let t0 = Instant::now();
        while grants.is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "renewal never arrived"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(grants.len(), 1, "only the running renewal was filed");
    }

    /// A renewal read late keeps the end D's grant had: the worker does not count the time it
    /// carries from when it read it.
    #[test]
    fn a_renewal_read_late_ends_when_the_grant_it_carries_ends() {
        let handoff: HandoffId = "cd".repeat(16).parse().unwrap();
        let ms = Duration::from_millis;
        let r = Renewal::within(handoff, 0, 2000);
        let sent = Instant::now();
        std::thread::sleep(ms(100));
        let read = Instant::now();
        let by = r.until(read).expect("still running");
        assert!(by <= sent + ms(2000), "the grant's end moved past D's");
        assert!(
            by + ms(100) <= read + ms(2000),
            "counted from the read, not from the grant"
        );
    }
}
