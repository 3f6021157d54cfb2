//! The asking side of heartbeats: numbering, batching per peer, and anchoring the grants that
//! come back at the moment the question left (so a delayed, duplicated or reordered reply can
//! only shorten a grant, never stretch it past the holder's lease — rules 2 and 3).

use std::collections::{HashMap, VecDeque};

use handoff_proto::{split_heartbeat, HeartbeatEntry, Message, TransferMode};

use crate::{PeerId, Time};

#[derive(Debug)]
pub(crate) struct HeartbeatSender {
    /// The flow whose blocks the heartbeats keep (see [`handoff_proto::Heartbeat::mode`]).
    mode: TransferMode,
    seq: u64,
    sent: HashMap<u64, (PeerId, Time)>,
    order: VecDeque<(Time, u64)>,
}

impl HeartbeatSender {
    pub fn new(mode: TransferMode) -> Self {
        HeartbeatSender {
            mode,
            seq: 0,
            sent: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Queues heartbeats for `entries` to `peer`, split under the message size cap.
    pub fn send(
        &mut self,
        peer: PeerId,
        entries: &[HeartbeatEntry],
        now: Time,
        out: &mut VecDeque<(PeerId, Message)>,
    ) -> usize {
        let seq = &mut self.seq;
        let batches = split_heartbeat(entries, self.mode, || {
            *seq += 1;
            *seq
        });
        let n = batches.len();
        for hb in batches {
            self.sent.insert(hb.seq, (peer, now));
            self.order.push_back((now, hb.seq));
            out.push_back((peer, Message::Heartbeat(hb)));
        }
        n
    }

    /// When the heartbeat `seq` left, if it went to `from` and is still remembered.
    pub fn anchor(&self, seq: u64, from: PeerId) -> Option<Time> {
        match self.sent.get(&seq) {
            Some(&(peer, at)) if peer == from => Some(at),
            _ => None,
        }
    }

    /// Forgets questions older than `ttl` (a reply that late grants nothing anyway).
    pub fn expire(&mut self, now: Time, ttl: Time) {
        while let Some(&(t, seq)) = self.order.front() {
            if now.saturating_sub(t) < ttl {
                break;
            }
            self.order.pop_front();
            self.sent.remove(&seq);
        }
    }

    pub fn awaiting(&self) -> usize {
        self.sent.len()
    }
}
