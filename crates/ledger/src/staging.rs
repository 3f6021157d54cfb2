//! Bounded memory for messages that name a handoff the ledger does not know (yet or any more)
//! — rule 7: memory for early, unknown or duplicate messages is bounded by a cap and an expiry.

use std::collections::{HashMap, VecDeque};

use handoff_proto::HandoffId;

use crate::{PeerId, Time};

/// Messages that arrived before their handoff was created (a push registration before P's
/// prefill ended, a release from the proxy that raced P's response, ...). Bounded in count, per
/// handoff and in age; the oldest is dropped first when full.
#[derive(Debug)]
pub(crate) struct Staging<M> {
    by_id: HashMap<HandoffId, Vec<(Option<PeerId>, M, Time)>>,
    order: VecDeque<(Time, HandoffId)>,
    count: usize,
    capacity: usize,
    per_handoff: usize,
    ttl: Time,
    pub dropped: u64,
}

impl<M> Staging<M> {
    pub fn new(capacity: usize, per_handoff: usize, ttl: Time) -> Self {
        Staging {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            count: 0,
            capacity,
            per_handoff,
            ttl,
            dropped: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// `from`: the peer that sent it, or `None` for a release from outside the cluster's peers
    /// (the proxy).
    pub fn stage(&mut self, id: HandoffId, from: Option<PeerId>, msg: M, now: Time) {
        self.expire(now);
        if self.capacity == 0 {
            self.dropped += 1;
            return;
        }
        while self.count >= self.capacity {
            if !self.drop_oldest() {
                break;
            }
        }
        let list = self.by_id.entry(id).or_default();
        if list.len() >= self.per_handoff {
            // One handoff cannot take the whole budget: its newest message is the one dropped.
            self.dropped += 1;
            return;
        }
        list.push((from, msg, now));
        self.order.push_back((now, id));
        self.count += 1;
    }

    /// Everything staged for `id`, oldest first.
    pub fn take(&mut self, id: HandoffId, now: Time) -> Vec<(Option<PeerId>, M)> {
        self.expire(now);
        let list = self.by_id.remove(&id).unwrap_or_default();
        self.count -= list.len();
        // `order` keeps stale (time, id) pairs; drop_oldest and expire skip them.
        list.into_iter().map(|(p, m, _)| (p, m)).collect()
    }

    pub fn expire(&mut self, now: Time) {
        while let Some(&(t, id)) = self.order.front() {
            if now.saturating_sub(t) < self.ttl {
                break;
            }
            self.order.pop_front();
            self.remove_entry(id, t);
        }
        // `order` may hold entries for ids already taken; bound it by the live count.
        if self.order.len() > 2 * self.capacity.max(1) + 64 {
            self.compact();
        }
    }

    fn remove_entry(&mut self, id: HandoffId, t: Time) -> bool {
        if let Some(list) = self.by_id.get_mut(&id) {
            if let Some(pos) = list.iter().position(|(_, _, at)| *at == t) {
                list.remove(pos);
                self.count -= 1;
                self.dropped += 1;
                if list.is_empty() {
                    self.by_id.remove(&id);
                }
                return true;
            }
        }
        false
    }

    fn drop_oldest(&mut self) -> bool {
        while let Some((t, id)) = self.order.pop_front() {
            if self.remove_entry(id, t) {
                return true;
            }
        }
        false
    }

    fn compact(&mut self) {
        let by_id = &self.by_id;
        self.order.retain(|(t, id)| {
            by_id
                .get(id)
                .is_some_and(|l| l.iter().any(|(_, _, at)| at == t))
        });
    }
}

/// Handoffs that ended recently, so a late message is recognised (and counted) as late instead of
/// being staged as early. Bounded in count and age.
#[derive(Debug)]
pub(crate) struct Tombstones<V> {
    map: HashMap<HandoffId, V>,
    order: VecDeque<(Time, HandoffId)>,
    capacity: usize,
    ttl: Time,
}

impl<V> Tombstones<V> {
    pub fn new(capacity: usize, ttl: Time) -> Self {
        Tombstones {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity,
            ttl,
        }
    }

    pub fn insert(&mut self, id: HandoffId, v: V, now: Time) {
        self.expire(now);
        if self.capacity == 0 {
            return;
        }
        while self.map.len() >= self.capacity {
            match self.order.pop_front() {
                Some((_, old)) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        if self.map.insert(id, v).is_none() {
            self.order.push_back((now, id));
        }
    }

    pub fn get(&self, id: &HandoffId) -> Option<&V> {
        self.map.get(id)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn expire(&mut self, now: Time) {
        while let Some(&(t, id)) = self.order.front() {
            if now.saturating_sub(t) < self.ttl {
                break;
            }
            self.order.pop_front();
            self.map.remove(&id);
        }
    }
}
