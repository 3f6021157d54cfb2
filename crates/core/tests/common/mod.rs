//! A discrete-event simulation of one P engine and two D engines around the real
//! [`ConnectorCore`]s: the code that ships, not a copy of it. The simulation plays every
//! executor and worker: it carries side-channel frames (per-connection order, delays,
//! partitions), opens connections, runs the transfer jobs the cores post (they take time, fail,
//! hang until aborted), delivers their completion notifications, kills engines with or without a
//! dead-peer signal, lets clients abort, D reject and retry requests, the proxy release, and a
//! stranger talk to P without a handshake. It owns the block pools and checks rules 1–7 against
//! them as the cores act.

#![allow(dead_code)]

mod sim_core;

pub use sim_core::SimCore;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::time::Duration;

use handoff_core::{
    ConnId, ConnectorEvent, CoreConfig, Hooks, Input, JobId, PrefillEnd, PrefillOutcome, Ready,
    Role, TransferJob, WorkerHello, WorkerOp, WorkerReport,
};
use handoff_ledger::testing::simulation_configs;
use handoff_ledger::{ConsumerConfig, ProducerConfig};
use handoff_plan::testing::{tiny_spec, Rng};
use handoff_plan::{KvSpec, RankLayout};
use handoff_proto::xfer::{GrantId, XferOp};
use handoff_proto::{
    Epoch, HandoffId, Heartbeat, HeartbeatEntry, KvTransferParams, Message, ReleaseReason,
    TransferMode,
};

pub const POOL_BLOCKS: u32 = 64;
const LAYERS: u32 = 2;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn spec() -> KvSpec {
    tiny_spec(LAYERS)
}

/// Bytes of one block of every layer (the cross-layer layout: block `b` is one range).
fn block_stride() -> u64 {
    spec().block_bytes() * u64::from(LAYERS)
}

fn blocks_of(offset: u64, len: u64) -> impl Iterator<Item = u32> {
    let s = block_stride();
    (offset / s) as u32..=((offset + len.max(1) - 1) / s) as u32
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

    /// The engine's transport agent (rank 0).
    fn agent(self) -> String {
        match self {
            Node::P => "p-r0".into(),
            Node::D(d) => format!("d{d}-r0"),
        }
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
        job: JobId,
        ok: bool,
    },
    Aborted {
        node: Node,
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
        from: String,
        bytes: Vec<u8>,
    },
    DeadAgent {
        to: Node,
        agent: String,
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
    op: XferOp,
    /// The engine at the other end.
    peer: Node,
    /// Blocks read (P's, for a READ; the poster's own, for a WRITE).
    src: Vec<u32>,
    /// Blocks written (D's).
    dst: Vec<u32>,
    /// Delivered to the peer once the job landed.
    notifications: Vec<Vec<u8>>,
    agent: String,
}

struct Engine {
    core: SimCore,
    alive: bool,
    pool: Pool,
    jobs: BTreeMap<JobId, Job>,
    /// What the transport would serve: grant → (op, peer agents, blocks).
    grants: HashMap<GrantId, (XferOp, Vec<String>, Vec<u32>)>,
    /// D: its prefix-cache blocks.
    prefix: Vec<u32>,
}

#[derive(Default)]
struct Req {
    handoff: Option<HandoffId>,
    params: Option<KvTransferParams>,
    p_blocks: Vec<u32>,
    /// D's request id, its blocks, and when it arrived.
    d_req: u64,
    d_blocks: Vec<u32>,
    arrived: Option<Duration>,
    tracked: bool,
    outcome: Option<&'static str>,
    aborted: bool,
    /// Layer-wise pull: P's prefill writes the blocks (started, not ended), and the layers it
    /// saved so far.
    filling: bool,
    layers_saved: u32,
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
    /// D blocks and by which handoff's transfer they were filled.
    landed: Vec<HashMap<u32, u128>>,
    by_d_req: HashMap<(usize, u64), usize>,
    dcfg: ConsumerConfig,
    errs: Vec<String>,
    report: Report,
    pub trace: bool,
}

impl Sim {
    pub fn new(mode: TransferMode, reqs: Vec<ReqSpec>, faults: Faults) -> Sim {
        // The ledger simulation's short timings, so partitions and slow reads outlast them; P's
        // per-peer staging quota left at its default (the ledger simulation exercises that one).
        let (mut pcfg, dcfg) = simulation_configs(1, 1);
        pcfg.staging_per_peer = ProducerConfig::default().staging_per_peer;
        let core = |name: &str, role| {
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
                vec![WorkerHello {
                    rank: 0,
                    layout: RankLayout::cross_layer(spec(), 0, POOL_BLOCKS, 0).unwrap(),
                    agent: format!("{name}-r0"),
                    metadata: vec![1],
                    memory: Default::default(),
                }],
            )
        };
        let engine = |c| Engine {
            core: c,
            alive: true,
            pool: Pool::new(),
            jobs: BTreeMap::new(),
            grants: HashMap::new(),
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
                engine(core("p", Role::Prefill)),
                engine(core("d0", Role::Decode)),
                engine(core("d1", Role::Decode)),
            ],
            links: HashMap::new(),
            connecting: HashMap::new(),
            last_arrival: HashMap::new(),
            next_conn: 1,
            pending_accept: HashSet::new(),
            landed: vec![HashMap::new(), HashMap::new()],
            by_d_req: HashMap::new(),
            dcfg,
            errs: Vec::new(),
            report: Report::default(),
            trace: std::env::var_os("SIM_TRACE").is_some(),
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
        self.final_checks();
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
            tp_size: Some(1),
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
        let n = usize::from(self.reqs[i].blocks);
        self.eng(Node::P)
            .pool
            .alloc(n, u128::from_le_bytes(handoff.to_bytes()))
    }

    fn tokens(&self, i: usize) -> u32 {
        u32::from(self.reqs[i].blocks) * 16 - 3
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Create(i) => {
                if !self.alive(Node::P) {
                    return;
                }
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&self.rng.next_u64().to_le_bytes());
                id[8..].copy_from_slice(&(i as u64 + 1).to_le_bytes());
                let handoff = HandoffId::from_bytes(id);
                if self.layerwise || self.mode == TransferMode::Push {
                    // Both legs leave at once; either may arrive first.
                    let (_, d_params) = self.both_legs(i, handoff);
                    self.state[i].handoff = Some(handoff);
                    self.state[i].params = Some(d_params);
                    let lag = ms(self.reqs[i].lag_ms);
                    let (p_at, d_at) = if self.reqs[i].lag_ms % 2 == 1 {
                        (now + lag, now)
                    } else {
                        (now, now + lag)
                    };
                    self.at(p_at, Ev::PrefillStart(i));
                    self.at(d_at, Ev::Arrive(i));
                    return;
                }
                let Some(blocks) = self.p_blocks_for(i, handoff) else {
                    return;
                };
                let tokens = self.tokens(i);
                let request = format!("r{i}");
                let leg = KvTransferParams::for_prefill_leg();
                let p = self.engines[0].core.at(now);
                let ended = p
                    .prefill_started(&request, &leg, handoff, blocks.clone(), tokens)
                    .and_then(|_| p.prefill_ended(&request, PrefillOutcome::Finished));
                let params = match ended {
                    Ok(PrefillEnd {
                        params: Some(prm),
                        holding: Some(_),
                    }) => prm,
                    other => {
                        self.errs
                            .push(format!("P refused to create handoff {i}: {other:?}"));
                        return;
                    }
                };
                self.state[i].handoff = Some(handoff);
                self.state[i].params = Some(params);
                self.state[i].p_blocks = blocks;
                let lag = ms(self.reqs[i].lag_ms);
                self.at(now + lag, Ev::Arrive(i));
            }
            Ev::PrefillStart(i) => {
                let Some(handoff) = self.state[i].handoff else {
                    return;
                };
                if !self.alive(Node::P) {
                    return;
                }
                let Some(blocks) = self.p_blocks_for(i, handoff) else {
                    return;
                };
                let (p_params, _) = self.both_legs(i, handoff);
                let tokens = self.tokens(i);
                match self.engines[0].core.at(now).prefill_started(
                    &format!("r{i}"),
                    &p_params,
                    handoff,
                    blocks.clone(),
                    tokens,
                ) {
                    Ok(Some(h)) if h == handoff => {}
                    other => {
                        self.errs
                            .push(format!("P refused the prefill of {i}: {other:?}"));
                        return;
                    }
                }
                self.state[i].p_blocks = blocks;
                self.state[i].filling = true;
                for l in 0..LAYERS {
                    self.at(now + ms(20 * u64::from(l + 1)), Ev::LayerSaved(i, l));
                }
                self.at(now + ms(20 * u64::from(LAYERS) + 5), Ev::PrefillEnd(i));
            }
            Ev::PrefillEnd(i) => {
                if !self.alive(Node::P) || !self.state[i].filling {
                    return;
                }
                self.state[i].filling = false;
                let ended = self.engines[0]
                    .core
                    .at(now)
                    .prefill_ended(&format!("r{i}"), PrefillOutcome::Finished);
                if !matches!(
                    ended,
                    Ok(PrefillEnd {
                        params: Some(_),
                        holding: Some(_)
                    })
                ) {
                    self.errs
                        .push(format!("P refused to end the prefill of {i}: {ended:?}"));
                }
            }
            Ev::LayerSaved(i, l) => {
                if self.alive(Node::P) && self.state[i].filling {
                    self.state[i].layers_saved = self.state[i].layers_saved.max(l + 1);
                    self.engines[0]
                        .core
                        .at(now)
                        .layers_saved(&format!("r{i}"), l + 1);
                }
            }
            Ev::Arrive(i) => {
                let d = self.reqs[i].d % 2;
                let Some(params) = self.state[i].params.clone() else {
                    return;
                };
                if self.reqs[i].fate == 4 {
                    // The proxy could not reach D: it releases at P.
                    if self.alive(Node::P) {
                        let _ = self.engines[0].core.at(now).release_from_proxy(&params);
                    }
                    return;
                }
                if !self.alive(Node::D(d)) {
                    if self.alive(Node::P) {
                        let _ = self.engines[0].core.at(now).release_from_proxy(&params);
                    }
                    return;
                }
                let tokens = self.tokens(i);
                let core = &mut self.engines[1 + d].core;
                if self.reqs[i].fate == 1 {
                    let _ = core.at(now).reject(&params);
                    return;
                }
                let req = (i as u64) * 2;
                self.state[i].d_req = req;
                self.by_d_req.insert((d, req), i);
                match core.at(now).request_arrived(req, &params, tokens) {
                    Ok(_) => {
                        self.state[i].tracked = true;
                        self.state[i].arrived = Some(now);
                        let admit = ms(self.reqs[i].admit_after_ms);
                        self.at(now + admit, Ev::Admit(i));
                        if matches!(self.reqs[i].fate, 2 | 3) {
                            self.at(now + ms(self.reqs[i].fate_ms), Ev::Fate(i));
                        }
                    }
                    Err(e) => self.errs.push(format!("D{d} refused request {i}: {e}")),
                }
            }
            Ev::Admit(i) => {
                let d = self.reqs[i].d % 2;
                let st = &self.state[i];
                if !self.alive(Node::D(d)) || st.outcome.is_some() || st.aborted {
                    return;
                }
                let req = st.d_req;
                let n = usize::from(self.reqs[i].blocks);
                let hit = usize::from(self.reqs[i].cached)
                    .min(n.saturating_sub(1))
                    .min(PREFIX_BLOCKS);
                let Some(blocks) = self.engines[1 + d].pool.alloc(n - hit, u128::from(req)) else {
                    return; // stays queued until its deadline
                };
                for b in &blocks {
                    self.landed[d].remove(b);
                }
                let cached = self.engines[1 + d].prefix[..hit].to_vec();
                match self.engines[1 + d]
                    .core
                    .at(now)
                    .blocks_allocated(req, cached, blocks.clone())
                {
                    Ok(()) => self.state[i].d_blocks = blocks,
                    Err(_) => self.free(Node::D(d), &blocks, "refused allocation"),
                }
            }
            Ev::Fate(i) => {
                let d = self.reqs[i].d % 2;
                if !self.alive(Node::D(d)) || self.state[i].outcome.is_some() {
                    return;
                }
                let Some(params) = self.state[i].params.clone() else {
                    return;
                };
                let core = &mut self.engines[1 + d].core;
                if self.reqs[i].fate == 2 {
                    self.state[i].aborted = true;
                    core.at(now)
                        .request_ended(self.state[i].d_req, ReleaseReason::Aborted);
                    // The prompt blocks stay the connector's until it releases them.
                } else {
                    // A retry of the same request hits a full queue: D refuses it.
                    let _ = core.at(now).reject(&params);
                }
            }
            Ev::Frame { to, conn, msg } => {
                if !self.alive(to) {
                    return;
                }
                if let Some((engine, attempt)) = self.connecting.remove(&(to, conn)) {
                    let reply = msg;
                    self.eng(to).core.input(
                        Input::Connected {
                            engine,
                            attempt,
                            conn,
                            reply,
                        },
                        now,
                    );
                    return;
                }
                if self.pending_accept.remove(&(to, conn)) {
                    self.eng(to).core.input(
                        Input::Accepted {
                            conn,
                            msg,
                            proven: None,
                        },
                        now,
                    );
                } else {
                    self.eng(to).core.input(Input::Frame { conn, msg }, now);
                }
            }
            Ev::Closed { to, conn } => {
                self.connecting.remove(&(to, conn));
                if self.alive(to) && self.links.remove(&(to, conn)).is_some() {
                    self.eng(to).core.input(Input::Closed { conn }, now);
                }
            }
            Ev::ConnectFailed { d, engine, attempt } => {
                if self.alive(Node::D(d)) {
                    self.engines[1 + d].core.input(
                        Input::ConnectFailed {
                            engine,
                            attempt,
                            error: "refused".into(),
                        },
                        now,
                    );
                }
            }
            Ev::JobEnd { node, job, ok } => {
                if !self.alive(node) {
                    return;
                }
                let Some(j) = self.eng(node).jobs.remove(&job) else {
                    return; // aborted
                };
                if ok {
                    let d = match (node, j.peer) {
                        (Node::D(d), _) | (_, Node::D(d)) => d,
                        _ => return,
                    };
                    for b in &j.dst {
                        if let Some(&owner) = self.engines[1 + d].pool.owner.get(b) {
                            self.landed[d].insert(*b, owner);
                        }
                    }
                    let from = j.agent.clone();
                    for bytes in j.notifications {
                        let t = self.arrival((node, u64::MAX - job.0), j.peer);
                        self.at(
                            t,
                            Ev::Notify {
                                to: j.peer,
                                from: from.clone(),
                                bytes,
                            },
                        );
                    }
                }
                let report = WorkerReport {
                    rank: 0,
                    ended: vec![(job, ok)],
                    ..Default::default()
                };
                self.eng(node).core.input(Input::WorkerReport(report), now);
            }
            Ev::Granted { node, rank, grant } => {
                if self.alive(node) {
                    let report = WorkerReport {
                        rank,
                        granted: vec![(grant, true)],
                        ..Default::default()
                    };
                    self.eng(node).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::Aborted { node, job } => {
                if self.alive(node) {
                    let report = WorkerReport {
                        rank: 0,
                        ended: vec![(job, false)],
                        ..Default::default()
                    };
                    self.eng(node).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::Notify { to, from, bytes } => {
                if self.alive(to) {
                    let report = WorkerReport {
                        rank: 0,
                        notifications: vec![(from, bytes)],
                        ..Default::default()
                    };
                    self.eng(to).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::DeadAgent { to, agent } => {
                if self.alive(to) {
                    let report = WorkerReport {
                        rank: 0,
                        dead_agents: vec![agent],
                        ..Default::default()
                    };
                    self.eng(to).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::DecodeDone { d, req } => {
                if let Some(&i) = self.by_d_req.get(&(d, req)) {
                    let blocks = std::mem::take(&mut self.state[i].d_blocks);
                    if self.alive(Node::D(d)) {
                        self.free(Node::D(d), &blocks, "request done");
                    }
                }
            }
            Ev::Kill(node, fin) => self.kill(node, fin),
            Ev::Stranger => self.stranger(),
            Ev::ProxyRelease => {
                let params = self.state.iter().rev().find_map(|s| s.params.clone());
                if let (true, Some(prm)) = (self.alive(Node::P), params) {
                    let _ = self.engines[0].core.at(now).release_from_proxy(&prm);
                }
            }
        }
    }

    /// Carries out every engine's `Ready` batch until none is left.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            for i in 0..3 {
                if !self.engines[i].alive || !self.engines[i].core.has_ready() {
                    continue;
                }
                any = true;
                let r = self.engines[i].core.ready();
                let node = match i {
                    0 => Node::P,
                    d => Node::D(d - 1),
                };
                use std::fmt::Write as _;
                let _ = writeln!(self.report.transcript, "{:?} {node:?} {r:?}", self.now);
                self.carry_out(node, &r);
                self.engines[i].core.advance(r);
            }
            if !any {
                break;
            }
        }
    }

    fn carry_out(&mut self, node: Node, r: &Ready) {
        let now = self.now;
        // The workers' transports: a grant is in force (and confirmed) a little later (now and
        // then much later: a busy worker), a revoke at once.
        for (rank, op) in &r.worker_ops {
            match op {
                WorkerOp::Grant {
                    grant,
                    op,
                    agents,
                    blocks,
                    ..
                } => {
                    self.eng(node)
                        .grants
                        .insert(*grant, (*op, agents.clone(), blocks.clone()));
                    let t = match self.below(4) {
                        0 => now + ms(self.below(300)),
                        _ => now + ms(self.below(4)),
                    };
                    self.at(
                        t,
                        Ev::Granted {
                            node,
                            rank: *rank,
                            grant: *grant,
                        },
                    );
                }
                WorkerOp::Revoke { grant } => {
                    self.eng(node).grants.remove(grant);
                }
                _ => {}
            }
        }
        for (conn, msg) in &r.messages {
            if let Some(&(to, their)) = self.links.get(&(node, *conn)) {
                let t = self.arrival((node, *conn), to);
                self.at(
                    t,
                    Ev::Frame {
                        to,
                        conn: their,
                        msg: msg.clone(),
                    },
                );
            }
        }
        for conn in &r.closes {
            if let Some((to, their)) = self.links.remove(&(node, *conn)) {
                let t = self.arrival((node, *conn), to);
                self.at(t, Ev::Closed { to, conn: their });
            }
        }
        for c in &r.connects {
            let Node::D(d) = node else {
                self.errs.push(format!("{node:?} dials {}", c.addr));
                continue;
            };
            if c.addr != "p:7000" || c.engine != "p" {
                self.errs
                    .push(format!("D{d} dials {} ({})", c.addr, c.engine));
                continue;
            }
            if !self.alive(Node::P) {
                self.at(
                    now + ms(50),
                    Ev::ConnectFailed {
                        d,
                        engine: c.engine.clone(),
                        attempt: c.attempt,
                    },
                );
                continue;
            }
            let (mine, theirs) = (self.next_conn, self.next_conn + 1);
            self.next_conn += 2;
            self.links.insert((node, mine), (Node::P, theirs));
            self.links.insert((Node::P, theirs), (node, mine));
            self.connecting
                .insert((node, mine), (c.engine.clone(), c.attempt));
            self.pending_accept.insert((Node::P, theirs));
            let t = self.arrival((node, mine), Node::P);
            self.at(
                t,
                Ev::Frame {
                    to: Node::P,
                    conn: theirs,
                    msg: c.hello.clone(),
                },
            );
        }
        for (_, job) in &r.transfers_to_post {
            self.post(node, job);
        }
        for (_, job) in &r.transfers_to_abort {
            // The worker lets the transfer go and reports it ended, failed.
            if self.eng(node).jobs.remove(job).is_some() {
                self.at(now, Ev::Aborted { node, job: *job });
            }
        }
        for o in &r.observations {
            if matches!(o, handoff_core::Observation::AnonymousRefused) {
                self.report.anonymous_refused += 1;
            }
        }
        for ev in &r.events {
            self.event(node, ev);
        }
    }

    fn post(&mut self, node: Node, job: &TransferJob) {
        let now = self.now;
        let part = &job.parts[0];
        let Some(peer) = [Node::P, Node::D(0), Node::D(1)]
            .into_iter()
            .find(|n| n.agent() == part.agent)
        else {
            self.errs
                .push(format!("{node:?} posts to unknown agent {}", part.agent));
            return;
        };
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for p in &job.parts {
            for d in &p.descs {
                local.extend(blocks_of(d.local_offset, d.len));
                remote.extend(blocks_of(d.remote_offset, d.len));
            }
        }
        local.sort_unstable();
        local.dedup();
        remote.sort_unstable();
        remote.dedup();
        let (src, dst) = match job.op {
            XferOp::Read => (remote, local),
            XferOp::Write => (local, remote),
        };
        // Rule 2 / rule 3 at post time: the blocks on both sides belong to this transfer's
        // handoff (P) and request (D).
        let d = match (node, peer) {
            (Node::D(d), Node::P) | (Node::P, Node::D(d)) => d,
            _ => {
                self.errs.push(format!("{node:?} posts to {peer:?}"));
                return;
            }
        };
        let d_owner: HashSet<u128> = dst
            .iter()
            .filter_map(|b| self.engines[1 + d].pool.owner.get(b).copied())
            .collect();
        let p_owner: HashSet<u128> = src
            .iter()
            .filter_map(|b| self.engines[0].pool.owner.get(b).copied())
            .collect();
        let d_ok = d_owner.len() == 1
            && dst
                .iter()
                .all(|b| self.engines[1 + d].pool.owner.contains_key(b));
        let p_ok = p_owner.len() == 1
            && src
                .iter()
                .all(|b| self.engines[0].pool.owner.contains_key(b));
        if self.alive(Node::P) && !p_ok {
            self.errs.push(format!(
                "rule 2: {node:?} posts a {:?} of P blocks {src:?} that P does not hold for one handoff, at {now:?}",
                job.op
            ));
        }
        if self.alive(Node::D(d)) && !d_ok {
            self.errs.push(format!(
                "rule 3: {node:?} posts a {:?} into D{d} blocks {dst:?} that D does not hold for one request, at {now:?}",
                job.op
            ));
        }
        // Layer-wise pull: D reads no layer P has not saved yet (the cross-layer layout puts
        // layer `l` of a block at `l` block sizes into its range).
        if let (true, XferOp::Read, Some(h)) = (self.layerwise, job.op, p_owner.iter().next()) {
            let layer_bytes = spec().block_bytes();
            let stride = block_stride();
            let deepest = job
                .parts
                .iter()
                .flat_map(|p| &p.descs)
                .map(|x| {
                    let (first, last) = (x.remote_offset, x.remote_offset + x.len.max(1) - 1);
                    if last / stride != first / stride {
                        LAYERS - 1
                    } else {
                        ((last % stride) / layer_bytes) as u32
                    }
                })
                .max();
            let i = self.state.iter().position(|st| {
                st.handoff
                    .is_some_and(|x| u128::from_le_bytes(x.to_bytes()) == *h)
            });
            if let (Some(deepest), Some(i)) = (deepest, i) {
                let st = &self.state[i];
                let saved = if st.filling { st.layers_saved } else { LAYERS };
                if deepest >= saved && self.alive(Node::P) {
                    self.errs.push(format!(
                        "layer-wise: D{d} reads layer {deepest} of handoff {i} with {saved} saved, at {now:?}"
                    ));
                }
            }
        }
        if let (Some(h), Some(r)) = (p_owner.iter().next(), d_owner.iter().next()) {
            let matched = self
                .by_d_req
                .get(&(d, *r as u64))
                .and_then(|&i| self.state[i].handoff)
                .is_some_and(|x| u128::from_le_bytes(x.to_bytes()) == *h);
            if !matched {
                self.errs.push(format!(
                    "rule 4: a {:?} moves handoff {h:x}'s blocks into D{d} request {r}'s, at {now:?}",
                    job.op
                ));
            }
        }
        // The target's transport serves only what it granted to the poster's agent (a second
        // enforcement of rules 2 and 3, beside the ledgers).
        let touched = match job.op {
            XferOp::Read => &src,
            XferOp::Write => &dst,
        };
        let me = node.agent();
        let granted = touched.iter().all(|b| {
            self.eng(peer).grants.values().any(|(op, agents, blocks)| {
                *op == job.op && agents.contains(&me) && blocks.contains(b)
            })
        });
        if self.alive(peer) && !granted {
            self.errs.push(format!(
                "grant: {node:?} posts a {:?} of {peer:?} blocks {touched:?} outside any grant to it, at {now:?}",
                job.op
            ));
        }
        let notifications = job
            .parts
            .iter()
            .filter_map(|p| p.notification.clone())
            .collect();
        self.eng(node).jobs.insert(
            job.job,
            Job {
                op: job.op,
                peer,
                src,
                dst,
                notifications,
                agent: node.agent(),
            },
        );
        let roll = self.below(100) as u8;
        if roll < self.faults.hang_pct {
            return; // runs until aborted
        }
        let ok = roll >= self.faults.hang_pct + self.faults.fail_pct;
        let took = ms(1 + self.faults.transfer_min_ms + self.below(self.faults.transfer_ms + 1));
        self.at(
            now + took,
            Ev::JobEnd {
                node,
                job: job.job,
                ok,
            },
        );
    }

    fn event(&mut self, node: Node, ev: &ConnectorEvent) {
        let now = self.now;
        match (node, ev) {
            (_, ConnectorEvent::BlocksReleased { blocks, reason, .. }) => {
                self.free(node, blocks, reason);
            }
            (Node::D(d), ConnectorEvent::Ready { requests, blocks }) => {
                for r in requests {
                    let Some(&i) = self.by_d_req.get(&(d, *r)) else {
                        self.errs
                            .push(format!("D{d} ready for unknown request {r}"));
                        continue;
                    };
                    let h = self.state[i]
                        .handoff
                        .map(|h| u128::from_le_bytes(h.to_bytes()));
                    // Rule 4: every block decoded holds KV that landed for this handoff.
                    for b in blocks {
                        let filled = self.landed[d].get(b).copied();
                        if filled != Some(u128::from(*r)) {
                            self.errs.push(format!(
                                "rule 4: D{d} decodes request {r} (handoff {h:x?}) from block {b}, which no transfer of it filled, at {now:?}"
                            ));
                        }
                    }
                    self.outcome(d, i, "ready");
                    self.report.ready += 1;
                    self.at(now + ms(50), Ev::DecodeDone { d, req: *r });
                }
            }
            (Node::D(_), ConnectorEvent::RemoteStarted { .. }) => {}
            (Node::D(d), ConnectorEvent::Recompute { requests, .. })
            | (Node::D(d), ConnectorEvent::Failed { requests, .. }) => {
                for r in requests {
                    if let Some(&i) = self.by_d_req.get(&(d, *r)) {
                        self.outcome(d, i, "recomputed");
                        self.report.recomputed += 1;
                    }
                }
            }
            (Node::P, other) => self.errs.push(format!("P emits {other:?}")),
        }
    }

    fn outcome(&mut self, d: usize, i: usize, what: &'static str) {
        let now = self.now;
        if let Some(prev) = self.state[i].outcome {
            self.errs.push(format!(
                "request {i} on D{d}: a second outcome {what} after {prev}, at {now:?}"
            ));
        }
        if let Some(arrived) = self.state[i].arrived {
            // Rule 6: an outcome within the request's wait deadline (plus a timer tick).
            if now > arrived + self.dcfg.wait_deadline + ms(100) {
                self.errs.push(format!(
                    "rule 6: request {i} on D{d} ended at {now:?}, past its deadline (arrived {arrived:?})"
                ));
            }
        }
        self.state[i].outcome = Some(what);
    }

    fn free(&mut self, node: Node, blocks: &[u32], why: &str) {
        let now = self.now;
        if node == Node::P {
            let owners: HashSet<u128> = blocks
                .iter()
                .filter_map(|b| self.engines[0].pool.owner.get(b).copied())
                .collect();
            for (i, st) in self.state.iter().enumerate() {
                let mine = st
                    .handoff
                    .is_some_and(|h| owners.contains(&u128::from_le_bytes(h.to_bytes())));
                // A push's prefill writes no block once its last layer is saved; a layer-wise
                // pull's handoff holds its blocks until the prefill said it ended.
                let writing = st.filling && (self.layerwise || st.layers_saved < LAYERS);
                if mine && writing {
                    self.errs.push(format!(
                        "prefill: P frees handoff {i}'s blocks ({why}) while its prefill writes them, at {now:?}"
                    ));
                }
            }
        }
        // Rules 2 and 3: no block goes back under a transfer that may still touch it.
        for other in 0..3 {
            let owner = match other {
                0 => Node::P,
                d => Node::D(d - 1),
            };
            if !self.engines[other].alive {
                continue;
            }
            for (job, j) in &self.engines[other].jobs {
                let touched = match node {
                    Node::P if j.peer == Node::P || owner == Node::P => &j.src,
                    Node::D(d) if j.peer == Node::D(d) || owner == Node::D(d) => &j.dst,
                    _ => continue,
                };
                if let Some(b) = blocks.iter().find(|b| touched.contains(b)) {
                    let rule = if node == Node::P { 2 } else { 3 };
                    self.errs.push(format!(
                        "rule {rule}: {node:?} frees block {b} ({why}) while {owner:?}'s {:?} job {} touches it, at {now:?}",
                        j.op, job.0
                    ));
                }
            }
        }
        let e = &mut self.engines[node.idx()];
        for b in blocks {
            if e.pool.owner.get(b) == Some(&PREFIX) {
                self.errs.push(format!(
                    "rule 1: {node:?} frees block {b} ({why}) of D's prefix cache, which no transfer owns, at {now:?}"
                ));
                continue;
            }
            if e.pool.owner.remove(b).is_none() {
                self.errs.push(format!(
                    "rule 1: {node:?} frees block {b} ({why}), which it does not hold, at {now:?}"
                ));
                continue;
            }
            e.pool.free.push(*b);
        }
    }

    fn kill(&mut self, node: Node, fin: bool) {
        let now = self.now;
        self.eng(node).alive = false;
        self.eng(node).jobs.clear();
        let ends: Vec<((Node, ConnId), (Node, ConnId))> = self
            .links
            .iter()
            .filter(|((n, _), _)| *n == node)
            .map(|(a, b)| (*a, *b))
            .collect();
        for (mine, (to, their)) in ends {
            self.links.remove(&mine);
            if fin {
                self.at(now + ms(1), Ev::Closed { to, conn: their });
            }
        }
        if fin {
            let agent = node.agent();
            for to in [Node::P, Node::D(0), Node::D(1)] {
                if to != node {
                    self.at(
                        now + ms(2),
                        Ev::DeadAgent {
                            to,
                            agent: agent.clone(),
                        },
                    );
                }
            }
        }
    }

    /// A connection to P that never says hello: a heartbeat for a live handoff, then a
    /// release of it.
    fn stranger(&mut self) {
        let now = self.now;
        if !self.alive(Node::P) {
            return;
        }
        let Some(h) = self.state.iter().rev().find_map(|s| s.handoff) else {
            return;
        };
        let conn = self.next_conn;
        self.next_conn += 1;
        let hb = Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![HeartbeatEntry {
                handoff: h,
                epoch: Epoch::FIRST,
            }],
        });
        let p = &mut self.engines[0].core;
        p.input(
            Input::Accepted {
                conn,
                msg: hb,
                proven: None,
            },
            now,
        );
        let msg = Message::Release(handoff_proto::Release {
            handoff: h,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Done,
        });
        p.input(Input::Frame { conn, msg }, now);
    }

    fn final_checks(&mut self) {
        let p_alive = self.engines[0].alive;
        if p_alive {
            let held = self.engines[0].pool.owner.len();
            if held > 0 {
                self.errs
                    .push(format!("rule 5: P still holds {held} blocks at the end"));
            }
        }
        for d in 0..2 {
            if !self.engines[1 + d].alive {
                continue;
            }
            let held = self.engines[1 + d].pool.owner.len() - PREFIX_BLOCKS;
            if held > 0 {
                self.errs.push(format!(
                    "rule 1/6: D{d} still holds {held} blocks at the end"
                ));
            }
            for (i, st) in self.state.iter().enumerate() {
                if self.reqs[i].d % 2 == d && st.tracked && !st.aborted && st.outcome.is_none() {
                    self.errs
                        .push(format!("rule 6: request {i} on D{d} never ended"));
                }
            }
        }
        for (i, e) in self.engines.iter().enumerate() {
            if !e.alive {
                continue;
            }
            let m = e.core.memory();
            if m.reads + m.pushes + m.jobs > 0 {
                self.errs.push(format!(
                    "rule 7: engine {i} keeps {} reads, {} pushes, {} jobs at the end",
                    m.reads, m.pushes, m.jobs
                ));
            }
        }
    }
}
