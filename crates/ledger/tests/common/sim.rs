//! A deterministic discrete-event simulation of one P engine and two D engines around the real
//! ledgers: block pools, a lossy network (drop, duplicate, delay and so reorder), transfers of
//! random duration, crashes, aborts and rejections. It checks the seven rules (docs/src/design/overview.md) as it goes
//! and at the end, and returns every violation in words.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::time::Duration;

use handoff_ledger::testing::simulation_configs;
use handoff_ledger::*;
use handoff_plan::testing::Rng;
use handoff_proto::{Epoch, HandoffId, Message, ReleaseReason, TransferMode};

pub const P_NAME: PeerId = PeerId(1);
pub fn d_name(d: usize) -> PeerId {
    PeerId(10 + d as u32)
}

/// One request of a schedule.
#[derive(Debug, Clone)]
pub struct ReqSpec {
    pub at_ms: u64,
    pub d: usize,
    pub push: bool,
    pub siblings: u8,
    pub blocks: u8,
    /// Proxy delay between P's create and D's arrival (pull), or the order of the two (push:
    /// negative means D first).
    pub lag_ms: i64,
    pub admit_after_ms: u64,
    /// What the client or D does: 0 nothing, 1 reject before admission, 2 abort a sibling at
    /// `abort_at_ms` after arrival.
    pub fate: u8,
    pub abort_at_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Faults {
    pub drop_pct: u8,
    pub dup_pct: u8,
    pub max_delay_ms: u64,
    pub transfer_ms: u64,
    /// Fraction (in %) of transfers that fail.
    pub fail_pct: u8,
    /// Fraction (in %) of transfers that hang until cancelled.
    pub hang_pct: u8,
    pub kill_d: Option<(usize, u64, bool)>,
    pub kill_p: Option<(u64, bool)>,
    /// A window (start, length in ms) in which every message between P and D is lost.
    pub partition: Option<(u64, u64)>,
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Node {
    P,
    D(usize),
}

#[derive(Debug, Clone)]
enum Ev {
    Deliver {
        to: Node,
        from: PeerId,
        msg: Message,
    },
    Create(usize),
    Arrive(usize),
    Admit(usize),
    Abort(usize),
    ReadEnd {
        d: usize,
        handoff: HandoffId,
        rank: u16,
        ok: bool,
        cancelled: bool,
    },
    WriteEnd {
        handoff: HandoffId,
        d_rank: u16,
        ok: bool,
        cancelled: bool,
    },
    DecodeDone {
        d: usize,
        blocks: Vec<u32>,
    },
    KillD(usize, bool),
    KillP(bool),
    PeerDead {
        at: Node,
        peer: PeerId,
    },
}

struct Pool {
    name: String,
    free: Vec<u32>,
    allocated: HashSet<u32>,
    version: HashMap<u32, u64>,
}

impl Pool {
    fn new(name: &str, n: u32) -> Self {
        Pool {
            name: name.into(),
            free: (0..n).rev().collect(),
            allocated: HashSet::new(),
            version: HashMap::new(),
        }
    }
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let out: Vec<u32> = (0..n).filter_map(|_| self.free.pop()).collect();
        for b in &out {
            self.allocated.insert(*b);
            *self.version.entry(*b).or_default() += 1;
        }
        Some(out)
    }
    fn free(&mut self, blocks: &[u32], errs: &mut Vec<String>, now: Duration, why: &str) {
        for b in blocks {
            if !self.allocated.remove(b) {
                errs.push(format!(
                    "rule 1: {} block {b} freed twice or never allocated ({why}) at {now:?}",
                    self.name
                ));
            } else {
                self.free.push(*b);
            }
        }
    }
}

struct Read {
    src: Vec<(u32, u64)>,
    dst: Vec<u32>,
    pending: HashSet<u16>,
    notes: Vec<handoff_proto::PullDone>,
    corrupt: bool,
}

struct Write {
    d: usize,
    src: Vec<(u32, u64)>,
    dst: Vec<(u32, u64)>,
    done: Vec<handoff_proto::PushDone>,
    active: bool,
}

struct ReqState {
    spec: ReqSpec,
    id: HandoffId,
    p_blocks: Option<Vec<u32>>,
    created_at: Option<Duration>,
    last_hb: Option<Duration>,
    arrived_at: Option<Duration>,
    ended: HashSet<u64>,
    d_requests: Vec<RequestId>,
    corrupt_kv: bool,
}

pub struct Report {
    pub violations: Vec<String>,
    pub ready: usize,
    pub recomputed: usize,
}

pub struct Sim {
    pcfg: ProducerConfig,
    dcfg: ConsumerConfig,
    p: ProducerLedger,
    ds: Vec<ConsumerLedger>,
    p_alive: bool,
    d_alive: Vec<bool>,
    p_pool: Pool,
    d_pools: Vec<Pool>,
    now: Duration,
    seq: u64,
    queue: BinaryHeap<Reverse<(Duration, u64, usize)>>,
    events: Vec<Option<Ev>>,
    rng: Rng,
    faults: Faults,
    reqs: Vec<ReqState>,
    by_handoff: HashMap<HandoffId, usize>,
    reads: BTreeMap<(usize, HandoffId), Read>,
    writes: BTreeMap<(HandoffId, u16), Write>,
    /// Rule 2, P's side of the truth: the end of the lease P holds for each live handoff, on P's
    /// clock (the sim clock), as P last stated it (the create grant and every grant P emitted,
    /// whether or not the network delivered it). P's lease only grows while it is leased; it
    /// ends when P releases the handoff.
    p_lease_end: HashMap<HandoffId, Duration>,
    errs: Vec<String>,
    ready: usize,
    recomputed: usize,
    trace: bool,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

impl Sim {
    pub fn new(reqs: Vec<ReqSpec>, faults: Faults, p_tp: u16, d_tp: u16) -> Self {
        let (pcfg, dcfg) = simulation_configs(p_tp, d_tp);
        let mut sim = Sim {
            p: ProducerLedger::new(pcfg.clone()),
            ds: (0..2).map(|_| ConsumerLedger::new(dcfg.clone())).collect(),
            pcfg,
            dcfg,
            p_alive: true,
            d_alive: vec![true, true],
            p_pool: Pool::new("P", 64),
            d_pools: vec![Pool::new("D0", 96), Pool::new("D1", 96)],
            now: Duration::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            events: Vec::new(),
            rng: Rng(faults.seed | 1),
            faults: faults.clone(),
            reqs: Vec::new(),
            by_handoff: HashMap::new(),
            reads: BTreeMap::new(),
            writes: BTreeMap::new(),
            p_lease_end: HashMap::new(),
            errs: Vec::new(),
            ready: 0,
            recomputed: 0,
            trace: std::env::var_os("SIM_TRACE").is_some(),
        };
        for (i, spec) in reqs.into_iter().enumerate() {
            let id = HandoffId::from_bytes(u128::to_le_bytes(0xabc0_0000 + i as u128 * 7919));
            let t = ms(spec.at_ms);
            let lag = spec.lag_ms.unsigned_abs();
            let (create_at, arrive_at) = if spec.push && spec.lag_ms < 0 {
                (t + ms(lag), t)
            } else {
                (t, t + ms(lag))
            };
            sim.schedule(create_at, Ev::Create(i));
            sim.schedule(arrive_at, Ev::Arrive(i));
            sim.reqs.push(ReqState {
                spec,
                id,
                p_blocks: None,
                created_at: None,
                last_hb: None,
                arrived_at: None,
                ended: HashSet::new(),
                d_requests: vec![],
                corrupt_kv: false,
            });
            sim.by_handoff.insert(id, i);
        }
        if let Some((d, at, notice)) = faults.kill_d {
            sim.schedule(ms(at), Ev::KillD(d % 2, notice));
        }
        if let Some((at, notice)) = faults.kill_p {
            sim.schedule(ms(at), Ev::KillP(notice));
        }
        sim
    }

    fn schedule(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        self.events.push(Some(ev));
        self.queue
            .push(Reverse((at, self.seq, self.events.len() - 1)));
    }

    fn send(&mut self, from_node: Node, to: Node, msg: Message) {
        let from = match from_node {
            Node::P => P_NAME,
            Node::D(d) => d_name(d),
        };
        if self.rng.pct(self.faults.drop_pct) {
            return;
        }
        if let Some((start, len)) = self.faults.partition {
            if self.now >= ms(start) && self.now < ms(start + len) {
                return;
            }
        }
        let copies = if self.rng.pct(self.faults.dup_pct) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = ms(self.rng.below(self.faults.max_delay_ms + 1));
            self.schedule(
                self.now + delay,
                Ev::Deliver {
                    to,
                    from,
                    msg: msg.clone(),
                },
            );
        }
    }

    pub fn run(mut self) -> Report {
        let end = ms(120_000);
        loop {
            let next_ev = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let mut next = next_ev;
            let mut timers = vec![];
            if self.p_alive {
                timers.push(self.p.poll_timeout());
            }
            for (i, d) in self.ds.iter().enumerate() {
                if self.d_alive[i] {
                    timers.push(d.poll_timeout());
                }
            }
            for t in timers.into_iter().flatten() {
                next = Some(next.map_or(t, |n: Duration| n.min(t)));
            }
            let Some(t) = next else { break };
            if t > end {
                break;
            }
            self.now = self.now.max(t);
            if next_ev.is_some_and(|e| e <= self.now) {
                let Reverse((_, _, idx)) = self.queue.pop().unwrap();
                let ev = self.events[idx].take().unwrap();
                self.handle(ev);
            }
            if self.p_alive && self.p.poll_timeout().is_some_and(|x| x <= self.now) {
                self.p.handle_timeout(self.now);
            }
            for i in 0..2 {
                if self.d_alive[i] && self.ds[i].poll_timeout().is_some_and(|x| x <= self.now) {
                    self.ds[i].handle_timeout(self.now);
                }
            }
            self.drain();
            self.check_memory();
        }
        self.final_checks();
        Report {
            violations: self.errs,
            ready: self.ready,
            recomputed: self.recomputed,
        }
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        if self.trace {
            eprintln!("{now:?} {ev:?}");
        }
        match ev {
            Ev::Deliver { to, from, msg } => match to {
                Node::P if self.p_alive => {
                    if let Message::Heartbeat(hb) = &msg {
                        for e in &hb.entries {
                            if let Some(&i) = self.by_handoff.get(&e.handoff) {
                                if self.p.contains(e.handoff) {
                                    self.reqs[i].last_hb = Some(now);
                                }
                            }
                        }
                    }
                    self.p.handle_message(from, msg, now);
                }
                Node::D(d) if self.d_alive[d] => self.ds[d].handle_message(from, msg, now),
                _ => {}
            },
            Ev::Create(i) => {
                if !self.p_alive {
                    return;
                }
                let n = self.reqs[i].spec.blocks.max(1) as usize;
                let Some(blocks) = self.p_pool.alloc(n) else {
                    return;
                };
                let mode = if self.reqs[i].spec.push {
                    TransferMode::Push
                } else {
                    TransferMode::Pull
                };
                let id = self.reqs[i].id;
                match self.p.create_handoff(id, blocks.clone(), mode, now) {
                    Ok(grant) => {
                        self.p_lease_end.insert(id, now + ms(grant.lease_ms as u64));
                        self.reqs[i].p_blocks = Some(blocks);
                        self.reqs[i].created_at = Some(now);
                    }
                    Err(_) => self
                        .p_pool
                        .free(&blocks, &mut self.errs, now, "create failed"),
                }
            }
            Ev::Arrive(i) => {
                let d = self.reqs[i].spec.d % 2;
                if !self.d_alive[d] {
                    return;
                }
                let spec = self.reqs[i].spec.clone();
                // Pull: D learns of the handoff only from P's params.
                if !spec.push && self.reqs[i].p_blocks.is_none() {
                    return;
                }
                let inc = IncomingHandoff {
                    handoff: self.reqs[i].id,
                    epoch: Epoch::FIRST,
                    peer: P_NAME,
                    p_tp: self.pcfg.tp,
                    mode: if spec.push {
                        TransferMode::Push
                    } else {
                        TransferMode::Pull
                    },
                    p_blocks: if spec.push {
                        vec![]
                    } else {
                        self.reqs[i].p_blocks.clone().unwrap_or_default()
                    },
                    num_tokens: spec.blocks as u32 * 16,
                };
                self.reqs[i].arrived_at = Some(now);
                for s in 0..spec.siblings.max(1) as u64 {
                    let req = RequestId(i as u64 * 100 + s);
                    if self.ds[d].on_request_arrived(req, inc.clone(), now).is_ok() {
                        self.reqs[i].d_requests.push(req);
                    }
                }
                if spec.fate == 1 {
                    for req in self.reqs[i].d_requests.clone() {
                        self.ds[d].on_request_ended(req, ReleaseReason::Rejected, now);
                        self.reqs[i].ended.insert(req.0);
                    }
                    return;
                }
                let admit = if spec.push { 0 } else { spec.admit_after_ms };
                self.schedule(now + ms(admit), Ev::Admit(i));
                if spec.fate == 2 {
                    self.schedule(now + ms(spec.abort_at_ms), Ev::Abort(i));
                }
            }
            Ev::Admit(i) => {
                let d = self.reqs[i].spec.d % 2;
                if !self.d_alive[d]
                    || !self.reqs[i]
                        .d_requests
                        .iter()
                        .any(|r| self.ds[d].is_tracking(*r))
                {
                    return;
                }
                let n = self.reqs[i].spec.blocks.max(1) as usize;
                let Some(blocks) = self.d_pools[d].alloc(n) else {
                    return;
                };
                if self.ds[d]
                    .on_blocks_allocated(self.reqs[i].id, blocks.clone(), now)
                    .is_err()
                {
                    self.d_pools[d].free(&blocks, &mut self.errs, now, "alloc refused");
                }
            }
            Ev::Abort(i) => {
                let d = self.reqs[i].spec.d % 2;
                if !self.d_alive[d] {
                    return;
                }
                if let Some(&req) = self.reqs[i].d_requests.first() {
                    if self.ds[d].is_tracking(req) {
                        self.ds[d].on_request_ended(req, ReleaseReason::Aborted, now);
                        self.reqs[i].ended.insert(req.0);
                    }
                }
            }
            Ev::ReadEnd {
                d,
                handoff,
                rank,
                ok,
                cancelled,
            } => {
                let p_alive = self.p_alive;
                let Some(read) = self.reads.get_mut(&(d, handoff)) else {
                    return;
                };
                if !read.pending.remove(&rank) {
                    return;
                }
                let ok = ok && !cancelled && p_alive;
                let mut notes = vec![];
                if ok {
                    // The READ copies P's bytes now: if a source block was freed or reused since
                    // the read started, D got another request's data.
                    for (b, v) in &read.src {
                        if !self.p_pool.allocated.contains(b)
                            || self.p_pool.version.get(b) != Some(v)
                        {
                            read.corrupt = true;
                        }
                    }
                    notes = read
                        .notes
                        .iter()
                        .filter(|n| n.consumer_rank == rank)
                        .copied()
                        .collect();
                }
                if read.corrupt {
                    if let Some(&i) = self.by_handoff.get(&handoff) {
                        self.reqs[i].corrupt_kv = true;
                    }
                }
                if read.pending.is_empty() {
                    self.reads.remove(&(d, handoff));
                }
                // The completion notification rides on the READ: sent only once its bytes landed.
                for n in notes {
                    self.send(Node::D(d), Node::P, Message::PullDone(n));
                }
                if self.d_alive[d] {
                    self.ds[d].on_read_done(handoff, rank, ok, now);
                }
            }
            Ev::WriteEnd {
                handoff,
                d_rank,
                ok,
                cancelled,
            } => {
                let p_alive = self.p_alive;
                let Some(w) = self.writes.get_mut(&(handoff, d_rank)) else {
                    return;
                };
                if !w.active {
                    return;
                }
                w.active = false;
                let d = w.d;
                let mut landed = ok && !cancelled && p_alive;
                if landed {
                    for (b, v) in &w.src {
                        if !self.p_pool.allocated.contains(b)
                            || self.p_pool.version.get(b) != Some(v)
                        {
                            if let Some(&i) = self.by_handoff.get(&handoff) {
                                self.reqs[i].corrupt_kv = true;
                            }
                        }
                    }
                }
                if ok && !cancelled && p_alive {
                    for (b, v) in &w.dst {
                        if self.d_alive[d]
                            && (!self.d_pools[d].allocated.contains(b)
                                || self.d_pools[d].version.get(b) != Some(v))
                        {
                            self.errs.push(format!(
                                "rule 3: WRITE of {handoff:?} landed in D{d} block {b} after D freed it, at {now:?}"
                            ));
                            landed = false;
                        }
                    }
                }
                let notes = std::mem::take(&mut w.done);
                self.writes.remove(&(handoff, d_rank));
                if landed {
                    for n in notes {
                        self.send(Node::P, Node::D(d), Message::PushDone(n));
                    }
                }
                if p_alive {
                    self.p.on_push_write_done(handoff, d_rank, landed, now);
                }
            }
            Ev::DecodeDone { d, blocks } => {
                if self.d_alive[d] {
                    self.d_pools[d].free(&blocks, &mut self.errs, now, "decode finished");
                }
            }
            Ev::KillD(d, notice) => {
                self.d_alive[d] = false;
                // Reads of a dead D are harmless to P: drop them.
                self.reads.retain(|(rd, _), _| *rd != d);
                if notice && self.p_alive {
                    let delay = ms(self.rng.below(300));
                    self.schedule(
                        now + delay,
                        Ev::PeerDead {
                            at: Node::P,
                            peer: d_name(d),
                        },
                    );
                }
            }
            Ev::KillP(notice) => {
                self.p_alive = false;
                // A dead writer writes no more; reads from a dead P fail when they end.
                self.writes.clear();
                if notice {
                    for d in 0..2 {
                        let delay = ms(self.rng.below(300));
                        self.schedule(
                            now + delay,
                            Ev::PeerDead {
                                at: Node::D(d),
                                peer: P_NAME,
                            },
                        );
                    }
                }
            }
            Ev::PeerDead { at, peer } => match at {
                Node::P if self.p_alive => self.p.handle_peer_dead(peer, now),
                Node::D(d) if self.d_alive[d] => self.ds[d].handle_peer_dead(peer, now),
                _ => {}
            },
        }
    }
}

impl Sim {
    fn drain(&mut self) {
        let now = self.now;
        // ----- P -----
        if self.p_alive {
            while let Some((to, msg)) = self.p.poll_message() {
                let d = (to.0 - 10) as usize;
                if let Message::GrantBatch(g) = &msg {
                    // lease_ms is measured from now on P's clock (P answered the heartbeat now).
                    for grant in &g.grants {
                        let end = now + ms(grant.lease_ms as u64);
                        let e = self.p_lease_end.entry(grant.handoff).or_insert(end);
                        *e = (*e).max(end);
                    }
                }
                self.send(Node::P, Node::D(d), msg);
            }
            while let Some(a) = self.p.poll_action() {
                match a {
                    ProducerAction::PushWrite(w) => {
                        let d = (w.d_peer.0 - 10) as usize;
                        if w.grant_until <= now {
                            self.errs.push(format!(
                                "rule 3: P issued a write on an expired grant at {now:?}"
                            ));
                        }
                        let src = w
                            .src_blocks
                            .iter()
                            .map(|b| (*b, self.p_pool.version.get(b).copied().unwrap_or(0)))
                            .collect();
                        let dst: Vec<(u32, u64)> = w
                            .dst_blocks
                            .iter()
                            .map(|b| (*b, self.d_pools[d].version.get(b).copied().unwrap_or(0)))
                            .collect();
                        for (b, _) in &dst {
                            if !self.d_pools[d].allocated.contains(b) {
                                self.errs.push(format!("rule 3: P writes into D{d} block {b}, which D does not hold, at {now:?}"));
                            }
                        }
                        self.writes.insert(
                            (w.handoff, w.d_rank),
                            Write {
                                d,
                                src,
                                dst,
                                done: w.done.clone(),
                                active: true,
                            },
                        );
                        if !self.rng.pct(self.faults.hang_pct) {
                            let dur = ms(self.rng.below(self.faults.transfer_ms + 1));
                            let ok = !self.rng.pct(self.faults.fail_pct);
                            self.schedule(
                                now + dur,
                                Ev::WriteEnd {
                                    handoff: w.handoff,
                                    d_rank: w.d_rank,
                                    ok,
                                    cancelled: false,
                                },
                            );
                        }
                    }
                    ProducerAction::AbortWrite { handoff, d_rank } => {
                        let lat = ms(self.rng.below(100));
                        self.schedule(
                            now + lat,
                            Ev::WriteEnd {
                                handoff,
                                d_rank,
                                ok: false,
                                cancelled: true,
                            },
                        );
                    }
                }
            }
            while let Some(rel) = self.p.poll_release() {
                if self.trace {
                    eprintln!("{now:?} P release {rel:?}");
                }
                self.check_p_release(&rel);
                self.p_lease_end.remove(&rel.handoff);
                self.p_pool
                    .free(&rel.blocks, &mut self.errs, now, "P ledger release");
            }
        }
        // ----- D -----
        for d in 0..2 {
            if !self.d_alive[d] {
                continue;
            }
            while let Some((_, msg)) = self.ds[d].poll_message() {
                self.send(Node::D(d), Node::P, msg);
            }
            while let Some(a) = self.ds[d].poll_action() {
                match a {
                    ConsumerAction::StartRead(r) => {
                        self.check_read_start(d, &r);
                        let src = r
                            .src_blocks
                            .iter()
                            .map(|b| {
                                let v = if self.p_pool.allocated.contains(b) {
                                    self.p_pool.version.get(b).copied().unwrap_or(0)
                                } else {
                                    u64::MAX
                                };
                                (*b, v)
                            })
                            .collect();
                        let ranks: HashSet<u16> = (0..self.dcfg.tp).collect();
                        for rank in &ranks {
                            if !self.rng.pct(self.faults.hang_pct) {
                                let dur = ms(self.rng.below(self.faults.transfer_ms + 1));
                                let ok = !self.rng.pct(self.faults.fail_pct);
                                self.schedule(
                                    now + dur,
                                    Ev::ReadEnd {
                                        d,
                                        handoff: r.handoff,
                                        rank: *rank,
                                        ok,
                                        cancelled: false,
                                    },
                                );
                            }
                        }
                        self.reads.insert(
                            (d, r.handoff),
                            Read {
                                src,
                                dst: r.dst_blocks.clone(),
                                pending: ranks,
                                notes: r.done.clone(),
                                corrupt: false,
                            },
                        );
                    }
                    // Not yet simulated: every read here is a classic pull's.
                    ConsumerAction::ReadMore { .. } => {}
                    ConsumerAction::CancelRead { handoff } => {
                        if let Some(read) = self.reads.get(&(d, handoff)) {
                            for rank in read.pending.clone() {
                                let lat = ms(self.rng.below(100));
                                self.schedule(
                                    now + lat,
                                    Ev::ReadEnd {
                                        d,
                                        handoff,
                                        rank,
                                        ok: false,
                                        cancelled: true,
                                    },
                                );
                            }
                        }
                    }
                }
            }
            while let Some(rel) = self.ds[d].poll_release() {
                if self.trace {
                    eprintln!("{now:?} D{d} release {rel:?}");
                }
                for b in &rel.blocks {
                    if self
                        .reads
                        .get(&(d, rel.handoff))
                        .is_some_and(|r| r.dst.contains(b))
                    {
                        self.errs.push(format!("rule 3: D{d} freed block {b} of {:?} while a READ into it was in flight, at {now:?}", rel.handoff));
                    }
                    if self.p_alive
                        && self
                            .writes
                            .values()
                            .any(|w| w.active && w.d == d && w.dst.iter().any(|(x, _)| x == b))
                    {
                        self.errs.push(format!("rule 3: D{d} freed block {b} of {:?} while a WRITE into it was in flight, at {now:?}", rel.handoff));
                    }
                }
                self.d_pools[d].free(&rel.blocks, &mut self.errs, now, "D ledger release");
            }
            while let Some(o) = self.ds[d].poll_outcome() {
                if self.trace {
                    eprintln!("{now:?} D{d} outcome {o:?}");
                }
                let (handoff, requests) = match &o {
                    Outcome::Ready {
                        handoff, requests, ..
                    } => (*handoff, requests.clone()),
                    Outcome::Recompute {
                        handoff, requests, ..
                    }
                    | Outcome::Failed {
                        handoff, requests, ..
                    } => (*handoff, requests.clone()),
                };
                let Some(&i) = self.by_handoff.get(&handoff) else {
                    self.errs
                        .push(format!("outcome for unknown handoff {handoff:?}"));
                    continue;
                };
                if let Some(arrived) = self.reqs[i].arrived_at {
                    if now > arrived + self.dcfg.wait_deadline + ms(1) {
                        self.errs.push(format!("rule 6: request of {handoff:?} ended at {now:?}, past its deadline (arrived {arrived:?})"));
                    }
                }
                for r in &requests {
                    if !self.reqs[i].ended.insert(r.0) {
                        self.errs.push(format!("request {r:?} got two outcomes"));
                    }
                }
                match o {
                    Outcome::Ready { blocks, .. } => {
                        if self.reqs[i].corrupt_kv {
                            self.errs.push(format!("rule 4: D{d} decodes {handoff:?} from KV that was not intact, at {now:?}"));
                        }
                        self.ready += 1;
                        let dt = ms(self.rng.below(500));
                        self.schedule(now + dt, Ev::DecodeDone { d, blocks });
                    }
                    _ => self.recomputed += 1,
                }
            }
        }
    }

    /// Rule 2, D's side: a READ starts only on a lease P still honours, with at least D's read
    /// margin left on P's own clock.
    ///
    /// D cannot know P's lease exactly: it measures each grant from the moment its heartbeat left
    /// (never later than the moment P extended the lease), so D's grant end is never later than
    /// P's lease end. Hence "D's grant ends more than `read_margin` after now" implies "P's lease
    /// ends more than `read_margin` after now", and that is what is checked, against P's truth:
    /// P must still hold the handoff, and its lease must reach past `now + read_margin`. (A
    /// release from someone other than the reader only stops renewals: P's fence then runs from
    /// the lease's end, never cuts it short.)
    fn check_read_start(&mut self, d: usize, r: &StartRead) {
        let now = self.now;
        if !self.p_alive {
            // Reads from a dead P fail when they end; there is no lease to check against.
            return;
        }
        let margin = self.dcfg.read_margin;
        let lease_end = if self.p.contains(r.handoff) {
            self.p_lease_end.get(&r.handoff).copied()
        } else {
            None
        };
        match lease_end {
            None => self.errs.push(format!(
                "rule 2: D{d} starts a READ of {:?} at {now:?}, but P no longer holds it",
                r.handoff
            )),
            Some(end) if end <= now + margin => self.errs.push(format!(
                "rule 2: D{d} starts a READ of {:?} at {now:?} on a lease P holds only until \
                 {end:?}: less than the read margin {margin:?} left",
                r.handoff
            )),
            Some(_) => {}
        }
    }

    fn check_p_release(&mut self, rel: &BlockRelease) {
        let now = self.now;
        for ((d, _), read) in &self.reads {
            if !self.d_alive[*d] {
                continue;
            }
            for b in &rel.blocks {
                if read.src.iter().any(|(x, _)| x == b) {
                    self.errs.push(format!("rule 2: P freed block {b} of {:?} while D{d}'s READ of it was in flight, at {now:?}", rel.handoff));
                }
            }
        }
        let Some(&i) = self.by_handoff.get(&rel.handoff) else {
            return;
        };
        let r = &self.reqs[i];
        let Some(created) = r.created_at else { return };
        let mut base = created + self.pcfg.initial_lease;
        if let Some(hb) = r.last_hb {
            base = base.max(hb + self.pcfg.heartbeat_extension);
        }
        let bound = base.min(created + self.pcfg.hard_cap) + self.pcfg.fence_grace + ms(1);
        if now > bound {
            self.errs.push(format!(
                "rule 5: P released {:?} at {now:?}, later than lease + grace {bound:?}",
                rel.handoff
            ));
        }
    }

    fn check_memory(&mut self) {
        let m = self.p.memory();
        if m.staged_messages > self.pcfg.staging_capacity {
            self.errs.push(format!(
                "rule 7: {} staged messages > cap",
                m.staged_messages
            ));
        }
        if m.tombstones > self.pcfg.tombstone_capacity {
            self.errs.push("rule 7: tombstones over cap".into());
        }
    }

    fn final_checks(&mut self) {
        if self.p_alive {
            if !self.p.is_empty() {
                self.errs.push(format!(
                    "rule 5: P still holds {} handoffs at the end",
                    self.p.len()
                ));
            }
            if !self.p_pool.allocated.is_empty() {
                self.errs.push(format!(
                    "rule 1: P blocks never returned: {:?}",
                    self.p_pool.allocated
                ));
            }
        }
        for d in 0..2 {
            if !self.d_alive[d] {
                continue;
            }
            if !self.ds[d].is_empty() {
                self.errs.push(format!(
                    "rule 6: D{d} still tracks {} handoffs at the end",
                    self.ds[d].len()
                ));
            }
            if !self.d_pools[d].allocated.is_empty() {
                self.errs.push(format!(
                    "rule 1: D{d} blocks never returned: {:?}",
                    self.d_pools[d].allocated
                ));
            }
            for r in &self.reqs {
                if r.spec.d % 2 != d {
                    continue;
                }
                for req in &r.d_requests {
                    if !r.ended.contains(&req.0) {
                        self.errs
                            .push(format!("rule 6: request {req:?} of {:?} never ended", r.id));
                    }
                }
            }
        }
    }
}
