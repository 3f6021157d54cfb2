//! The driver thread: the only place where the connector reads the clock and does I/O.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use handoff_ledger::{
    ConsumerAction, ConsumerLedger, Outcome, PeerId, ProducerAction, ProducerLedger, StartRead,
};
use handoff_plan::RankLayout;
use handoff_proto::{
    decode, encode, HandoffId, Hello, HelloReply, Message, PushDone, TransferMode,
};
use handoff_transport::{XferDesc, XferId, XferOp, XferStatus};

use crate::side_channel::{self, Conn, ConnId, SideEvent};
use crate::{Connector, ConnectorEvent};

/// Bumped with any incompatible change of the side-channel protocol or the handshake.
pub const PROTOCOL_VERSION: u16 = 1;

/// The peer id under which a proxy's release reaches the producer ledger.
pub(crate) const PROXY_PEER: PeerId = PeerId(u32::MAX);

/// Control messages kept for a peer while its connection is being set up.
const MAX_QUEUED: usize = 4096;

/// The longest the driver sleeps: transports are polled for notifications at this rate.
const POLL: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerState {
    /// `started`: a connect attempt is under way.
    Connecting {
        started: bool,
    },
    Ready,
    /// Refused or unreachable; the reason is what requests fail with.
    Failed(String),
    Closed,
}

pub(crate) struct Peer {
    engine: String,
    addr: Option<String>,
    conn: Option<Conn>,
    state: PeerState,
    layouts: Vec<RankLayout>,
    agents: Vec<String>,
    queued: VecDeque<Message>,
    /// Number of the latest connection attempt (0: none yet); an outcome of an older one is
    /// stale.
    attempt: u64,
}

#[derive(Default)]
pub(crate) struct Peers {
    by_id: HashMap<PeerId, Peer>,
    by_engine: HashMap<String, PeerId>,
    by_conn: HashMap<ConnId, PeerId>,
    by_agent: HashMap<String, PeerId>,
    next: u32,
    /// Connection attempts started so far (numbers them).
    attempts: u64,
}

impl Peers {
    pub fn engines(&self) -> impl Iterator<Item = (&str, PeerId)> {
        self.by_engine.iter().map(|(e, p)| (e.as_str(), *p))
    }

    pub fn peer_of_engine(&self, engine: &str) -> Option<PeerId> {
        self.by_engine.get(engine).copied()
    }

    pub fn state(&self, id: PeerId) -> Option<&PeerState> {
        self.by_id.get(&id).map(|p| &p.state)
    }
}

/// P, push mode: one handoff's prefill and the writes into each registered D rank.
pub(crate) struct PushState {
    blocks: Vec<u32>,
    num_tokens: u32,
    pub layers_saved: u32,
    writes: HashMap<u16, ActiveWrite>,
}

impl PushState {
    pub fn new(blocks: Vec<u32>, num_tokens: u32) -> Self {
        PushState {
            blocks,
            num_tokens,
            layers_saved: 0,
            writes: HashMap::new(),
        }
    }
}

struct ActiveWrite {
    d_peer: PeerId,
    d_blocks: Vec<u32>,
    done: Vec<PushDone>,
    layers_posted: u32,
    xfers: Vec<(u16, XferId)>,
    failed: bool,
    aborted: bool,
    started: Instant,
    bytes: u64,
    descs: usize,
}

struct ActiveRead {
    dst_blocks: Vec<u32>,
    num_tokens: u32,
    started: Instant,
    bytes: u64,
    descs: usize,
    /// Per D rank: the transfers still running (transport rank, id) and whether one failed.
    ranks: HashMap<u16, (Vec<XferId>, bool)>,
}

pub(crate) struct Inner {
    pub producer: Option<ProducerLedger>,
    pub consumer: Option<ConsumerLedger>,
    pub peers: Peers,
    pub requests: HashMap<u64, HandoffId>,
    /// Which P each tracked handoff comes from (to explain a failure).
    pub handoff_peer: HashMap<HandoffId, PeerId>,
    reads: HashMap<HandoffId, ActiveRead>,
    pub pushes: HashMap<HandoffId, PushState>,
    /// D: each tracked handoff's prompt length and mode (to zero a pushed block's tail).
    pub handoff_tokens: HashMap<HandoffId, (u32, TransferMode)>,
    /// Why requests of a peer failed (incompatible handshake, unreachable).
    refusals: HashMap<PeerId, String>,
    anon_conns: HashMap<ConnId, Conn>,
    late_seen: u64,
}

impl Inner {
    /// Shuts every side-channel connection (engine shutdown).
    pub(crate) fn close_connections(&mut self) {
        for p in self.peers.by_id.values_mut() {
            if let Some(c) = p.conn.take() {
                c.close();
            }
        }
        for (_, c) in self.anon_conns.drain() {
            c.close();
        }
    }

    pub fn new(producer: Option<ProducerLedger>, consumer: Option<ConsumerLedger>) -> Self {
        Inner {
            producer,
            consumer,
            peers: Peers::default(),
            requests: HashMap::new(),
            handoff_peer: HashMap::new(),
            reads: HashMap::new(),
            pushes: HashMap::new(),
            handoff_tokens: HashMap::new(),
            refusals: HashMap::new(),
            anon_conns: HashMap::new(),
            late_seen: 0,
        }
    }

    /// The peer for engine `engine`, created (to be connected) if new or gone.
    pub fn peer_for(&mut self, engine: &str, addr: String) -> PeerId {
        if let Some(&id) = self.peers.by_engine.get(engine) {
            let p = self.peers.by_id.get_mut(&id).expect("indexed peer exists");
            p.addr = Some(addr);
            if matches!(p.state, PeerState::Closed | PeerState::Failed(_)) {
                // A new request names it: try again (P may have restarted).
                p.state = PeerState::Connecting { started: false };
                self.refusals.remove(&id);
            }
            return id;
        }
        self.peers.next += 1;
        let id = PeerId(self.peers.next);
        self.peers.by_engine.insert(engine.to_string(), id);
        self.peers.by_id.insert(
            id,
            Peer {
                engine: engine.to_string(),
                addr: Some(addr),
                conn: None,
                state: PeerState::Connecting { started: false },
                layouts: vec![],
                agents: vec![],
                queued: VecDeque::new(),
                attempt: 0,
            },
        );
        id
    }

    /// Tells the producer again that every peer whose connection is gone is dead: a handoff
    /// created after the death may have bound such a peer through a staged message.
    pub fn redeclare_dead(&mut self, now: Duration) {
        let dead: Vec<PeerId> = self
            .peers
            .by_id
            .iter()
            .filter(|(_, p)| matches!(p.state, PeerState::Closed | PeerState::Failed(_)))
            .map(|(id, _)| *id)
            .collect();
        if let Some(p) = self.producer.as_mut() {
            for peer in dead {
                if p.held_blocks_for(peer) > 0 {
                    p.handle_peer_dead(peer, now);
                }
            }
        }
    }

    /// Why the P of `handoff` refused or could not be reached, if it did.
    pub fn refusal(&self, handoff: HandoffId) -> Option<String> {
        self.handoff_peer
            .get(&handoff)
            .and_then(|p| self.refusals.get(p))
            .cloned()
    }

    /// Sends a control message to a peer, or queues it until the connection is up. Returns false
    /// when the connection broke (the caller declares the peer dead).
    pub fn send(&mut self, peer: PeerId, msg: Message) -> bool {
        let Some(p) = self.peers.by_id.get_mut(&peer) else {
            return true;
        };
        match (&p.state, &p.conn) {
            (PeerState::Ready, Some(conn)) => conn.send(&msg).is_ok(),
            (PeerState::Connecting { .. }, _) => {
                if p.queued.len() < MAX_QUEUED {
                    p.queued.push_back(msg);
                }
                true
            }
            // Lost: the ledgers already know the peer is dead; the message is moot.
            _ => true,
        }
    }
}

impl Connector {
    pub(crate) fn connect(&self, inner: &mut Inner, peer: PeerId) {
        let Some(p) = inner.peers.by_id.get_mut(&peer) else {
            return;
        };
        let Some(addr) = p.addr.clone() else {
            return;
        };
        inner.peers.attempts += 1;
        let attempt = inner.peers.attempts;
        p.attempt = attempt;
        p.state = PeerState::Connecting { started: true };
        let hello = match self.hello() {
            Ok(h) => h,
            Err(e) => {
                p.state = PeerState::Failed(e);
                return;
            }
        };
        side_channel::connect(
            p.engine.clone(),
            attempt,
            addr,
            Message::Hello(hello),
            self.wake.clone(),
        );
    }

    fn hello(&self) -> Result<Hello, String> {
        let layouts: Vec<RankLayout> = self.ranks.iter().map(|r| r.layout.clone()).collect();
        let mut agents = Vec::new();
        for r in &self.ranks {
            agents.push(r.transport.local_metadata().map_err(|e| e.to_string())?);
        }
        Ok(Hello {
            engine_id: self.cfg.engine_id.clone(),
            rank: 0,
            tp: self.spec.tp as u16,
            fingerprint: self.fingerprint.clone(),
            layout: postcard::to_allocvec(&layouts).map_err(|e| e.to_string())?,
            agent_metadata: postcard::to_allocvec(&agents).map_err(|e| e.to_string())?,
        })
    }

    /// Checks a peer's hello and loads its agents; returns its layouts and agent names.
    fn accept_hello(&self, h: &Hello) -> Result<(Vec<RankLayout>, Vec<String>), String> {
        if let Some(why) = self.fingerprint.mismatch(&h.fingerprint) {
            return Err(why);
        }
        let layouts: Vec<RankLayout> =
            postcard::from_bytes(&h.layout).map_err(|e| format!("bad layout: {e}"))?;
        let mds: Vec<Vec<u8>> = postcard::from_bytes(&h.agent_metadata)
            .map_err(|e| format!("bad agent metadata: {e}"))?;
        if layouts.len() != h.tp as usize || mds.len() != h.tp as usize || h.tp == 0 {
            return Err(format!(
                "peer announces tp {} with {} layouts and {} agents",
                h.tp,
                layouts.len(),
                mds.len()
            ));
        }
        for (i, l) in layouts.iter().enumerate() {
            l.validate().map_err(|e| format!("peer rank {i}: {e}"))?;
        }
        // P's spec first: the check is directional only in its wording.
        let (p, d) = match self.cfg.role {
            crate::Role::Decode => (&layouts[0].spec, &self.spec),
            _ => (&self.spec, &layouts[0].spec),
        };
        handoff_plan::check_compatible(p, d).map_err(|e| e.to_string())?;
        let mut agents = Vec::new();
        for md in &mds {
            let mut name = None;
            for r in &self.ranks {
                name = Some(r.transport.load_remote(md).map_err(|e| e.to_string())?);
            }
            agents.push(name.unwrap_or_default());
        }
        Ok((layouts, agents))
    }

    /// The driver loop.
    pub(crate) fn run(&self, events: Receiver<SideEvent>) {
        loop {
            if self.stopped() {
                break;
            }
            let timeout = {
                let inner = self.inner.lock();
                let now = self.now();
                let next = [
                    inner.producer.as_ref().and_then(|p| p.poll_timeout()),
                    inner.consumer.as_ref().and_then(|c| c.poll_timeout()),
                ]
                .into_iter()
                .flatten()
                .min();
                next.map_or(POLL, |t| t.saturating_sub(now).min(POLL))
            };
            match events.recv_timeout(timeout) {
                Ok(ev) => {
                    self.on_side_event(ev);
                    while let Ok(ev) = events.try_recv() {
                        self.on_side_event(ev);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.step();
        }
    }

    fn step(&self) {
        let now = self.now();
        let mut inner = self.inner.lock();
        if let Some(p) = inner.producer.as_mut() {
            if p.poll_timeout().is_some_and(|t| t <= now) {
                p.handle_timeout(now);
            }
        }
        if let Some(c) = inner.consumer.as_mut() {
            if c.poll_timeout().is_some_and(|t| t <= now) {
                c.handle_timeout(now);
            }
        }
        // Transport notifications (completions riding on transfers) and dead peers.
        for (rank, r) in self.ranks.iter().enumerate() {
            for n in r.transport.drain_notifications() {
                let Some(&peer) = inner.peers.by_agent.get(&n.from) else {
                    self.metrics.unknown_notifications.inc();
                    continue;
                };
                match decode(&n.msg) {
                    Ok(msg) => self.deliver(&mut inner, peer, msg, now),
                    Err(e) => {
                        tracing::debug!(rank, from = %n.from, error = %e, "bad notification");
                        self.metrics.unknown_notifications.inc();
                    }
                }
            }
            for agent in r.transport.drain_dead_peers() {
                if let Some(&peer) = inner.peers.by_agent.get(&agent) {
                    tracing::info!(agent, "transport reports peer dead");
                    self.peer_dead(&mut inner, peer, now);
                }
            }
        }
        self.poll_reads(&mut inner, now);
        self.advance_pushes(&mut inner, now);
        self.flush(&mut inner, now);
        self.update_gauges(&mut inner);
    }

    fn deliver(&self, inner: &mut Inner, peer: PeerId, msg: Message, now: Duration) {
        match &msg {
            Message::Heartbeat(_) => self
                .metrics
                .heartbeats
                .get_or_create(&crate::metrics::DirLabels {
                    direction: "received",
                })
                .inc(),
            _ => 0,
        };
        // A message is for the ledger of the side it concerns.
        let to_producer = matches!(
            msg,
            Message::PullDone(_)
                | Message::Release(_)
                | Message::PushRegister(_)
                | Message::PushCancel(_)
        );
        let to_consumer = matches!(
            msg,
            Message::PushDone(_) | Message::PushFailed(_) | Message::PushCancelAck(_)
        );
        if to_producer {
            if let Some(p) = inner.producer.as_mut() {
                p.handle_message(peer, msg, now);
            }
        } else if to_consumer {
            if let Some(c) = inner.consumer.as_mut() {
                c.handle_message(peer, msg, now);
            }
        } else {
            // Heartbeats and grants go both ways (pull: D→P; push: also P→D). Whoever does not
            // know the ids ignores them.
            match (&mut inner.producer, &mut inner.consumer) {
                (Some(p), Some(c)) => {
                    p.handle_message(peer, msg.clone(), now);
                    c.handle_message(peer, msg, now);
                }
                (Some(p), None) => p.handle_message(peer, msg, now),
                (None, Some(c)) => c.handle_message(peer, msg, now),
                (None, None) => {}
            }
        }
    }

    fn peer_dead(&self, inner: &mut Inner, peer: PeerId, now: Duration) {
        if let Some(p) = inner.producer.as_mut() {
            p.handle_peer_dead(peer, now);
        }
        if let Some(c) = inner.consumer.as_mut() {
            c.handle_peer_dead(peer, now);
        }
        if let Some(p) = inner.peers.by_id.get_mut(&peer) {
            if let Some(conn) = p.conn.take() {
                conn.close();
                inner.peers.by_conn.remove(&conn.id);
            }
            if !matches!(p.state, PeerState::Failed(_)) {
                p.state = PeerState::Closed;
            }
            p.queued.clear();
        }
    }

    fn on_side_event(&self, ev: SideEvent) {
        let now = self.now();
        let mut inner = self.inner.lock();
        match ev {
            SideEvent::Wake => {}
            SideEvent::Inbound { conn, msg } => match msg {
                Message::Hello(h) => {
                    let reply = match self.accept_hello(&h) {
                        Ok((layouts, agents)) => match self.hello() {
                            Ok(mine) => {
                                let id = inner.peer_for(&h.engine_id, String::new());
                                let p = inner.peers.by_id.get_mut(&id).expect("just created");
                                p.addr = None;
                                if let Some(old) = p.conn.replace(conn.clone()) {
                                    old.close();
                                }
                                p.state = PeerState::Ready;
                                p.layouts = layouts;
                                for a in &agents {
                                    inner.peers.by_agent.insert(a.clone(), id);
                                }
                                let p = inner.peers.by_id.get_mut(&id).expect("exists");
                                p.agents = agents;
                                inner.peers.by_conn.insert(conn.id, id);
                                HelloReply::Accepted(mine)
                            }
                            Err(e) => HelloReply::Refused { reason: e },
                        },
                        Err(reason) => {
                            self.metrics.handshakes_refused.inc();
                            tracing::warn!(peer = %h.engine_id, %reason, "handshake refused");
                            HelloReply::Refused { reason }
                        }
                    };
                    let refused = matches!(reply, HelloReply::Refused { .. });
                    let _ = conn.send(&Message::HelloReply(reply));
                    if refused {
                        conn.close();
                    }
                }
                // A proxy (or anyone holding the capability) sends a release without a
                // handshake.
                other => {
                    inner.anon_conns.insert(conn.id, conn);
                    if let Some(p) = inner.producer.as_mut() {
                        p.handle_message(PROXY_PEER, other, now);
                    }
                }
            },
            SideEvent::Message { conn, msg } => {
                if inner.anon_conns.contains_key(&conn) {
                    if let Some(p) = inner.producer.as_mut() {
                        p.handle_message(PROXY_PEER, msg, now);
                    }
                } else if let Some(&peer) = inner.peers.by_conn.get(&conn) {
                    self.deliver(&mut inner, peer, msg, now);
                }
            }
            SideEvent::Connected {
                engine,
                attempt,
                conn,
                reply,
            } => {
                let Some(&peer) = inner.peers.by_engine.get(&engine) else {
                    conn.close();
                    return;
                };
                // A success of an attempt older than the latest is still a working connection
                // to that engine: it is used like the latest's (closing it could make P take
                // it, if it is P's newest, for our death).
                if inner
                    .peers
                    .by_id
                    .get(&peer)
                    .is_some_and(|p| p.attempt != attempt)
                {
                    tracing::debug!(peer = %engine, attempt, "connected on an earlier attempt");
                }
                let outcome = match reply {
                    Message::HelloReply(HelloReply::Accepted(h)) => self.accept_hello(&h),
                    Message::HelloReply(HelloReply::Refused { reason }) => Err(reason),
                    other => Err(format!("unexpected handshake reply {}", other.kind())),
                };
                match outcome {
                    Ok((layouts, agents)) => {
                        for a in &agents {
                            inner.peers.by_agent.insert(a.clone(), peer);
                        }
                        inner.peers.by_conn.insert(conn.id, peer);
                        let p = inner.peers.by_id.get_mut(&peer).expect("indexed");
                        p.layouts = layouts;
                        p.agents = agents;
                        p.state = PeerState::Ready;
                        let queued: Vec<Message> = p.queued.drain(..).collect();
                        let mut ok = true;
                        for m in queued {
                            ok &= conn.send(&m).is_ok();
                        }
                        p.conn = Some(conn);
                        if !ok {
                            self.peer_dead(&mut inner, peer, now);
                        }
                    }
                    Err(reason) => {
                        conn.close();
                        self.metrics.handshakes_refused.inc();
                        tracing::warn!(peer = %engine, %reason, "handshake with P failed");
                        self.fail_peer(&mut inner, peer, reason, now);
                    }
                }
            }
            SideEvent::ConnectFailed {
                engine,
                attempt,
                error,
            } => {
                let Some(&peer) = inner.peers.by_engine.get(&engine) else {
                    return;
                };
                // Only the latest attempt's failure says anything about the peer: an older one
                // (a connect that timed out after the peer was found dead and retried) must not
                // fail the requests that wait on the newer attempt, or one that succeeded.
                let latest = inner.peers.by_id.get(&peer).map(|p| p.attempt);
                if latest != Some(attempt) {
                    tracing::debug!(peer = %engine, attempt, ?latest, %error, "stale connect failure ignored");
                    return;
                }
                tracing::warn!(peer = %engine, %error, "cannot reach P");
                self.fail_peer(&mut inner, peer, error, now);
            }
            SideEvent::Closed { conn } => {
                inner.anon_conns.remove(&conn);
                if let Some(peer) = inner.peers.by_conn.remove(&conn) {
                    let current = inner
                        .peers
                        .by_id
                        .get(&peer)
                        .and_then(|p| p.conn.as_ref())
                        .is_some_and(|c| c.id == conn);
                    if current {
                        tracing::info!(peer = ?peer, "side channel closed: peer dead");
                        self.peer_dead(&mut inner, peer, now);
                    }
                }
            }
        }
        drop(inner);
    }

    fn fail_peer(&self, inner: &mut Inner, peer: PeerId, reason: String, now: Duration) {
        inner.refusals.insert(peer, reason.clone());
        self.peer_dead(inner, peer, now);
        if let Some(p) = inner.peers.by_id.get_mut(&peer) {
            p.state = PeerState::Failed(reason);
        }
    }

    /// Moves every ledger output to where it goes.
    fn flush(&self, inner: &mut Inner, now: Duration) {
        let mut p_actions = Vec::new();
        let mut released_pushes = Vec::new();
        loop {
            let mut progressed = false;
            let mut out = Vec::new();
            if let Some(p) = inner.producer.as_mut() {
                while let Some(m) = p.poll_message() {
                    out.push(m);
                }
            }
            if let Some(c) = inner.consumer.as_mut() {
                while let Some(m) = c.poll_message() {
                    out.push(m);
                }
            }
            for (peer, msg) in out {
                progressed = true;
                if matches!(msg, Message::Heartbeat(_)) {
                    self.metrics
                        .heartbeats
                        .get_or_create(&crate::metrics::DirLabels { direction: "sent" })
                        .inc();
                }
                if peer == PROXY_PEER {
                    continue;
                }
                if !inner.send(peer, msg) {
                    self.peer_dead(inner, peer, now);
                }
            }
            if let Some(p) = inner.producer.as_mut() {
                while let Some(rel) = p.poll_release() {
                    progressed = true;
                    self.metrics
                        .handoffs_ended
                        .get_or_create(&crate::metrics::ReasonLabels {
                            reason: rel.reason.as_str(),
                        })
                        .inc();
                    self.metrics
                        .lease_age_at_release
                        .observe(rel.held_for.as_secs_f64());
                    released_pushes.push(rel.handoff);
                    let _ = self.out.send(ConnectorEvent::BlocksReleased {
                        blocks: rel.blocks,
                        reason: rel.reason.as_str().into(),
                    });
                }
                while let Some(a) = p.poll_action() {
                    progressed = true;
                    p_actions.push(a);
                }
            }
            for h in released_pushes.drain(..) {
                if let Some(st) = inner.pushes.remove(&h) {
                    // Writes still posted are aborted: the ledger only releases after they
                    // ended or were fenced, so this only cleans up.
                    for w in st.writes.values() {
                        for (rank, id) in &w.xfers {
                            if let Some(r) = self.ranks.get(*rank as usize) {
                                let _ = r.transport.release(*id);
                            }
                        }
                    }
                }
            }
            for a in p_actions.drain(..) {
                match a {
                    ProducerAction::PushWrite(w) => {
                        let accepted = inner.pushes.get_mut(&w.handoff).map(|st| {
                            st.writes.insert(
                                w.d_rank,
                                ActiveWrite {
                                    d_peer: w.d_peer,
                                    d_blocks: w.dst_blocks.clone(),
                                    done: w.done.clone(),
                                    layers_posted: 0,
                                    xfers: Vec::new(),
                                    failed: false,
                                    aborted: false,
                                    started: Instant::now(),
                                    bytes: 0,
                                    descs: 0,
                                },
                            )
                        });
                        if accepted.is_none() {
                            if let Some(p) = inner.producer.as_mut() {
                                p.on_push_write_done(w.handoff, w.d_rank, false, now);
                            }
                        }
                    }
                    ProducerAction::AbortWrite { handoff, d_rank } => {
                        if let Some(w) = inner
                            .pushes
                            .get_mut(&handoff)
                            .and_then(|st| st.writes.get_mut(&d_rank))
                        {
                            w.aborted = true;
                            for (rank, id) in &w.xfers {
                                if let Some(r) = self.ranks.get(*rank as usize) {
                                    let _ = r.transport.release(*id);
                                }
                            }
                            w.xfers.clear();
                        }
                    }
                }
            }
            let mut actions = Vec::new();
            let mut outcomes = Vec::new();
            if let Some(c) = inner.consumer.as_mut() {
                while let Some(rel) = c.poll_release() {
                    progressed = true;
                    let _ = self.out.send(ConnectorEvent::BlocksReleased {
                        blocks: rel.blocks,
                        reason: rel.reason.as_str().into(),
                    });
                }
                while let Some(a) = c.poll_action() {
                    actions.push(a);
                }
                while let Some(o) = c.poll_outcome() {
                    outcomes.push(o);
                }
            }
            for o in outcomes {
                progressed = true;
                let ev = match o {
                    Outcome::Ready {
                        requests,
                        blocks,
                        handoff,
                    } => {
                        inner.handoff_peer.remove(&handoff);
                        if let Some((n, TransferMode::Push)) = inner.handoff_tokens.remove(&handoff)
                        {
                            // P wrote exactly the prompt's tokens: clear what it did not.
                            for rank in 0..self.spec.tp as u16 {
                                self.zero_tail(rank, &blocks, n);
                            }
                        }
                        ConnectorEvent::Ready {
                            requests: requests.iter().map(|r| r.0).collect(),
                            blocks,
                        }
                    }
                    Outcome::Recompute {
                        requests,
                        reason,
                        handoff,
                    } => {
                        inner.handoff_tokens.remove(&handoff);
                        self.count_failure(reason.as_str());
                        let why = self.reason_text(inner.refusal(handoff), reason.as_str());
                        inner.handoff_peer.remove(&handoff);
                        ConnectorEvent::Recompute {
                            requests: requests.iter().map(|r| r.0).collect(),
                            reason: why,
                        }
                    }
                    Outcome::Failed {
                        requests,
                        reason,
                        handoff,
                    } => {
                        inner.handoff_tokens.remove(&handoff);
                        self.count_failure(reason.as_str());
                        let why = self.reason_text(inner.refusal(handoff), reason.as_str());
                        inner.handoff_peer.remove(&handoff);
                        ConnectorEvent::Failed {
                            requests: requests.iter().map(|r| r.0).collect(),
                            reason: why,
                        }
                    }
                };
                if let ConnectorEvent::Ready { requests, .. }
                | ConnectorEvent::Recompute { requests, .. }
                | ConnectorEvent::Failed { requests, .. } = &ev
                {
                    for r in requests {
                        inner.requests.remove(r);
                    }
                }
                let _ = self.out.send(ev);
            }
            for a in actions {
                progressed = true;
                match a {
                    ConsumerAction::StartRead(r) => self.start_read(inner, r, now),
                    ConsumerAction::CancelRead { handoff } => self.cancel_read(inner, handoff, now),
                }
            }
            if !progressed {
                break;
            }
        }
    }

    fn count_failure(&self, reason: &'static str) {
        self.metrics
            .requests_failed
            .get_or_create(&crate::metrics::ReasonLabels { reason })
            .inc();
    }

    fn reason_text(&self, refusal: Option<String>, reason: &str) -> String {
        match refusal {
            Some(r) => format!("{reason}: {r}"),
            None => reason.to_string(),
        }
    }

    fn start_read(&self, inner: &mut Inner, r: StartRead, now: Duration) {
        let d_tp = self.spec.tp as u16;
        let fail_all = |inner: &mut Inner, why: String| {
            tracing::warn!(handoff = %r.handoff, %why, "read not started");
            if let Some(c) = inner.consumer.as_mut() {
                for rank in 0..d_tp {
                    c.on_read_done(r.handoff, rank, false, now);
                }
            }
        };
        let Some(peer) = inner.peers.by_id.get(&r.p_peer) else {
            return fail_all(inner, "unknown P".into());
        };
        if peer.state != PeerState::Ready {
            return fail_all(inner, "P not connected".into());
        }
        let d_layouts: Vec<RankLayout> = self.ranks.iter().map(|x| x.layout.clone()).collect();
        // Move whole blocks where both sides have them: the tail of the last block costs a
        // descriptor per head and layer when cut at the last token, and nothing when moved with
        // the rest of its run. The bytes past the prompt are zeroed on arrival (`zero_tail`).
        let p_cap = r.src_blocks.len() as u64 * peer.layouts[0].spec.block_size as u64;
        let d_cap = r.dst_blocks.len() as u64 * self.spec.block_size as u64;
        let planned_tokens = p_cap.min(d_cap).max(r.num_tokens as u64) as u32;
        let plan = match handoff_plan::plan(
            &peer.layouts,
            &d_layouts,
            &r.src_blocks,
            &r.dst_blocks,
            planned_tokens,
        ) {
            Ok(p) => p,
            Err(e) => return fail_all(inner, e.to_string()),
        };
        let agents = peer.agents.clone();
        let mut active = ActiveRead {
            dst_blocks: r.dst_blocks.clone(),
            num_tokens: r.num_tokens,
            started: Instant::now(),
            bytes: 0,
            descs: 0,
            ranks: (0..d_tp).map(|rank| (rank, (Vec::new(), false))).collect(),
        };
        for pair in &plan.pairs {
            let d_rank = pair.d_rank as u16;
            let p_rank = pair.p_rank as u16;
            // D reads: its own memory is the destination.
            let descs = xfer_descs(&pair.descriptors, XferOp::Read);
            active.bytes += descs.iter().map(|d| d.len).sum::<u64>();
            active.descs += descs.len();
            let note = r
                .done
                .iter()
                .find(|n| n.consumer_rank == d_rank && n.p_rank == p_rank)
                .and_then(|n| encode(&Message::PullDone(*n)).ok());
            let entry = active.ranks.entry(d_rank).or_default();
            let (Some(rank), Some(agent)) =
                (self.ranks.get(d_rank as usize), agents.get(p_rank as usize))
            else {
                entry.1 = true;
                continue;
            };
            match rank
                .transport
                .post(XferOp::Read, agent, &descs, note.as_deref())
            {
                Ok(id) => entry.0.push(id),
                Err(e) => {
                    tracing::warn!(handoff = %r.handoff, error = %e, "READ post failed");
                    entry.1 = true;
                }
            }
        }
        self.metrics
            .transfer_descriptors
            .observe(active.descs as f64);
        inner.reads.insert(r.handoff, active);
        self.poll_reads(inner, now);
    }

    fn cancel_read(&self, inner: &mut Inner, handoff: HandoffId, now: Duration) {
        let Some(read) = inner.reads.remove(&handoff) else {
            return;
        };
        for (rank, (ids, _)) in read.ranks {
            if let Some(r) = self.ranks.get(rank as usize) {
                for id in ids {
                    let _ = r.transport.release(id);
                }
            }
            if let Some(c) = inner.consumer.as_mut() {
                c.on_read_done(handoff, rank, false, now);
            }
        }
    }

    /// Progress of one posted transfer: `None` while it runs, `Some(ok)` once it ended (and was
    /// released).
    fn xfer_ended(&self, rank: u16, id: XferId, handoff: HandoffId, op: &str) -> Option<bool> {
        let Some(r) = self.ranks.get(rank as usize) else {
            return Some(false);
        };
        match r.transport.status(id) {
            Ok(XferStatus::InProgress) => None,
            Ok(XferStatus::Done) => {
                let _ = r.transport.release(id);
                Some(true)
            }
            Ok(XferStatus::Failed(e)) => {
                tracing::warn!(%handoff, error = %e, "{op} failed");
                let _ = r.transport.release(id);
                Some(false)
            }
            Err(_) => Some(false),
        }
    }

    fn poll_reads(&self, inner: &mut Inner, now: Duration) {
        let mut finished: Vec<(HandoffId, u16, bool)> = Vec::new();
        let mut done_reads = Vec::new();
        for (handoff, read) in inner.reads.iter_mut() {
            for (rank, (ids, failed)) in read.ranks.iter_mut() {
                ids.retain(|id| match self.xfer_ended(*rank, *id, *handoff, "READ") {
                    None => true,
                    Some(ok) => {
                        *failed |= !ok;
                        false
                    }
                });
            }
            let ended: Vec<u16> = read
                .ranks
                .iter()
                .filter(|(_, (ids, _))| ids.is_empty())
                .map(|(r, _)| *r)
                .collect();
            for rank in ended {
                if let Some((_, failed)) = read.ranks.remove(&rank) {
                    let ok = !failed && self.zero_tail(rank, &read.dst_blocks, read.num_tokens);
                    finished.push((*handoff, rank, ok));
                }
            }
            if read.ranks.is_empty() {
                done_reads.push(*handoff);
            }
        }
        for h in done_reads {
            if let Some(read) = inner.reads.remove(&h) {
                self.metrics.transfer_bytes.inc_by(read.bytes);
                self.metrics
                    .transfer_duration
                    .observe(read.started.elapsed().as_secs_f64());
            }
        }
        if let Some(c) = inner.consumer.as_mut() {
            for (handoff, rank, ok) in finished {
                c.on_read_done(handoff, rank, ok, now);
            }
        }
    }

    /// P, push mode: posts the layers that are ready into every granted registration, and
    /// reports each registration's writes to the ledger once they all ended.
    fn advance_pushes(&self, inner: &mut Inner, now: Duration) {
        let num_layers = self.spec.shape.num_layers;
        let my_layouts: Vec<RankLayout> = self.ranks.iter().map(|x| x.layout.clone()).collect();
        let mut ended: Vec<(HandoffId, u16, bool)> = Vec::new();
        let handoffs: Vec<HandoffId> = inner.pushes.keys().copied().collect();
        for h in handoffs {
            let Some(st) = inner.pushes.get_mut(&h) else {
                continue;
            };
            for (d_rank, w) in st.writes.iter_mut() {
                // Progress of posted writes.
                w.xfers
                    .retain(|(rank, id)| match self.xfer_ended(*rank, *id, h, "WRITE") {
                        None => true,
                        Some(ok) => {
                            w.failed |= !ok;
                            false
                        }
                    });
                if w.aborted || w.failed {
                    if w.xfers.is_empty() {
                        ended.push((h, *d_rank, false));
                    }
                    continue;
                }
                if w.layers_posted == num_layers {
                    if w.xfers.is_empty() {
                        self.metrics.transfer_bytes.inc_by(w.bytes);
                        self.metrics
                            .transfer_duration
                            .observe(w.started.elapsed().as_secs_f64());
                        self.metrics.transfer_descriptors.observe(w.descs as f64);
                        ended.push((h, *d_rank, true));
                    }
                    continue;
                }
                let Some(peer) = inner.peers.by_id.get(&w.d_peer) else {
                    w.failed = true;
                    continue;
                };
                while w.layers_posted < st.layers_saved.min(num_layers) {
                    let layer = w.layers_posted;
                    let last = layer + 1 == num_layers;
                    // The completion rides on the last layer's WRITE, posted only once every
                    // earlier one landed (a backend may complete transfers out of order).
                    if last && !w.xfers.is_empty() {
                        break;
                    }
                    // Rule 3: post only on a registration grant that is still valid.
                    let permitted = inner
                        .producer
                        .as_ref()
                        .is_some_and(|p| p.write_permit(h, *d_rank, now).is_ok());
                    if !permitted {
                        break;
                    }
                    let plan = match handoff_plan::plan_layers(
                        &my_layouts,
                        &peer.layouts,
                        &st.blocks,
                        &w.d_blocks,
                        st.num_tokens,
                        layer..layer + 1,
                    ) {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::warn!(handoff = %h, error = %e, "push plan failed");
                            w.failed = true;
                            break;
                        }
                    };
                    for pair in plan.pairs.iter().filter(|p| p.d_rank as u16 == *d_rank) {
                        let p_rank = pair.p_rank as u16;
                        // P writes: its own memory is the source.
                        let descs = xfer_descs(&pair.descriptors, XferOp::Write);
                        w.bytes += descs.iter().map(|d| d.len).sum::<u64>();
                        w.descs += descs.len();
                        let note = if last {
                            w.done
                                .iter()
                                .find(|n| n.p_rank == p_rank && n.d_rank == *d_rank)
                                .and_then(|n| encode(&Message::PushDone(*n)).ok())
                        } else {
                            None
                        };
                        let (Some(r), Some(agent)) = (
                            self.ranks.get(p_rank as usize),
                            peer.agents.get(*d_rank as usize),
                        ) else {
                            w.failed = true;
                            continue;
                        };
                        match r
                            .transport
                            .post(XferOp::Write, agent, &descs, note.as_deref())
                        {
                            Ok(id) => w.xfers.push((p_rank, id)),
                            Err(e) => {
                                tracing::warn!(handoff = %h, error = %e, "WRITE post failed");
                                w.failed = true;
                            }
                        }
                    }
                    w.layers_posted += 1;
                }
            }
            for (hh, d_rank, _) in ended.iter().filter(|(x, _, _)| *x == h) {
                if let Some(st) = inner.pushes.get_mut(hh) {
                    st.writes.remove(d_rank);
                }
            }
        }
        if let Some(p) = inner.producer.as_mut() {
            for (h, d_rank, ok) in ended {
                p.on_push_write_done(h, d_rank, ok, now);
            }
        }
    }

    /// Zeroes the bytes of the destination blocks past the prompt's last token, so no stale
    /// byte (P's or a previous request's) stays in a partially filled block.
    fn zero_tail(&self, rank: u16, dst_blocks: &[u32], num_tokens: u32) -> bool {
        let Some(r) = self.ranks.get(rank as usize) else {
            return false;
        };
        let spans = match handoff_plan::uncovered_dst(&r.layout, dst_blocks, num_tokens) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot compute the tail to zero");
                return false;
            }
        };
        let zeros = vec![0u8; spans.iter().map(|s| s.len).max().unwrap_or(0) as usize];
        spans.iter().all(|s| {
            r.regions
                .iter()
                .find(|(id, _)| *id == s.region)
                .is_some_and(|(_, region)| {
                    region
                        .write(s.offset as usize, &zeros[..s.len as usize])
                        .is_ok()
                })
        })
    }

    pub(crate) fn update_gauges(&self, inner: &mut Inner) {
        use crate::metrics::HeldLabels;
        // Late notifications are counted by the ledgers; the metric follows their total.
        let late = inner
            .producer
            .as_ref()
            .map_or(0, |p| p.stats().late_notifications)
            + inner
                .consumer
                .as_ref()
                .map_or(0, |c| c.stats().late_notifications);
        if late > inner.late_seen {
            self.metrics
                .late_notifications
                .inc_by(late - inner.late_seen);
            inner.late_seen = late;
        }
        let block_bytes = self.spec.block_bytes() * self.spec.shape.num_layers as u64;
        let set = |side: &'static str, state: &'static str, blocks: usize| {
            let l = HeldLabels { side, state };
            self.metrics
                .blocks_held
                .get_or_create(&l)
                .set(blocks as i64);
            self.metrics
                .bytes_held
                .get_or_create(&l)
                .set((blocks as u64 * block_bytes * self.spec.tp as u64) as i64);
        };
        if let Some(p) = inner.producer.as_ref() {
            let (leased, fencing) = p.held_blocks_by_state();
            set("prefill", "leased", leased);
            set("prefill", "fencing", fencing);
        }
        if let Some(c) = inner.consumer.as_ref() {
            set("decode", "waiting", c.held_blocks());
        }
    }
}

/// The planner's descriptors (P memory → D memory) as the transport's, seen from the side that
/// posts: D posts READs into its memory, P posts WRITEs from its memory.
fn xfer_descs(descs: &[handoff_plan::Descriptor], op: XferOp) -> Vec<XferDesc> {
    descs
        .iter()
        .map(|d| match op {
            XferOp::Read => XferDesc {
                local_region: d.dst_region,
                local_offset: d.dst_offset,
                remote_region: d.src_region,
                remote_offset: d.src_offset,
                len: d.len,
            },
            XferOp::Write => XferDesc {
                local_region: d.src_region,
                local_offset: d.src_offset,
                remote_region: d.dst_region,
                remote_offset: d.dst_offset,
                len: d.len,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use handoff_plan::{BlockLayout, KvSpec, ModelShape, RankLayout};
    use handoff_proto::TransferMode;
    use handoff_transport::mem::{MemFabric, MemTransport};
    use handoff_transport::KvRegion;
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::{ConnectorConfig, RankMemory, Role};

    /// A decode connector on the mem transport, with a tiny KV pool.
    fn decode_connector() -> Arc<Connector> {
        let spec = KvSpec {
            shape: ModelShape {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                dtype_size: 2,
            },
            tp: 1,
            block_size: 16,
            block_layout: BlockLayout::HeadMajor,
        };
        let layout = RankLayout::cross_layer(spec, 0, 8, 0).unwrap();
        let region = Arc::new(KvRegion::new(layout.region_len(0).unwrap() as usize, 4096));
        let transport = MemTransport::new(&MemFabric::new(), "d-r0").unwrap();
        let cfg = ConnectorConfig {
            engine_id: "d".into(),
            role: Role::Decode,
            mode: TransferMode::Pull,
            model: "m".into(),
            dtype: "bf16".into(),
            side_channel_bind: "127.0.0.1:0".parse().unwrap(),
            advertise_host: "127.0.0.1".into(),
            producer: Default::default(),
            consumer: Default::default(),
        };
        let ranks = vec![RankMemory {
            layout,
            regions: vec![(0, region)],
            transport,
        }];
        Connector::start(cfg, ranks, &mut Registry::default()).unwrap()
    }

    /// A connect attempt that fails after the peer was retried says nothing about the retry:
    /// only the latest attempt's failure fails the peer (and every request waiting on it).
    #[test]
    fn only_the_latest_connect_attempts_failure_fails_the_peer() {
        let c = decode_connector();
        // P is named by a request; the attempt is numbered as the driver starts it. (Port 9 on
        // loopback: nothing listens, so the real attempt fails fast, and its failure is the
        // latest one's, which must count.)
        let peer = {
            let mut inner = c.inner.lock();
            let peer = inner.peer_for("p", "127.0.0.1:9".into());
            c.connect(&mut inner, peer);
            peer
        };
        let state = |c: &Connector| c.inner.lock().peers.by_id[&peer].state.clone();
        let attempt = |c: &Connector| c.inner.lock().peers.by_id[&peer].attempt;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !matches!(state(&c), PeerState::Failed(_)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(matches!(state(&c), PeerState::Failed(_)), "{:?}", state(&c));
        let first = attempt(&c);
        // A new request retries P; while that attempt runs, the first one's failure (as if it
        // had taken seconds to time out) arrives again: stale, ignored.
        {
            let mut inner = c.inner.lock();
            inner.peer_for("p", "127.0.0.1:9".into());
            let p = inner.peers.by_id.get_mut(&peer).unwrap();
            p.attempt = first + 1;
            p.state = PeerState::Connecting { started: true };
        }
        c.on_side_event(SideEvent::ConnectFailed {
            engine: "p".into(),
            attempt: first,
            error: "timed out".into(),
        });
        assert_eq!(state(&c), PeerState::Connecting { started: true });
        assert_eq!(c.inner.lock().refusals.get(&peer), None);
        // The latest attempt's own failure does fail the peer, with its reason.
        c.on_side_event(SideEvent::ConnectFailed {
            engine: "p".into(),
            attempt: first + 1,
            error: "refused".into(),
        });
        assert_eq!(state(&c), PeerState::Failed("refused".into()));
        c.shutdown();
    }
}
