//! The peer table: every other engine this one talks to, by engine id, side-channel connection
//! and transport agent. Numbered with the ledgers' [`PeerId`]s.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use handoff_ledger::{PeerId, Time};
use handoff_plan::RankLayout;
use handoff_proto::Message;

use super::HandshakeRefusal;

/// A side-channel connection, as the executor numbers it.
pub type ConnId = u64;

/// Control messages kept for a peer while its connection is being set up; the oldest are
/// dropped past it (every message is idempotent or retried by its ledger: rule 7).
pub(crate) const MAX_QUEUED: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerState {
    /// Known (named by a request) but not dialled yet.
    Idle,
    /// A connect attempt is under way.
    Connecting,
    Ready,
    /// Refused or unreachable; the reason is what its requests fail with.
    Failed(String),
    /// Its connection closed: the peer is dead until a request names it again.
    Closed,
}

#[derive(Debug)]
pub(crate) struct Peer {
    pub engine: String,
    /// Where to dial it (D: from P's `kv_transfer_params`); `None` for a peer that dialled us.
    pub addr: Option<String>,
    pub conn: Option<ConnId>,
    pub state: PeerState,
    pub layouts: Vec<RankLayout>,
    pub agents: Vec<String>,
    pub queued: VecDeque<Message>,
    /// Number of the latest connect attempt; an outcome of an older one is stale.
    pub attempt: u64,
    /// The protocol version its connection speaks (its hello's): the notifications that ride
    /// on transfers to it are encoded in it too.
    pub version: u8,
}

impl Peer {
    pub fn is_down(&self) -> bool {
        matches!(self.state, PeerState::Closed | PeerState::Failed(_))
    }
}

/// Refused connections kept open at once, at most: a storm of refused handshakes closes the
/// rest at once (their Ds' requests recompute anyway; their blocks wait for their leases).
pub(crate) const MAX_REFUSED: usize = 256;

#[derive(Default, Debug)]
pub(crate) struct PeerTable {
    // Ordered where iterated (forgetting peers, closing connections): deterministic output.
    by_id: BTreeMap<PeerId, Peer>,
    by_engine: HashMap<String, PeerId>,
    by_conn: BTreeMap<ConnId, PeerId>,
    by_agent: HashMap<String, PeerId>,
    /// Connections that sent no handshake (a proxy's release).
    anonymous: BTreeSet<ConnId>,
    /// Connections whose hello was refused, open until the deadline for their peer's releases.
    refused: BTreeMap<ConnId, Time>,
    next: u32,
    attempts: u64,
}

impl PeerTable {
    pub fn get(&self, id: PeerId) -> Option<&Peer> {
        self.by_id.get(&id)
    }

    pub fn get_mut(&mut self, id: PeerId) -> Option<&mut Peer> {
        self.by_id.get_mut(&id)
    }

    pub fn by_engine(&self, engine: &str) -> Option<PeerId> {
        self.by_engine.get(engine).copied()
    }

    pub fn by_conn(&self, conn: ConnId) -> Option<PeerId> {
        self.by_conn.get(&conn).copied()
    }

    pub fn by_agent(&self, agent: &str) -> Option<PeerId> {
        self.by_agent.get(agent).copied()
    }

    pub fn engines(&self) -> impl Iterator<Item = (&str, PeerId)> {
        self.by_engine.iter().map(|(e, p)| (e.as_str(), *p))
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The peer for `engine`, created if new.
    pub fn peer_for(&mut self, engine: &str) -> PeerId {
        if let Some(&id) = self.by_engine.get(engine) {
            return id;
        }
        self.next += 1;
        let id = PeerId(self.next);
        self.by_engine.insert(engine.to_string(), id);
        self.by_id.insert(
            id,
            Peer {
                engine: engine.to_string(),
                addr: None,
                conn: None,
                state: PeerState::Idle,
                layouts: vec![],
                agents: vec![],
                queued: VecDeque::new(),
                attempt: 0,
                version: handoff_proto::PROTOCOL_VERSION,
            },
        );
        id
    }

    /// Numbers a new connect attempt to `id`.
    pub fn start_attempt(&mut self, id: PeerId) -> Option<u64> {
        let p = self.by_id.get_mut(&id)?;
        self.attempts += 1;
        p.attempt = self.attempts;
        p.state = PeerState::Connecting;
        Some(self.attempts)
    }

    /// Binds `conn` to `id`; returns the connection it replaces, if any.
    pub fn bind_conn(&mut self, id: PeerId, conn: ConnId) -> Option<ConnId> {
        let p = self.by_id.get_mut(&id)?;
        let old = p.conn.replace(conn);
        if let Some(old) = old {
            self.by_conn.remove(&old);
        }
        self.by_conn.insert(conn, id);
        old.filter(|o| *o != conn)
    }

    /// Drops the peer's connection; returns it.
    pub fn unbind_conn(&mut self, id: PeerId) -> Option<ConnId> {
        let conn = self.by_id.get_mut(&id)?.conn.take()?;
        self.by_conn.remove(&conn);
        Some(conn)
    }

    /// Forgets a connection that closed; returns its peer when it was that peer's current one.
    pub fn conn_closed(&mut self, conn: ConnId) -> Option<PeerId> {
        self.anonymous.remove(&conn);
        self.refused.remove(&conn);
        let id = self.by_conn.remove(&conn)?;
        let p = self.by_id.get_mut(&id)?;
        if p.conn == Some(conn) {
            p.conn = None;
            Some(id)
        } else {
            None
        }
    }

    /// Records the peer's agents. Refuses a name another peer holds: a peer cannot take over
    /// another engine's agent (and with it, its notifications and dead-peer reports).
    pub fn set_agents(&mut self, id: PeerId, agents: Vec<String>) -> Result<(), HandshakeRefusal> {
        for a in &agents {
            if let Some(owner) = self.by_agent.get(a) {
                if *owner != id {
                    return Err(HandshakeRefusal::AgentTaken(a.clone()));
                }
            }
        }
        let Some(p) = self.by_id.get_mut(&id) else {
            return Err(HandshakeRefusal::UnknownPeer);
        };
        for old in p.agents.drain(..) {
            self.by_agent.remove(&old);
        }
        for a in &agents {
            self.by_agent.insert(a.clone(), id);
        }
        p.agents = agents;
        Ok(())
    }

    /// Peers that may be forgotten: down (closed or failed) with no connection.
    pub fn forgettable(&self) -> Vec<PeerId> {
        self.by_id
            .iter()
            .filter(|(_, p)| p.is_down() && p.conn.is_none())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Forgets a peer entirely; returns its agents.
    pub fn remove(&mut self, id: PeerId) -> Vec<String> {
        let Some(p) = self.by_id.remove(&id) else {
            return Vec::new();
        };
        self.by_engine.remove(&p.engine);
        if let Some(c) = p.conn {
            self.by_conn.remove(&c);
        }
        for a in &p.agents {
            self.by_agent.remove(a);
        }
        p.agents
    }

    pub fn mark_anonymous(&mut self, conn: ConnId) {
        self.anonymous.insert(conn);
    }

    pub fn is_anonymous(&self, conn: ConnId) -> bool {
        self.anonymous.contains(&conn)
    }

    /// Keeps `conn`, whose hello was refused, open until `until`; false (close it now) when
    /// [`MAX_REFUSED`] are open already.
    pub fn linger_refused(&mut self, conn: ConnId, until: Time) -> bool {
        if self.refused.len() >= MAX_REFUSED {
            return false;
        }
        self.refused.insert(conn, until);
        true
    }

    pub fn is_refused(&self, conn: ConnId) -> bool {
        self.refused.contains_key(&conn)
    }

    /// The earliest end of a refused connection's linger.
    pub fn next_refused_deadline(&self) -> Option<Time> {
        self.refused.values().min().copied()
    }

    /// Forgets the refused connections whose linger ended by `now`; returns them (to close).
    pub fn expire_refused(&mut self, now: Time) -> Vec<ConnId> {
        let due: Vec<ConnId> = self
            .refused
            .iter()
            .filter(|(_, &until)| until <= now)
            .map(|(&c, _)| c)
            .collect();
        for c in &due {
            self.refused.remove(c);
        }
        due
    }

    /// Peers whose connection is gone (their blocks are reclaimable at once).
    pub fn down(&self) -> Vec<PeerId> {
        self.by_id
            .iter()
            .filter(|(_, p)| p.is_down())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Every connection, for shutdown.
    pub fn all_conns(&self) -> Vec<ConnId> {
        self.by_conn
            .keys()
            .chain(self.anonymous.iter())
            .chain(self.refused.keys())
            .copied()
            .collect()
    }
}
