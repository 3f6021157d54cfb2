//! A zero-delay harness around one P ledger and one D ledger: messages are delivered at once,
//! transfers are completed by hand, so each scenario reads as a script.
#![allow(dead_code)]

use std::time::Duration;

use handoff_ledger::*;
use handoff_proto::{Epoch, HandoffId, Message, TransferMode};

/// D's name for P, and P's name for D.
pub const P_PEER: PeerId = PeerId(1);
pub const D_PEER: PeerId = PeerId(2);

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn hid(n: u128) -> HandoffId {
    HandoffId::from_bytes(u128::to_le_bytes(
        0x5eed_0000_0000_0000_0000_0000_0000_0000 | n,
    ))
}

pub struct Pair {
    pub p: ProducerLedger,
    pub d: ConsumerLedger,
    pub now: Duration,
    pub p_releases: Vec<BlockRelease>,
    pub d_releases: Vec<BlockRelease>,
    pub outcomes: Vec<Outcome>,
    pub reads: Vec<StartRead>,
    pub cancelled_reads: Vec<HandoffId>,
    /// Layer-wise pull: the layers each `ReadMore` said are saved.
    pub read_more: Vec<(HandoffId, Option<u32>)>,
    pub writes: Vec<PushWrite>,
    pub aborted_writes: Vec<(HandoffId, u16)>,
    /// Every message delivered, in order, with its direction ("P>D" or "D>P").
    pub log: Vec<(Duration, &'static str, Message)>,
    /// When false, messages from that side are lost (a crashed or partitioned engine).
    pub p_alive: bool,
    pub d_alive: bool,
}

impl Pair {
    pub fn new(p: ProducerConfig, d: ConsumerConfig) -> Self {
        Pair {
            p: ProducerLedger::new(p),
            d: ConsumerLedger::new(d),
            now: Duration::ZERO,
            p_releases: vec![],
            d_releases: vec![],
            outcomes: vec![],
            reads: vec![],
            cancelled_reads: vec![],
            read_more: vec![],
            writes: vec![],
            aborted_writes: vec![],
            log: vec![],
            p_alive: true,
            d_alive: true,
        }
    }

    pub fn default_pair() -> Self {
        Pair::new(ProducerConfig::default(), ConsumerConfig::default())
    }

    pub fn incoming(&self, id: HandoffId, blocks: &[u32], mode: TransferMode) -> IncomingHandoff {
        IncomingHandoff {
            handoff: id,
            epoch: Epoch::FIRST,
            peer: P_PEER,
            p_tp: self.p.config().tp,
            mode,
            p_blocks: if mode == TransferMode::Pull {
                blocks.to_vec()
            } else {
                vec![]
            },
            num_tokens: blocks.len() as u32 * 16,
        }
    }

    /// Delivers every queued message and runs due timers, until quiet.
    pub fn pump(&mut self) {
        loop {
            let mut moved = false;
            if self.p.poll_timeout().is_some_and(|t| t <= self.now) {
                self.p.handle_timeout(self.now);
            }
            if self.d.poll_timeout().is_some_and(|t| t <= self.now) {
                self.d.handle_timeout(self.now);
            }
            while let Some((to, m)) = self.d.poll_message() {
                assert_eq!(to, P_PEER);
                moved = true;
                if self.d_alive && self.p_alive {
                    self.log.push((self.now, "D>P", m.clone()));
                    self.p.handle_message(D_PEER, m, self.now);
                }
            }
            while let Some((to, m)) = self.p.poll_message() {
                assert_eq!(to, D_PEER);
                moved = true;
                if self.d_alive && self.p_alive {
                    self.log.push((self.now, "P>D", m.clone()));
                    self.d.handle_message(P_PEER, m, self.now);
                }
            }
            while let Some(a) = self.d.poll_action() {
                moved = true;
                match a {
                    ConsumerAction::StartRead(r) => self.reads.push(r),
                    ConsumerAction::CancelRead { handoff } => self.cancelled_reads.push(handoff),
                    ConsumerAction::ReadMore {
                        handoff, layers, ..
                    } => self.read_more.push((handoff, layers)),
                }
            }
            while let Some(a) = self.p.poll_action() {
                moved = true;
                match a {
                    ProducerAction::PushWrite(w) => self.writes.push(w),
                    ProducerAction::AbortWrite { handoff, d_rank } => {
                        self.aborted_writes.push((handoff, d_rank))
                    }
                }
            }
            while let Some(r) = self.p.poll_release() {
                self.p_releases.push(r);
            }
            while let Some(r) = self.d.poll_release() {
                self.d_releases.push(r);
            }
            while let Some(o) = self.d.poll_outcome() {
                self.outcomes.push(o);
            }
            if !moved {
                break;
            }
        }
    }

    /// Moves the clock to `now + dt`, stopping at every timer on the way.
    pub fn advance(&mut self, dt: Duration) {
        let target = self.now + dt;
        loop {
            self.pump();
            let next = [self.p.poll_timeout(), self.d.poll_timeout()]
                .into_iter()
                .flatten()
                .filter(|t| *t > self.now)
                .min();
            match next {
                Some(t) if t <= target => self.now = t,
                _ => break,
            }
        }
        self.now = target;
        self.pump();
    }

    /// Advances until `cond` holds (checked at every timer), at most `limit`.
    pub fn advance_until(&mut self, limit: Duration, mut cond: impl FnMut(&Pair) -> bool) -> bool {
        let target = self.now + limit;
        loop {
            self.pump();
            if cond(self) {
                return true;
            }
            let next = [self.p.poll_timeout(), self.d.poll_timeout()]
                .into_iter()
                .flatten()
                .filter(|t| *t > self.now)
                .min();
            match next {
                Some(t) if t <= target => self.now = t,
                _ => {
                    self.now = target;
                    self.pump();
                    return cond(self);
                }
            }
        }
    }

    /// Completes a pull read: delivers each pair's PullDone to P (they ride on the READ), then
    /// reports every D rank done.
    pub fn complete_read(&mut self, read: &StartRead) {
        for n in &read.done {
            self.p
                .handle_message(D_PEER, Message::PullDone(*n), self.now);
        }
        let ranks: std::collections::BTreeSet<u16> =
            read.done.iter().map(|n| n.consumer_rank).collect();
        for r in ranks {
            self.d.on_read_done(read.handoff, r, true, self.now);
        }
        self.pump();
    }

    /// Push, P first: P creates `id` on blocks [1, 2], then request 1 arrives at D, which
    /// reserves [40, 41] and registers. Returns the one write P is granted.
    /// Push: D's request 1 for `id` arrives and gets blocks 40 and 41, which D registers with P
    /// (sent at the next pump).
    pub fn d_registers(&mut self, id: HandoffId) {
        self.d_push_arrives(id);
        self.d
            .on_blocks_allocated(id, vec![40, 41], self.now)
            .unwrap();
    }

    /// Push: D's request 1 for `id` arrives (no blocks reserved yet).
    pub fn d_push_arrives(&mut self, id: HandoffId) {
        let inc = self.incoming(id, &[], TransferMode::Push);
        self.d
            .on_request_arrived(RequestId(1), inc, self.now)
            .unwrap();
    }

    pub fn push_writing(&mut self, id: HandoffId) -> PushWrite {
        self.p
            .create_handoff(id, vec![1, 2], TransferMode::Push, self.now)
            .unwrap();
        self.d_registers(id);
        self.pump();
        assert_eq!(self.writes.len(), 1, "registration matched; write granted");
        self.writes[0].clone()
    }

    /// Completes a push write: its PushDone notifications reach D, then P learns it ended.
    pub fn complete_write(&mut self, w: &PushWrite) {
        for n in &w.done {
            self.d
                .handle_message(P_PEER, Message::PushDone(*n), self.now);
        }
        self.p
            .on_push_write_done(w.handoff, w.d_rank, true, self.now);
        self.pump();
    }

    /// When the last message of `kind` went in direction `dir`.
    pub fn last(&self, dir: &str, kind: &str) -> Option<Duration> {
        self.log
            .iter()
            .rev()
            .filter(|(_, d, m)| *d == dir && m.kind() == kind)
            .map(|(t, _, _)| *t)
            .next()
    }

    pub fn p_released(&self, id: HandoffId) -> Option<&BlockRelease> {
        self.p_releases.iter().find(|r| r.handoff == id)
    }

    pub fn count(&self, dir: &str, kind: &str) -> usize {
        self.log
            .iter()
            .filter(|(_, d, m)| *d == dir && m.kind() == kind)
            .count()
    }
}
