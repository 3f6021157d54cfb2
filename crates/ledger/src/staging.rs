//! Bounded memory for messages that name a handoff the ledger does not know (yet or any more)
//! — rule 7: memory for early, unknown or duplicate messages is bounded by a cap and an expiry.

use std::collections::{BTreeMap, HashMap, VecDeque};

use handoff_proto::HandoffId;

use crate::{PeerId, Time};

/// Messages that arrived before their handoff was created (a push registration before P's
/// prefill ended, a release from the proxy that raced P's response, ...). Bounded in count, per
/// handoff, per sender and in age. One sender's flood of made-up ids never evicts another's
/// messages: past its quota its own new messages are dropped, and when the whole store is full
/// the oldest message of the sender holding the most goes first.
#[derive(Debug)]
pub(crate) struct Staging<M> {
    by_id: HashMap<HandoffId, Vec<(Option<PeerId>, M, Time)>>,
    /// Per sender, when each of its messages was staged, oldest first. Entries whose message was
    /// taken stay until they reach the front (or a compaction).
    queues: BTreeMap<Option<PeerId>, VecDeque<(Time, HandoffId)>>,
    /// Per sender, its messages still staged.
    counts: BTreeMap<Option<PeerId>, usize>,
    count: usize,
    capacity: usize,
    per_handoff: usize,
    per_peer: usize,
    ttl: Time,
    /// Messages dropped: expired, evicted, over a quota.
    pub dropped: u64,
    /// Of those, dropped because their sender was over its quota.
    pub over_quota: u64,
}

impl<M> Staging<M> {
    pub fn new(capacity: usize, per_handoff: usize, per_peer: usize, ttl: Time) -> Self {
        Staging {
            by_id: HashMap::new(),
            queues: BTreeMap::new(),
            counts: BTreeMap::new(),
            count: 0,
            capacity,
            per_handoff,
            per_peer,
            ttl,
            dropped: 0,
            over_quota: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn stage(&mut self, id: HandoffId, from: Option<PeerId>, msg: M, now: Time) -> bool {
        self.expire(now);
        if self.capacity == 0 {
            self.dropped += 1;
            return false;
        }
        if self.counts.get(&from).copied().unwrap_or(0) >= self.per_peer {
            self.dropped += 1;
            self.over_quota += 1;
            return false;
        }
        if self
            .by_id
            .get(&id)
            .is_some_and(|l| l.len() >= self.per_handoff)
        {
            self.dropped += 1;
            return false;
        }
        while self.count >= self.capacity {
            let Some(biggest) = self.counts.iter().max_by_key(|(_, n)| **n).map(|(p, _)| *p) else {
                break;
            };
            if !self.drop_oldest_of(biggest) {
                break;
            }
        }
        self.by_id.entry(id).or_default().push((from, msg, now));
        self.queues.entry(from).or_default().push_back((now, id));
        *self.counts.entry(from).or_default() += 1;
        self.count += 1;
        true
    }

    pub fn take(&mut self, id: HandoffId, now: Time) -> Vec<(Option<PeerId>, M)> {
        self.expire(now);
        let list = self.by_id.remove(&id).unwrap_or_default();
        for (from, _, _) in &list {
            self.uncount(*from);
        }
        list.into_iter().map(|(p, m, _)| (p, m)).collect()
    }

    /// Drops the messages staged for `id` that `drop` names (their queue entries go lazily, as
    /// for [`Staging::take`]).
    pub fn discard(&mut self, id: HandoffId, drop: impl Fn(Option<PeerId>, &M) -> bool) {
        let Some(list) = self.by_id.get_mut(&id) else {
            return;
        };
        let mut gone = Vec::new();
        list.retain(|(f, m, _)| {
            let d = drop(*f, m);
            if d {
                gone.push(*f);
            }
            !d
        });
        if list.is_empty() {
            self.by_id.remove(&id);
        }
        for f in gone {
            self.uncount(f);
        }
    }

    pub fn expire(&mut self, now: Time) {
        let senders: Vec<Option<PeerId>> = self.queues.keys().copied().collect();
        for from in senders {
            while let Some(&(t, id)) = self.queues.get(&from).and_then(|q| q.front()) {
                if now.saturating_sub(t) < self.ttl {
                    break;
                }
                if let Some(q) = self.queues.get_mut(&from) {
                    q.pop_front();
                }
                self.remove_entry(id, from, t);
            }
            self.tidy(from);
        }
    }

    /// One less message of `from` staged; its queue goes once it holds none.
    fn uncount(&mut self, from: Option<PeerId>) {
        self.count -= 1;
        if let Some(n) = self.counts.get_mut(&from) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&from);
                self.queues.remove(&from);
            }
        }
    }

    /// Drops the queue entries of `from` whose messages were taken once they outnumber the live
    /// ones (so a sender whose messages are all taken in time costs nothing).
    fn tidy(&mut self, from: Option<PeerId>) {
        let live = self.counts.get(&from).copied().unwrap_or(0);
        let Some(q) = self.queues.get_mut(&from) else {
            return;
        };
        if live == 0 {
            self.queues.remove(&from);
        } else if q.len() > 2 * live + 64 {
            let by_id = &self.by_id;
            q.retain(|(t, id)| {
                by_id
                    .get(id)
                    .is_some_and(|l| l.iter().any(|(f, _, at)| *f == from && at == t))
            });
        }
    }

    fn remove_entry(&mut self, id: HandoffId, from: Option<PeerId>, t: Time) -> bool {
        let Some(list) = self.by_id.get_mut(&id) else {
            return false;
        };
        let Some(pos) = list.iter().position(|(f, _, at)| *f == from && *at == t) else {
            return false;
        };
        list.remove(pos);
        if list.is_empty() {
            self.by_id.remove(&id);
        }
        self.dropped += 1;
        self.uncount(from);
        true
    }

    /// Makes room for one more message of `from` when it is at its quota, by dropping its
    /// oldest staged message that `replaceable` says may go (one its sender repeats anyway).
    /// Whether there is room now.
    pub fn make_room(&mut self, from: Option<PeerId>, replaceable: impl Fn(&M) -> bool) -> bool {
        if self.counts.get(&from).copied().unwrap_or(0) < self.per_peer {
            return true;
        }
        let Some(q) = self.queues.get(&from) else {
            return false;
        };
        let by_id = &self.by_id;
        let oldest = q.iter().find_map(|(t, id)| {
            by_id
                .get(id)?
                .iter()
                .any(|(f, m, at)| *f == from && at == t && replaceable(m))
                .then_some((*t, *id))
        });
        match oldest {
            Some((t, id)) => self.remove_entry(id, from, t),
            None => false,
        }
    }

    fn drop_oldest_of(&mut self, from: Option<PeerId>) -> bool {
        while let Some((t, id)) = self.queues.get_mut(&from).and_then(|q| q.pop_front()) {
            if self.remove_entry(id, from, t) {
                return true;
            }
        }
        false
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

/// Tombstone bounds up to this many entries get their table at its steady-state size up front.
const PREALLOCATE_MAX: usize = 1 << 20;

impl<V> Tombstones<V> {
    /// The table is made at its steady-state size at once. A full table churns: one id in, one
    /// out, per ended handoff. Under churn the hash map rehashes in place only while at most
    /// half its room is live, so a full table ends up with room for twice its bound anyway,
    /// tens of thousands of handoffs into a run. That showed as a one-off RSS step mid-run in the
    /// soak bench (~0.5 MiB at 8,192 entries; ~8 MiB at the default 65,536). Allocated here, its
    /// pages become resident while the first handoffs end, and memory stays flat after.
    pub fn new(capacity: usize, ttl: Time) -> Self {
        let room = if capacity <= PREALLOCATE_MAX {
            capacity * 2
        } else {
            0
        };
        Tombstones {
            map: HashMap::with_capacity(room),
            order: VecDeque::with_capacity(capacity.min(PREALLOCATE_MAX)),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> HandoffId {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&n.to_le_bytes());
        HandoffId::from_bytes(b)
    }

    #[test]
    fn a_full_tombstone_table_churns_without_growing() {
        let cap = 4096;
        let mut t = Tombstones::new(cap, Time::MAX);
        let (room, order) = (t.map.capacity(), t.order.capacity());
        for n in 0..20 * cap as u64 {
            t.insert(id(n), (), Time::from_millis(n));
        }
        assert_eq!(t.len(), cap);
        // Without the table made at its steady-state size up front, the map ends at twice the
        // room it had when the bound first filled: a step in memory long after start-up.
        // (`capacity` counts free room: deleted slots awaiting a rehash lower it a little.)
        assert!(
            t.map.capacity() <= room,
            "the tombstone table grew under churn: {} > {room}",
            t.map.capacity()
        );
        assert_eq!(t.order.capacity(), order);
    }
}
