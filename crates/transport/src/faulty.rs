//! A fault-injecting wrapper over any backend. From a seed it drops, duplicates, delays and
//! reorders notifications, fails transfers and kills peers, and records every fault it injected
//! so that an end-to-end failure can be replayed with the same seed.
//!
//! Faults apply to what *this* agent sends: notifications (standalone or attached to a transfer)
//! and transfers. A delayed notification is held back and sent after a number of later calls
//! into the agent (any method), which also reorders it behind newer ones.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::{
    KvRegion, Notification, RegionId, Transport, TransportError, XferDesc, XferId, XferOp,
    XferStatus,
};

/// What to inject, in percent per event.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    pub seed: u64,
    pub drop_notification_pct: u8,
    pub duplicate_notification_pct: u8,
    pub delay_notification_pct: u8,
    /// A delayed notification is sent after this many later calls (at most).
    pub max_delay_calls: u32,
    pub fail_transfer_pct: u8,
    /// READs that land with one byte of their first destination changed (a transfer that
    /// damaged what it moved, reported done): what a KV digest check must catch.
    pub corrupt_read_pct: u8,
    /// A released transfer is said to be still running for this many
    /// [`Transport::still_running`] questions (a NIXL transfer the backend cannot stop at once).
    pub linger_released: u32,
}

/// One injected fault, for the replay log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    DroppedNotification {
        peer: String,
        len: usize,
    },
    DuplicatedNotification {
        peer: String,
        len: usize,
    },
    DelayedNotification {
        peer: String,
        len: usize,
        calls: u32,
    },
    FailedTransfer {
        peer: String,
        id: XferId,
    },
    CorruptedRead {
        peer: String,
        id: XferId,
    },
    KilledPeer {
        peer: String,
    },
}

struct Held {
    peer: String,
    msg: Vec<u8>,
    after_calls: u32,
}

struct State {
    rng: u64,
    held: VecDeque<Held>,
    failed: HashSet<XferId>,
    /// READs to damage when they report done: the byte to flip.
    corrupt: HashMap<XferId, (RegionId, u64)>,
    /// Released transfers still said to run: questions left.
    lingering: HashMap<XferId, u32>,
    regions: HashMap<RegionId, Arc<KvRegion>>,
    next_failed: u64,
    killed: HashSet<String>,
    dead_reported: VecDeque<String>,
    log: Vec<Fault>,
}

pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    plan: FaultPlan,
    /// `plan.corrupt_read_pct`, changeable while running ([`Self::set_corrupt_read_pct`]).
    corrupt_read_pct: AtomicU8,
    state: Mutex<State>,
}

impl FaultyTransport {
    pub fn new(inner: Arc<dyn Transport>, plan: FaultPlan) -> Arc<Self> {
        Arc::new(FaultyTransport {
            inner,
            state: Mutex::new(State {
                rng: plan.seed | 1,
                held: VecDeque::new(),
                failed: HashSet::new(),
                corrupt: HashMap::new(),
                lingering: HashMap::new(),
                regions: HashMap::new(),
                next_failed: u64::MAX / 2,
                killed: HashSet::new(),
                dead_reported: VecDeque::new(),
                log: Vec::new(),
            }),
            corrupt_read_pct: AtomicU8::new(plan.corrupt_read_pct),
            plan,
        })
    }

    /// From now on, this share of READs lands damaged (a test switches damage on and off
    /// between requests).
    pub fn set_corrupt_read_pct(&self, pct: u8) {
        self.corrupt_read_pct.store(pct.min(100), Ordering::Relaxed);
    }

    /// Cuts `peer` off: nothing more is sent to or accepted from it, and it is reported dead.
    pub fn kill_peer(&self, peer: &str) {
        let mut st = self.state.lock();
        if st.killed.insert(peer.to_string()) {
            st.dead_reported.push_back(peer.to_string());
            st.log.push(Fault::KilledPeer { peer: peer.into() });
        }
    }

    /// Every fault injected so far, in order.
    pub fn faults(&self) -> Vec<Fault> {
        self.state.lock().log.clone()
    }

    /// Sends every held notification now (end of a test, or a healed network).
    pub fn flush(&self) {
        let held: Vec<Held> = self.state.lock().held.drain(..).collect();
        for h in held {
            let _ = self.inner.send_notification(&h.peer, &h.msg);
        }
    }

    fn roll(st: &mut State, pct: u8) -> bool {
        st.rng ^= st.rng >> 12;
        st.rng ^= st.rng << 25;
        st.rng ^= st.rng >> 27;
        (st.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % 100) < pct as u64
    }

    fn below(st: &mut State, n: u32) -> u32 {
        st.rng ^= st.rng >> 12;
        st.rng ^= st.rng << 25;
        st.rng ^= st.rng >> 27;
        (st.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1) as u64) as u32
    }

    /// Sends held notifications whose time has come; called on every entry into the agent.
    fn tick(&self) {
        let due: Vec<Held> = {
            let mut st = self.state.lock();
            for h in st.held.iter_mut() {
                h.after_calls = h.after_calls.saturating_sub(1);
            }
            let (due, keep): (Vec<Held>, Vec<Held>) =
                st.held.drain(..).partition(|h| h.after_calls == 0);
            st.held = keep.into();
            due
        };
        for h in due {
            let _ = self.inner.send_notification(&h.peer, &h.msg);
        }
    }

    /// Decides the fate of one outgoing notification: `Some(copies)` to send now, `None` when
    /// dropped or held.
    fn fate(&self, peer: &str, msg: &[u8]) -> Option<u32> {
        let mut st = self.state.lock();
        let p = &self.plan;
        if Self::roll(&mut st, p.drop_notification_pct) {
            st.log.push(Fault::DroppedNotification {
                peer: peer.into(),
                len: msg.len(),
            });
            return None;
        }
        if Self::roll(&mut st, p.delay_notification_pct) {
            let calls = 1 + Self::below(&mut st, p.max_delay_calls.max(1));
            st.log.push(Fault::DelayedNotification {
                peer: peer.into(),
                len: msg.len(),
                calls,
            });
            st.held.push_back(Held {
                peer: peer.into(),
                msg: msg.to_vec(),
                after_calls: calls,
            });
            return None;
        }
        if Self::roll(&mut st, p.duplicate_notification_pct) {
            st.log.push(Fault::DuplicatedNotification {
                peer: peer.into(),
                len: msg.len(),
            });
            return Some(2);
        }
        Some(1)
    }

    fn is_killed(&self, peer: &str) -> bool {
        self.state.lock().killed.contains(peer)
    }
}

impl Transport for FaultyTransport {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn register(&self, id: RegionId, region: Arc<KvRegion>) -> Result<(), TransportError> {
        self.state.lock().regions.insert(id, region.clone());
        self.inner.register(id, region)
    }

    fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        self.state.lock().regions.remove(&id);
        self.inner.deregister(id)
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.inner.local_metadata()
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        self.inner.load_remote(metadata)
    }

    fn forget_remote(&self, peer: &str) {
        self.inner.forget_remote(peer)
    }

    fn post(
        &self,
        op: XferOp,
        peer: &str,
        descs: &[XferDesc],
        notification: Option<&[u8]>,
    ) -> Result<XferId, TransportError> {
        self.tick();
        if self.is_killed(peer) {
            return Err(TransportError::PeerDead(peer.into()));
        }
        {
            let mut st = self.state.lock();
            if Self::roll(&mut st, self.plan.fail_transfer_pct) {
                st.next_failed += 1;
                let id = XferId(st.next_failed);
                st.failed.insert(id);
                st.log.push(Fault::FailedTransfer {
                    peer: peer.into(),
                    id,
                });
                // Nothing was moved and no notification leaves: a failed transfer.
                return Ok(id);
            }
        }
        let id = match notification {
            None => self.inner.post(op, peer, descs, None)?,
            Some(n) => match self.fate(peer, n) {
                Some(copies) => {
                    let id = self.inner.post(op, peer, descs, Some(n))?;
                    for _ in 1..copies {
                        let _ = self.inner.send_notification(peer, n);
                    }
                    id
                }
                // Dropped or held: the bytes still move; the held copy is sent later.
                None => self.inner.post(op, peer, descs, None)?,
            },
        };
        if let (XferOp::Read, Some(first)) = (op, descs.first()) {
            let mut st = self.state.lock();
            if Self::roll(&mut st, self.corrupt_read_pct.load(Ordering::Relaxed)) {
                let at = first.local_offset + first.len / 2;
                st.corrupt.insert(id, (first.local_region, at));
                st.log.push(Fault::CorruptedRead {
                    peer: peer.into(),
                    id,
                });
            }
        }
        Ok(id)
    }

    fn status(&self, id: XferId) -> Result<XferStatus, TransportError> {
        self.tick();
        if self.state.lock().failed.contains(&id) {
            return Ok(XferStatus::Failed("injected failure".into()));
        }
        let status = self.inner.status(id)?;
        if status == XferStatus::Done {
            let mut st = self.state.lock();
            if let Some((region, at)) = st.corrupt.remove(&id) {
                if let Some(r) = st.regions.get(&region) {
                    let mut b = [0u8; 1];
                    if r.read(at as usize, &mut b).is_ok() {
                        let _ = r.write(at as usize, &[b[0] ^ 0x5a]);
                    }
                }
            }
        }
        Ok(status)
    }

    fn release(&self, id: XferId) -> Result<(), TransportError> {
        // Only a transfer not done lingers (one done has nothing left to move): one in flight,
        // or one that failed (injected or not), as NIXL may keep either running. Bounded all
        // the same, for a run that never asks.
        let done = matches!(self.inner.status(id), Ok(XferStatus::Done));
        let mut st = self.state.lock();
        st.corrupt.remove(&id);
        if self.plan.linger_released > 0 && !done && st.lingering.len() < 4096 {
            st.lingering.insert(id, self.plan.linger_released);
        }
        if st.failed.remove(&id) {
            return Ok(());
        }
        drop(st);
        self.inner.release(id)
    }

    fn still_running(&self, id: XferId) -> bool {
        let mut st = self.state.lock();
        match st.lingering.get_mut(&id) {
            Some(0) => {
                st.lingering.remove(&id);
            }
            Some(left) => {
                *left -= 1;
                return true;
            }
            None => {}
        }
        drop(st);
        self.inner.still_running(id)
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        self.tick();
        if self.is_killed(peer) {
            return Err(TransportError::PeerDead(peer.into()));
        }
        match self.fate(peer, msg) {
            Some(copies) => {
                for _ in 0..copies {
                    self.inner.send_notification(peer, msg)?;
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        self.tick();
        let killed = self.state.lock().killed.clone();
        self.inner
            .drain_notifications()
            .into_iter()
            .filter(|n| !killed.contains(&n.from))
            .collect()
    }

    fn drain_dead_peers(&self) -> Vec<String> {
        let mut out: Vec<String> = self.state.lock().dead_reported.drain(..).collect();
        for p in self.inner.drain_dead_peers() {
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }

    fn refused_connections(&self) -> u64 {
        self.inner.refused_connections()
    }

    fn grant(
        &self,
        grant: crate::GrantId,
        op: XferOp,
        peers: &[String],
        extents: &[crate::Extent],
    ) -> Result<(), TransportError> {
        self.inner.grant(grant, op, peers, extents)
    }

    fn revoke(&self, grant: crate::GrantId) {
        self.inner.revoke(grant)
    }

    fn checks_grants(&self) -> bool {
        self.inner.checks_grants()
    }

    fn refused_transfers(&self) -> u64 {
        self.inner.refused_transfers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{MemFabric, MemTransport};

    fn pair(plan: FaultPlan) -> (Arc<FaultyTransport>, Arc<MemTransport>, Arc<KvRegion>) {
        let fabric = MemFabric::new();
        let a = MemTransport::new(&fabric, "a").unwrap();
        let b = MemTransport::new(&fabric, "b").unwrap();
        let ra = Arc::new(KvRegion::new(1024, 256));
        let rb = Arc::new(KvRegion::new(1024, 256));
        ra.write(0, &[5; 1024]).unwrap();
        a.register(0, ra).unwrap();
        b.register(0, rb.clone()).unwrap();
        a.load_remote(&b.local_metadata().unwrap()).unwrap();
        b.load_remote(&a.local_metadata().unwrap()).unwrap();
        (FaultyTransport::new(a, plan), b, rb)
    }

    const DESC: [XferDesc; 1] = [XferDesc {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 0,
        len: 100,
    }];

    #[test]
    fn dropped_notification_still_moves_the_bytes() {
        let (a, b, rb) = pair(FaultPlan {
            drop_notification_pct: 100,
            ..Default::default()
        });
        let id = a.post(XferOp::Write, "b", &DESC, Some(b"done")).unwrap();
        assert_eq!(a.status(id).unwrap(), XferStatus::Done);
        let mut out = [0; 100];
        rb.read(0, &mut out).unwrap();
        assert_eq!(out, [5; 100]);
        assert!(b.drain_notifications().is_empty());
        assert!(matches!(
            a.faults()[..],
            [Fault::DroppedNotification { .. }]
        ));
    }

    #[test]
    fn a_corrupted_read_lands_with_one_byte_changed_and_reports_done() {
        let fabric = MemFabric::new();
        let a = MemTransport::new(&fabric, "a").unwrap();
        let b = MemTransport::new(&fabric, "b").unwrap();
        let a = FaultyTransport::new(
            a,
            FaultPlan {
                corrupt_read_pct: 100,
                ..Default::default()
            },
        );
        let (ra, rb) = (
            Arc::new(KvRegion::new(1024, 256)),
            Arc::new(KvRegion::new(1024, 256)),
        );
        rb.write(0, &[7; 1024]).unwrap();
        a.register(0, ra.clone()).unwrap();
        b.register(0, rb).unwrap();
        a.load_remote(&b.local_metadata().unwrap()).unwrap();
        let desc = XferDesc {
            local_region: 0,
            local_offset: 0,
            remote_region: 0,
            remote_offset: 0,
            len: 100,
        };
        let id = a.post(XferOp::Read, "b", &[desc], None).unwrap();
        while a.status(id).unwrap() == XferStatus::InProgress {
            std::thread::yield_now();
        }
        let mut out = [0u8; 100];
        ra.read(0, &mut out).unwrap();
        let changed = out.iter().filter(|b| **b != 7).count();
        assert_eq!(changed, 1, "{out:?}");
        assert!(matches!(a.faults()[..], [Fault::CorruptedRead { .. }]));
    }

    #[test]
    fn duplicated_notification_arrives_twice() {
        let (a, b, _) = pair(FaultPlan {
            duplicate_notification_pct: 100,
            ..Default::default()
        });
        a.send_notification("b", b"x").unwrap();
        assert_eq!(b.drain_notifications().len(), 2);
    }

    #[test]
    fn delayed_notifications_come_later_and_out_of_order() {
        let (a, b, _) = pair(FaultPlan {
            delay_notification_pct: 100,
            max_delay_calls: 1,
            ..Default::default()
        });
        a.send_notification("b", b"first").unwrap();
        assert!(b.drain_notifications().is_empty(), "held back");
        a.flush();
        assert_eq!(b.drain_notifications()[0].msg, b"first");
    }

    #[test]
    fn failed_transfer_moves_nothing() {
        let (a, b, rb) = pair(FaultPlan {
            fail_transfer_pct: 100,
            ..Default::default()
        });
        let id = a.post(XferOp::Write, "b", &DESC, Some(b"done")).unwrap();
        assert!(matches!(a.status(id).unwrap(), XferStatus::Failed(_)));
        let mut out = [9; 100];
        rb.read(0, &mut out).unwrap();
        assert_eq!(out, [0; 100]);
        assert!(b.drain_notifications().is_empty());
    }

    #[test]
    fn killed_peer_is_reported_and_unreachable() {
        let (a, _b, _) = pair(FaultPlan::default());
        a.kill_peer("b");
        assert_eq!(a.drain_dead_peers(), vec!["b".to_string()]);
        assert!(matches!(
            a.post(XferOp::Read, "b", &DESC, None),
            Err(TransportError::PeerDead(_))
        ));
    }

    #[test]
    fn the_same_seed_replays_the_same_faults() {
        let plan = FaultPlan {
            seed: 42,
            drop_notification_pct: 30,
            duplicate_notification_pct: 30,
            delay_notification_pct: 30,
            max_delay_calls: 3,
            fail_transfer_pct: 20,
            corrupt_read_pct: 0,
            linger_released: 0,
        };
        let run = || {
            let (a, _b, _) = pair(plan.clone());
            for i in 0..50u8 {
                let _ = a.post(XferOp::Write, "b", &DESC, Some(&[i]));
                let _ = a.send_notification("b", &[i, i]);
            }
            a.faults()
        };
        let first = run();
        assert!(first.len() > 10);
        assert_eq!(first, run());
    }
}
