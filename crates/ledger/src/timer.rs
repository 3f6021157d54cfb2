//! Deadline queue with lazy deletion (after quinn-proto's timer): "when is the next deadline" is a
//! heap peek, never a scan of every lease (vLLM's O(N) reaper, #58222, is what this avoids).
//!
//! An entry carries a generation. A renewal that pushes a deadline *later* does not touch the heap:
//! the old entry fires early, the owner sees its real deadline is still ahead and re-arms it. A
//! deadline that moves *earlier* bumps the generation and pushes a new entry; the old one is
//! discarded as stale when it surfaces. So each live item has one live entry, and an idle tick is
//! O(1).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hash::Hash;

use crate::Time;

#[derive(Debug)]
pub(crate) struct TimerQueue<K> {
    heap: BinaryHeap<Reverse<(Time, u64, K)>>,
}

impl<K: Ord + Copy + Hash> Default for TimerQueue<K> {
    fn default() -> Self {
        TimerQueue {
            heap: BinaryHeap::new(),
        }
    }
}

impl<K: Ord + Copy + Hash> TimerQueue<K> {
    pub fn schedule(&mut self, key: K, at: Time, generation: u64) {
        self.heap.push(Reverse((at, generation, key)));
    }

    pub fn next_deadline(&self) -> Option<Time> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Pops one entry due at `now`; the caller checks the generation against the item's.
    pub fn pop_due(&mut self, now: Time) -> Option<(K, u64)> {
        match self.heap.peek() {
            Some(Reverse((t, _, _))) if *t <= now => {
                self.heap.pop().map(|Reverse((_, g, k))| (k, g))
            }
            _ => None,
        }
    }

    /// Pops entries due at `now` until one that `live(key, generation)` accepts (the caller
    /// checks the item still exists and still expects that generation, firing its slot); stale
    /// entries of lazy deletion are dropped on the way. Both ledgers drain their timers with it.
    pub fn pop_live(&mut self, now: Time, mut live: impl FnMut(K, u64) -> bool) -> Option<K> {
        while let Some((key, generation)) = self.pop_due(now) {
            if live(key, generation) {
                return Some(key);
            }
        }
        None
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Drops stale entries once they outnumber the `live_items` (each owns at most one live
    /// entry) by more than [`COMPACT_SLACK`]: an item that ends long before its deadline leaves
    /// its entry behind until that deadline surfaces (a D request's wait deadline is a minute
    /// away), which at a steady request rate is a table that grows with the deadline. `live`
    /// says whether an entry is an item's live one. Amortised O(1) per ended item.
    pub fn compact_if_stale(&mut self, live_items: usize, mut live: impl FnMut(K, u64) -> bool) {
        if self.heap.len() > 2 * live_items + COMPACT_SLACK {
            self.heap.retain(|Reverse((_, g, k))| live(*k, *g));
        }
    }
}

/// Stale timer entries tolerated beyond twice the live items before a compaction.
pub(crate) const COMPACT_SLACK: usize = 1024;

/// The timer slot an item owns: its current deadline and the generation of its live heap entry.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TimerSlot {
    pub armed_at: Option<Time>,
    pub generation: u64,
}

impl TimerSlot {
    /// Makes sure the queue will wake the item no later than `at`.
    pub fn arm<K: Ord + Copy + Hash>(&mut self, q: &mut TimerQueue<K>, key: K, at: Time) {
        match self.armed_at {
            Some(current) if current <= at => {}
            _ => {
                self.generation += 1;
                self.armed_at = Some(at);
                q.schedule(key, at, self.generation);
            }
        }
    }

    /// Whether the queue entry of `generation` is this item's live one.
    pub fn is_live(&self, generation: u64) -> bool {
        generation == self.generation && self.armed_at.is_some()
    }

    /// Called when an entry of this item popped: true when it is the live one (then the slot is
    /// disarmed and the owner must re-arm for its next deadline, if any).
    pub fn fired(&mut self, generation: u64) -> bool {
        if generation == self.generation && self.armed_at.is_some() {
            self.armed_at = None;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Duration;

    #[test]
    fn items_that_end_early_leave_a_bounded_number_of_stale_entries() {
        let mut q: TimerQueue<u32> = TimerQueue::default();
        let mut live: HashMap<u32, TimerSlot> = HashMap::new();
        // 100,000 items, each armed for a minute and ended at once, 10 alive at a time.
        for i in 0..100_000u32 {
            let mut slot = TimerSlot::default();
            slot.arm(&mut q, i, Duration::from_secs(60));
            live.insert(i, slot);
            if i >= 10 {
                live.remove(&(i - 10));
                q.compact_if_stale(live.len(), |k, g| {
                    live.get(&k).is_some_and(|s| s.is_live(g))
                });
            }
        }
        assert!(
            q.len() <= 2 * live.len() + COMPACT_SLACK,
            "{} entries",
            q.len()
        );
        // The live items still fire.
        let mut fired = 0;
        while q
            .pop_live(Duration::from_secs(61), |k, g| {
                live.get_mut(&k).is_some_and(|s| s.fired(g))
            })
            .is_some()
        {
            fired += 1;
        }
        assert_eq!(fired, 10);
    }
}
