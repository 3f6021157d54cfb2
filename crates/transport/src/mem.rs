//! In-process, deterministic backend for connector tests: transfers copy at `post` time, a
//! notification is queued at the peer right after its bytes, and a peer dies when the test says
//! so ([`MemFabric::kill`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::{
    check_bounds, KvRegion, Notification, RegionId, Transport, TransportError, XferDesc, XferId,
    XferOp, XferStatus, MAX_NOTIFICATION_BYTES,
};

const MAGIC: &[u8; 4] = b"HMM1";

/// The "network" the mem agents of one test share.
#[derive(Default)]
pub struct MemFabric {
    agents: Mutex<HashMap<String, Weak<MemTransport>>>,
}

impl MemFabric {
    pub fn new() -> Arc<Self> {
        Arc::new(MemFabric::default())
    }

    /// Kills agent `name`: its peers see it dead, and it neither sends nor receives any more.
    pub fn kill(&self, name: &str) {
        let agent = self.agents.lock().remove(name);
        if let Some(agent) = agent.and_then(|w| w.upgrade()) {
            agent.state.lock().dead_self = true;
        }
        for weak in self.agents.lock().values() {
            if let Some(peer) = weak.upgrade() {
                let mut st = peer.state.lock();
                if st.peers.contains_key(name) {
                    st.dead.push_back(name.to_string());
                    st.peers.remove(name);
                }
            }
        }
    }

    fn get(&self, name: &str) -> Option<Arc<MemTransport>> {
        self.agents.lock().get(name).and_then(Weak::upgrade)
    }
}

#[derive(Default)]
struct State {
    regions: HashMap<RegionId, Arc<KvRegion>>,
    /// Peers loaded, with the region lengths they advertised.
    peers: HashMap<String, HashMap<RegionId, u64>>,
    xfers: HashMap<XferId, XferStatus>,
    next_xfer: u64,
    notifications: VecDeque<Notification>,
    dead: VecDeque<String>,
    dead_self: bool,
}

pub struct MemTransport {
    name: String,
    fabric: Arc<MemFabric>,
    state: Mutex<State>,
}

impl MemTransport {
    /// A new agent `name` on `fabric`. Refused while another live agent of the fabric has that
    /// name (its peers would silently start talking to this one); free again once that agent
    /// is dropped or killed.
    pub fn new(fabric: &Arc<MemFabric>, name: &str) -> Result<Arc<Self>, TransportError> {
        let mut agents = fabric.agents.lock();
        if agents.get(name).and_then(Weak::upgrade).is_some() {
            return Err(TransportError::Io(format!(
                "a live mem agent is already named {name:?} on this fabric"
            )));
        }
        let t = Arc::new(MemTransport {
            name: name.to_string(),
            fabric: fabric.clone(),
            state: Mutex::new(State::default()),
        });
        agents.insert(name.to_string(), Arc::downgrade(&t));
        Ok(t)
    }

    fn peer(&self, peer: &str) -> Result<Arc<MemTransport>, TransportError> {
        let st = self.state.lock();
        if st.dead_self {
            return Err(TransportError::Io("this agent was killed".into()));
        }
        if !st.peers.contains_key(peer) {
            return Err(if st.dead.iter().any(|d| d == peer) {
                TransportError::PeerDead(peer.into())
            } else {
                TransportError::UnknownPeer(peer.into())
            });
        }
        drop(st);
        self.fabric
            .get(peer)
            .ok_or_else(|| TransportError::PeerDead(peer.into()))
    }

    fn deliver(&self, from: &str, msg: &[u8]) {
        let mut st = self.state.lock();
        if !st.dead_self {
            st.notifications.push_back(Notification {
                from: from.to_string(),
                msg: msg.to_vec(),
            });
        }
    }
}

impl Transport for MemTransport {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        "mem"
    }

    fn register(&self, id: RegionId, region: Arc<KvRegion>) -> Result<(), TransportError> {
        let mut st = self.state.lock();
        if st.regions.contains_key(&id) {
            return Err(TransportError::AlreadyRegistered(id));
        }
        st.regions.insert(id, region);
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        self.state
            .lock()
            .regions
            .remove(&id)
            .map(|_| ())
            .ok_or(TransportError::UnknownRegion { region: id })
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let st = self.state.lock();
        let mut regions: Vec<(RegionId, u64)> = st
            .regions
            .iter()
            .map(|(id, r)| (*id, r.len() as u64))
            .collect();
        regions.sort_unstable();
        postcard::to_extend(&(self.name.as_str(), regions), MAGIC.to_vec())
            .map_err(|e| TransportError::BadMetadata(e.to_string()))
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        let body = metadata
            .strip_prefix(MAGIC)
            .ok_or_else(|| TransportError::BadMetadata("not mem metadata".into()))?;
        let (name, regions): (String, Vec<(RegionId, u64)>) =
            postcard::from_bytes(body).map_err(|e| TransportError::BadMetadata(e.to_string()))?;
        self.state
            .lock()
            .peers
            .insert(name.clone(), regions.into_iter().collect());
        Ok(name)
    }

    fn forget_remote(&self, peer: &str) {
        self.state.lock().peers.remove(peer);
    }

    fn post(
        &self,
        op: XferOp,
        peer: &str,
        descs: &[XferDesc],
        notification: Option<&[u8]>,
    ) -> Result<XferId, TransportError> {
        if let Some(n) = notification {
            if n.len() > MAX_NOTIFICATION_BYTES {
                return Err(TransportError::NotificationTooLarge {
                    len: n.len(),
                    max: MAX_NOTIFICATION_BYTES,
                });
            }
        }
        let remote = self.peer(peer)?;
        // Check everything before moving a byte: a refused transfer changes nothing.
        let local_regions = self.state.lock().regions.clone();
        let remote_regions = remote.state.lock().regions.clone();
        let mut plan = Vec::with_capacity(descs.len());
        for d in descs {
            let l = local_regions
                .get(&d.local_region)
                .ok_or(TransportError::UnknownRegion {
                    region: d.local_region,
                })?;
            check_bounds(d.local_region, d.local_offset, d.len, l.len() as u64)?;
            // The peer refuses what it did not register, whatever our copy of its metadata says.
            let r = remote_regions
                .get(&d.remote_region)
                .ok_or(TransportError::UnknownRegion {
                    region: d.remote_region,
                })?;
            check_bounds(d.remote_region, d.remote_offset, d.len, r.len() as u64)?;
            plan.push((l.clone(), r.clone(), *d));
        }
        for (l, r, d) in plan {
            let (lo, ro, n) = (
                d.local_offset as usize,
                d.remote_offset as usize,
                d.len as usize,
            );
            match op {
                XferOp::Read => l.copy_from(lo, &r, ro, n)?,
                XferOp::Write => r.copy_from(ro, &l, lo, n)?,
            }
        }
        if let Some(n) = notification {
            remote.deliver(&self.name, n);
        }
        let mut st = self.state.lock();
        st.next_xfer += 1;
        let id = XferId(st.next_xfer);
        st.xfers.insert(id, XferStatus::Done);
        Ok(id)
    }

    fn status(&self, id: XferId) -> Result<XferStatus, TransportError> {
        self.state
            .lock()
            .xfers
            .get(&id)
            .cloned()
            .ok_or(TransportError::UnknownXfer(id))
    }

    fn release(&self, id: XferId) -> Result<(), TransportError> {
        self.state
            .lock()
            .xfers
            .remove(&id)
            .map(|_| ())
            .ok_or(TransportError::UnknownXfer(id))
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        if msg.len() > MAX_NOTIFICATION_BYTES {
            return Err(TransportError::NotificationTooLarge {
                len: msg.len(),
                max: MAX_NOTIFICATION_BYTES,
            });
        }
        self.peer(peer)?.deliver(&self.name, msg);
        Ok(())
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        self.state.lock().notifications.drain(..).collect()
    }

    fn drain_dead_peers(&self) -> Vec<String> {
        self.state.lock().dead.drain(..).collect()
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        let mut agents = self.fabric.agents.lock();
        if agents
            .get(&self.name)
            .is_some_and(|w| w.strong_count() == 0)
        {
            agents.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_in_use_is_refused_until_its_agent_is_gone() {
        let fabric = MemFabric::new();
        let first = MemTransport::new(&fabric, "p").unwrap();
        let peer = MemTransport::new(&fabric, "d").unwrap();
        peer.load_remote(&first.local_metadata().unwrap()).unwrap();
        assert!(MemTransport::new(&fabric, "p").is_err());
        // The refused twin changed nothing: the peer still reaches the first agent.
        peer.send_notification("p", b"still you").unwrap();
        let got = first.drain_notifications();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].msg, b"still you");
        // Dropped, or killed: the name is free for a new life.
        drop(first);
        let second = MemTransport::new(&fabric, "p").unwrap();
        fabric.kill("p");
        assert!(MemTransport::new(&fabric, "p").is_ok());
        drop(second);
    }
}
