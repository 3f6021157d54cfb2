//! The core's side of the side channel: handshakes, routing control messages to and from the
//! ledgers, connection outcomes and dead peers.

use handoff_ledger::{PeerId, Time};
use handoff_plan::{KvGroups, RankLayout};
use handoff_proto::{versions, Fingerprint, Hello, HelloReply, MemoryKind, Message, TransferMode};

use super::peers::{ConnId, PeerState, MAX_QUEUED};
use super::{Connect, ConnectorCore, CoreConfig, HandshakeRefusal, Observation};
use crate::worker_protocol::{WorkerHello, WorkerOp};
use crate::{CoreError, Role};

/// One agent of a peer as its hello announces it: name and transport metadata.
type AgentInfo = (String, Vec<u8>);

/// What a peer's hello said, checked: its layouts, its agents, and the protocol version its
/// connection speaks.
type CheckedHello = (Vec<RankLayout>, Vec<AgentInfo>, u8);

/// How long a connection whose hello we refused stays open for the releases its peer sends
/// (a D sends them at once, on the reply).
pub(super) const REFUSED_LINGER: Time = Time::from_secs(2);

/// The hello's `layout` bytes: every rank's layout and, for a model whose layers are kept in
/// several KV cache groups, the groups after them. A peer of a build before groups reads the
/// layouts and nothing after them (postcard stops at the value's end); such a peer keeps one
/// group, and the side that knows groups refuses the pair ([`KvGroups::check_pair`]).
fn layout_bytes(layouts: &[RankLayout], groups: &KvGroups) -> Result<Vec<u8>, CoreError> {
    let mut out = postcard::to_allocvec(layouts).map_err(CoreError::Encode)?;
    if !groups.is_single() {
        out.extend(postcard::to_allocvec(groups).map_err(CoreError::Encode)?);
    }
    Ok(out)
}

/// A peer's `layout` bytes: its layouts and groups (one group when none follow).
fn read_layout_bytes(bytes: &[u8]) -> Result<(Vec<RankLayout>, KvGroups), postcard::Error> {
    let (layouts, rest) = postcard::take_from_bytes::<Vec<RankLayout>>(bytes)?;
    if rest.is_empty() {
        return Ok((layouts, KvGroups::single()));
    }
    let (groups, rest) = postcard::take_from_bytes::<KvGroups>(rest)?;
    if !rest.is_empty() {
        return Err(postcard::Error::DeserializeBadEncoding);
    }
    Ok((layouts, groups))
}

/// This engine's hello: identity, fingerprint, every rank's layout and agent.
pub(super) fn own_hello(
    cfg: &CoreConfig,
    fingerprint: &Fingerprint,
    ranks: &[WorkerHello],
) -> Result<Hello, CoreError> {
    let layouts: Vec<RankLayout> = ranks.iter().map(|r| r.layout.clone()).collect();
    let groups = ranks.first().map(|r| r.groups.clone()).unwrap_or_default();
    let agents: Vec<AgentInfo> = ranks
        .iter()
        .map(|r| (r.agent.clone(), r.metadata.clone()))
        .collect();
    Ok(Hello {
        engine_id: cfg.engine_id.clone(),
        rank: 0,
        tp: ranks.len() as u16,
        fingerprint: fingerprint.clone(),
        layout: layout_bytes(&layouts, &groups)?,
        agent_metadata: postcard::to_allocvec(&agents).map_err(CoreError::Encode)?,
        memory: ranks.iter().map(|r| r.memory).collect(),
    })
}

impl ConnectorCore {
    /// Checks a peer's hello; returns its layouts, agents and protocol version.
    fn check_hello(&self, h: &Hello) -> Result<CheckedHello, HandshakeRefusal> {
        if let Some(why) = self.fingerprint.mismatch(&h.fingerprint) {
            return Err(HandshakeRefusal::Fingerprint(why));
        }
        // The mismatch check kept the version to one this engine speaks.
        let version = u8::try_from(h.fingerprint.protocol_version).unwrap_or(u8::MAX);
        let described = |m: &&MemoryKind| versions::describes(version, **m);
        if let Some(&memory) = self.hello.memory.iter().find(|m| !described(m)) {
            return Err(HandshakeRefusal::CannotDescribe { version, memory });
        }
        if h.engine_id == self.cfg.engine_id {
            return Err(HandshakeRefusal::OwnEngineId(h.engine_id.clone()));
        }
        let undecodable = |what| {
            move |e: postcard::Error| HandshakeRefusal::Undecodable {
                what,
                error: e.to_string(),
            }
        };
        let (layouts, groups) = read_layout_bytes(&h.layout).map_err(undecodable("layout"))?;
        let agents: Vec<AgentInfo> =
            postcard::from_bytes(&h.agent_metadata).map_err(undecodable("agent metadata"))?;
        if h.tp == 0
            || layouts.len() != h.tp as usize
            || agents.len() != h.tp as usize
            || h.memory.len() != h.tp as usize
        {
            return Err(HandshakeRefusal::RankCount {
                tp: h.tp,
                layouts: layouts.len(),
                agents: agents.len(),
                memory: h.memory.len(),
            });
        }
        for (rank, l) in layouts.iter().enumerate() {
            l.validate()
                .map_err(|error| HandshakeRefusal::RankLayout { rank, error })?;
            if l.rank as usize != rank || l.spec != layouts[0].spec {
                return Err(HandshakeRefusal::RankNamesAnother {
                    rank,
                    named: l.rank,
                });
            }
        }
        for (i, (a, _)) in agents.iter().enumerate() {
            if a.is_empty() || agents[..i].iter().any(|(b, _)| b == a) {
                return Err(HandshakeRefusal::AgentNames(a.clone()));
            }
        }
        // P's spec first: the check is directional only in its wording.
        let (p, d) = match self.cfg.role {
            Role::Decode => (&layouts[0].spec, &self.spec),
            _ => (&self.spec, &layouts[0].spec),
        };
        handoff_plan::check_compatible(p, d)?;
        groups
            .validate(layouts[0].spec.shape.num_layers)
            .map_err(HandshakeRefusal::BadGroups)?;
        let (p_groups, d_groups) = match self.cfg.role {
            Role::Decode => (&groups, &self.groups),
            _ => (&self.groups, &groups),
        };
        p_groups.check_pair(d_groups, p.block_size, d.block_size)?;
        if self.cfg.opaque_blocks && !p.opaque_pages_pair(d) {
            return Err(HandshakeRefusal::OpaqueBlocks {
                p: Box::new(*p),
                d: Box::new(*d),
            });
        }
        Ok((layouts, agents, version))
    }

    /// Makes `peer` ready on `conn` with what its hello said; every local worker loads its
    /// agents. Returns an error (and changes nothing) when its agent names belong to another
    /// engine.
    fn bind_peer(
        &mut self,
        peer: PeerId,
        conn: ConnId,
        (layouts, agents, version): CheckedHello,
    ) -> Result<(), HandshakeRefusal> {
        let names: Vec<String> = agents.iter().map(|(a, _)| a.clone()).collect();
        self.peers.set_agents(peer, names)?;
        if let Some(old) = self.peers.bind_conn(peer, conn) {
            self.out.closes.push(old);
        }
        if let Some(p) = self.peers.get_mut(peer) {
            p.layouts = layouts;
            p.state = PeerState::Ready;
            p.version = version;
        }
        for (agent, metadata) in agents {
            for rank in 0..self.ranks.len() as u16 {
                self.out.worker_ops.push((
                    rank,
                    WorkerOp::LoadRemote {
                        agent: agent.clone(),
                        metadata: metadata.clone(),
                    },
                ));
            }
        }
        Ok(())
    }

    /// Sends what was queued for `peer` while it connected.
    fn flush_queued(&mut self, peer: PeerId) {
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        let Some(conn) = p.conn else {
            return;
        };
        let queued: Vec<Message> = p.queued.drain(..).collect();
        for m in queued {
            if let Some(m) = self.gate(peer, m) {
                self.out.messages.push((conn, m));
            }
        }
    }

    /// Dials `peer` at `addr` unless it is connected or being connected. A peer that died or
    /// refused is dialled again: a new request names it, and P may have restarted.
    pub(super) fn dial_if_needed(&mut self, peer: PeerId, addr: String, _now: Time) {
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        match p.state {
            PeerState::Ready | PeerState::Connecting => return,
            PeerState::Idle | PeerState::Closed | PeerState::Failed(_) => {}
        }
        p.addr = Some(addr.clone());
        let engine = p.engine.clone();
        let Some(attempt) = self.peers.start_attempt(peer) else {
            return;
        };
        self.out.connects.push(Connect {
            engine,
            attempt,
            addr,
            hello: Message::Hello(self.hello.clone()),
        });
    }

    /// Sends a control message to a peer, or queues it until its connection is up.
    pub(super) fn send(&mut self, peer: PeerId, msg: Message) {
        if matches!(msg, Message::Heartbeat(_)) {
            self.out.observations.push(Observation::HeartbeatSent);
        }
        if let Message::GrantBatch(g) = &msg {
            if !g.gone.is_empty() {
                tracing::debug!(engine = %self.cfg.engine_id, ?peer, gone = ?g.gone, "handoffs this P no longer holds");
            }
        }
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        match (&p.state, p.conn) {
            (PeerState::Ready, Some(conn)) => {
                if let Some(msg) = self.gate(peer, msg) {
                    self.out.messages.push((conn, msg));
                }
            }
            (PeerState::Idle | PeerState::Connecting, _) => {
                if p.queued.len() >= MAX_QUEUED {
                    p.queued.pop_front();
                    self.out.observations.push(Observation::QueuedDropped);
                }
                p.queued.push_back(msg);
            }
            // The peer is dead and the ledgers know it: the message is moot.
            _ => {}
        }
    }

    /// A message from an authenticated peer goes to the ledger of the side it concerns.
    pub(super) fn deliver(&mut self, peer: PeerId, msg: Message, now: Time) {
        if matches!(msg, Message::Heartbeat(_)) {
            self.out.observations.push(Observation::HeartbeatReceived);
        }
        // A grant can make a push write possible: the writes of its handoffs go on at once.
        let granted: Vec<_> = match &msg {
            Message::GrantBatch(g) if self.producer.is_some() => {
                g.grants.iter().map(|g| g.handoff).collect()
            }
            _ => Vec::new(),
        };
        match msg {
            Message::PullDone(_)
            | Message::Release(_)
            | Message::PushRegister(_)
            | Message::PushCancel(_)
            | Message::BlocksQuery(_) => {
                if let Some(p) = self.producer.as_mut() {
                    p.handle_message(peer, msg, now);
                }
            }
            Message::PushDone(_)
            | Message::PushFailed(_)
            | Message::PushCancelAck(_)
            | Message::PullBlocks(_) => {
                if let Some(c) = self.consumer.as_mut() {
                    c.handle_message(peer, msg, now);
                }
            }
            // A heartbeat says whose blocks it keeps: a pull's are P's (the producer), a push's
            // are D's (the consumer). Both ledgers answer heartbeats and a consumer answers
            // "gone" for ids it does not know, so a pull heartbeat given to it would tell D its
            // P no longer held the handoff.
            Message::Heartbeat(hb) => match hb.mode {
                TransferMode::Pull => {
                    if let Some(p) = self.producer.as_mut() {
                        p.handle_message(peer, Message::Heartbeat(hb), now);
                    }
                }
                TransferMode::Push => {
                    if let Some(c) = self.consumer.as_mut() {
                        c.handle_message(peer, Message::Heartbeat(hb), now);
                    }
                }
            },
            // Grants go to both: each ledger applies only those of handoffs it tracks.
            Message::GrantBatch(_) => match (&mut self.producer, &mut self.consumer) {
                (Some(p), Some(c)) => {
                    p.handle_message(peer, msg.clone(), now);
                    c.handle_message(peer, msg, now);
                }
                (Some(p), None) => p.handle_message(peer, msg, now),
                (None, Some(c)) => c.handle_message(peer, msg, now),
                (None, None) => {}
            },
            // A handshake on an established connection: ignored.
            Message::Hello(_) | Message::HelloReply(_) => {}
        }
        for h in granted {
            self.advance_push(h, now);
            self.renew_held_writes(h, now);
        }
    }

    /// The first frame of a connection a peer opened to us. `proven`: the engine id the peer
    /// proved holding the cluster key (`None` when the cluster has no key); a hello under any
    /// other id is refused, so no one takes over another engine's name.
    pub(crate) fn handle_accepted(
        &mut self,
        conn: ConnId,
        msg: Message,
        proven: Option<&str>,
        now: Time,
    ) {
        match msg {
            Message::Hello(h) if proven.is_some_and(|p| p != h.engine_id) => {
                let named = h.engine_id.chars().take(64).collect::<String>();
                let reason = HandshakeRefusal::NotTheProvenEngine(named);
                self.refuse_impostor(conn, &h.engine_id, reason);
            }
            Message::Hello(h) => {
                match self.check_hello(&h) {
                    Ok(checked) => {
                        let peer = self.peer_named(&h.engine_id);
                        // Whatever this peer was before, it is the one on this connection now.
                        let was_down = self.peers.get(peer).is_some_and(|p| p.is_down());
                        match self.bind_peer(peer, conn, checked) {
                            Ok(()) => {
                                if let Some(p) = self.peers.get_mut(peer) {
                                    p.addr = None;
                                }
                                self.out.messages.push((
                                    conn,
                                    Message::HelloReply(HelloReply::Accepted(self.hello.clone())),
                                ));
                                self.flush_queued(peer);
                                if was_down {
                                    tracing::info!(peer = %h.engine_id, "peer is back");
                                }
                            }
                            Err(reason) => self.refuse_impostor(conn, &h.engine_id, reason),
                        }
                    }
                    Err(reason) => self.refuse_hello(conn, &h.engine_id, reason, now),
                }
            }
            other => {
                self.peers.mark_anonymous(conn);
                self.handle_anonymous(conn, other);
            }
        }
        self.pump(now);
    }

    /// Refuses a peer's hello. The connection stays open a little ([`REFUSED_LINGER`]) for
    /// the releases of the handoffs that peer came for (it cannot read them: without those, P
    /// would hold their blocks until their leases end); then, or at its first other frame, it
    /// closes.
    fn refuse_hello(&mut self, conn: ConnId, engine: &str, reason: HandshakeRefusal, now: Time) {
        self.send_refusal(conn, engine, reason);
        if !self.peers.linger_refused(conn, now + REFUSED_LINGER) {
            self.out.closes.push(conn);
        }
    }

    /// Refuses a hello that claims what is not its own (another engine's id or agent names):
    /// an impostor, heard no further.
    fn refuse_impostor(&mut self, conn: ConnId, engine: &str, reason: HandshakeRefusal) {
        self.send_refusal(conn, engine, reason);
        self.out.closes.push(conn);
    }

    fn send_refusal(&mut self, conn: ConnId, engine: &str, reason: HandshakeRefusal) {
        self.out.observations.push(Observation::HandshakeRefused);
        tracing::warn!(peer = %engine, kind = reason.kind(), %reason, "handshake refused");
        let reason = reason.to_string();
        self.out
            .messages
            .push((conn, Message::HelloReply(HelloReply::Refused { reason })));
    }

    /// A frame on a connection whose hello we refused: a release of a handoff this engine
    /// holds, from the D it was meant for, ends it as a proxy's release does (at once when no
    /// D reads it, else after the fence); anything else closes the connection.
    fn handle_refused_frame(&mut self, conn: ConnId, msg: Message, now: Time) {
        match (msg, self.producer.as_mut()) {
            (Message::Release(r), Some(p)) => {
                tracing::info!(handoff = %r.handoff, "released by a D whose handshake was refused");
                p.release_unclaimed(r, now);
            }
            (other, _) => {
                tracing::debug!(
                    conn,
                    kind = other.kind(),
                    "frame after a refused handshake: closed"
                );
                self.peers.conn_closed(conn);
                self.out.closes.push(conn);
            }
        }
    }

    /// Closes the refused connections whose linger has passed.
    pub(super) fn expire_refused(&mut self, now: Time) {
        for conn in self.peers.expire_refused(now) {
            self.out.closes.push(conn);
        }
    }

    /// A connection that never said hello is refused and closed: whatever it says, it is no
    /// peer, never a reader, and cannot release anything (the proxy releases through P's HTTP
    /// API, which calls [`ConnectorCore::release_from_proxy`]).
    fn handle_anonymous(&mut self, conn: ConnId, msg: Message) {
        tracing::debug!(
            conn,
            kind = msg.kind(),
            "message without a handshake refused"
        );
        self.out.observations.push(Observation::AnonymousRefused);
        self.out.closes.push(conn);
    }

    /// A frame on an established connection.
    pub(crate) fn handle_frame(&mut self, conn: ConnId, msg: Message, now: Time) {
        if self.peers.is_anonymous(conn) {
            self.handle_anonymous(conn, msg);
        } else if self.peers.is_refused(conn) {
            self.handle_refused_frame(conn, msg, now);
        } else if let Some(peer) = self.peers.by_conn(conn) {
            self.deliver(peer, msg, now);
        }
        self.pump(now);
    }

    /// Our connect attempt `attempt` to `engine` got `reply` on `conn`.
    pub(crate) fn handle_connected(
        &mut self,
        engine: &str,
        attempt: u64,
        conn: ConnId,
        reply: Message,
        now: Time,
    ) {
        let Some(peer) = self.peers.by_engine(engine) else {
            self.out.closes.push(conn);
            return;
        };
        // A success of an attempt older than the latest is still a working connection to that
        // engine: it is used like the latest's (closing it could make P, if it is P's newest,
        // take it for our death).
        if self.peers.get(peer).is_some_and(|p| p.attempt != attempt) {
            tracing::debug!(peer = %engine, attempt, "connected on an earlier attempt");
        }
        let outcome = match reply {
            Message::HelloReply(HelloReply::Accepted(h)) if h.engine_id != engine => {
                Err(HandshakeRefusal::AnsweredAs {
                    engine: engine.to_string(),
                    answered: h.engine_id.chars().take(64).collect(),
                })
            }
            Message::HelloReply(HelloReply::Accepted(h)) => self.check_hello(&h),
            Message::HelloReply(HelloReply::Refused { reason }) => {
                Err(HandshakeRefusal::RefusedByPeer(reason))
            }
            other => Err(HandshakeRefusal::UnexpectedReply(other.kind())),
        };
        let outcome = outcome.and_then(|checked| self.bind_peer(peer, conn, checked));
        match outcome {
            Ok(()) => self.flush_queued(peer),
            Err(reason) => {
                // P holds the prompts we came for until their leases end unless told: the
                // releases go on this connection before it closes (a P that refused us reads
                // them there; one we refused has us as a peer already).
                let releases = self
                    .consumer
                    .as_mut()
                    .map(|c| c.handle_peer_refused(peer, now))
                    .unwrap_or_default();
                for r in releases {
                    self.out.messages.push((conn, Message::Release(r)));
                }
                self.out.closes.push(conn);
                self.out.observations.push(Observation::HandshakeRefused);
                tracing::warn!(peer = %engine, kind = reason.kind(), %reason, "handshake with P failed");
                self.fail_peer(peer, reason.to_string(), now);
            }
        }
        self.pump(now);
    }

    /// Connect attempt `attempt` to `engine` failed.
    pub(crate) fn handle_connect_failed(
        &mut self,
        engine: &str,
        attempt: u64,
        error: String,
        now: Time,
    ) {
        let Some(peer) = self.peers.by_engine(engine) else {
            return;
        };
        // Only the latest attempt's failure says anything about the peer: an older one (a
        // connect that timed out after the peer was found dead and retried) must not fail the
        // requests that wait on the newer attempt, or one that succeeded.
        let latest = self.peers.get(peer).map(|p| p.attempt);
        if latest != Some(attempt) {
            tracing::debug!(peer = %engine, attempt, ?latest, %error, "stale connect failure ignored");
            return;
        }
        tracing::warn!(peer = %engine, %error, "cannot reach P");
        self.fail_peer(peer, error, now);
        self.pump(now);
    }

    /// A connection closed or broke. The peer's current one: the peer is dead.
    pub(crate) fn handle_closed(&mut self, conn: ConnId, now: Time) {
        if let Some(peer) = self.peers.conn_closed(conn) {
            tracing::info!(?peer, "side channel closed: peer dead");
            self.peer_dead(peer, now);
        }
        self.pump(now);
    }

    /// The peer is gone: both ledgers end what it held at once (rules 5 and 6).
    pub(super) fn peer_dead(&mut self, peer: PeerId, now: Time) {
        if let Some(p) = self.producer.as_mut() {
            p.handle_peer_dead(peer, now);
        }
        if let Some(c) = self.consumer.as_mut() {
            c.handle_peer_dead(peer, now);
        }
        if let Some(conn) = self.peers.unbind_conn(peer) {
            self.out.closes.push(conn);
        }
        if let Some(p) = self.peers.get_mut(peer) {
            if !matches!(p.state, PeerState::Failed(_)) {
                p.state = PeerState::Closed;
            }
            p.queued.clear();
        }
    }

    /// The peer refused us or cannot be reached: dead, and its requests fail with `reason`.
    pub(super) fn fail_peer(&mut self, peer: PeerId, reason: String, now: Time) {
        if let Some(p) = self.peers.get_mut(peer) {
            p.state = PeerState::Failed(reason.clone());
        }
        self.peer_dead(peer, now);
        // The outcomes this produced are this peer's: they carry the reason.
        self.take_outcomes(Some(&reason), now);
    }

    /// Closes every connection (shutdown).
    pub(crate) fn close_all(&mut self) {
        for conn in self.peers.all_conns() {
            self.out.closes.push(conn);
        }
    }
}
