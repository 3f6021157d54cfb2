//! The tcp backend: pure Rust (std threads and `std::net`), across processes and hosts; the
//! embedded default transport.
//!
//! # Model
//!
//! Each agent listens on one port. The agent that posts transfers (the *initiator*) opens one
//! connection to each peer it loaded (at `load_remote`, so a dead peer is noticed even before
//! the first transfer); the peer (the *target*) serves READs and WRITEs of its registered
//! memory on that connection. Two agents that both post use two connections, one per direction
//! of initiative. Every connection has a reader and a writer thread at each end; `post` only
//! validates and queues, so it returns at once, and callers poll [`Transport::status`].
//!
//! Bytes go straight between registered memory and the socket: the sender writes each
//! [`KvRegion::with_span`] piece, the receiver reads into each [`KvRegion::with_span_mut`]
//! piece. There is no staging copy.
//!
//! - READ: request (xfer id, the target's descriptors); the target checks every descriptor
//!   against what it registered and streams the bytes, or refuses; the initiator lands them,
//!   queues the notification (if any) behind them on the same connection, then reports `Done`.
//! - WRITE: header (xfer id, descriptors, notification) then the bytes; the target checks the
//!   header first (refused: the bytes are read and dropped, never landed), lands the bytes,
//!   queues the notification locally, and replies; the initiator reports `Done` on that reply.
//!
//! # Liveness
//!
//! A writer idle for `keepalive` sends a PING, so a live peer is heard at least that often.
//! Every socket operation has a timeout: a reader that heard nothing for `dead_after`, a writer
//! that could not push a byte for `dead_after` (neither counting time its own thread was not
//! run: a paused host is not a dead peer), EOF or a reset closes the connection, fails its
//! transfers in flight, closes every other connection with that peer (so the peer notices too),
//! and reports the peer once in [`Transport::drain_dead_peers`]. `post` to a peer found dead
//! returns [`TransportError::PeerDead`] until its metadata is loaded again. A peer that
//! `forget_remote`s us says GOODBYE first, which is not a death; a dropped transport is.
//! Setting up a connection (connect, the key's proofs) has its own, longer deadline
//! (`Inner::handshake_deadline`): on a congested link it waits out TCP's backoff.
//!
//! The wire format is described in `wire.rs`.
//!
//! One file, over 800 lines: the agent itself (listen, post, poll, grants, notifications);
//! connections are in `conn`, the wire format in `wire`.

mod conn;
mod wire;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use self::conn::{Conn, Job, Span, Xfer};
use self::wire::{Meta, WireDesc};
use crate::auth::ClusterKey;
use crate::grants::{Extent, GrantId, GrantTable};
use crate::{
    check_bounds, KvRegion, Notification, RegionId, Transport, TransportError, XferDesc, XferId,
    XferOp, XferStatus, MAX_NOTIFICATION_BYTES,
};

/// Settings of a [`TcpTransport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// Where to listen; port 0 picks a free one. Default `127.0.0.1:0`.
    pub bind: SocketAddr,
    /// Host name or address peers should connect to. Default: the bound address, or, when bound
    /// to an unspecified address, the address of the default route (loopback if none).
    pub advertise_host: Option<String>,
    /// A connection idle this long sends a ping. Default 250 ms.
    pub keepalive: Duration,
    /// A peer silent (or not reading) on an established connection this long is dead.
    /// Default 1500 ms. Must exceed `keepalive`. Setting up a connection (the connect and the
    /// cluster key's proofs) may take longer: 5 s ([`crate::auth::DEFAULT_DEADLINE`]), or
    /// `dead_after` if that is longer.
    pub dead_after: Duration,
    /// While a transfer's bytes are landing, how long a reader that drained its socket polls it
    /// (non-blocking) before it sleeps in the kernel. Default 200 µs; zero never polls; at most
    /// 10 ms. Between processes of a small host a receiver that sleeps whenever it is ahead of
    /// the sender is woken once per segment, and those wake-ups (and the scheduler's habit of
    /// moving a woken receiver onto its sender's core) cost more than the copy: on 2 cores a
    /// 256 MiB transfer of 64 KiB blocks moved at ~2.1 GB/s without polling and ~3.0 with it.
    /// The price is up to one core per landing connection while a transfer runs (never between
    /// transfers); a host whose cores are all busy with other work may prefer zero.
    pub landing_spin: Duration,
    /// The cluster key: every connection proves it in both directions before anything else
    /// (see [`crate::auth`]), and a caller is known by the name it proved. `None`: no
    /// authentication (loopback clusters, tests).
    pub key: Option<ClusterKey>,
    /// Serve a peer's READ or WRITE only inside a live grant to the name it proved (see
    /// [`crate::grants`]); every refusal is counted in [`Transport::refused_transfers`]. Off by
    /// default: a bare transport serves all registered memory, as a NIXL agent does.
    pub check_grants: bool,
    /// Most descriptors in one transfer, posted or served. A peer's request with more is
    /// refused (counted in [`Transport::refused_transfers`]) without being held in memory.
    /// Default 2^18 (a 5 MiB request header); at most 2^20, the wire's own limit.
    pub max_descs: usize,
    /// Most descriptors of a connection's requests queued for its writer at once: past it the
    /// connection's reader stops reading until the writer catches up (backpressure on the
    /// requester, never a refusal). Bounds the memory one peer's queued requests hold.
    /// Default 2^20; at least `max_descs`.
    pub max_queued_descs: usize,
    /// Most inbound connections open at once (handshaking or serving; each costs a thread, two
    /// once authenticated). One more is closed at once and counted in
    /// [`Transport::refused_connections`]. Default 1024.
    pub max_connections: usize,
}

/// Longest [`TcpConfig::landing_spin`] accepted (a landing read's own timeout).
pub const MAX_LANDING_SPIN: Duration = conn::STALL;

impl TcpConfig {
    /// Defaults, with settings from the environment where set: `landing_spin` from
    /// `HANDOFF_TCP_LANDING_SPIN_US` (µs up to [`MAX_LANDING_SPIN`]), `dead_after` from
    /// `HANDOFF_TCP_DEAD_AFTER_MS` (hosts so loaded that a healthy peer can be silent longer
    /// than the default 1.5 s), and the bounds from
    /// `HANDOFF_TCP_MAX_DESCS`, `HANDOFF_TCP_MAX_QUEUED_DESCS` and `HANDOFF_TCP_MAX_CONNECTIONS`.
    /// A value that does not parse is ignored with a warning; one out of range fails
    /// [`TcpTransport::new`] with the reason.
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`TcpConfig::from_env`] over any variable lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let mut cfg = TcpConfig::default();
        if let Some(v) = get("HANDOFF_TCP_LANDING_SPIN_US") {
            match v.trim().parse::<u64>().map(Duration::from_micros) {
                Ok(d) if d <= MAX_LANDING_SPIN => cfg.landing_spin = d,
                _ => tracing::warn!(
                    "ignoring HANDOFF_TCP_LANDING_SPIN_US={v:?} (want µs from 0 to {})",
                    MAX_LANDING_SPIN.as_micros()
                ),
            }
        }
        if let Some(v) = get("HANDOFF_TCP_DEAD_AFTER_MS") {
            // Checked against `keepalive` by `TcpTransport::new`.
            match v.trim().parse::<u64>().map(Duration::from_millis) {
                Ok(d) => cfg.dead_after = d,
                Err(_) => tracing::warn!("ignoring HANDOFF_TCP_DEAD_AFTER_MS={v:?} (want ms)"),
            }
        }
        for (var, field) in [
            ("HANDOFF_TCP_MAX_DESCS", &mut cfg.max_descs),
            ("HANDOFF_TCP_MAX_QUEUED_DESCS", &mut cfg.max_queued_descs),
            ("HANDOFF_TCP_MAX_CONNECTIONS", &mut cfg.max_connections),
        ] {
            if let Some(v) = get(var) {
                match v.trim().parse::<usize>() {
                    Ok(n) => *field = n,
                    Err(_) => tracing::warn!("ignoring {var}={v:?} (want a count)"),
                }
            }
        }
        cfg
    }
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise_host: None,
            keepalive: Duration::from_millis(250),
            dead_after: Duration::from_millis(1500),
            landing_spin: Duration::from_micros(200),
            key: None,
            check_grants: false,
            max_descs: 1 << 18,
            max_queued_descs: 1 << 20,
            max_connections: 1024,
        }
    }
}

/// A peer's regions as its metadata published them: id → length.
type RegionTable = Arc<HashMap<RegionId, u64>>;

/// A peer loaded with `load_remote`.
struct Peer {
    host: String,
    port: u16,
    regions: RegionTable,
    conn: Arc<Conn>,
}

#[derive(Default)]
struct DeadPeers {
    queue: Vec<String>,
    /// Peers reported dead, each with the connection-id counter at its death: a connection
    /// with that peer accepted before then is stale (refused), a later one is a new life.
    reported: HashMap<String, u64>,
}

/// State shared by the transport and its threads.
pub(super) struct Inner {
    name: String,
    cfg: TcpConfig,
    local_addr: SocketAddr,
    host: String,
    shut_down: AtomicBool,
    regions: RwLock<HashMap<RegionId, Arc<KvRegion>>>,
    peers: Mutex<HashMap<String, Peer>>,
    inbound: Mutex<HashMap<u64, Arc<Conn>>>,
    xfers: Mutex<HashMap<XferId, Arc<Xfer>>>,
    notifications: Mutex<Vec<Notification>>,
    dead: Mutex<DeadPeers>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_xfer: AtomicU64,
    next_conn: AtomicU64,
    /// Inbound connections refused at the handshake (no or wrong proof, a name not proved).
    refused: AtomicU64,
    grants: RwLock<GrantTable>,
    /// Inbound READs and WRITEs refused for want of a grant.
    refused_xfers: AtomicU64,
}

impl Inner {
    /// How long setting up a connection may take: the connect and the cluster key's proofs,
    /// at each end. Longer than `dead_after` where that is short: a lost SYN is sent again
    /// after 1 s and 3 s, and a handshake packet that meets a queue full of another
    /// connection's bulk bytes (a READ served on the connection the peer opened to us) waits
    /// out TCP's retransmission backoff. A healthy peer failed there would be reported dead.
    /// A peer that is gone refuses or resets at once; only a silent one costs the whole wait.
    pub(super) fn handshake_deadline(&self) -> Duration {
        self.cfg.dead_after.max(crate::auth::DEFAULT_DEADLINE)
    }

    /// Timeout of every socket operation: how often a blocked thread checks for death.
    fn tick(&self) -> Duration {
        self.cfg
            .keepalive
            .min(self.cfg.dead_after / 4)
            .max(Duration::from_millis(1))
    }

    fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }

    fn check_running(&self) -> Result<(), TransportError> {
        if self.is_shut_down() {
            return Err(TransportError::Io(format!(
                "tcp transport {:?} is shut down",
                self.name
            )));
        }
        Ok(())
    }

    fn spawn(&self, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        let h = std::thread::Builder::new()
            .name("handoff-tcp".into())
            .spawn(f)?;
        let mut threads = self.threads.lock();
        threads.retain(|h| !h.is_finished());
        threads.push(h);
        Ok(())
    }

    /// The target's check of a request from `peer`: every descriptor inside a registered region
    /// and, when grants are checked, inside a live grant of `op` to `peer`.
    fn resolve(
        &self,
        peer: &str,
        op: XferOp,
        descs: &[WireDesc],
    ) -> Result<(Vec<Span>, u64), TransportError> {
        if self.cfg.check_grants {
            let grants = self.grants.read();
            if let Some(d) = descs
                .iter()
                .find(|d| !grants.allows(peer, op, d.region, d.offset, d.len))
            {
                return Err(self.refuse_xfer(TransportError::NotGranted {
                    peer: peer.to_string(),
                    op,
                    region: d.region,
                    offset: d.offset,
                    len: d.len,
                }));
            }
        }
        let regions = self.regions.read();
        let mut spans = Vec::with_capacity(descs.len());
        let mut total = 0u64;
        for d in descs {
            let r = regions
                .get(&d.region)
                .ok_or(TransportError::UnknownRegion { region: d.region })?;
            check_bounds(d.region, d.offset, d.len, r.len() as u64)?;
            spans.push(Span {
                region: r.clone(),
                offset: d.offset as usize,
                len: d.len as usize,
            });
            total = total
                .checked_add(d.len)
                .ok_or_else(|| TransportError::Io("transfer length overflows".into()))?;
        }
        Ok((spans, total))
    }

    /// The most bytes any live connection's writer ever staged at once.
    #[cfg(test)]
    pub(super) fn staged_peak(&self) -> usize {
        let outs: Vec<Arc<Conn>> = self.peers.lock().values().map(|p| p.conn.clone()).collect();
        let ins: Vec<Arc<Conn>> = self.inbound.lock().values().cloned().collect();
        outs.iter()
            .chain(&ins)
            .map(|c| c.staged_peak())
            .max()
            .unwrap_or(0)
    }

    /// The most answer descriptors any live inbound connection ever had queued.
    #[cfg(test)]
    pub(super) fn backlog_peak(&self) -> usize {
        let inbound = self.inbound.lock();
        inbound
            .values()
            .map(|c| c.backlog_peak())
            .max()
            .unwrap_or(0)
    }

    /// Counts a peer's READ or WRITE refused, logging it at 1, 2, 4, 8, ... refusals so that a
    /// flood cannot flood the log.
    pub(super) fn refuse_xfer(&self, err: TransportError) -> TransportError {
        let n = self.refused_xfers.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(agent = %self.name, refused = n, error = %err, "transfer refused");
        }
        err
    }

    /// Counts an inbound connection refused (cap, handshake), logged like [`Self::refuse_xfer`].
    pub(super) fn refuse_conn(&self, why: &str) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(agent = %self.name, refused = n, why, "tcp connection refused");
        }
    }

    fn push_notification(&self, from: &str, msg: Vec<u8>) {
        self.notifications.lock().push(Notification {
            from: from.to_string(),
            msg,
        });
    }

    /// A connection with `peer` (id `conn`) is up; false if it predates the peer's death, so it
    /// belongs to the life already reported. Otherwise a later loss is a new death.
    fn peer_connected(&self, peer: &str, conn: u64) -> bool {
        let mut dead = self.dead.lock();
        match dead.reported.get(peer) {
            Some(&since) if conn < since => false,
            Some(_) => {
                dead.reported.remove(peer);
                true
            }
            None => true,
        }
    }

    /// A connection broke: close it and, unless it was closed on purpose, declare its peer dead.
    fn conn_lost(&self, conn: &Conn, reason: &str) {
        if !conn.close(reason, false) || self.is_shut_down() {
            return;
        }
        if let Some(peer) = conn.peer.get() {
            self.peer_died(peer, reason);
        }
    }

    /// Closes every connection with `peer` and reports it once.
    fn peer_died(&self, peer: &str, reason: &str) {
        tracing::info!(agent = %self.name, peer, reason, "tcp peer dead");
        let out = self.peers.lock().get(peer).map(|p| p.conn.clone());
        let ins: Vec<Arc<Conn>> = self
            .inbound
            .lock()
            .values()
            .filter(|c| c.peer.get().is_some_and(|p| p == peer))
            .cloned()
            .collect();
        for c in out.iter().chain(&ins) {
            c.close(reason, false);
        }
        let mut dead = self.dead.lock();
        if !dead.reported.contains_key(peer) {
            let since = self.next_conn.load(Ordering::Relaxed);
            dead.reported.insert(peer.to_string(), since);
            dead.queue.push(peer.to_string());
        }
    }

    fn accept(self: &Arc<Self>, stream: TcpStream) {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (conn, jobs) = Conn::new(id, None, self.cfg.max_queued_descs);
        {
            let mut inbound = self.inbound.lock();
            if inbound.len() >= self.cfg.max_connections {
                drop(inbound);
                // Counted, then closed before it costs a thread (counted first, so whoever sees
                // it closed sees it counted).
                self.refuse_conn("connection cap");
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
            inbound.insert(id, conn.clone());
        }
        if self.is_shut_down() {
            conn.close("transport shut down", false);
            self.inbound.lock().remove(&id);
            return;
        }
        let (inner, c) = (self.clone(), conn.clone());
        if self
            .spawn(move || conn::inbound(inner, c, jobs, stream))
            .is_err()
        {
            conn.close("cannot start a thread", false);
            self.inbound.lock().remove(&id);
        }
    }
}

fn listen(inner: Arc<Inner>, listener: TcpListener) {
    loop {
        let res = listener.accept();
        if inner.is_shut_down() {
            break;
        }
        match res {
            Ok((stream, _)) => inner.accept(stream),
            Err(e) => {
                tracing::warn!(agent = %inner.name, error = %e, "tcp accept failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The address peers should dial when we listen on an unspecified address.
fn default_host(bound: SocketAddr) -> String {
    let ip = bound.ip();
    if !ip.is_unspecified() {
        return ip.to_string();
    }
    // Connecting a UDP socket sends nothing; it only picks the source address of the route.
    let (any, probe, fallback): (SocketAddr, SocketAddr, IpAddr) = match ip {
        IpAddr::V4(_) => (
            (Ipv4Addr::UNSPECIFIED, 0).into(),
            (Ipv4Addr::new(192, 0, 2, 1), 9).into(),
            Ipv4Addr::LOCALHOST.into(),
        ),
        IpAddr::V6(_) => (
            (Ipv6Addr::UNSPECIFIED, 0).into(),
            (Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1), 9).into(),
            Ipv6Addr::LOCALHOST.into(),
        ),
    };
    UdpSocket::bind(any)
        .and_then(|s| s.connect(probe).and_then(|()| s.local_addr()))
        .map(|a| a.ip())
        .ok()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(fallback)
        .to_string()
}

/// The tcp transport. Dropping it (or [`TcpTransport::shutdown`]) closes every connection and
/// stops its threads; its peers then see it dead.
pub struct TcpTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("name", &self.inner.name)
            .field("local_addr", &self.inner.local_addr)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Binds `cfg.bind` and starts listening.
    pub fn new(name: &str, cfg: TcpConfig) -> Result<Arc<TcpTransport>, TransportError> {
        if name.is_empty() || name.len() > wire::MAX_NAME_BYTES {
            return Err(TransportError::Io(format!(
                "agent name must be 1 to {} bytes",
                wire::MAX_NAME_BYTES
            )));
        }
        if cfg.keepalive.is_zero() || cfg.dead_after <= cfg.keepalive {
            return Err(TransportError::Io(format!(
                "tcp config: need 0 < keepalive ({:?}) < dead_after ({:?})",
                cfg.keepalive, cfg.dead_after
            )));
        }
        if cfg.max_descs == 0 || cfg.max_descs > wire::MAX_DESCS {
            return Err(TransportError::Io(format!(
                "max_descs {} is not in 1..={}",
                cfg.max_descs,
                wire::MAX_DESCS
            )));
        }
        if cfg.max_queued_descs < cfg.max_descs || cfg.max_connections == 0 {
            return Err(TransportError::Io(format!(
                "max_queued_descs {} must be at least max_descs {}, and max_connections {} at least 1",
                cfg.max_queued_descs, cfg.max_descs, cfg.max_connections
            )));
        }
        if cfg.landing_spin > MAX_LANDING_SPIN {
            return Err(TransportError::Io(format!(
                "tcp config: landing_spin ({:?}) above {:?}",
                cfg.landing_spin, MAX_LANDING_SPIN
            )));
        }
        let io = |what: &str, e: std::io::Error| TransportError::Io(format!("{what}: {e}"));
        let listener =
            TcpListener::bind(cfg.bind).map_err(|e| io(&format!("bind {}", cfg.bind), e))?;
        let local_addr = listener.local_addr().map_err(|e| io("local address", e))?;
        let host = match &cfg.advertise_host {
            Some(h) if h.is_empty() || h.len() > wire::MAX_NAME_BYTES => {
                return Err(TransportError::Io(format!("bad advertise_host {h:?}")))
            }
            Some(h) => h.clone(),
            None => default_host(local_addr),
        };
        let inner = Arc::new(Inner {
            name: name.to_string(),
            cfg,
            local_addr,
            host,
            shut_down: AtomicBool::new(false),
            regions: RwLock::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            inbound: Mutex::new(HashMap::new()),
            xfers: Mutex::new(HashMap::new()),
            notifications: Mutex::new(Vec::new()),
            dead: Mutex::new(DeadPeers::default()),
            threads: Mutex::new(Vec::new()),
            next_xfer: AtomicU64::new(1),
            next_conn: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            grants: RwLock::new(GrantTable::default()),
            refused_xfers: AtomicU64::new(0),
        });
        let i = inner.clone();
        inner
            .spawn(move || listen(i, listener))
            .map_err(|e| io("starting the listener", e))?;
        Ok(Arc::new(TcpTransport { inner }))
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// Closes every connection (peers see this agent dead), fails transfers in flight and stops
    /// the threads (waits up to 2 s for them). Later calls fail with `Io`. Idempotent.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        if inner.shut_down.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the listener.
        let mut wake = inner.local_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(500));
        let outs: Vec<Arc<Conn>> = inner
            .peers
            .lock()
            .values()
            .map(|p| p.conn.clone())
            .collect();
        let ins: Vec<Arc<Conn>> = inner.inbound.lock().values().cloned().collect();
        for c in outs.iter().chain(&ins) {
            c.close("transport shut down", false);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let pending: Vec<JoinHandle<()>> = std::mem::take(&mut *inner.threads.lock());
            if pending.is_empty() {
                break;
            }
            let mut left = Vec::new();
            for h in pending {
                if h.is_finished() {
                    let _ = h.join();
                } else {
                    left.push(h);
                }
            }
            if left.is_empty() {
                continue;
            }
            inner.threads.lock().extend(left);
            if Instant::now() >= deadline {
                tracing::warn!(agent = %inner.name, "tcp threads still running after shutdown");
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[cfg(test)]
    fn live_threads(&self) -> usize {
        self.inner
            .threads
            .lock()
            .iter()
            .filter(|h| !h.is_finished())
            .count()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn check_notification(msg: &[u8]) -> Result<(), TransportError> {
    if msg.len() > MAX_NOTIFICATION_BYTES {
        return Err(TransportError::NotificationTooLarge {
            len: msg.len(),
            max: MAX_NOTIFICATION_BYTES,
        });
    }
    Ok(())
}

impl TcpTransport {
    /// The live connection to a loaded peer and the regions it published.
    fn peer(&self, peer: &str) -> Result<(Arc<Conn>, RegionTable), TransportError> {
        let peers = self.inner.peers.lock();
        let p = peers
            .get(peer)
            .ok_or_else(|| TransportError::UnknownPeer(peer.to_string()))?;
        if p.conn.is_closed() {
            return Err(TransportError::PeerDead(peer.to_string()));
        }
        Ok((p.conn.clone(), p.regions.clone()))
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn register(&self, id: RegionId, region: Arc<KvRegion>) -> Result<(), TransportError> {
        let mut regions = self.inner.regions.write();
        if regions.contains_key(&id) {
            return Err(TransportError::AlreadyRegistered(id));
        }
        regions.insert(id, region);
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        self.inner
            .regions
            .write()
            .remove(&id)
            .map(|_| ())
            .ok_or(TransportError::UnknownRegion { region: id })
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let mut regions: Vec<(RegionId, u64)> = self
            .inner
            .regions
            .read()
            .iter()
            .map(|(id, r)| (*id, r.len() as u64))
            .collect();
        regions.sort_unstable();
        wire::encode_meta(&Meta {
            name: self.inner.name.clone(),
            host: self.inner.host.clone(),
            port: self.inner.local_addr.port(),
            regions,
        })
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        let meta = wire::decode_meta(metadata)?;
        self.inner.check_running()?;
        let regions: RegionTable = Arc::new(meta.regions.iter().copied().collect());
        let name = meta.name;
        let mut peers = self.inner.peers.lock();
        if let Some(p) = peers.get_mut(&name) {
            if p.host == meta.host && p.port == meta.port && !p.conn.is_closed() {
                p.regions = regions;
                return Ok(name);
            }
        }
        let id = self.inner.next_conn.fetch_add(1, Ordering::Relaxed);
        let (conn, jobs) = Conn::new(id, Some(name.clone()), self.inner.cfg.max_queued_descs);
        let old = peers.insert(
            name.clone(),
            Peer {
                host: meta.host.clone(),
                port: meta.port,
                regions,
                conn: conn.clone(),
            },
        );
        drop(peers);
        if let Some(old) = old {
            old.conn.close("peer metadata reloaded", true);
        }
        self.inner.peer_connected(&name, id);
        let (inner, c) = (self.inner.clone(), conn.clone());
        let (host, port) = (meta.host, meta.port);
        if let Err(e) = self
            .inner
            .spawn(move || conn::outbound(inner, c, jobs, host, port))
        {
            self.inner
                .conn_lost(&conn, &format!("cannot start a thread: {e}"));
        }
        Ok(name)
    }

    fn forget_remote(&self, peer: &str) {
        let p = self.inner.peers.lock().remove(peer);
        if let Some(p) = p {
            p.conn.close("peer forgotten", true);
        }
    }

    fn post(
        &self,
        op: XferOp,
        peer: &str,
        descs: &[XferDesc],
        notification: Option<&[u8]>,
    ) -> Result<XferId, TransportError> {
        let inner = &self.inner;
        inner.check_running()?;
        if let Some(n) = notification {
            check_notification(n)?;
        }
        if descs.len() > inner.cfg.max_descs {
            return Err(TransportError::TooManyDescriptors {
                count: descs.len(),
                max: inner.cfg.max_descs,
            });
        }
        let (conn, remote_regions) = self.peer(peer)?;
        let mut local = Vec::with_capacity(descs.len());
        let mut remote = Vec::with_capacity(descs.len());
        let mut total = 0u64;
        {
            let regions = inner.regions.read();
            for d in descs {
                let r = regions
                    .get(&d.local_region)
                    .ok_or(TransportError::UnknownRegion {
                        region: d.local_region,
                    })?;
                check_bounds(d.local_region, d.local_offset, d.len, r.len() as u64)?;
                let remote_len =
                    remote_regions
                        .get(&d.remote_region)
                        .ok_or(TransportError::UnknownRegion {
                            region: d.remote_region,
                        })?;
                check_bounds(d.remote_region, d.remote_offset, d.len, *remote_len)?;
                local.push(Span {
                    region: r.clone(),
                    offset: d.local_offset as usize,
                    len: d.len as usize,
                });
                remote.push(WireDesc {
                    region: d.remote_region,
                    offset: d.remote_offset,
                    len: d.len,
                });
                total = total
                    .checked_add(d.len)
                    .ok_or_else(|| TransportError::Io("transfer length overflows".into()))?;
            }
        }
        let id = inner.next_xfer.fetch_add(1, Ordering::Relaxed);
        let x = Arc::new(Xfer {
            id,
            op,
            local,
            remote,
            total,
            notification: notification.map(<[u8]>::to_vec),
            status: Mutex::new(XferStatus::InProgress),
            aborted: AtomicBool::new(false),
            conn: Arc::downgrade(&conn),
        });
        inner.xfers.lock().insert(XferId(id), x.clone());
        if !conn.add_inflight(&x) {
            inner.xfers.lock().remove(&XferId(id));
            return Err(TransportError::PeerDead(peer.to_string()));
        }
        let _ = conn.tx.send(match op {
            XferOp::Read => Job::Read(x),
            XferOp::Write => Job::Write(x),
        });
        Ok(XferId(id))
    }

    fn status(&self, id: XferId) -> Result<XferStatus, TransportError> {
        let x = self
            .inner
            .xfers
            .lock()
            .get(&id)
            .cloned()
            .ok_or(TransportError::UnknownXfer(id))?;
        let st = x.status.lock().clone();
        Ok(st)
    }

    fn release(&self, id: XferId) -> Result<(), TransportError> {
        let x = self
            .inner
            .xfers
            .lock()
            .remove(&id)
            .ok_or(TransportError::UnknownXfer(id))?;
        if *x.status.lock() == XferStatus::InProgress {
            x.aborted.store(true, Ordering::Relaxed);
            if let Some(c) = x.conn.upgrade() {
                c.take_inflight(x.id);
            }
            x.finish(XferStatus::Failed("released".into()));
        }
        Ok(())
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        self.inner.check_running()?;
        check_notification(msg)?;
        let (conn, _) = self.peer(peer)?;
        conn.tx
            .send(Job::Notify(msg.to_vec()))
            .map_err(|_| TransportError::PeerDead(peer.to_string()))
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        std::mem::take(&mut *self.inner.notifications.lock())
    }

    fn drain_dead_peers(&self) -> Vec<String> {
        std::mem::take(&mut self.inner.dead.lock().queue)
    }

    fn refused_connections(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    fn grant(
        &self,
        grant: GrantId,
        op: XferOp,
        peers: &[String],
        extents: &[Extent],
    ) -> Result<(), TransportError> {
        let regions = self.inner.regions.read();
        for e in extents {
            let r = regions
                .get(&e.region)
                .ok_or(TransportError::UnknownRegion { region: e.region })?;
            check_bounds(e.region, e.offset, e.len, r.len() as u64)?;
        }
        self.inner.grants.write().grant(grant, op, peers, extents);
        Ok(())
    }

    fn revoke(&self, grant: GrantId) {
        self.inner.grants.write().revoke(grant);
    }

    fn checks_grants(&self) -> bool {
        self.inner.cfg.check_grants
    }

    fn refused_transfers(&self) -> u64 {
        self.inner.refused_xfers.load(Ordering::Relaxed)
    }
}
