//! The side channel's sockets: one TCP connection per pair of engines carrying handoff's
//! control messages (handshake, heartbeats and grants, releases, push registrations and
//! cancels), framed as `[u32 length][proto message]`. Bulk data and the completion
//! notifications that must follow it travel over the transport instead.
//!
//! Every connection has a reading thread, which hands each frame to the executor, and a writing
//! thread fed by a bounded queue ([`SEND_QUEUE`]), so that neither the connector core nor the
//! engine's scheduler ever waits on a socket. A connection that closes is a dead peer (a
//! SIGKILLed engine's socket is closed by the kernel at once), which is how P reclaims a dead
//! D's blocks in milliseconds rather than after a lease.
//!
//! One file, over 800 lines: both ends of a connection (dial, accept, the authenticated handshake,
//! the bounded send queue, the reader) share the framing and the limits.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use handoff_proto::{decode_up_to, encode_as, Message, MAX_MESSAGE_BYTES, OLDEST_PROTOCOL_VERSION};
use handoff_transport::auth::{self, ClusterKey, FrameOpener, FrameSealer, TAG_BYTES};

use handoff_core::ConnId;

/// Frames waiting to be written on one connection. A peer that stops reading until this many
/// wait is treated as dead: the connection is closed (P then reclaims what that D held, D fails
/// over per policy). Dropping frames instead would be safe for heartbeats and grants but not for
/// releases and registrations, which must not vanish silently.
pub const SEND_QUEUE: usize = 1024;

/// How long one frame may take to write before the connection counts as broken.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a whole handshake may take, from the connection to the hello's answer (the
/// cluster key's proofs included): a peer that dribbles a byte at a time is cut off here.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Who this engine is on the side channel and what it demands of callers.
#[derive(Debug, Clone)]
pub struct SideConfig {
    /// Proven to every peer, and the id a dialled peer must prove.
    pub engine_id: String,
    /// The cluster key both ends of every connection prove (`None`: no authentication).
    pub key: Option<ClusterKey>,
    /// Most connections open at once, accepted and dialled each (handshaking or established);
    /// one more accepted is closed at once and counted ([`SideEvent::Refused`]), one more
    /// dialled fails its connect. Each costs two threads.
    pub max_connections: usize,
    /// Most inbound connections from one source address still in their handshake: a stranger
    /// on one host cannot hold the whole inbound cap with connections that never prove
    /// anything. One more is closed at once and counted.
    pub max_handshakes_per_source: usize,
    /// The newest protocol version this engine speaks (`handoff_proto::versions`): a hello in
    /// a newer one is closed without a reply, as a build that does not know it would. It says
    /// hello in this version, and once more in the oldest when the peer closes without a reply.
    pub protocol_version: u8,
}

/// Why an inbound connection was turned away before it reached the connector core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedBy {
    /// [`SideConfig::max_connections`] were open.
    ConnectionCap,
    /// Its source address had [`SideConfig::max_handshakes_per_source`] handshakes open.
    SourceBudget,
    /// No, or a wrong, proof of the cluster key.
    Authentication,
    /// The handshake did not finish within its deadline, or its first frame was malformed.
    Handshake,
}

impl RefusedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            RefusedBy::ConnectionCap => "connection_cap",
            RefusedBy::SourceBudget => "source_budget",
            RefusedBy::Authentication => "authentication",
            RefusedBy::Handshake => "handshake",
        }
    }
}

/// What the side channel's threads tell the executor.
#[derive(Debug)]
pub enum SideEvent {
    /// A peer connected to us; `msg` is its first frame (a hello, or a proxy's release).
    /// `proven`: the engine id it proved holding the cluster key (`None` without a key).
    Accepted {
        conn: ConnId,
        writer: ConnWriter,
        msg: Message,
        proven: Option<String>,
    },
    /// An inbound connection was closed before its first frame reached the core.
    Refused(RefusedBy),
    /// A frame on an established connection. `ticket` holds its place among the connection's
    /// unhandled frames until the event is dropped (see [`MAX_UNHANDLED_FRAMES`]).
    Frame {
        conn: ConnId,
        msg: Message,
        ticket: FrameTicket,
    },
    /// A connection's reader stopped reading: [`MAX_UNHANDLED_FRAMES`] of its frames wait for
    /// the executor (counted; the peer sends faster than this engine handles).
    Backpressured { conn: ConnId },
    /// Our connect attempt `attempt` to `engine` got `reply` to its hello.
    Connected {
        engine: String,
        attempt: u64,
        conn: ConnId,
        writer: ConnWriter,
        reply: Message,
    },
    /// Connect attempt `attempt` to `engine` failed.
    ConnectFailed {
        engine: String,
        attempt: u64,
        error: String,
    },
    /// The connection closed or broke.
    Closed { conn: ConnId },
}

/// Where the side channel's threads deliver: false once the executor is gone.
pub type Sink = Arc<dyn Fn(SideEvent) -> bool + Send + Sync>;

/// Why a frame was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// The peer stopped reading: [`SEND_QUEUE`] frames wait.
    Full,
    /// The connection is gone.
    Closed,
}

/// What the writing thread of a connection gets.
#[derive(Debug)]
enum Outgoing {
    Frame(Vec<u8>),
    /// Shut the connection once everything queued before was written.
    Finish,
}

/// The writing half of a connection: a bounded queue to its writing thread.
#[derive(Debug, Clone)]
pub struct ConnWriter {
    queue: SyncSender<Outgoing>,
    socket: Arc<TcpStream>,
    closed: Arc<AtomicBool>,
    /// The protocol version the connection's handshake settled on: every frame is in it.
    version: u8,
}

impl ConnWriter {
    /// Queues one message; never blocks.
    pub fn try_send(&self, msg: &Message) -> Result<(), SendError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(SendError::Closed);
        }
        let bytes = match encode_as(&in_version(msg, self.version), self.version) {
            Ok(bytes) => bytes,
            Err(e) => {
                // Every message the ledgers make fits (they split batches to the cap), and the
                // core refuses a peer whose version cannot carry its hello; should one still
                // not encode, the peer must not wait for it: the connection ends.
                tracing::error!(kind = msg.kind(), error = %e, "cannot encode a control message: closing the connection");
                self.close();
                return Err(SendError::Closed);
            }
        };
        match self.queue.try_send(Outgoing::Frame(bytes)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(SendError::Full),
            Err(TrySendError::Disconnected(_)) => Err(SendError::Closed),
        }
    }

    /// Closes the connection once the frames queued so far are written (a refusal's reason
    /// reaches the peer before the close); at once when the queue is full.
    pub fn finish(&self) {
        if self.closed.swap(true, Ordering::Relaxed) {
            return;
        }
        if self.queue.try_send(Outgoing::Finish).is_err() {
            let _ = self.socket.shutdown(Shutdown::Both);
        }
    }

    /// Closes the connection: queued frames are dropped, the reading thread ends and reports
    /// the close.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let _ = self.socket.shutdown(Shutdown::Both);
        // Wake the writing thread if it waits for frames (it holds a sender itself, so the
        // queue never disconnects): it ends, and with it the socket.
        let _ = self.queue.try_send(Outgoing::Finish);
    }
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// Why no frame was read.
#[derive(Debug)]
struct FrameError {
    text: String,
    /// The peer closed the connection before the frame began.
    closed: bool,
}

impl From<String> for FrameError {
    fn from(text: String) -> Self {
        FrameError {
            text,
            closed: false,
        }
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// Reads one frame: `[u32 length][message]`, then, on an authenticated connection, the
/// frame's tag, which must check (a relay cannot change, drop, reorder or inject frames).
/// The message may be in any protocol version from the oldest this build speaks to `newest`;
/// returns it with its version.
fn read_frame(
    r: &mut impl Read,
    opener: Option<&mut FrameOpener>,
    newest: u8,
) -> Result<(Message, u8), FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(|e| FrameError {
        // A clean end of stream, as a build that refuses a version's hello closes after reading
        // all of it (a reset is something else: a peer at its connection cap, a crash).
        closed: e.kind() == std::io::ErrorKind::UnexpectedEof,
        text: e.to_string(),
    })?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_MESSAGE_BYTES {
        return Err(format!("frame of {len} bytes refused").into());
    }
    let mut buf = vec![0; len];
    r.read_exact(&mut buf).map_err(|e| e.to_string())?;
    if let Some(o) = opener {
        let mut tag = [0u8; TAG_BYTES];
        r.read_exact(&mut tag).map_err(|e| e.to_string())?;
        if !o.open(&buf, &tag) {
            return Err(String::from("a frame failed authentication").into());
        }
    }
    Ok(decode_up_to(&buf, newest).map_err(|e| e.to_string())?)
}

/// The frame reader for the fuzz targets (feature `fuzzing`; not API), as a connection's
/// reader thread runs it. Unauthenticated, `bytes` is the stream. Authenticated, `bytes` is a
/// list of `[u8 length][message bytes]` pieces that the harness frames and seals as the peer
/// would (with a wrong tag where a piece's length byte is odd and over 200), so the fuzzer's
/// messages get past the tag check to the decoder. Reads until the first error; returns the
/// frames decoded.
#[cfg(feature = "fuzzing")]
pub fn fuzz_read_frames(bytes: &[u8], authenticated: bool) -> usize {
    let mut n = 0;
    if !authenticated {
        let mut r = bytes;
        while read_frame(&mut r, None, handoff_proto::PROTOCOL_VERSION).is_ok() {
            n += 1;
        }
        return n;
    }
    let key = ClusterKey::from_hex(&"ab".repeat(32)).expect("a valid key");
    let (dialer, acceptor) = auth::Session::pair_for_fuzzing(&key);
    let (mut sealer, _) = dialer.split();
    let (_, mut opener) = acceptor.split();
    let mut stream = Vec::new();
    let mut rest = bytes;
    while let Some((&len, tail)) = rest.split_first() {
        let take = (len as usize).min(tail.len());
        let (piece, tail) = tail.split_at(take);
        let mut sealing = Some(&mut sealer);
        let bad = len > 200 && len % 2 == 1;
        let mut framed = Vec::new();
        // A write to a Vec cannot fail.
        let _ = write_frame(&mut framed, piece, sealing.take());
        if bad {
            if let Some(last) = framed.last_mut() {
                *last ^= 1;
            }
        }
        stream.extend_from_slice(&framed);
        rest = tail;
    }
    let mut r = &stream[..];
    while read_frame(&mut r, Some(&mut opener), handoff_proto::PROTOCOL_VERSION).is_ok() {
        n += 1;
    }
    n
}

fn write_frame(
    w: &mut impl Write,
    bytes: &[u8],
    sealer: Option<&mut FrameSealer>,
) -> std::io::Result<()> {
    w.write_all(&(bytes.len() as u32).to_le_bytes())?;
    w.write_all(bytes)?;
    if let Some(s) = sealer {
        w.write_all(&s.seal(bytes))?;
    }
    Ok(())
}

/// Starts the writing thread of `stream`, whose frames are in `version`; returns its id and
/// writer.
fn open(
    stream: &TcpStream,
    sealer: Option<FrameSealer>,
    version: u8,
) -> std::io::Result<(ConnId, ConnWriter)> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let socket = Arc::new(stream.try_clone()?);
    let out = stream.try_clone()?;
    let (queue, frames) = sync_channel::<Outgoing>(SEND_QUEUE);
    let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
    let writer = ConnWriter {
        queue,
        socket,
        closed: Arc::new(AtomicBool::new(false)),
        version,
    };
    let w = writer.clone();
    std::thread::Builder::new()
        .name(format!("handoff-side-w{id}"))
        .spawn(move || write_loop(out, frames, w, sealer))?;
    Ok((id, writer))
}

fn write_loop(
    stream: TcpStream,
    frames: Receiver<Outgoing>,
    writer: ConnWriter,
    mut sealer: Option<FrameSealer>,
) {
    let mut w = BufWriter::new(stream);
    while let Ok(first) = frames.recv() {
        let mut finish = false;
        let mut r = Ok(());
        // Whatever else waits goes out in the same flush.
        let mut next = Some(first);
        while let (Ok(()), Some(out)) = (&r, next.take()) {
            match out {
                Outgoing::Frame(bytes) => r = write_frame(&mut w, &bytes, sealer.as_mut()),
                Outgoing::Finish => {
                    finish = true;
                    break;
                }
            }
            next = frames.try_recv().ok();
        }
        if r.and_then(|_| w.flush()).is_err() || finish {
            // The reading thread sees the shutdown and reports the close.
            let _ = w.get_ref().shutdown(Shutdown::Both);
            writer.close();
            return;
        }
    }
}

/// Most frames of one connection handed to the executor and not handled yet. Past it the
/// connection's reader stops reading, so a peer that sends faster than this engine handles (a
/// flood of valid frames) slows only itself, as TCP pushes back on it, and the executor's queue
/// holds at most this many frames per connection: other peers' frames, the workers' reports and
/// the scheduler's calls wait behind no unbounded backlog.
pub const MAX_UNHANDLED_FRAMES: usize = 64;

/// A frame's place among its connection's unhandled frames, given back when the event that
/// carries it is dropped (handled, or dropped unhandled by a stopped executor).
#[derive(Debug)]
pub struct FrameTicket(Arc<AtomicUsize>);

impl FrameTicket {
    fn take(unhandled: &Arc<AtomicUsize>) -> FrameTicket {
        unhandled.fetch_add(1, Ordering::AcqRel);
        FrameTicket(unhandled.clone())
    }
}

impl Drop for FrameTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads frames until the connection ends; every frame goes to the executor, at most
/// [`MAX_UNHANDLED_FRAMES`] of them unhandled at once. A frame in another version than the
/// handshake's ends the connection.
fn read_loop(
    conn: ConnId,
    writer: ConnWriter,
    mut r: impl Read,
    mut opener: Option<FrameOpener>,
    sink: Sink,
) {
    let version = writer.version;
    let unhandled = Arc::new(AtomicUsize::new(0));
    loop {
        if unhandled.load(Ordering::Acquire) >= MAX_UNHANDLED_FRAMES {
            if !sink(SideEvent::Backpressured { conn }) {
                break;
            }
            while unhandled.load(Ordering::Acquire) >= MAX_UNHANDLED_FRAMES {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        match read_frame(&mut r, opener.as_mut(), version) {
            Ok((_, v)) if v != version => {
                tracing::debug!(conn, "side channel closed: a frame in version {v} on a connection that speaks {version}");
                break;
            }
            Ok((msg, _)) => {
                let ticket = FrameTicket::take(&unhandled);
                if !sink(SideEvent::Frame { conn, msg, ticket }) {
                    break;
                }
            }
            Err(e) => {
                tracing::debug!(conn, error = %e, "side channel closed");
                break;
            }
        }
    }
    writer.close();
    sink(SideEvent::Closed { conn });
}

/// Counts the connections open at once; a slot is given back when its guard drops.
#[derive(Debug, Clone)]
struct Slots {
    open: Arc<AtomicUsize>,
    max: usize,
}

struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Slots {
    fn take(&self) -> Option<Slot> {
        let n = self.open.fetch_add(1, Ordering::Relaxed);
        if n >= self.max {
            self.open.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Slot(self.open.clone()))
    }
}

/// An inbound handshake in progress, counted against its source address until dropped.
struct HandshakeTicket {
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    source: IpAddr,
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        let mut open = self.open.lock();
        if let Some(n) = open.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.source);
            }
        }
    }
}

/// The side channel of one engine: its settings and the counts of the connections it accepted
/// and dialled.
#[derive(Clone)]
pub struct SideChannel {
    cfg: Arc<SideConfig>,
    /// Connections peers opened to us. Separate from ours, so a flood of strangers that fills
    /// it cannot stop this engine from dialling the peers it needs.
    slots: Slots,
    /// Connections we dialled.
    dial_slots: Slots,
    /// Inbound handshakes open per source address.
    handshaking: Arc<Mutex<HashMap<IpAddr, usize>>>,
    sink: Sink,
}

impl SideChannel {
    pub fn new(cfg: SideConfig, sink: Sink) -> Self {
        let slots = || Slots {
            open: Arc::new(AtomicUsize::new(0)),
            max: cfg.max_connections.max(1),
        };
        SideChannel {
            slots: slots(),
            dial_slots: slots(),
            handshaking: Arc::default(),
            cfg: Arc::new(cfg),
            sink,
        }
    }

    /// Accepts connections until `stop` is set; returns the bound address.
    pub fn listen(&self, bind: SocketAddr, stop: Arc<AtomicBool>) -> std::io::Result<SocketAddr> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let side = self.clone();
        std::thread::Builder::new()
            .name("handoff-side-accept".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => side.accepted(stream),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "side channel accept failed");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })?;
        Ok(addr)
    }

    fn accepted(&self, stream: TcpStream) {
        let refuse = |why| {
            // No thread for it: closed at once, before it costs anything.
            let _ = stream.shutdown(Shutdown::Both);
            (self.sink)(SideEvent::Refused(why));
        };
        let Some(source) = stream.peer_addr().ok().map(|a| a.ip()) else {
            return refuse(RefusedBy::Handshake);
        };
        let Some(ticket) = self.handshake_ticket(source) else {
            return refuse(RefusedBy::SourceBudget);
        };
        let Some(slot) = self.slots.take() else {
            return refuse(RefusedBy::ConnectionCap);
        };
        let side = self.clone();
        let spawned = std::thread::Builder::new()
            .name("handoff-side-r".into())
            .spawn(move || side.accept_one(stream, slot, ticket));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread for a side-channel connection");
            (self.sink)(SideEvent::Refused(RefusedBy::ConnectionCap));
        }
    }

    /// One more handshake from `source`, if its budget allows.
    fn handshake_ticket(&self, source: IpAddr) -> Option<HandshakeTicket> {
        let mut open = self.handshaking.lock();
        let n = open.entry(source).or_insert(0);
        if *n >= self.cfg.max_handshakes_per_source.max(1) {
            return None;
        }
        *n += 1;
        Some(HandshakeTicket {
            open: self.handshaking.clone(),
            source,
        })
    }

    fn accept_one(&self, stream: TcpStream, slot: Slot, ticket: HandshakeTicket) {
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let _ = stream.set_nonblocking(false);
        let refuse = |why: RefusedBy, error: String| {
            tracing::debug!(%error, "side channel: connection refused ({})", why.as_str());
            let _ = stream.shutdown(Shutdown::Both);
            (self.sink)(SideEvent::Refused(why));
        };
        let (proven, session) = match &self.cfg.key {
            Some(key) => {
                match auth::accept(&stream, key, "side", &self.cfg.engine_id, HANDSHAKE_TIMEOUT) {
                    Ok((id, session)) => (Some(id), Some(session.split())),
                    Err(auth::AuthError::Deadline(_)) => {
                        return refuse(RefusedBy::Handshake, "deadline".into())
                    }
                    Err(e) => return refuse(RefusedBy::Authentication, e.to_string()),
                }
            }
            None => (None, None),
        };
        let (sealer, mut opener) = session.unzip();
        let mut r = match stream.try_clone() {
            Ok(s) => BufReader::new(DeadlineRead {
                stream: s,
                deadline: Some(deadline),
            }),
            Err(_) => return,
        };
        // The hello's version is the connection's: this engine answers in it.
        let (first, version) = match read_frame(&mut r, opener.as_mut(), self.cfg.protocol_version)
        {
            Ok(m) => m,
            Err(e) => return refuse(RefusedBy::Handshake, e.text),
        };
        if let Err(e) = says_its_version(&first, version) {
            return refuse(RefusedBy::Handshake, e);
        }
        r.get_mut().established();
        drop(ticket);
        let Ok((conn, writer)) = open(&stream, sealer, version) else {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        };
        let sink = self.sink.clone();
        if sink(SideEvent::Accepted {
            conn,
            writer: writer.clone(),
            msg: first,
            proven,
        }) {
            read_loop(conn, writer, r, opener, sink);
        } else {
            writer.close();
        }
        drop(slot);
    }

    /// Connects to `addr`, proves the cluster key (and that the engine there is `engine`), says
    /// `hello`, waits for the reply (all under one deadline), then keeps reading. The outcome
    /// names `attempt`, so the executor can tell it from that of a newer attempt to the same
    /// engine (an attempt can take seconds to fail, and the peer may be retried meanwhile).
    pub fn connect(&self, engine: String, attempt: u64, addr: String, hello: Message) {
        let sink = self.sink.clone();
        let fail = |error: String| {
            sink(SideEvent::ConnectFailed {
                engine: engine.clone(),
                attempt,
                error,
            });
        };
        let Some(slot) = self.dial_slots.take() else {
            return fail(format!(
                "{} side-channel connections dialled and open: no more",
                self.dial_slots.max
            ));
        };
        let side = self.clone();
        let spawned = std::thread::Builder::new()
            .name("handoff-side-c".into())
            .spawn({
                let engine = engine.clone();
                move || side.dial(engine, attempt, addr, hello, slot)
            });
        if let Err(e) = spawned {
            fail(format!("no thread to connect: {e}"));
        }
    }

    fn dial(&self, engine: String, attempt: u64, addr: String, hello: Message, slot: Slot) {
        let sink = self.sink.clone();
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let newest = self.cfg.protocol_version;
        let mut result = encode_as(&in_version(&hello, newest), newest)
            .map_err(|e| FrameError::from(e.to_string()))
            .and_then(|bytes| self.say_hello(&engine, &addr, &bytes, newest, deadline));
        if let Err(e) = &result {
            // A build that does not know this version closes without a reply: say it once
            // more in the oldest version this one speaks, if that version can say it (device
            // memory it cannot).
            let older = (e.closed && newest > OLDEST_PROTOCOL_VERSION)
                .then(|| {
                    let older = in_version(&hello, OLDEST_PROTOCOL_VERSION);
                    encode_as(&older, OLDEST_PROTOCOL_VERSION).ok()
                })
                .flatten();
            if let Some(bytes) = older {
                tracing::debug!(engine, addr, "no reply to a version-{newest} hello: trying version {OLDEST_PROTOCOL_VERSION}");
                result = self
                    .say_hello(&engine, &addr, &bytes, OLDEST_PROTOCOL_VERSION, deadline)
                    .map_err(|older| FrameError {
                        text: format!("{e}; in version {OLDEST_PROTOCOL_VERSION}: {older}"),
                        closed: older.closed,
                    });
            }
        }
        match result {
            Ok((conn, writer, r, opener, reply)) => {
                if sink(SideEvent::Connected {
                    engine,
                    attempt,
                    conn,
                    writer: writer.clone(),
                    reply,
                }) {
                    read_loop(conn, writer, r, opener, sink);
                } else {
                    writer.close();
                }
            }
            Err(error) => {
                sink(SideEvent::ConnectFailed {
                    engine,
                    attempt,
                    error: error.text,
                });
            }
        }
        drop(slot);
    }

    /// One connection to `addr`: proves the cluster key, says `hello` (encoded in `version`),
    /// reads the reply (which must be in the same version), all before `deadline`.
    fn say_hello(
        &self,
        engine: &str,
        addr: &str,
        hello: &[u8],
        version: u8,
        deadline: Instant,
    ) -> Result<Dialled, FrameError> {
        let sock: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map_err(|e| format!("cannot resolve {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("cannot resolve {addr}"))?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("{addr}: no time left in the handshake's deadline").into());
        }
        let stream = TcpStream::connect_timeout(&sock, left.min(Duration::from_secs(3)))
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let (mut sealer, mut opener) = match &self.cfg.key {
            Some(key) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let session = auth::dial(&stream, key, "side", &self.cfg.engine_id, engine, left)
                    .map_err(|e| format!("{addr}: {e}"))?;
                let (s, o) = session.split();
                (Some(s), Some(o))
            }
            None => (None, None),
        };
        stream
            .set_write_timeout(Some(WRITE_TIMEOUT))
            .map_err(|e| e.to_string())?;
        write_frame(&mut &stream, hello, sealer.as_mut()).map_err(|e| format!("{addr}: {e}"))?;
        let mut r = BufReader::new(DeadlineRead {
            stream: stream.try_clone().map_err(|e| e.to_string())?,
            deadline: Some(deadline),
        });
        let (reply, got) =
            read_frame(&mut r, opener.as_mut(), version).map_err(|e| FrameError {
                text: format!("no handshake reply from {addr}: {e}"),
                closed: e.closed,
            })?;
        if got != version {
            return Err(
                format!("{addr} replied in version {got} to a version-{version} hello").into(),
            );
        }
        if let Err(e) = says_its_version(&reply, version) {
            return Err(format!("{addr}: {e}").into());
        }
        r.get_mut().established();
        let (conn, writer) = open(&stream, sealer, version).map_err(|e| e.to_string())?;
        Ok((conn, writer, r, opener, reply))
    }
}

/// `msg` as said on a connection of `version`: a hello (or an accepted reply's) names that
/// version in its fingerprint, whatever this engine's newest is.
fn in_version(msg: &Message, version: u8) -> std::borrow::Cow<'_, Message> {
    use handoff_proto::HelloReply;
    let named = |h: &handoff_proto::Hello| {
        let mut h = h.clone();
        h.fingerprint.protocol_version = u16::from(version);
        h
    };
    match msg {
        Message::Hello(h) if h.fingerprint.protocol_version != u16::from(version) => {
            std::borrow::Cow::Owned(Message::Hello(named(h)))
        }
        Message::HelloReply(HelloReply::Accepted(h))
            if h.fingerprint.protocol_version != u16::from(version) =>
        {
            std::borrow::Cow::Owned(Message::HelloReply(HelloReply::Accepted(named(h))))
        }
        other => std::borrow::Cow::Borrowed(other),
    }
}

/// A hello (or an accepted reply's hello) names in its fingerprint the version of the frame it
/// came in: the core keeps that version for the peer's notifications, the connection's writer
/// the frame's, and a peer must not make them differ.
fn says_its_version(msg: &Message, version: u8) -> Result<(), String> {
    let hello = match msg {
        Message::Hello(h) | Message::HelloReply(handoff_proto::HelloReply::Accepted(h)) => h,
        _ => return Ok(()),
    };
    if hello.fingerprint.protocol_version != u16::from(version) {
        return Err(format!(
            "a hello naming protocol version {} in a version-{version} frame",
            hello.fingerprint.protocol_version
        ));
    }
    Ok(())
}

/// A dialled connection after its handshake: id, writer, reader, frame opener, the reply.
type Dialled = (
    ConnId,
    ConnWriter,
    BufReader<DeadlineRead>,
    Option<FrameOpener>,
    Message,
);

/// A socket's reading half with a deadline for everything read until [`Self::established`]
/// (each read's timeout is what is left), none after.
struct DeadlineRead {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl DeadlineRead {
    fn established(&mut self) {
        self.deadline = None;
        let _ = self.stream.set_read_timeout(None);
    }
}

impl Read for DeadlineRead {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.deadline {
            Some(d) => auth::read_before(&self.stream, d, buf),
            None => self.stream.read(buf),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_proto::{decode, encode, Heartbeat};
    use std::sync::mpsc::{channel, Receiver};

    fn p_side(key: &ClusterKey) -> (SocketAddr, Receiver<SideEvent>, Arc<AtomicBool>) {
        p_side_with(key, 8)
    }

    fn p_side_with(
        key: &ClusterKey,
        per_source: usize,
    ) -> (SocketAddr, Receiver<SideEvent>, Arc<AtomicBool>) {
        let (tx, rx) = channel();
        let sink: Sink = Arc::new(move |ev| tx.send(ev).is_ok());
        let side = SideChannel::new(
            SideConfig {
                engine_id: "p".into(),
                key: Some(key.clone()),
                max_connections: 8,
                max_handshakes_per_source: per_source,
                protocol_version: handoff_proto::PROTOCOL_VERSION,
            },
            sink,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let addr = side
            .listen("127.0.0.1:0".parse().unwrap(), stop.clone())
            .unwrap();
        (addr, rx, stop)
    }

    fn frame() -> Vec<u8> {
        encode(&Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![],
        }))
        .unwrap()
    }

    /// A peer that sends faster than the executor handles waits on its own frames: its reader
    /// stops once `MAX_UNHANDLED_FRAMES` of them are unhandled (says so once), and resumes,
    /// losing none, as they are handled.
    #[test]
    fn a_flooding_peer_waits_on_its_own_unhandled_frames() {
        let key = ClusterKey::generate().unwrap();
        let (addr, events, _stop) = p_side(&key);
        let s = TcpStream::connect(addr).unwrap();
        let session = auth::dial(&s, &key, "side", "d", "p", Duration::from_secs(2)).unwrap();
        let (mut sealer, _) = session.split();
        let sent = 4 * MAX_UNHANDLED_FRAMES;
        // All of it fits in the socket buffers: only the reader's own limit can hold it back.
        let flood = std::thread::spawn(move || {
            for _ in 0..=sent {
                write_frame(&mut &s, &frame(), Some(&mut sealer)).unwrap();
            }
            s
        });
        // Nothing is handled for a while: every event received is kept, tickets and all.
        std::thread::sleep(Duration::from_millis(500));
        let held: Vec<SideEvent> = events.try_iter().collect();
        let frames = |evs: &[SideEvent]| {
            evs.iter()
                .filter(|e| matches!(e, SideEvent::Frame { .. }))
                .count()
        };
        assert!(
            matches!(held[0], SideEvent::Accepted { .. }),
            "{:?}",
            held[0]
        );
        assert_eq!(
            frames(&held),
            MAX_UNHANDLED_FRAMES,
            "frames queued unhandled"
        );
        assert!(
            matches!(held.last(), Some(SideEvent::Backpressured { .. })),
            "{:?}",
            held.last()
        );
        // Handled (dropped): the reader goes on, and every frame arrives.
        let mut got = frames(&held);
        drop(held);
        while got < sent {
            match events
                .recv_timeout(Duration::from_secs(5))
                .expect("the rest")
            {
                SideEvent::Frame { .. } => got += 1,
                SideEvent::Backpressured { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        let _s = flood.join().unwrap();
    }

    /// A relay that passed the handshake through (to a P address a client chose) cannot change
    /// what crosses afterwards: a frame whose tag does not check closes the connection.
    /// A hello whose fingerprint names another version than its frame's is refused before the
    /// core sees it (the core would keep the fingerprint's version for the peer, the connection
    /// the frame's); the same hello in a frame of its own version is accepted.
    #[test]
    fn a_hello_must_name_the_version_of_its_frame() {
        let key = ClusterKey::generate().unwrap();
        let (addr, events, stop) = p_side(&key);
        let hello = |protocol_version: u16| {
            Message::Hello(handoff_proto::Hello {
                engine_id: "d".into(),
                rank: 0,
                tp: 1,
                fingerprint: handoff_proto::Fingerprint {
                    protocol_version,
                    model: "m".into(),
                    num_layers: 1,
                    num_kv_heads: 1,
                    head_dim: 8,
                    dtype: "bf16".into(),
                    mode: handoff_proto::TransferMode::Pull,
                },
                layout: vec![],
                agent_metadata: vec![],
                memory: vec![handoff_proto::MemoryKind::Host],
            })
        };
        let say = |bytes: Vec<u8>| {
            let s = TcpStream::connect(addr).unwrap();
            let session = auth::dial(&s, &key, "side", "d", "p", Duration::from_secs(2)).unwrap();
            let (mut sealer, _) = session.split();
            write_frame(&mut &s, &bytes, Some(&mut sealer)).unwrap();
            let event = events
                .recv_timeout(Duration::from_secs(5))
                .expect("an event");
            (s, event)
        };
        // A version-7 frame whose hello names version 8.
        let lying = handoff_proto::encode_as(&hello(8), 7).unwrap();
        assert!(matches!(
            handoff_proto::decode(&lying),
            Ok(Message::Hello(h)) if h.fingerprint.protocol_version == 8
        ));
        let (_s, event) = say(lying);
        assert!(
            matches!(event, SideEvent::Refused(RefusedBy::Handshake)),
            "{event:?}"
        );
        let (_s, event) = say(handoff_proto::encode_as(&in_version(&hello(8), 7), 7).unwrap());
        assert!(matches!(event, SideEvent::Accepted { .. }), "{event:?}");
        stop.store(true, Ordering::Relaxed);
    }

    #[test]
    fn a_frame_changed_after_the_handshake_is_refused() {
        let key = ClusterKey::generate().unwrap();
        let (addr, events, stop) = p_side(&key);
        let wait = |events: &Receiver<SideEvent>| {
            events
                .recv_timeout(Duration::from_secs(5))
                .expect("an event")
        };

        // Honest: the sealed frame arrives, under the id the dialer proved.
        let s = TcpStream::connect(addr).unwrap();
        let session = auth::dial(&s, &key, "side", "d", "p", Duration::from_secs(2)).unwrap();
        let (mut sealer, _) = session.split();
        write_frame(&mut &s, &frame(), Some(&mut sealer)).unwrap();
        match wait(&events) {
            SideEvent::Accepted { proven, .. } => assert_eq!(proven.as_deref(), Some("d")),
            other => panic!("{other:?}"),
        }

        // Changed in flight: one byte of the frame differs from what was tagged.
        let s = TcpStream::connect(addr).unwrap();
        let session = auth::dial(&s, &key, "side", "d", "p", Duration::from_secs(2)).unwrap();
        let (mut sealer, _) = session.split();
        let bytes = frame();
        let tag = sealer.seal(&bytes);
        // The heartbeat's seq (byte 2: after the version and the variant): still a valid
        // message, so only the tag can tell.
        let mut changed = bytes.clone();
        changed[2] ^= 1;
        assert!(decode(&changed).is_ok());
        (&s).write_all(&(changed.len() as u32).to_le_bytes())
            .unwrap();
        (&s).write_all(&changed).unwrap();
        (&s).write_all(&tag).unwrap();
        match wait(&events) {
            SideEvent::Refused(RefusedBy::Handshake) => {}
            other => panic!("{other:?}"),
        }

        // Injected with a made-up tag by someone who never had the session: refused too.
        let s = TcpStream::connect(addr).unwrap();
        auth::dial(&s, &key, "side", "d", "p", Duration::from_secs(2)).unwrap();
        write_frame(&mut &s, &frame(), None).unwrap();
        (&s).write_all(&[0u8; TAG_BYTES]).unwrap();
        match wait(&events) {
            SideEvent::Refused(_) => {}
            other => panic!("{other:?}"),
        }
        stop.store(true, Ordering::Relaxed);
    }

    /// One source's connections still in their handshake are capped below the inbound cap:
    /// past its budget one more is closed at once and counted, while connections that finished
    /// their handshake no longer count against it.
    #[test]
    fn a_source_holds_at_most_its_budget_of_open_handshakes() {
        let key = ClusterKey::generate().unwrap();
        let (addr, events, stop) = p_side_with(&key, 2);
        let next = || {
            events
                .recv_timeout(Duration::from_secs(5))
                .expect("an event")
        };
        let honest = || {
            let s = TcpStream::connect(addr).unwrap();
            let session = auth::dial(&s, &key, "side", "d", "p", Duration::from_secs(2));
            let (mut sealer, _) = session.expect("proved").split();
            write_frame(&mut &s, &frame(), Some(&mut sealer)).unwrap();
            s
        };
        let idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut third = TcpStream::connect(addr).unwrap();
        third
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let start = Instant::now();
        let mut b = [0u8; 1];
        assert!(matches!(third.read(&mut b), Ok(0) | Err(_)));
        assert!(start.elapsed() < Duration::from_secs(1), "closed at once");
        assert!(matches!(
            next(),
            SideEvent::Refused(RefusedBy::SourceBudget)
        ));
        // The idle ones go: their handshakes end, and an honest peer from the source is served.
        drop(idle);
        for _ in 0..2 {
            // A peer that hangs up before proving anything fails its authentication.
            assert!(matches!(
                next(),
                SideEvent::Refused(RefusedBy::Authentication)
            ));
        }
        let a = honest();
        let b = honest();
        for _ in 0..2 {
            assert!(matches!(next(), SideEvent::Accepted { .. }));
        }
        // Established connections hold no budget: two more handshakes may open.
        let again: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        assert!(events.try_recv().is_err(), "no refusal within the budget");
        drop((a, b, again));
        stop.store(true, Ordering::Relaxed);
    }
}
