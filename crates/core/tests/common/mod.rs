//! A discrete-event simulation of one P engine and two D engines around the real
//! [`ConnectorCore`]s: the code that ships, not a copy of it. The simulation plays every
//! executor and worker: it carries side-channel frames (per-connection order, delays,
//! partitions), opens connections, runs the transfer jobs the cores post (they take time, fail,
//! hang until aborted), delivers their completion notifications, kills engines with or without a
//! dead-peer signal, lets clients abort, D reject and retry requests, the proxy release, and a
//! stranger talk to P without a handshake. It owns the block pools and checks rules 1–7 against
//! them as the cores act.

#![allow(dead_code)]

mod carry_out;
mod checks;
mod events;
mod sim_core;

pub use sim_core::SimCore;

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use handoff_core::trace::Cluster;

use handoff_core::{
    ConnId, ConnectorEvent, CoreConfig, Hooks, Input, JobId, PrefillEnd, PrefillOutcome, Ready,
    Role, TransferJob, WorkerHello, WorkerOp, WorkerReport,
};
use handoff_ledger::testing::simulation_configs;
use handoff_ledger::ConsumerConfig;
use handoff_plan::testing::{tiny_spec, Rng};
use handoff_plan::{KvGroups, KvSpec, RankLayout};
use handoff_proto::xfer::GrantId;
use handoff_proto::{
    Epoch, HandoffId, Heartbeat, HeartbeatEntry, KvTransferParams, Message, ReleaseReason,
    TransferMode,
};

pub const POOL_BLOCKS: u32 = 64;
const LAYERS: u32 = 2;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The engine's KV at TP `tp`: four KV heads, so that every TP size of the runs (1, 2, 4) splits
/// them.
fn spec(tp: u16) -> KvSpec {
    let mut s = tiny_spec(LAYERS);
    s.shape.num_kv_heads = 4;
    s.tp = u32::from(tp);
    s
}

/// One request as the schedule describes it.
#[derive(Debug, Clone)]
pub struct ReqSpec {
    pub at_ms: u64,
    pub d: usize,
    pub blocks: u8,
    /// Proxy delay between P's answer and D's arrival (push: between P's start and D's).
    pub lag_ms: u64,
    pub admit_after_ms: u64,
    /// 0 nothing; 1 D rejects it before tracking it; 2 the client aborts `fate_ms` after
    /// arrival; 3 the same request is retried at D `fate_ms` after arrival and D rejects the
    /// retry (a full queue) while the first one is tracked; 4 the proxy never reaches D and
    /// releases at P instead.
    pub fate: u8,
    pub fate_ms: u64,
    /// D's prefix cache holds this many of the prompt's first blocks already (at most one less
    /// than `blocks`, and [`PREFIX_BLOCKS`]): no transfer may write them, and D's connector
    /// never gives them back.
    pub cached: u8,
}

/// D's prefix cache: blocks each D holds for the whole run (shared, never a transfer's).
pub const PREFIX_BLOCKS: usize = 2;
/// The owner of D's prefix-cache blocks in the pool.
const PREFIX: u128 = u128::MAX;

#[derive(Debug, Clone, Default)]
pub struct Faults {
    pub max_delay_ms: u64,
    pub transfer_ms: u64,
    pub fail_pct: u8,
    pub hang_pct: u8,
    /// (which D, when, whether P hears of it at once: FIN and the transport's dead agent).
    pub kill_d: Option<(usize, u64, bool)>,
    pub kill_p: Option<(u64, bool)>,
    /// A window (start, length) in which nothing between P and D arrives (held until it ends,
    /// as TCP retransmits).
    pub partition: Option<(u64, u64)>,
    /// A stranger connects to P at this time and sends a heartbeat and a release for a live
    /// handoff without a handshake.
    pub stranger_at_ms: Option<u64>,
    /// The proxy releases the latest handoff at P at this time (it believes D never got it).
    pub proxy_release_at_ms: Option<u64>,
    /// Every transfer takes at least this long.
    pub transfer_min_ms: u64,
    /// Side-channel frames (but the handshake) lost, and sent twice, in a hundred.
    pub drop_pct: u8,
    pub dup_pct: u8,
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Node {
    P,
    D(usize),
}

impl Node {
    fn idx(self) -> usize {
        match self {
            Node::P => 0,
            Node::D(d) => 1 + d,
        }
    }

    fn name(self) -> String {
        match self {
            Node::P => "p".into(),
            Node::D(d) => format!("d{d}"),
        }
    }

    /// The transport agent of the engine's rank `rank`.
    fn agent(self, rank: u16) -> String {
        format!("{}-r{rank}", self.name())
    }
}

#[derive(Debug)]
enum Ev {
    Create(usize),
    /// Layer-wise pull: P's prefill starts (the handoff exists from now on), then ends.
    PrefillStart(usize),
    PrefillEnd(usize),
    LayerSaved(usize, u32),
    Arrive(usize),
    Admit(usize),
    Fate(usize),
    /// A frame arrives at `to` on its end `conn` of a connection.
    Frame {
        to: Node,
        conn: ConnId,
        msg: Message,
    },
    Closed {
        to: Node,
        conn: ConnId,
    },
    ConnectFailed {
        d: usize,
        engine: String,
        attempt: u64,
    },
    JobEnd {
        node: Node,
        rank: u16,
        job: JobId,
        ok: bool,
    },
    Aborted {
        node: Node,
        rank: u16,
        job: JobId,
    },
    /// A worker put a grant in force on its transport.
    Granted {
        node: Node,
        rank: u16,
        grant: GrantId,
    },
    Notify {
        to: Node,
        rank: u16,
        from: String,
        bytes: Vec<u8>,
    },
    DeadAgent {
        to: Node,
        agents: Vec<String>,
    },
    DecodeDone {
        d: usize,
        req: u64,
    },
    Kill(Node, bool),
    Stranger,
    ProxyRelease,
}

struct Pool {
    /// Block → who holds it (a handoff on P, a request on D).
    owner: HashMap<u32, u128>,
    free: Vec<u32>,
}

impl Pool {
    fn new() -> Self {
        Pool {
            owner: HashMap::new(),
            free: (0..POOL_BLOCKS).rev().collect(),
        }
    }
    fn alloc(&mut self, n: usize, owner: u128) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let b: Vec<u32> = (0..n).filter_map(|_| self.free.pop()).collect();
        for x in &b {
            self.owner.insert(*x, owner);
        }
        Some(b)
    }
}

struct Job {
    /// The engine at the other end, and the rank there.
    peer: Node,
    peer_rank: u16,
    /// Delivered to the peer once the job landed.
    notifications: Vec<Vec<u8>>,
    agent: String,
}

struct Engine {
    core: SimCore,
    /// Its TP size: one worker (and transport agent) per rank.
    tp: u16,
    alive: bool,
    pool: Pool,
    jobs: BTreeMap<JobId, Job>,
    /// D: its prefix-cache blocks.
    prefix: Vec<u32>,
}

#[derive(Default)]
struct Req {
    handoff: Option<HandoffId>,
    params: Option<KvTransferParams>,
    p_blocks: Vec<u32>,
    /// D's request id and its blocks.
    d_req: u64,
    d_blocks: Vec<u32>,
    tracked: bool,
    outcome: bool,
    aborted: bool,
    /// Layer-wise pull: P's prefill writes the blocks (started, not ended), and the layers it
    /// saved so far.
    filling: bool,
}

/// What a run found.
#[derive(Debug, Default)]
pub struct Report {
    /// Every output of every core, in order, with its time and engine: two runs of one schedule
    /// must give the same transcript, byte for byte.
    pub transcript: String,
    pub violations: Vec<String>,
    pub ready: usize,
    pub recomputed: usize,
    pub anonymous_refused: usize,
    /// Each engine's trace (P, D0, D1), as JSON lines.
    pub traces: Vec<Vec<String>>,
}

/// A busy schedule: two D engines, many handoffs per peer (heartbeats, block queries and
/// releases batch them), one abort, failed transfers and a D killed mid-run.
pub fn busy_schedule() -> (Vec<ReqSpec>, Faults) {
    let reqs = (0..10u64)
        .map(|i| ReqSpec {
            at_ms: i * 7,
            d: (i % 2) as usize,
            blocks: 1 + (i % 4) as u8,
            lag_ms: i % 3,
            admit_after_ms: 300 + 40 * i,
            fate: if i == 5 { 2 } else { 0 },
            fate_ms: 150,
            cached: 0,
        })
        .collect();
    let faults = Faults {
        max_delay_ms: 15,
        transfer_ms: 60,
        fail_pct: 10,
        kill_d: Some((1, 400, true)),
        seed: 11,
        ..Faults::default()
    };
    (reqs, faults)
}

pub struct Sim {
    now: Duration,
    mode: TransferMode,
    /// Pull mode as a layer-wise pull: both legs at once, D reads each layer once P saved it.
    layerwise: bool,
    reqs: Vec<ReqSpec>,
    state: Vec<Req>,
    faults: Faults,
    rng: Rng,
    queue: BinaryHeap<Reverse<(Duration, u64)>>,
    events: HashMap<u64, Ev>,
    seq: u64,
    engines: Vec<Engine>,
    /// Each connection end → the other end.
    links: HashMap<(Node, ConnId), (Node, ConnId)>,
    /// A D end still waiting for its HelloReply: (engine, attempt).
    connecting: HashMap<(Node, ConnId), (String, u64)>,
    /// Per direction, when its last frame arrives (frames keep their order).
    last_arrival: HashMap<(Node, ConnId), Duration>,
    next_conn: ConnId,
    /// Connection ends whose first frame is the handshake (the accepting side).
    pending_accept: HashSet<(Node, ConnId)>,
    by_d_req: HashMap<(usize, u64), usize>,
    dcfg: ConsumerConfig,
    /// What the simulation itself saw go wrong (a core refusing what it should take, a dial
    /// to a stranger); the rules are the cluster checker's.
    errs: Vec<String>,
    cluster: Rc<RefCell<Cluster>>,
    report: Report,
    pub trace: bool,
    /// The model's KV cache groups (one full group unless a run says otherwise).
    groups: KvGroups,
}

impl Sim {
    pub fn new(mode: TransferMode, reqs: Vec<ReqSpec>, faults: Faults) -> Sim {
        Sim::with_tp(mode, reqs, faults, 1, 1)
    }

    /// P at TP `p_tp`, both D engines at `d_tp`.
    pub fn with_tp(
        mode: TransferMode,
        reqs: Vec<ReqSpec>,
        faults: Faults,
        p_tp: u16,
        d_tp: u16,
    ) -> Sim {
        Sim::with_groups(mode, reqs, faults, (p_tp, d_tp), KvGroups::single())
    }

    /// A hybrid model: layer 1 keeps every token, layer 0 a sliding window of `window` tokens.
    /// Each engine's block list of a handoff is then each group's moved blocks (the window's
    /// tail of the second), as a hybrid KV cache manager hands them out.
    pub fn hybrid(window: u32) -> KvGroups {
        handoff_plan::testing::hybrid_groups(&[1], window, LAYERS)
    }

    /// A hybrid SSM model: layer 1 keeps every token, layer 0 a recurrent state (one block a
    /// handoff, whatever the prompt).
    pub fn with_state() -> KvGroups {
        handoff_plan::testing::state_groups(&[1], LAYERS)
    }

    /// P at TP `p_tp`, both D engines at `d_tp`, the model's layers in `groups`.
    pub fn with_groups(
        mode: TransferMode,
        reqs: Vec<ReqSpec>,
        faults: Faults,
        (p_tp, d_tp): (u16, u16),
        groups: KvGroups,
    ) -> Sim {
        // Short timings, so partitions and slow reads outlast them; P's per-peer staging quota
        // small, so that generated schedules reach it.
        let (pcfg, dcfg) = simulation_configs(p_tp, d_tp);
        let cluster = Rc::new(RefCell::new(Cluster::new()));
        let core = |name: &str, role, tp: u16| {
            SimCore::new(
                CoreConfig {
                    engine_id: name.into(),
                    role,
                    mode,
                    model: "m".into(),
                    dtype: "bf16".into(),
                    advertise_host: name.into(),
                    side_channel_port: 7000,
                    producer: pcfg.clone(),
                    consumer: dcfg.clone(),
                    opaque_blocks: false,
                    kv_digest: false,
                    peer_hosts: Vec::new(),
                    protocol_version: handoff_proto::PROTOCOL_VERSION,
                    // Layer-wise pulls are asked for only in the runs that test them.
                    layerwise_pull: true,
                    layer_reports: Default::default(),
                },
                (0..tp)
                    .map(|rank| WorkerHello {
                        rank,
                        layout: RankLayout::cross_layer(spec(tp), u32::from(rank), POOL_BLOCKS, 0)
                            .expect("a valid layout"),
                        agent: format!("{name}-r{rank}"),
                        metadata: vec![1],
                        memory: Default::default(),
                        groups: groups.clone(),
                    })
                    .collect(),
                cluster.clone(),
            )
        };
        let engine = |c, tp| Engine {
            core: c,
            tp,
            alive: true,
            pool: Pool::new(),
            jobs: BTreeMap::new(),
            prefix: Vec::new(),
        };
        let mut sim = Sim {
            now: Duration::ZERO,
            mode,
            layerwise: false,
            state: reqs.iter().map(|_| Req::default()).collect(),
            rng: Rng(faults.seed | 1),
            faults: faults.clone(),
            reqs,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            seq: 0,
            engines: vec![
                engine(core("p", Role::Prefill, p_tp), p_tp),
                engine(core("d0", Role::Decode, d_tp), d_tp),
                engine(core("d1", Role::Decode, d_tp), d_tp),
            ],
            links: HashMap::new(),
            connecting: HashMap::new(),
            last_arrival: HashMap::new(),
            next_conn: 1,
            pending_accept: HashSet::new(),
            by_d_req: HashMap::new(),
            dcfg,
            errs: Vec::new(),
            cluster,
            report: Report::default(),
            trace: std::env::var_os("SIM_TRACE").is_some(),
            groups,
        };
        for e in &mut sim.engines[1..] {
            e.prefix = e
                .pool
                .alloc(PREFIX_BLOCKS, PREFIX)
                .expect("room for the prefix cache");
        }
        for i in 0..sim.reqs.len() {
            let at = ms(sim.reqs[i].at_ms);
            sim.at(at, Ev::Create(i));
        }
        if let Some((d, t, fin)) = faults.kill_d {
            sim.at(ms(t), Ev::Kill(Node::D(d % 2), fin));
        }
        if let Some((t, fin)) = faults.kill_p {
            sim.at(ms(t), Ev::Kill(Node::P, fin));
        }
        if let Some(t) = faults.stranger_at_ms {
            sim.at(ms(t), Ev::Stranger);
        }
        if let Some(t) = faults.proxy_release_at_ms {
            sim.at(ms(t), Ev::ProxyRelease);
        }
        sim
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rng.below(n)
    }

    fn at(&mut self, t: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn eng(&mut self, n: Node) -> &mut Engine {
        &mut self.engines[n.idx()]
    }

    fn alive(&self, n: Node) -> bool {
        self.engines[n.idx()].alive
    }

    /// When a frame sent now from `from` to `to` arrives.
    fn arrival(&mut self, from: (Node, ConnId), to: Node) -> Duration {
        let delay = ms(self.below(self.faults.max_delay_ms + 1));
        let mut t = self.now + delay;
        if let Some((start, len)) = self.faults.partition {
            let (start, end) = (ms(start), ms(start + len));
            let crosses = matches!((from.0, to), (Node::P, Node::D(_)) | (Node::D(_), Node::P));
            if crosses && t >= start && t < end {
                t = end + delay;
            }
        }
        let last = self.last_arrival.entry(from).or_default();
        t = t.max(*last);
        *last = t;
        t
    }

    pub fn run(mut self) -> Report {
        let end = ms(120_000);
        loop {
            let next_ev = self.queue.peek().map(|Reverse((t, _))| *t);
            let timers: Vec<Duration> = (0..3)
                .filter(|&i| self.engines[i].alive)
                .filter_map(|i| self.engines[i].core.poll_timeout())
                .collect();
            let next = timers.into_iter().chain(next_ev).min();
            let Some(t) = next else { break };
            if t > end {
                break;
            }
            self.now = self.now.max(t);
            if next_ev.is_some_and(|e| e <= self.now) {
                let Some(Reverse((_, seq))) = self.queue.pop() else {
                    break;
                };
                if let Some(ev) = self.events.remove(&seq) {
                    if self.trace {
                        eprintln!("{:?} {ev:?}", self.now);
                    }
                    self.handle(ev);
                }
            }
            for i in 0..3 {
                let now = self.now;
                let e = &mut self.engines[i];
                if e.alive && e.core.poll_timeout().is_some_and(|x| x <= now) {
                    let _ = e.core.handle(Input::Timeout, now);
                }
            }
            self.drain();
        }
        for e in &mut self.engines {
            e.core.at_end();
        }
        let names = ["P", "D0", "D1"];
        let cluster = std::mem::take(&mut *self.cluster.borrow_mut());
        for (e, v) in cluster.into_violations() {
            self.errs.push(format!(
                "rule {}: {} after input {} at {} ms: {}",
                v.rule, names[e], v.input, v.at_ms, v.what
            ));
        }
        self.report.violations = self.errs;
        self.report.traces = self
            .engines
            .iter_mut()
            .map(|e| std::mem::take(&mut e.core.trace))
            .collect();
        self.report
    }

    /// Re-inserts a fixed bug into engine `node`'s core before the run (replay tests).
    pub fn with_bug(mut self, node: Node, bug: handoff_core::KnownBug) -> Sim {
        self.eng(node).core.core_mut().reinsert(bug);
        self
    }

    /// The same schedule run as layer-wise pulls (pull mode only).
    pub fn layerwise(mut self) -> Sim {
        self.layerwise = self.mode == TransferMode::Pull;
        self
    }

    /// A layer-wise pull's legs as the proxy sends them: P's (to prefill under the proxy's id)
    /// and D's (P found by its info, no block ids).
    /// The two legs a router sends at once in a layer-wise pull or a push: P's, and D's.
    fn both_legs(&self, i: usize, handoff: HandoffId) -> (KvTransferParams, KvTransferParams) {
        let p = KvTransferParams {
            do_remote_decode: true,
            handoff_id: Some(handoff),
            transfer_mode: Some(self.mode),
            layerwise: self.layerwise.then_some(true),
            ..Default::default()
        };
        let d = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("p".into()),
            remote_host: Some("p".into()),
            remote_port: Some(7000),
            tp_size: Some(self.engines[0].tp),
            remote_num_tokens: Some(self.tokens(i)),
            epoch: Some(1),
            ..p.clone()
        };
        (
            p,
            KvTransferParams {
                do_remote_decode: false,
                ..d
            },
        )
    }

    /// P's blocks for request `i`'s prompt, owned by `handoff` in P's pool (none when full).
    fn p_blocks_for(&mut self, i: usize, handoff: HandoffId) -> Option<Vec<u32>> {
        let n = self.moved_blocks(i, 0);
        self.eng(Node::P)
            .pool
            .alloc(n, u128::from_le_bytes(handoff.to_bytes()))
    }

    /// How many blocks request `i`'s handoff lists after D's first `cached` blocks: every block
    /// of the prompt for one group, each group's moved blocks for a hybrid model.
    fn moved_blocks(&self, i: usize, cached: usize) -> usize {
        let ranges = self
            .groups
            .moved(self.tokens(i), 16, cached as u32)
            .expect("a window of at least one token");
        ranges.iter().map(|r| r.len()).sum()
    }

    fn tokens(&self, i: usize) -> u32 {
        u32::from(self.reqs[i].blocks) * 16 - 3
    }
}
