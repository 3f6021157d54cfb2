//! The engine's scheduler: a waiting queue, admission against the KV pool, prefill and batched
//! decode steps priced by the cost model, and the connector hooks at the points where vLLM's
//! scheduler calls them. It runs on a thread of its own; HTTP handlers talk to it over channels.
//!
//! One file, over 800 lines: the scheduler loop calls the connector's hooks in the order vLLM's
//! scheduler does (arrival, admission, prefill layer by layer, decode, end); split, that order
//! would be lost.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_connector::{Connector, ConnectorEvent, Hooks, PrefillEnd, PrefillOutcome};
use handoff_proto::{KvTransferParams, ReleaseReason};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::EngineConfig;
use crate::kv::KvMemory;
use crate::metrics::EngineMetrics;
use crate::model;
use crate::pool::BlockPool;
use crate::prompt::{PromptKv, Reads};

/// What a request asks of this engine.
#[derive(Debug, Clone)]
pub enum Kind {
    /// Prefill and decode here.
    Local,
    /// P: prefill, answer one token per choice and `kv_transfer_params`, keep the blocks for D.
    /// With push-mode params, write the KV into D's registered blocks layer by layer meanwhile.
    RemoteDecode(Option<Box<KvTransferParams>>),
    /// D: the KV comes from P.
    RemotePrefill(Box<KvTransferParams>),
}

/// What the scheduler streams back to a request's HTTP handler.
#[derive(Debug, Clone)]
pub enum SeqEvent {
    Token {
        choice: u32,
        text: String,
    },
    Finished {
        choice: u32,
        reason: &'static str,
    },
    KvParams(Box<KvTransferParams>),
    /// The request ended with an error; `status` is the HTTP status to answer.
    Error {
        status: u16,
        message: String,
    },
    /// Every choice finished.
    Done {
        prompt_tokens: u32,
        completion_tokens: u32,
    },
}

pub struct Submission {
    pub id: u64,
    pub external_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub n: u32,
    pub kind: Kind,
    pub events: UnboundedSender<SeqEvent>,
}

pub enum Command {
    Submit(Submission),
    /// The connector queued events (a KV landed, a transfer failed): handle them now rather
    /// than at the idle loop's next tick.
    Wake,
    /// Drain: whether nothing is queued, awaited or decoded here and every block is back in
    /// the pool (the second value: blocks out of it).
    Idle(tokio::sync::oneshot::Sender<(bool, usize)>),
    Shutdown,
}

struct Request {
    sub: Submission,
    arrived: Instant,
    /// When its blocks were allocated (the end of its `queued` phase).
    admitted: Option<Instant>,
    /// Blocks for the generated tokens of each choice, reserved at admission.
    gen_blocks: Vec<Vec<u32>>,
    prompt_blocks: Vec<u32>,
    /// D: the transfer failed and the policy says prefill here.
    recompute: bool,
    /// P: the prompt blocks belong to a connector's handoff (since the prefill started, in a
    /// push or a layer-wise pull): they come back through `BlocksReleased`, never freed here.
    handed_over: bool,
    /// P: the connector was told this prefill started and not yet that it ended.
    prefilling: bool,
    /// D, layer-wise pull: P's prefill has not started yet (`ConnectorEvent::RemoteStarted`),
    /// so the request is not admitted: blocks held here for a request P cannot start, while P's
    /// pool is full of requests waiting for D's blocks, would deadlock the two engines.
    awaits_remote_start: bool,
}

impl Request {
    /// Whether admission may give it blocks now.
    fn admissible(&self) -> bool {
        !self.awaits_remote_start || self.recompute
    }
}

struct Seq {
    req: u64,
    choice: u32,
    digest: u64,
    last_prefix: u64,
    generated: u32,
    gen_prefix: Vec<u64>,
    gen_blocks: Vec<u32>,
    last_token: u32,
}

/// Prompt blocks shared by a request's choices, freed when the last choice ends.
struct Shared {
    blocks: Vec<u32>,
    live: u32,
    events: UnboundedSender<SeqEvent>,
    prompt_tokens: u32,
    completion_tokens: u32,
    ttft_seen: bool,
    arrived: Instant,
    max_tokens: u32,
}

pub struct Scheduler {
    cfg: EngineConfig,
    /// Where a prompt's KV lives (a hybrid model's groups).
    prompt: PromptKv,
    pool: BlockPool,
    kv: Arc<KvMemory>,
    connector: Option<Arc<Connector>>,
    metrics: EngineMetrics,
    waiting: VecDeque<Request>,
    awaiting_kv: HashMap<u64, Request>,
    running: Vec<Seq>,
    shared: HashMap<u64, Shared>,
}

impl Scheduler {
    pub fn new(
        cfg: EngineConfig,
        kv: Arc<KvMemory>,
        connector: Option<Arc<Connector>>,
        metrics: EngineMetrics,
    ) -> Self {
        Scheduler {
            // Checked when the engine started (`EngineConfig::validate`).
            prompt: PromptKv::new(
                cfg.kv_groups().unwrap_or_default(),
                cfg.num_layers,
                cfg.block_size,
            ),
            pool: BlockPool::new(cfg.num_blocks),
            cfg,
            kv,
            connector,
            metrics,
            waiting: VecDeque::new(),
            awaiting_kv: HashMap::new(),
            running: Vec::new(),
            shared: HashMap::new(),
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size as usize)
    }

    pub fn run(mut self, inbox: Receiver<Command>) {
        loop {
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let wait = if idle {
                Duration::from_millis(2)
            } else {
                Duration::ZERO
            };
            match inbox.recv_timeout(wait) {
                Ok(Command::Submit(s)) => self.submit(s),
                Ok(Command::Wake) => {}
                Ok(Command::Idle(tx)) => self.answer_idle(tx),
                Ok(Command::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            while let Ok(cmd) = inbox.try_recv() {
                match cmd {
                    Command::Submit(s) => self.submit(s),
                    Command::Wake => {}
                    Command::Idle(tx) => self.answer_idle(tx),
                    Command::Shutdown => return,
                }
            }
            self.connector_events();
            self.reap_disconnected();
            self.admit();
            self.decode_step();
            self.update_gauges();
        }
    }

    fn answer_idle(&self, tx: tokio::sync::oneshot::Sender<(bool, usize)>) {
        let used = self.pool.used_count();
        let idle = self.waiting.is_empty()
            && self.awaiting_kv.is_empty()
            && self.running.is_empty()
            && self.shared.is_empty()
            && used == 0;
        // The drain that asked may have given up meanwhile.
        let _ = tx.send((idle, used));
    }

    fn update_gauges(&self) {
        self.metrics.blocks_free.set(self.pool.free_count() as i64);
        self.metrics.blocks_used.set(self.pool.used_count() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.awaiting_kv.set(self.awaiting_kv.len() as i64);
    }

    fn reject(&self, sub: &Submission, status: u16, message: String) {
        if let Kind::RemotePrefill(params) = &sub.kind {
            // D refuses before admission: P must not wait for a lease to free the blocks.
            if let Some(c) = &self.connector {
                if let Err(e) = c.reject(params) {
                    tracing::warn!(error = %e, "could not tell P to release");
                }
            }
        }
        self.metrics.outcome(if status == 503 {
            "rejected_full"
        } else {
            "rejected"
        });
        let _ = sub.events.send(SeqEvent::Error { status, message });
    }

    fn submit(&mut self, sub: Submission) {
        let prompt = sub.prompt.len();
        if prompt == 0 {
            return self.reject(&sub, 400, "empty prompt".into());
        }
        let total = prompt + sub.max_tokens as usize;
        if total > self.cfg.max_model_len as usize {
            return self.reject(
                &sub,
                400,
                format!(
                    "prompt ({prompt} tokens) + max_tokens ({}) exceeds max_model_len {}",
                    sub.max_tokens, self.cfg.max_model_len
                ),
            );
        }
        let need =
            self.prompt.blocks(prompt) + sub.n as usize * self.blocks_for(sub.max_tokens as usize);
        if need > self.pool.total() as usize {
            return self.reject(
                &sub,
                400,
                format!(
                    "request needs {need} KV blocks, the pool has {}",
                    self.pool.total()
                ),
            );
        }
        let mut awaits_remote_start = false;
        if self.waiting.len() >= self.cfg.max_waiting {
            return self.reject(
                &sub,
                503,
                format!(
                    "KV pool full: {} requests already waiting",
                    self.waiting.len()
                ),
            );
        }
        if let Kind::RemotePrefill(params) = &sub.kind {
            if params
                .remote_num_tokens
                .is_some_and(|n| n as usize != prompt)
            {
                return self.reject(
                    &sub,
                    400,
                    format!(
                        "prompt has {prompt} tokens but P prefilled {:?}",
                        params.remote_num_tokens
                    ),
                );
            }
            let Some(c) = &self.connector else {
                return self.reject(&sub, 400, "this engine has no connector".into());
            };
            // Tracking (and heartbeats) start now, while the request still waits in the queue.
            let arrival = match c.request_arrived(sub.id, params, prompt as u32) {
                Ok(arrival) => arrival,
                Err(e) => return self.reject(&sub, 400, e.to_string()),
            };
            if arrival.reserve_now {
                return self.reserve_for_push(sub);
            }
            awaits_remote_start = arrival.after_remote_start;
        }
        if matches!(sub.kind, Kind::RemoteDecode(_)) && self.connector.is_none() {
            return self.reject(
                &sub,
                400,
                "this engine does not prefill for remote decode".into(),
            );
        }
        self.waiting.push_back(Request {
            sub,
            arrived: Instant::now(),
            admitted: None,
            gen_blocks: vec![],
            prompt_blocks: vec![],
            recompute: false,
            handed_over: false,
            prefilling: false,
            awaits_remote_start,
        });
    }

    /// D, push mode: reserve the blocks on arrival so P can write as soon as its KV exists. A
    /// full pool answers at once (never an unbounded wait: P is told to release).
    fn reserve_for_push(&mut self, sub: Submission) {
        let prompt_blocks = self.prompt.blocks(sub.prompt.len());
        let gen_each = self.blocks_for(sub.max_tokens as usize);
        let need = prompt_blocks + gen_each * sub.n as usize;
        let Some(c) = self.connector.clone() else {
            return;
        };
        if self.pool.free_count() < need {
            c.request_ended(sub.id, ReleaseReason::Rejected);
            self.metrics.outcome("rejected_full");
            let _ = sub.events.send(SeqEvent::Error {
                status: 503,
                message: format!(
                    "KV pool full: {need} blocks needed, {} free",
                    self.pool.free_count()
                ),
            });
            return;
        }
        let prompt = self.pool.alloc(prompt_blocks).unwrap_or_default();
        let gen_blocks: Vec<Vec<u32>> = (0..sub.n)
            .map(|_| self.pool.alloc(gen_each).unwrap_or_default())
            .collect();
        let now = Instant::now();
        self.metrics.phase("queued", Duration::ZERO);
        let r = Request {
            arrived: now,
            admitted: Some(now),
            gen_blocks,
            prompt_blocks: prompt.clone(),
            recompute: false,
            handed_over: false,
            prefilling: false,
            awaits_remote_start: false,
            sub,
        };
        match c.blocks_allocated(r.sub.id, Vec::new(), prompt) {
            Ok(()) => {
                self.awaiting_kv.insert(r.sub.id, r);
            }
            Err(e) => {
                // The handoff already ended (P gone, refused): settle it per policy.
                let id = r.sub.id;
                let mut r = r;
                self.pool.free(&r.prompt_blocks);
                r.prompt_blocks.clear();
                self.waiting.push_back(r);
                self.settle_refused(id, e.to_string());
            }
        }
    }

    fn connector_events(&mut self) {
        let Some(c) = self.connector.clone() else {
            return;
        };
        for ev in c.poll_events() {
            match ev {
                ConnectorEvent::BlocksReleased { blocks, .. } => self.pool.free(&blocks),
                ConnectorEvent::Ready { requests, blocks } => self.kv_landed(requests, blocks),
                ConnectorEvent::RemoteStarted { requests } => {
                    for r in self.waiting.iter_mut() {
                        if requests.contains(&r.sub.id) {
                            r.awaits_remote_start = false;
                        }
                    }
                }
                ConnectorEvent::Recompute { requests, reason } => {
                    for id in requests {
                        // Not admitted yet: it will prefill here when it is.
                        if let Some(r) = self.waiting.iter_mut().find(|r| r.sub.id == id) {
                            tracing::info!(request = %r.sub.external_id, %reason, "KV transfer failed before admission: recomputing");
                            self.metrics.outcome("recomputed");
                            r.recompute = true;
                            continue;
                        }
                        if let Some(mut r) = self.awaiting_kv.remove(&id) {
                            tracing::info!(request = %r.sub.external_id, %reason, "KV transfer failed: recomputing");
                            self.metrics.outcome("recomputed");
                            // The failed transfer's blocks come back through BlocksReleased.
                            r.prompt_blocks.clear();
                            r.recompute = true;
                            self.waiting.push_front(r);
                        }
                    }
                }
                ConnectorEvent::Failed { requests, reason } => {
                    self.transfer_failed(requests, &reason)
                }
            }
        }
    }

    /// The KV of `requests` will not come and the policy is to fail them. Their generation
    /// blocks are freed here; the prompt blocks of an admitted one are the connector's (a READ
    /// on another rank may still be landing in them) and come back through `BlocksReleased`,
    /// never here: freeing them twice would hand them to another request while the transfer
    /// still writes, and the second free would take them from that request.
    fn transfer_failed(&mut self, requests: Vec<u64>, reason: &str) {
        for id in requests {
            // Admitted (waiting for its KV) or not yet (still queued).
            let queued = || self.waiting.iter().position(|r| r.sub.id == id);
            let r = match self.awaiting_kv.remove(&id) {
                Some(r) => Some(r),
                None => queued().and_then(|i| self.waiting.remove(i)),
            };
            if let Some(r) = r {
                self.pool.free(&r.gen_blocks.concat());
                self.metrics.outcome("transfer_failed");
                let _ = r.sub.events.send(SeqEvent::Error {
                    status: 502,
                    message: format!("KV transfer from the prefill engine failed: {reason}"),
                });
            }
        }
    }

    /// A handoff's KV landed in `blocks` for `requests`: the one still waiting for it decodes from
    /// them. One that no longer waits (its client left after the connector queued this event, or
    /// a second request naming the same handoff was settled on its own) takes nothing, and with
    /// no taker the blocks go back to the pool: nobody else will ever free them.
    fn kv_landed(&mut self, requests: Vec<u64>, blocks: Vec<u32>) {
        let taker = requests.iter().find_map(|id| self.awaiting_kv.remove(id));
        match taker {
            Some(mut r) => {
                r.prompt_blocks = blocks;
                self.start_decoding(r);
            }
            None => self.pool.free(&blocks),
        }
    }

    /// The connector refused blocks for queued request `id` because its handoff already ended
    /// (P refused the handshake, died, or the deadline passed). The ledger queued that outcome,
    /// per failure policy and with its reason, before the refusal could be seen: apply the queued
    /// events first. A request they did not settle gets the policy here, never a silent local
    /// prefill under policy `fail`.
    fn settle_refused(&mut self, id: u64, error: String) {
        self.connector_events();
        let Some(i) = self.waiting.iter().position(|r| r.sub.id == id) else {
            return; // failed by its event
        };
        if self.waiting[i].recompute {
            return; // recompute by its event
        }
        if self.cfg.failure_policy == "fail" {
            if let Some(r) = self.waiting.remove(i) {
                self.pool.free(&r.gen_blocks.concat());
                self.metrics.outcome("transfer_failed");
                let _ = r.sub.events.send(SeqEvent::Error {
                    status: 502,
                    message: format!("KV transfer from the prefill engine failed: {error}"),
                });
            }
        } else {
            let r = &mut self.waiting[i];
            tracing::info!(request = %r.sub.external_id, %error, "recomputing");
            self.metrics.outcome("recomputed");
            r.recompute = true;
        }
    }

    /// Requests whose client went away before they produced anything.
    fn reap_disconnected(&mut self) {
        let mut gone = Vec::new();
        self.waiting.retain(|r| {
            if r.sub.events.is_closed() {
                gone.push((r.sub.id, r.sub.kind.clone(), r.gen_blocks.concat()));
                false
            } else {
                true
            }
        });
        let ids: Vec<u64> = self
            .awaiting_kv
            .iter()
            .filter(|(_, r)| r.sub.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(r) = self.awaiting_kv.remove(&id) {
                gone.push((id, r.sub.kind.clone(), r.gen_blocks.concat()));
            }
        }
        for (id, kind, gen) in gone {
            self.metrics.outcome("aborted");
            self.pool.free(&gen);
            if let (Kind::RemotePrefill(_), Some(c)) = (&kind, &self.connector) {
                // The prompt blocks are the connector's until it releases them.
                c.request_ended(id, ReleaseReason::Aborted);
            }
        }
    }

    fn admit(&mut self) {
        // One prefill per iteration so decode steps interleave with long prompts.
        let mut prefilled = false;
        // In order, passing over layer-wise pulls P has not started: the first of those must not
        // hold back the requests behind it (P may be waiting for D to read them).
        while let Some(at) = self.waiting.iter().position(Request::admissible) {
            let front = &self.waiting[at];
            let prompt = front.sub.prompt.len();
            let gen_each = self.blocks_for(front.sub.max_tokens as usize);
            let n = front.sub.n as usize;
            let is_remote = matches!(front.sub.kind, Kind::RemotePrefill(_)) && !front.recompute;
            if !is_remote && prefilled {
                break;
            }
            let need_gen = if front.gen_blocks.is_empty() {
                gen_each * n
            } else {
                0
            };
            let need = self.prompt.blocks(prompt) + need_gen;
            if self.pool.free_count() < need {
                break;
            }
            let Some(mut r) = self.waiting.remove(at) else {
                break;
            };
            let Some(prompt_blocks) = self.pool.alloc(self.prompt.blocks(prompt)) else {
                self.waiting.insert(at, r);
                break;
            };
            if r.gen_blocks.is_empty() && matches!(r.sub.kind, Kind::Local | Kind::RemotePrefill(_))
            {
                for _ in 0..n {
                    r.gen_blocks
                        .push(self.pool.alloc(gen_each).unwrap_or_default());
                }
            }
            r.prompt_blocks = prompt_blocks;
            if r.admitted.is_none() {
                let now = Instant::now();
                self.metrics.phase("queued", now - r.arrived);
                r.admitted = Some(now);
            }
            if is_remote {
                let result = match &self.connector {
                    Some(c) => c
                        .blocks_allocated(r.sub.id, Vec::new(), r.prompt_blocks.clone())
                        .map_err(|e| e.to_string()),
                    None => Err("no connector".to_string()),
                };
                match result {
                    Ok(()) => {
                        self.awaiting_kv.insert(r.sub.id, r);
                    }
                    Err(e) => {
                        // The handoff ended before admission (P gone, refused, deadline):
                        // settle it per policy.
                        let id = r.sub.id;
                        self.pool.free(&r.prompt_blocks);
                        r.prompt_blocks.clear();
                        self.waiting.insert(at, r);
                        self.settle_refused(id, e);
                        break;
                    }
                }
            } else {
                self.prefill(r);
                prefilled = true;
            }
        }
    }

    fn sleep_cost(&self, micros: f64) {
        if micros > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(micros / 1e6));
        }
    }

    fn prefill(&mut self, mut r: Request) {
        let started = Instant::now();
        let prompt = &r.sub.prompt;
        let prefix = model::prefix_hashes(prompt, 0);
        let layers = self.cfg.num_layers.max(1) as f64;
        let per_layer = prompt.len() as f64 * self.cfg.prefill_us_per_token / layers;
        // A prefill for a remote decode: the connector picks the flow (pull, layer-wise pull,
        // push) from the params the router sent and says whether its handoff holds the blocks
        // from now on.
        let remote = match &r.sub.kind {
            Kind::RemoteDecode(p) => Some(
                p.as_deref()
                    .cloned()
                    .unwrap_or_else(KvTransferParams::for_prefill_leg),
            ),
            _ => None,
        };
        let connector = self.connector.clone().filter(|_| remote.is_some());
        if let (Some(params), Some(c)) = (&remote, &connector) {
            match c.prefill_started_now(
                &r.sub.external_id,
                params,
                r.prompt_blocks.clone(),
                prompt.len() as u32,
            ) {
                Ok(holding) => {
                    r.handed_over = holding.is_some();
                    r.prefilling = true;
                }
                Err(e) => return self.fail_local(r, e.to_string()),
            }
        }
        // The forward pass, layer by layer: each layer's KV exists once its share of the cost is
        // spent, and in push mode it leaves for D at once, overlapping the rest of the prefill.
        // The share is spent first and the KV written at its end: on a GPU the layer's time is
        // the device's and the KV is final only when it ends; here the bytes are written by the
        // CPU, and writing them at the start would both publish them a layer early and make a
        // push WRITE (CPU copies on this host) compete with the next layer's writing instead of
        // overlapping the time that stands for the GPU's.
        for layer in 0..self.cfg.num_layers {
            self.sleep_cost(per_layer);
            if let Err(e) = self
                .prompt
                .write_layer(&self.kv, &prefix, &r.prompt_blocks, layer)
            {
                return self.fail_local(r, e.to_string());
            }
            if let Some(c) = &connector {
                c.layers_saved(&r.sub.external_id, layer + 1);
            }
        }
        self.metrics.phase("prefill", started.elapsed());
        match &r.sub.kind {
            Kind::RemoteDecode(_) => {
                // P: sample the first token (as vLLM's P does), then hand the KV over. A real
                // P's token comes out of the forward pass it just ran, at no extra cost: its
                // logits read the last position only. Reading the whole KV here (as D's first
                // step and a monolithic engine's do, which is what proves the KV arrived whole)
                // would put a second full scan on the critical path that no real P pays.
                let last = prefix.last().copied().unwrap_or(0);
                let read = self.prompt.digest(
                    &self.kv,
                    &r.prompt_blocks,
                    (prompt.len(), last),
                    Reads::Last,
                );
                let digest = match read {
                    Ok(d) => d,
                    Err(e) => return self.fail_local(r, e.to_string()),
                };
                let Some(c) = self.connector.clone() else {
                    return self.fail_local(r, "no connector".into());
                };
                // A client that left during the prefill waits for no params: a pull then
                // creates no handoff at all (a flow whose D got its leg with P's goes on).
                let outcome = if r.sub.events.is_closed() {
                    PrefillOutcome::Abandoned
                } else {
                    PrefillOutcome::Finished
                };
                r.prefilling = false;
                let end = match c.prefill_ended(&r.sub.external_id, outcome) {
                    Ok(end) => end,
                    Err(e) => return self.fail_local(r, e.to_string()),
                };
                let PrefillEnd { params, holding } = end;
                r.handed_over = holding.is_some();
                if !r.handed_over {
                    self.pool.free(&r.prompt_blocks);
                }
                let Some(params) = params else {
                    tracing::info!(
                        request = %r.sub.external_id,
                        "client left during the prefill: no handoff kept for it"
                    );
                    self.metrics.outcome("aborted");
                    return;
                };
                self.metrics.ttft.observe(r.arrived.elapsed().as_secs_f64());
                self.metrics.outcome("prefilled_for_remote");
                let ev = &r.sub.events;
                // n>1: one prefill and one handoff for every choice (D fans out after one
                // pull); each choice gets its own first token, as on D.
                for choice in 0..r.sub.n {
                    let _ = ev.send(SeqEvent::Token {
                        choice,
                        text: model::detokenize(model::sample(digest, choice)),
                    });
                }
                if ev
                    .send(SeqEvent::KvParams(Box::new(params.clone())))
                    .is_err()
                {
                    // The client left between the check above and now: nobody will read or
                    // release this handoff (a D that got its leg already keeps what it
                    // claimed: the release ends only what no D claimed).
                    tracing::info!(
                        request = %r.sub.external_id,
                        "client left before its KV params were returned; releasing"
                    );
                    if let Err(e) = c.release_from_proxy(&params) {
                        tracing::warn!(error = %e, "cannot release an unclaimed handoff");
                    }
                }
                for choice in 0..r.sub.n {
                    let _ = ev.send(SeqEvent::Finished {
                        choice,
                        reason: "length",
                    });
                }
                let _ = ev.send(SeqEvent::Done {
                    prompt_tokens: prompt.len() as u32,
                    completion_tokens: r.sub.n,
                });
            }
            Kind::Local | Kind::RemotePrefill(_) => self.start_decoding(r),
        }
    }

    fn fail_local(&mut self, mut r: Request, message: String) {
        tracing::error!(request = %r.sub.external_id, %message, "request failed");
        // A prefill the connector was told of ends failed: a handoff that holds the blocks
        // keeps them until it ends (a push's WRITE, a layer-wise pull's READ may still use
        // them); freeing them here would free them twice.
        if let (true, Some(c)) = (r.prefilling, &self.connector) {
            r.prefilling = false;
            match c.prefill_ended(&r.sub.external_id, PrefillOutcome::Failed) {
                Ok(end) => r.handed_over = end.holding.is_some(),
                Err(e) => {
                    tracing::warn!(error = %e, "the connector did not take the failed prefill")
                }
            }
        }
        if !r.handed_over {
            self.pool.free(&r.prompt_blocks);
        }
        self.pool.free(&r.gen_blocks.concat());
        self.metrics.outcome("failed");
        let _ = r.sub.events.send(SeqEvent::Error {
            status: 500,
            message,
        });
    }

    /// The prompt's KV is in `r.prompt_blocks` (prefilled here or transferred): read it back,
    /// sample each choice's first token, and start decoding.
    fn start_decoding(&mut self, r: Request) {
        let started = Instant::now();
        if let (Kind::RemotePrefill(_), false, Some(at)) = (&r.sub.kind, r.recompute, r.admitted) {
            self.metrics.phase("kv_wait", started - at);
        }
        let prompt_len = r.sub.prompt.len();
        let last_prefix = model::prefix_hashes(&r.sub.prompt, 0)
            .last()
            .copied()
            .unwrap_or(0);
        let read = self.prompt.digest(
            &self.kv,
            &r.prompt_blocks,
            (prompt_len, last_prefix),
            Reads::Attended,
        );
        let digest = match read {
            Ok(d) => d,
            Err(e) => return self.fail_local(r, e.to_string()),
        };
        let id = r.sub.id;
        self.shared.insert(
            id,
            Shared {
                blocks: r.prompt_blocks.clone(),
                live: r.sub.n,
                events: r.sub.events.clone(),
                prompt_tokens: prompt_len as u32,
                completion_tokens: 0,
                ttft_seen: false,
                arrived: r.arrived,
                max_tokens: r.sub.max_tokens,
            },
        );
        for (choice, gen_blocks) in r.gen_blocks.into_iter().enumerate() {
            let token = model::sample(digest, choice as u32);
            let seq = Seq {
                req: id,
                choice: choice as u32,
                digest,
                last_prefix,
                generated: 0,
                gen_prefix: Vec::new(),
                gen_blocks,
                last_token: token,
            };
            self.emit(seq);
        }
        self.metrics.phase("first_token", started.elapsed());
    }

    /// Sends a sequence's current token; keeps it running or finishes it.
    fn emit(&mut self, mut seq: Seq) {
        let Some(sh) = self.shared.get_mut(&seq.req) else {
            return;
        };
        let max_tokens = sh.max_tokens;
        if !sh.ttft_seen {
            sh.ttft_seen = true;
            self.metrics
                .ttft
                .observe(sh.arrived.elapsed().as_secs_f64());
        }
        let alive = sh
            .events
            .send(SeqEvent::Token {
                choice: seq.choice,
                text: model::detokenize(seq.last_token),
            })
            .is_ok();
        seq.generated += 1;
        sh.completion_tokens += 1;
        if !alive || seq.generated >= max_tokens {
            if alive {
                let _ = sh.events.send(SeqEvent::Finished {
                    choice: seq.choice,
                    reason: "length",
                });
            }
            self.finish_seq(seq, alive);
        } else {
            self.running.push(seq);
        }
    }

    fn finish_seq(&mut self, seq: Seq, alive: bool) {
        self.pool.free(&seq.gen_blocks);
        let Some(sh) = self.shared.get_mut(&seq.req) else {
            return;
        };
        sh.live -= 1;
        if sh.live == 0 {
            let sh = self.shared.remove(&seq.req).expect("present");
            self.pool.free(&sh.blocks);
            if alive {
                self.metrics.outcome("ok");
                let _ = sh.events.send(SeqEvent::Done {
                    prompt_tokens: sh.prompt_tokens,
                    completion_tokens: sh.completion_tokens,
                });
            } else {
                self.metrics.outcome("aborted");
            }
        }
    }

    fn decode_step(&mut self) {
        if self.running.is_empty() {
            return;
        }
        let batch: Vec<Seq> = {
            let n = self.running.len().min(self.cfg.max_batch);
            self.running.drain(..n).collect()
        };
        self.sleep_cost(
            self.cfg.decode_step_ms * 1000.0 + self.cfg.decode_us_per_seq * batch.len() as f64,
        );
        for mut seq in batch {
            // Append the last token's KV, read it back, and sample the next token from it.
            let prefix = model::mix(
                seq.last_prefix ^ (seq.last_token as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            seq.last_prefix = prefix;
            seq.gen_prefix.push(prefix);
            let pos = seq.gen_prefix.len() - 1;
            let step = self
                .kv
                .write_positions(&seq.gen_prefix, pos..pos + 1, &seq.gen_blocks)
                .and_then(|()| {
                    self.kv
                        .digest_positions(seq.digest, pos..pos + 1, &seq.gen_blocks)
                });
            match step {
                Ok(d) => {
                    seq.digest = d;
                    seq.last_token = model::sample(d, seq.choice);
                    self.emit(seq);
                }
                Err(e) => {
                    tracing::error!(error = %e, "decode step failed");
                    self.finish_seq(seq, false);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
