//! One TCP connection and its two threads.
//!
//! A connection is opened by the *initiator* (the agent that posts transfers) to the *target*
//! (the agent whose memory is read or written). Each end runs a reader thread and a writer
//! thread; the writer takes [`Job`]s from a channel and sends a PING whenever it has been idle
//! for `keepalive`, so a live end always hears from its peer. Every socket operation has a
//! timeout; a reader that heard nothing for `dead_after`, or a writer that could not push a byte
//! for `dead_after`, declares the peer dead.
//!
//! One file, over 800 lines: a connection's reader and writer threads share one state (jobs in
//! flight, keepalive, the close), which is easiest to check in one place.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::wire::{self, WireDesc};
use super::Inner;
use crate::device::{MemoryKind, Stager};
use crate::{KvRegion, XferOp, XferStatus, MAX_NOTIFICATION_BYTES};

/// A piece of registered memory a transfer touches.
pub(super) struct Span {
    pub region: Arc<KvRegion>,
    pub offset: usize,
    pub len: usize,
}

/// A transfer posted by this agent.
pub(super) struct Xfer {
    pub id: u64,
    pub op: XferOp,
    pub local: Vec<Span>,
    pub remote: Vec<WireDesc>,
    pub total: u64,
    pub notification: Option<Vec<u8>>,
    pub status: Mutex<XferStatus>,
    pub aborted: AtomicBool,
    pub conn: Weak<Conn>,
}

impl Xfer {
    /// Sets the final status unless one is already set.
    pub fn finish(&self, s: XferStatus) {
        let mut st = self.status.lock();
        if *st == XferStatus::InProgress {
            *st = s;
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }
}

/// Work for a connection's writer thread.
pub(super) enum Job {
    /// The connection is closed: exit.
    Stop,
    /// Say goodbye, then close.
    Goodbye,
    Read(Arc<Xfer>),
    Write(Arc<Xfer>),
    Notify(Vec<u8>),
    /// Target side: stream these spans to the initiator.
    ReadData {
        xfer: u64,
        total: u64,
        spans: Vec<Span>,
    },
    XferErr {
        kind: u8,
        xfer: u64,
        msg: String,
    },
    WriteDone {
        xfer: u64,
    },
}

impl Job {
    /// What a target-side answer weighs against [`Conn::serve_later`]'s backlog (its
    /// descriptors, at least 1); `None` for the initiator's own jobs, which are not counted.
    fn served_weight(&self) -> Option<usize> {
        match self {
            Job::ReadData { spans, .. } => Some(spans.len().max(1)),
            Job::XferErr { .. } | Job::WriteDone { .. } => Some(1),
            _ => None,
        }
    }
}

/// Descriptors of a connection's answers queued for its writer, and their cap.
struct Backlog {
    queued: Mutex<usize>,
    room: Condvar,
    max: usize,
    /// The most ever queued (tests check the bound holds).
    peak: AtomicUsize,
}

struct ConnState {
    dead: bool,
    inflight: HashMap<u64, Arc<Xfer>>,
}

pub(super) struct Conn {
    pub id: u64,
    /// The agent at the other end (known at once for an outbound connection, after the hello
    /// for an inbound one).
    pub peer: OnceLock<String>,
    pub tx: Sender<Job>,
    stream: Mutex<Option<TcpStream>>,
    closed: AtomicBool,
    state: Mutex<ConnState>,
    backlog: Backlog,
    /// The most bytes the writer ever staged at once (tests check the bound holds).
    staged_peak: AtomicUsize,
}

impl Conn {
    pub fn new(id: u64, peer: Option<String>, max_queued: usize) -> (Arc<Conn>, Receiver<Job>) {
        let (tx, rx) = mpsc::channel();
        let cell = OnceLock::new();
        if let Some(p) = peer {
            let _ = cell.set(p);
        }
        let conn = Conn {
            id,
            peer: cell,
            tx,
            stream: Mutex::new(None),
            closed: AtomicBool::new(false),
            state: Mutex::new(ConnState {
                dead: false,
                inflight: HashMap::new(),
            }),
            backlog: Backlog {
                queued: Mutex::new(0),
                room: Condvar::new(),
                max: max_queued,
                peak: AtomicUsize::new(0),
            },
            staged_peak: AtomicUsize::new(0),
        };
        (Arc::new(conn), rx)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Keeps a handle on the socket so that [`Conn::close`] can wake its threads.
    fn set_stream(&self, s: TcpStream) -> io::Result<()> {
        *self.stream.lock() = Some(s);
        if self.is_closed() {
            self.shutdown_socket();
            return Err(io::Error::other("connection closed"));
        }
        Ok(())
    }

    fn shutdown_socket(&self) {
        if let Some(s) = self.stream.lock().as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Registers a transfer; false if the connection is already dead.
    pub fn add_inflight(&self, x: &Arc<Xfer>) -> bool {
        let mut st = self.state.lock();
        if st.dead {
            return false;
        }
        st.inflight.insert(x.id, x.clone());
        true
    }

    pub fn take_inflight(&self, id: u64) -> Option<Arc<Xfer>> {
        self.state.lock().inflight.remove(&id)
    }

    fn get_inflight(&self, id: u64) -> Option<Arc<Xfer>> {
        self.state.lock().inflight.get(&id).cloned()
    }

    /// Queues a target-side answer for the writer, first waiting (this is the connection's
    /// reader: the peer's further requests wait unread) while the answers already queued hold
    /// the backlog's descriptors. A lone answer always fits, so a legal request never waits for
    /// ever; fails once the connection is closed.
    pub fn serve_later(&self, job: Job, tick: Duration) -> io::Result<()> {
        let w = job.served_weight().unwrap_or(0);
        let b = &self.backlog;
        let mut queued = b.queued.lock();
        while *queued > 0 && *queued + w > b.max {
            if self.is_closed() {
                return Err(io::Error::other("connection closed"));
            }
            b.room.wait_for(&mut queued, tick);
        }
        *queued += w;
        b.peak.fetch_max(*queued, Ordering::Relaxed);
        drop(queued);
        let _ = self.tx.send(job);
        Ok(())
    }

    /// The most answers' descriptors ever queued at once.
    #[cfg(test)]
    pub fn backlog_peak(&self) -> usize {
        self.backlog.peak.load(Ordering::Relaxed)
    }

    /// The most bytes the writer staged at once.
    #[cfg(test)]
    pub fn staged_peak(&self) -> usize {
        self.staged_peak.load(Ordering::Relaxed)
    }

    /// The writer sent (or dropped) an answer of this weight.
    fn served(&self, w: usize) {
        let b = &self.backlog;
        let mut queued = b.queued.lock();
        *queued = queued.saturating_sub(w);
        b.room.notify_one();
    }

    /// A READ landed: send its notification, then report it done.
    fn complete_read(&self, x: &Xfer) {
        let st = {
            let mut st = self.state.lock();
            st.inflight.remove(&x.id);
            if st.dead {
                XferStatus::Failed("connection lost before the notification".into())
            } else {
                if let (false, Some(n)) = (x.is_aborted(), &x.notification) {
                    let _ = self.tx.send(Job::Notify(n.clone()));
                }
                XferStatus::Done
            }
        };
        x.finish(st);
    }

    /// Closes the connection once: fails what is in flight and stops both threads (after a
    /// GOODBYE frame when `goodbye`). True for the call that closed it.
    pub fn close(&self, reason: &str, goodbye: bool) -> bool {
        let inflight = {
            let mut st = self.state.lock();
            if st.dead {
                return false;
            }
            st.dead = true;
            self.closed.store(true, Ordering::Release);
            std::mem::take(&mut st.inflight)
        };
        for x in inflight.values() {
            x.finish(XferStatus::Failed(reason.to_string()));
        }
        if goodbye {
            let _ = self.tx.send(Job::Goodbye);
        } else {
            self.shutdown_socket();
            let _ = self.tx.send(Job::Stop);
        }
        true
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// How long past a socket call's `timeout` (begun at `asleep_at`) this thread was not run: time
/// beyond twice the timeout, scheduling jitter on a busy host staying inside that. Neither end's
/// liveness check holds that time against the peer (see [`Rx`]).
fn not_run_since(asleep_at: Instant, timeout: Duration) -> Duration {
    asleep_at.elapsed().saturating_sub(timeout * 2)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// While a chunk lock is held, a socket operation waits at most this long. A peer that stalls
/// longer gets the rest of that piece through a staging buffer, with the lock released: two
/// agents that READ and WRITE the same chunks at once (or share a chunk between transfers)
/// would otherwise deadlock, each holding a lock while blocked on a socket the other must drain.
pub(super) const STALL: Duration = Duration::from_millis(10);
/// Most bytes staged at once when a peer stalls.
const STAGE_BYTES: usize = 64 * 1024;
/// Bytes per copy between device memory and the socket's host buffer: large enough that the
/// driver's per-copy cost is small beside the bytes.
const DEVICE_STAGE_BYTES: usize = 1 << 20;
/// Most bytes of consecutive chunk pieces moved by one vectored socket call (their locks held
/// together): an engine locks its KV per layer of a block (64 KiB for an 8B-class model), and a
/// system call per piece made a 256 MiB READ take twice as long as calls of this size.
const BATCH_BYTES: usize = 2 << 20;

/// Why a piece of a span was not completed under its lock.
enum PieceErr {
    Stall,
    Aborted,
    Io(io::Error),
}

fn region_err(e: crate::TransportError) -> io::Error {
    io::Error::other(e.to_string())
}

fn device_err(e: crate::device::DeviceError) -> io::Error {
    io::Error::other(e.to_string())
}

/// A half's stager, kept between transfers (its pinned buffers cost a driver call each).
type StagerSlot = Option<(MemoryKind, Box<dyn Stager>)>;

/// The device and address of a device region's span, and a stager for that device: the one
/// kept in `slot` if it is for that device, else a new one.
fn staging_for(
    slot: &mut StagerSlot,
    region: &KvRegion,
    offset: usize,
    len: usize,
) -> io::Result<(Box<dyn Stager>, MemoryKind, usize)> {
    let span = region
        .device_span(offset, len)
        .map_err(region_err)?
        .ok_or_else(|| io::Error::other("staging host memory"))?;
    let (device, addr) = (span.device, span.addr);
    let kind = device.memory();
    let st = match slot.take() {
        Some((k, st)) if k == kind => st,
        _ => device
            .clone()
            .stager(DEVICE_STAGE_BYTES)
            .map_err(device_err)?,
    };
    Ok((st, kind, addr))
}

pub(super) fn configure(s: &TcpStream, tick: Duration) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(tick))?;
    s.set_write_timeout(Some(STALL))?;
    Ok(())
}

/// The reading half: every read has a timeout, and silence longer than `dead_after` is an error.
///
/// Silence is counted only while this reader was there to hear: when one of its own timed-out
/// reads returns much later than its timeout, this thread was not run meanwhile (the host
/// paused the whole machine, a VM's CPUs were taken away, the process was stopped), and the
/// peer's writer most likely was not run either. That time is not held against the peer;
/// otherwise a two-second pause of one host kills every connection on it the moment it resumes,
/// before any writer has had the chance to send its PING. A peer that is really gone still
/// costs at most `dead_after` of listening, plus the pauses.
pub(super) struct Rx {
    stream: TcpStream,
    last_rx: Instant,
    /// Time since `last_rx` this reader could not have heard anything (see above).
    unheard: Duration,
    dead_after: Duration,
    /// The socket's read timeout between frames.
    tick: Duration,
    timeout: Duration,
    conn: Arc<Conn>,
    scratch: Vec<u8>,
    /// Pinned buffers and a copy stream for landing device memory.
    stager: StagerSlot,
    /// Bytes of a transfer are being read (set by [`Rx::landing`]).
    landing: bool,
    landing_spin: Duration,
}

impl Rx {
    fn new(stream: TcpStream, inner: &Inner, conn: Arc<Conn>) -> Rx {
        Rx {
            stream,
            last_rx: Instant::now(),
            unheard: Duration::ZERO,
            dead_after: inner.cfg.dead_after,
            tick: inner.tick(),
            timeout: inner.tick(),
            conn,
            scratch: Vec::new(),
            stager: None,
            landing: false,
            landing_spin: inner.cfg.landing_spin,
        }
    }

    /// Short read timeouts while landing data (see [`STALL`]), the tick between frames.
    fn landing(&mut self, on: bool) -> io::Result<()> {
        self.landing = on;
        let d = if on { STALL } else { self.tick };
        if d != self.timeout {
            self.stream.set_read_timeout(Some(d))?;
            self.timeout = d;
        }
        Ok(())
    }

    /// After a read that timed out, having waited since `asleep_at`: the time this reader was
    /// not run ([`not_run_since`]) is credited to the peer, then the silence it did hear is
    /// checked against `dead_after`.
    fn check_alive(&mut self, asleep_at: Instant) -> io::Result<()> {
        if self.conn.is_closed() {
            return Err(io::Error::other("connection closed"));
        }
        let missed = not_run_since(asleep_at, self.timeout);
        if missed >= self.tick {
            tracing::debug!(
                missed_ms = missed.as_millis() as u64,
                "tcp reader was not run for longer than its timeout: that time is not the peer's silence"
            );
        }
        self.unheard += missed;
        let silent = self.last_rx.elapsed().saturating_sub(self.unheard);
        if silent >= self.dead_after {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("peer silent for {} ms", silent.as_millis()),
            ));
        }
        Ok(())
    }

    /// One read. While landing, a socket found empty is polled without blocking for up to
    /// `landing_spin` before the thread sleeps in the kernel (see [`super::TcpConfig`]).
    fn read_some(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let spin = self.landing_spin;
        if self.landing && !spin.is_zero() {
            let start = Instant::now();
            let mut tries = 0u32;
            loop {
                let mut no_control = rustix::net::RecvAncillaryBuffer::new(&mut []);
                match rustix::net::recvmsg(
                    &self.stream,
                    bufs,
                    &mut no_control,
                    rustix::net::RecvFlags::DONTWAIT,
                ) {
                    Ok(m) => return Ok(m.bytes),
                    Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
                tries += 1;
                if tries % 32 == 0 && start.elapsed() >= spin {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        self.stream.read_vectored(bufs)
    }

    /// Reads into `buf` until it is full or a read times out; returns the count.
    fn fill_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.fill_some_vectored(&mut [IoSliceMut::new(buf)])
    }

    /// Reads into `bufs` in order until they are full or a read times out; returns the count.
    fn fill_some_vectored(&mut self, mut bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let mut at = 0;
        while !bufs.is_empty() {
            let asleep_at = Instant::now();
            match self.read_some(bufs) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed by the peer",
                    ))
                }
                Ok(n) => {
                    at += n;
                    self.last_rx = Instant::now();
                    self.unheard = Duration::ZERO;
                    IoSliceMut::advance_slices(&mut bufs, n);
                }
                Err(e) if is_timeout(&e) => {
                    self.check_alive(asleep_at)?;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(at)
    }

    /// `read_exact` that survives read timeouts while the peer is alive.
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            at += self.fill_some(&mut buf[at..])?;
        }
        Ok(())
    }

    /// Lands `len` bytes from the socket at `offset` of `region`, reading straight into the
    /// region's pieces. Once `aborted()` the rest is read and dropped.
    fn land_span(
        &mut self,
        region: &KvRegion,
        offset: usize,
        len: usize,
        aborted: &dyn Fn() -> bool,
    ) -> io::Result<()> {
        if region.device().is_some() {
            return self.land_staged(region, offset, len, aborted);
        }
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            if aborted() {
                return self.discard((end - pos) as u64);
            }
            let r = region
                .with_span_mut_batched(pos, end - pos, BATCH_BYTES, |pieces| {
                    if aborted() {
                        return Err(PieceErr::Aborted);
                    }
                    let len: usize = pieces.iter().map(|p| p.len()).sum();
                    let mut iov: Vec<_> = pieces.iter_mut().map(|p| IoSliceMut::new(p)).collect();
                    let n = self.fill_some_vectored(&mut iov).map_err(PieceErr::Io)?;
                    pos += n;
                    if n < len {
                        return Err(PieceErr::Stall);
                    }
                    Ok(())
                })
                .map_err(region_err)?;
            match r {
                Ok(()) => return Ok(()),
                Err(PieceErr::Io(e)) => return Err(e),
                Err(PieceErr::Aborted) => {}
                Err(PieceErr::Stall) => {
                    // The peer is slow: wait for the next bytes without holding the lock.
                    let k = (end - pos).min(STAGE_BYTES);
                    let mut stage = std::mem::take(&mut self.scratch);
                    stage.resize(STAGE_BYTES, 0);
                    let r = self.fill(&mut stage[..k]);
                    if r.is_ok() && !aborted() {
                        region.write(pos, &stage[..k]).map_err(region_err)?;
                    }
                    self.scratch = stage;
                    r?;
                    pos += k;
                }
            }
        }
        Ok(())
    }

    /// Lands bytes in device memory through the stager's pinned buffers: the WRITE or READ is
    /// reported done only once its last copy completed (its last byte is in device memory).
    fn land_staged(
        &mut self,
        region: &KvRegion,
        offset: usize,
        len: usize,
        aborted: &dyn Fn() -> bool,
    ) -> io::Result<()> {
        let (mut st, kind, addr) = staging_for(&mut self.stager, region, offset, len)?;
        let res = self.land_through(&mut *st, addr, len, aborted);
        // Landed (or failed) only once no copy into the region is left: the ledger may give
        // the blocks back as soon as this returns.
        let waited = st.wait_all().map_err(device_err);
        self.stager = Some((kind, st));
        res.and(waited)
    }

    /// The socket fills one pinned buffer while the other's copy to the device runs.
    fn land_through(
        &mut self,
        st: &mut dyn Stager,
        addr: usize,
        len: usize,
        aborted: &dyn Fn() -> bool,
    ) -> io::Result<()> {
        let piece = st.piece();
        let (mut at, mut i) = (0, 0);
        while at < len {
            let k = (len - at).min(piece);
            // Waits for this buffer's copy two pieces ago.
            let buf = st.buffer(i).map_err(device_err)?;
            self.fill(&mut buf[..k])?;
            if !aborted() {
                st.start_up(i, addr + at, k).map_err(device_err)?;
            }
            at += k;
            i = 1 - i;
        }
        Ok(())
    }

    /// Reads and drops `n` bytes.
    fn discard(&mut self, mut n: u64) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(STAGE_BYTES, 0);
        let mut res = Ok(());
        while n > 0 {
            let k = n.min(scratch.len() as u64) as usize;
            if let Err(e) = self.fill(&mut scratch[..k]) {
                res = Err(e);
                break;
            }
            n -= k as u64;
        }
        self.scratch = scratch;
        res
    }

    fn array<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Ok(b)
    }

    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> io::Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn bytes(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.fill(&mut v)?;
        Ok(v)
    }

    /// A length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, len: usize, max: usize) -> io::Result<String> {
        if len > max {
            return Err(invalid(format!("string of {len} bytes exceeds {max}")));
        }
        String::from_utf8(self.bytes(len)?).map_err(|_| invalid("string is not UTF-8".into()))
    }

    /// Reads `n` descriptors (`n` already checked against the agent's limit).
    fn descs(&mut self, n: usize) -> io::Result<Vec<WireDesc>> {
        Ok(wire::parse_descs(&self.bytes(n * wire::DESC_BYTES)?))
    }

    /// Reads past `n` descriptors without holding them, returning the bytes they span.
    fn skip_descs(&mut self, mut n: usize) -> io::Result<u64> {
        const CHUNK: usize = 4096;
        let mut total = 0u64;
        while n > 0 {
            let k = n.min(CHUNK);
            for d in self.descs(k)? {
                total = total
                    .checked_add(d.len)
                    .ok_or_else(|| invalid("transfer length overflows".into()))?;
            }
            n -= k;
        }
        Ok(total)
    }
}

/// The writing half: `write_all` that survives write timeouts while the peer still reads.
pub(super) struct Tx {
    stream: TcpStream,
    dead_after: Duration,
    conn: Arc<Conn>,
    stage: Vec<u8>,
    /// Pinned buffers and a copy stream for sending device memory.
    stager: StagerSlot,
}

impl Tx {
    fn new(stream: TcpStream, inner: &Inner, conn: Arc<Conn>) -> Tx {
        Tx {
            stream,
            dead_after: inner.cfg.dead_after,
            conn,
            stage: Vec::new(),
            stager: None,
        }
    }

    /// Writes `bufs` in order until done or a write times out ([`STALL`]); returns the count.
    fn send_some(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        let mut iov: Vec<_> = bufs.iter().map(|b| IoSlice::new(b)).collect();
        let mut rest = &mut iov[..];
        let mut at = 0;
        while !rest.is_empty() {
            // `sendmsg` with MSG_NOSIGNAL, not `write_vectored` (`writev`): a peer that closed
            // must fail the call, not raise SIGPIPE in a host process that did not ignore it (a
            // C or C++ engine, libFuzzer's main). std's `write` already passes the flag.
            let mut no_control = rustix::net::SendAncillaryBuffer::default();
            let sent = rustix::net::sendmsg(
                &self.stream,
                rest,
                &mut no_control,
                rustix::net::SendFlags::NOSIGNAL,
            )
            .map_err(io::Error::from);
            match sent {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    at += n;
                    IoSlice::advance_slices(&mut rest, n);
                }
                Err(e) if is_timeout(&e) => {
                    if self.conn.is_closed() {
                        return Err(io::Error::other("connection closed"));
                    }
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(at)
    }

    /// Streams `len` bytes at `offset` of `region` straight from its pieces (device memory:
    /// through pinned buffers, as `Rx::land_staged` lands it).
    fn send_span(&mut self, region: &KvRegion, offset: usize, len: usize) -> io::Result<()> {
        if region.device().is_some() {
            return self.send_staged(region, offset, len);
        }
        let end = offset + len;
        let mut pos = offset;
        let mut stage = std::mem::take(&mut self.stage);
        let res = loop {
            if pos >= end {
                break Ok(());
            }
            stage.clear();
            let r = region.with_span_batched(pos, end - pos, BATCH_BYTES, |pieces| {
                let n = self.send_some(pieces).map_err(PieceErr::Io)?;
                let len: usize = pieces.iter().map(|p| p.len()).sum();
                if n < len {
                    // The peer is slow: the rest of the piece it stopped in goes without the
                    // locks, and the pieces after it are sent from the region again. Staging
                    // only that piece keeps a stalled connection's buffer at one piece (a
                    // chunk), not a whole group of up to `BATCH_BYTES`.
                    let mut skip = n;
                    for p in pieces {
                        if skip < p.len() {
                            stage.extend_from_slice(&p[skip..]);
                            break;
                        }
                        skip -= p.len();
                    }
                    pos += n + stage.len();
                    self.conn
                        .staged_peak
                        .fetch_max(stage.len(), Ordering::Relaxed);
                    return Err(PieceErr::Stall);
                }
                pos += len;
                Ok(())
            });
            match r {
                Err(e) => break Err(region_err(e)),
                Ok(Ok(())) => break Ok(()),
                Ok(Err(PieceErr::Io(e))) => break Err(e),
                Ok(Err(PieceErr::Stall | PieceErr::Aborted)) => {
                    if let Err(e) = self.send(&stage) {
                        break Err(e);
                    }
                }
            }
        };
        stage.clear();
        self.stage = stage;
        res
    }

    /// Sends device memory through the stager's pinned buffers; returns once no copy out of the
    /// region is left.
    fn send_staged(&mut self, region: &KvRegion, offset: usize, len: usize) -> io::Result<()> {
        let (mut st, kind, addr) = staging_for(&mut self.stager, region, offset, len)?;
        let res = self.send_through(&mut *st, addr, len);
        let waited = st.wait_all().map_err(device_err);
        self.stager = Some((kind, st));
        res.and(waited)
    }

    /// The copy of piece j+1 to the other pinned buffer runs while piece j is on the socket.
    fn send_through(&mut self, st: &mut dyn Stager, addr: usize, len: usize) -> io::Result<()> {
        let piece = st.piece();
        let pieces = len.div_ceil(piece);
        let size = |j: usize| (len - j * piece).min(piece);
        if pieces == 0 {
            return Ok(());
        }
        st.start_down(0, addr, size(0)).map_err(device_err)?;
        for j in 0..pieces {
            if j + 1 < pieces {
                // The other buffer's piece went to the socket in the last round.
                st.start_down((j + 1) % 2, addr + (j + 1) * piece, size(j + 1))
                    .map_err(device_err)?;
            }
            let buf = st.buffer(j % 2).map_err(device_err)?;
            self.send(&buf[..size(j)])?;
        }
        Ok(())
    }

    /// Writes all of `buf`. A peer that reads nothing for `dead_after` is dead; as for the
    /// reader's silence (see [`Rx`]), time this thread was not run is not counted against it.
    fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut at = 0;
        let mut progress = Instant::now();
        let mut unrun = Duration::ZERO;
        while at < buf.len() {
            let asleep_at = Instant::now();
            match self.stream.write(&buf[at..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    at += n;
                    progress = Instant::now();
                    unrun = Duration::ZERO;
                }
                Err(e) if is_timeout(&e) => {
                    if self.conn.is_closed() {
                        return Err(io::Error::other("connection closed"));
                    }
                    unrun += not_run_since(asleep_at, STALL);
                    let stuck = progress.elapsed().saturating_sub(unrun);
                    if stuck >= self.dead_after {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("peer has not read for {} ms", stuck.as_millis()),
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Streams the bytes of `spans` straight from registered memory.
    fn send_spans<'a>(&mut self, spans: impl IntoIterator<Item = &'a Span>) -> io::Result<()> {
        for s in spans {
            self.send_span(&s.region, s.offset, s.len)?;
        }
        Ok(())
    }
}

fn spawn_or_close(inner: &Arc<Inner>, conn: &Arc<Conn>, f: impl FnOnce() + Send + 'static) -> bool {
    match inner.spawn(f) {
        Ok(()) => true,
        Err(e) => {
            inner.conn_lost(conn, &format!("cannot start a thread: {e}"));
            false
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writer (both ends).

fn writer_loop(inner: Arc<Inner>, conn: Arc<Conn>, jobs: Receiver<Job>, mut tx: Tx) {
    let keepalive = inner.cfg.keepalive;
    loop {
        let job = match jobs.recv_timeout(keepalive) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => {
                if conn.is_closed() {
                    break;
                }
                if let Err(e) = tx.send(&[wire::PING]) {
                    inner.conn_lost(&conn, &format!("sending: {e}"));
                    break;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if let Some(w) = job.served_weight() {
            conn.served(w);
        }
        let res = match job {
            Job::Stop => break,
            Job::Goodbye => {
                let _ = tx.send(&[wire::GOODBYE]);
                break;
            }
            _ if conn.is_closed() => continue,
            Job::Read(x) => {
                if x.is_aborted() {
                    continue;
                }
                tx.send(&wire::read_req(x.id, &x.remote))
            }
            Job::Write(x) => {
                if x.is_aborted() {
                    continue;
                }
                tx.send(&wire::write_req(x.id, &x.remote, x.notification.as_deref()))
                    .and_then(|()| tx.send_spans(&x.local))
            }
            Job::Notify(m) => tx.send(&wire::notify(&m)),
            Job::ReadData { xfer, total, spans } => tx
                .send(&wire::read_data(xfer, total))
                .and_then(|()| tx.send_spans(&spans)),
            Job::XferErr { kind, xfer, msg } => tx.send(&wire::xfer_err(kind, xfer, &msg)),
            Job::WriteDone { xfer } => tx.send(&wire::write_done(xfer)),
        };
        if let Err(e) = res {
            inner.conn_lost(&conn, &format!("sending: {e}"));
            break;
        }
    }
    conn.shutdown_socket();
}

// ---------------------------------------------------------------------------------------------
// Initiator side.

/// Thread body of an outbound connection: connects, then writes.
pub(super) fn outbound(
    inner: Arc<Inner>,
    conn: Arc<Conn>,
    jobs: Receiver<Job>,
    host: String,
    port: u16,
) {
    let peer = conn.peer.get().cloned().unwrap_or_default();
    match connect(&inner, &conn, &host, port, &peer) {
        Ok(tx) => writer_loop(inner, conn, jobs, tx),
        Err(e) => {
            // Said at once, with the address tried: a peer whose data port cannot be reached
            // (a transport bound to the wrong address, a firewall) must not fail silently.
            let why = format!("cannot reach {peer:?} at {host}:{port}: {e}");
            tracing::warn!(agent = %inner.name, "{why}");
            inner.conn_lost(&conn, &why)
        }
    }
}

fn connect(
    inner: &Arc<Inner>,
    conn: &Arc<Conn>,
    host: &str,
    port: u16,
    peer: &str,
) -> io::Result<Tx> {
    let deadline = inner.handshake_deadline();
    let mut last_err = io::Error::new(io::ErrorKind::NotFound, "no address");
    let mut stream = None;
    for addr in (host, port).to_socket_addrs()? {
        if conn.is_closed() {
            return Err(io::Error::other("connection closed"));
        }
        match TcpStream::connect_timeout(&addr, deadline) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last_err = e,
        }
    }
    let stream = stream.ok_or(last_err)?;
    if let Some(key) = &inner.cfg.key {
        // Both ends prove the cluster key before a byte of the protocol: the target serves no
        // one else, and we land nothing from an impostor.
        // Bulk bytes are not tagged (see SECURITY.md): the session key is not used here.
        crate::auth::dial(&stream, key, "tcp", &inner.name, peer, deadline)
            .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()))?;
    }
    configure(&stream, inner.tick())?;
    conn.set_stream(stream.try_clone()?)?;
    let mut tx = Tx::new(stream.try_clone()?, inner, conn.clone());
    let mut rx = Rx::new(stream, inner, conn.clone());
    tx.send(&wire::hello(&inner.name, peer))?;
    let head: [u8; 6] = rx.array()?;
    if head[..4] != wire::ACK_MAGIC || head[4] != wire::VERSION {
        return Err(invalid("not a handoff tcp agent (bad handshake)".into()));
    }
    let status = head[5];
    let len = rx.u16()? as usize;
    let text = rx.string(len, wire::MAX_ERROR_BYTES)?;
    if status != 0 {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!("refused: {text}"),
        ));
    }
    if text != peer {
        return Err(invalid(format!("the agent there is {text:?}")));
    }
    let (i, c) = (inner.clone(), conn.clone());
    if !spawn_or_close(inner, conn, move || outbound_reader(i, c, rx)) {
        return Err(io::Error::other("cannot start the reader"));
    }
    Ok(tx)
}

fn outbound_reader(inner: Arc<Inner>, conn: Arc<Conn>, mut rx: Rx) {
    let e = match outbound_frames(&conn, &mut rx) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    inner.conn_lost(&conn, &format!("receiving: {e}"));
}

fn outbound_frames(conn: &Conn, rx: &mut Rx) -> io::Result<std::convert::Infallible> {
    loop {
        match rx.u8()? {
            wire::PING => {}
            wire::READ_DATA => {
                let id = rx.u64()?;
                let total = rx.u64()?;
                match conn.get_inflight(id) {
                    Some(x) if x.op == XferOp::Read => {
                        if total != x.total {
                            return Err(invalid(format!(
                                "read reply of {total} bytes for a {}-byte transfer",
                                x.total
                            )));
                        }
                        land(rx, &x)?;
                        conn.complete_read(&x);
                    }
                    // Released (or unknown): the bytes are dropped, never landed.
                    _ => rx.discard(total)?,
                }
            }
            t @ (wire::READ_ERR | wire::WRITE_ERR) => {
                let id = rx.u64()?;
                let len = rx.u32()? as usize;
                let msg = rx.string(len, wire::MAX_ERROR_BYTES)?;
                if let Some(x) = conn.take_inflight(id) {
                    let what = if t == wire::READ_ERR { "read" } else { "write" };
                    x.finish(XferStatus::Failed(format!(
                        "peer refused the {what}: {msg}"
                    )));
                }
            }
            wire::WRITE_DONE => {
                let id = rx.u64()?;
                if let Some(x) = conn.take_inflight(id) {
                    x.finish(XferStatus::Done);
                }
            }
            t => return Err(invalid(format!("unexpected frame type {t}"))),
        }
    }
}

/// Lands the bytes of a READ reply in the transfer's local spans, straight from the socket.
fn land(rx: &mut Rx, x: &Xfer) -> io::Result<()> {
    rx.landing(true)?;
    for s in &x.local {
        rx.land_span(&s.region, s.offset, s.len, &|| x.is_aborted())?;
    }
    rx.landing(false)
}

// ---------------------------------------------------------------------------------------------
// Target side.

/// A request over the agent's descriptor limit, refused and counted.
fn too_many(inner: &Inner, count: usize) -> crate::TransportError {
    inner.refuse_xfer(crate::TransportError::TooManyDescriptors {
        count,
        max: inner.cfg.max_descs,
    })
}

/// Thread body of an accepted connection: handshake, then serve requests.
pub(super) fn inbound(inner: Arc<Inner>, conn: Arc<Conn>, jobs: Receiver<Job>, stream: TcpStream) {
    match serve(&inner, &conn, jobs, stream) {
        Ok(()) => {
            conn.close("the peer closed the connection", false);
        }
        Err(e) if conn.peer.get().is_some() => inner.conn_lost(&conn, &format!("{e}")),
        Err(_) => {
            conn.close("handshake failed", false);
        }
    }
    inner.inbound.lock().remove(&conn.id);
}

fn serve(
    inner: &Arc<Inner>,
    conn: &Arc<Conn>,
    jobs: Receiver<Job>,
    stream: TcpStream,
) -> io::Result<()> {
    // With a cluster key, the caller's name is the one it proved, never just the one it claims.
    let proven = match &inner.cfg.key {
        Some(key) => {
            let deadline = inner.handshake_deadline();
            match crate::auth::accept(&stream, key, "tcp", &inner.name, deadline) {
                Ok((name, _session)) => Some(name),
                Err(e) => {
                    inner.refuse_conn(&e.to_string());
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        e.to_string(),
                    ));
                }
            }
        }
        None => None,
    };
    configure(&stream, inner.tick())?;
    conn.set_stream(stream.try_clone()?)?;
    let mut rx = Rx::new(stream.try_clone()?, inner, conn.clone());
    let mut tx = Tx::new(stream, inner, conn.clone());

    let head: [u8; 5] = rx.array()?;
    if head[..4] != wire::HELLO_MAGIC || head[4] != wire::VERSION {
        return Err(invalid("bad hello".into()));
    }
    let len = rx.u16()? as usize;
    let from = rx.string(len, wire::MAX_NAME_BYTES)?;
    let len = rx.u16()? as usize;
    let to = rx.string(len, wire::MAX_NAME_BYTES)?;
    let refused = if to != inner.name || from.is_empty() {
        Some(format!("this agent is {:?}, not {to:?}", inner.name))
    } else if proven.as_ref().is_some_and(|p| *p != from) {
        Some(format!("{from:?} is not the name the caller proved"))
    } else if !inner.peer_connected(&from, conn.id) {
        Some(format!("{from:?} was found dead; connect again"))
    } else {
        None
    };
    if let Some(why) = refused {
        inner.refuse_conn(&why);
        let _ = tx.send(&wire::ack(false, &why));
        return Err(invalid(why));
    }
    tx.send(&wire::ack(true, &inner.name))?;
    let _ = conn.peer.set(from.clone());
    let (i, c) = (inner.clone(), conn.clone());
    if !spawn_or_close(inner, conn, move || writer_loop(i, c, jobs, tx)) {
        return Err(io::Error::other("cannot start the writer"));
    }

    loop {
        match rx.u8()? {
            wire::PING => {}
            wire::READ_REQ => {
                let xfer = rx.u64()?;
                let n = rx.u32()? as usize;
                let res = if n > inner.cfg.max_descs {
                    rx.skip_descs(n)?;
                    Err(too_many(inner, n))
                } else {
                    inner.resolve(&from, XferOp::Read, &rx.descs(n)?)
                };
                let job = match res {
                    Ok((spans, total)) => Job::ReadData { xfer, total, spans },
                    Err(e) => Job::XferErr {
                        kind: wire::READ_ERR,
                        xfer,
                        msg: e.to_string(),
                    },
                };
                conn.serve_later(job, inner.tick())?;
            }
            wire::WRITE_REQ => {
                let xfer = rx.u64()?;
                let n = rx.u32()? as usize;
                let nlen = rx.u32()?;
                // Over the limit: skipped unheld (only the bytes they span are counted).
                let descs = if n > inner.cfg.max_descs {
                    Err(rx.skip_descs(n)?)
                } else {
                    Ok(rx.descs(n)?)
                };
                let note = match nlen {
                    wire::NO_NOTIFICATION => None,
                    l if l as usize <= MAX_NOTIFICATION_BYTES => Some(rx.bytes(l as usize)?),
                    l => return Err(invalid(format!("notification of {l} bytes"))),
                };
                // Refused (over the limit, or outside what may be written): the bytes that
                // follow are read and dropped, nothing lands.
                let checked = match descs {
                    Err(skipped) => Err((skipped, too_many(inner, n))),
                    Ok(descs) => {
                        let total = descs
                            .iter()
                            .try_fold(0u64, |t, d| t.checked_add(d.len))
                            .ok_or_else(|| invalid("write length overflows".into()))?;
                        inner
                            .resolve(&from, XferOp::Write, &descs)
                            .map_err(|e| (total, e))
                    }
                };
                let job = match checked {
                    Ok((spans, _)) => {
                        rx.landing(true)?;
                        for s in &spans {
                            rx.land_span(&s.region, s.offset, s.len, &|| false)?;
                        }
                        rx.landing(false)?;
                        if let Some(msg) = note {
                            inner.push_notification(&from, msg);
                        }
                        Job::WriteDone { xfer }
                    }
                    Err((bytes, e)) => {
                        rx.discard(bytes)?;
                        Job::XferErr {
                            kind: wire::WRITE_ERR,
                            xfer,
                            msg: e.to_string(),
                        }
                    }
                };
                conn.serve_later(job, inner.tick())?;
            }
            wire::NOTIFY => {
                let len = rx.u32()? as usize;
                if len > MAX_NOTIFICATION_BYTES {
                    return Err(invalid(format!("notification of {len} bytes")));
                }
                let msg = rx.bytes(len)?;
                inner.push_notification(&from, msg);
            }
            wire::GOODBYE => return Ok(()),
            t => return Err(invalid(format!("unexpected frame type {t}"))),
        }
    }
}
