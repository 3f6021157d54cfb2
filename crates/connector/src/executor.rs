//! The executor: the thin I/O shell around a [`ConnectorCore`], and the handle the engine's
//! scheduler holds ([`Connector`]).
//!
//! One thread owns the core. It is the only place that reads the clock for it; it feeds it
//! scheduler calls, side-channel frames, connect outcomes, worker reports and timeouts, and
//! carries out each [`Ready`] batch: frames into each connection's bounded send queue (never a
//! blocking write), connect attempts on threads of their own, steps to the workers, events to
//! the scheduler. Nothing here holds a lock that the scheduler thread waits on: the scheduler
//! talks to the core through the same queue as everything else, and its calls are answered
//! after the batch they caused was carried out (so an event the call produced is already there
//! when the answer is).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use handoff_ledger::Time;
use handoff_plan::KvSpec;
use handoff_proto::{HandoffId, KvTransferParams, ReleaseReason};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;

use crate::metrics::{DirLabels, HeldLabels, Metrics, ReasonLabels};
use crate::side_channel::{self, ConnWriter, SendError, SideChannel, SideConfig, SideEvent, Sink};
use crate::step::{WorkerHello, WorkerOp, WorkerReport, WorkerStep};
use crate::worker::{self, RankMemory, WorkerSide};
use crate::{ConnectorConfig, ConnectorError, ConnectorEvent, Role};
use handoff_core::{
    Answer, ConnId, ConnectorCore, CoreConfig, CoreMemory, Input, LedgerCounters, Observation,
    Ready,
};

/// The longest the executor sleeps without a timer due (it wakes on every input anyway).
const IDLE: Duration = Duration::from_millis(100);

/// Inputs handled in one go before the batch they produced is carried out.
const BATCH: usize = 256;

/// How often the held-blocks gauges follow the ledgers (a scrape refreshes them first).
const GAUGES_EVERY: Duration = Duration::from_millis(100);

type Reply = Box<dyn FnOnce() + Send>;
type Query = Box<dyn FnOnce(&ConnectorCore) -> Reply + Send>;
type Answered = Result<Answer, handoff_core::CoreError>;

/// What reaches the executor thread.
enum Msg {
    /// An input for the core, and where its answer goes (`None`: nobody waits).
    Core(Input, Option<std::sync::mpsc::SyncSender<Answered>>),
    /// A read-only look at the core (snapshots for metrics and tests): no input, so not recorded.
    Query(Query),
    Side(SideEvent),
}

/// Where the executor sends one worker its steps.
pub trait WorkerLink: Send {
    /// False when the worker is gone.
    fn send(&mut self, step: WorkerStep) -> bool;
}

impl WorkerLink for Sender<WorkerStep> {
    fn send(&mut self, step: WorkerStep) -> bool {
        Sender::send(self, step).is_ok()
    }
}

/// Feeds worker reports to a running connector (from a worker thread or a remote worker's
/// connection).
#[derive(Clone)]
pub struct ReportSink(Sender<Msg>);

impl ReportSink {
    /// False once the connector stopped.
    pub fn report(&self, r: WorkerReport) -> bool {
        self.0.send(Msg::Core(Input::WorkerReport(r), None)).is_ok()
    }
}

/// The scheduler side of a connector, as the engine holds it. Every method is a short message to
/// the executor thread; those that answer wait only for the core's (CPU-only) work.
pub struct Connector {
    engine_id: String,
    role: Role,
    mode: handoff_proto::TransferMode,
    layerwise_pull: bool,
    advertise_host: String,
    spec: KvSpec,
    /// See [`ConnectorCore::compat_key`].
    compat_key: String,
    side_addr: SocketAddr,
    inbox: Sender<Msg>,
    events: Mutex<Receiver<ConnectorEvent>>,
    waker: Waker,
    stop: Arc<AtomicBool>,
}

/// Called by the executor after it queued events, so an engine loop that sleeps between
/// polls picks them up at once (D's first decode step starts when its KV landed, not at the
/// loop's next tick).
type Waker = Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>;

impl Connector {
    /// Registers every rank's memory with its transport, runs a worker side per rank on a
    /// thread of its own, opens the side channel and starts the executor.
    pub fn start(
        cfg: ConnectorConfig,
        ranks: Vec<RankMemory>,
        registry: &mut Registry,
    ) -> Result<Arc<Connector>, ConnectorError> {
        let mut workers = Vec::new();
        for mem in ranks {
            workers.push(WorkerSide::new(mem)?);
        }
        let hellos = workers
            .iter()
            .map(WorkerSide::hello)
            .collect::<Result<Vec<_>, _>>()?;
        let (connector, sink) = Connector::start_with(cfg, hellos, registry, |sink| {
            let mut links: Vec<Box<dyn WorkerLink>> = Vec::new();
            for w in workers {
                let (tx, rx) = channel::<WorkerStep>();
                let sink = sink.clone();
                worker::spawn(w, rx, move |r| sink.report(r)).map_err(ConnectorError::Thread)?;
                links.push(Box::new(tx));
            }
            Ok(links)
        })?;
        drop(sink);
        Ok(connector)
    }

    /// Starts the scheduler side for workers that live elsewhere: `hellos` is what each said,
    /// `links` (made with the sink that takes their reports) carries their steps.
    pub fn start_with(
        cfg: ConnectorConfig,
        hellos: Vec<WorkerHello>,
        registry: &mut Registry,
        links: impl FnOnce(&ReportSink) -> Result<Vec<Box<dyn WorkerLink>>, ConnectorError>,
    ) -> Result<(Arc<Connector>, ReportSink), ConnectorError> {
        let (inbox, inputs) = channel::<Msg>();
        let stop = Arc::new(AtomicBool::new(false));
        let side_sink: Sink = {
            let inbox = inbox.clone();
            Arc::new(move |ev| inbox.send(Msg::Side(ev)).is_ok())
        };
        crate::check_exposure(cfg.side_channel_bind.ip(), cfg.key.as_ref(), cfg.insecure)?;
        let side = SideChannel::new(
            SideConfig {
                engine_id: cfg.engine_id.clone(),
                key: cfg.key.clone(),
                max_connections: cfg.max_side_connections,
                max_handshakes_per_source: cfg.max_side_handshakes_per_source,
            },
            side_sink,
        );
        let side_addr = side
            .listen(cfg.side_channel_bind, stop.clone())
            .map_err(ConnectorError::Listen)?;
        let recorded_ranks = cfg.record.as_ref().map(|_| hellos.clone());
        let core = ConnectorCore::new(
            CoreConfig {
                engine_id: cfg.engine_id.clone(),
                role: cfg.role,
                mode: cfg.mode,
                model: cfg.model.clone(),
                dtype: cfg.dtype.clone(),
                advertise_host: cfg.advertise_host.clone(),
                side_channel_port: side_addr.port(),
                producer: cfg.producer.clone(),
                consumer: cfg.consumer.clone(),
                opaque_blocks: cfg.opaque_blocks,
                kv_digest: cfg.kv_digest,
                peer_hosts: cfg.peer_hosts.clone(),
            },
            hellos,
        );
        let core = match core {
            Ok(c) => c,
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                return Err(e.into());
            }
        };
        let recorder = match (&cfg.record, recorded_ranks) {
            (Some(rc), Some(ranks)) => {
                match crate::recorder::Recorder::create(rc.clone(), core.config(), &ranks) {
                    Ok(r) => {
                        tracing::info!(path = %rc.path.display(), "recording the connector core's inputs");
                        Some(r)
                    }
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        return Err(ConnectorError::Record(rc.path.clone(), e));
                    }
                }
            }
            _ => None,
        };
        let spec = *core.spec();
        let compat_key = core.compat_key();
        let sink = ReportSink(inbox.clone());
        let workers = match links(&sink) {
            Ok(l) => l,
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        };
        let (events_tx, events) = channel();
        let waker = Waker::default();
        let metrics = Metrics::new(registry);
        crate::metrics::register_compat_key(registry, &compat_key);
        let exec = Executor {
            core,
            start: Instant::now(),
            inputs,
            side,
            conns: HashMap::new(),
            workers,
            events: events_tx,
            waker: waker.clone(),
            metrics,
            stop: stop.clone(),
            counters_seen: LedgerCounters::default(),
            gauges_at: None,
            fallbacks: FallbackLog::default(),
            recorder,
        };
        std::thread::Builder::new()
            .name(format!("handoff-exec-{}", cfg.engine_id))
            .spawn(move || exec.run())
            .map_err(ConnectorError::Thread)?;
        Ok((
            Arc::new(Connector {
                engine_id: cfg.engine_id,
                role: cfg.role,
                mode: cfg.mode,
                layerwise_pull: cfg.layerwise_pull,
                advertise_host: cfg.advertise_host,
                spec,
                compat_key,
                side_addr,
                inbox,
                events: Mutex::new(events),
                waker,
                stop,
            }),
            sink,
        ))
    }

    /// Gives the core `input` and waits for its answer (sent once the batch it caused went
    /// out, so an event it produced is already queued).
    fn call(&self, input: Input) -> Result<Answer, ConnectorError> {
        let (tx, rx) = sync_channel::<Answered>(1);
        self.inbox
            .send(Msg::Core(input, Some(tx)))
            .map_err(|_| ConnectorError::Stopped)?;
        Ok(rx.recv().map_err(|_| ConnectorError::Stopped)??)
    }

    /// Gives the core `input` without waiting. Once the executor has stopped (the connector
    /// shut down) nothing takes it: said at debug level, since every handoff ended with the
    /// executor anyway (its connections closed, its peers told by that).
    fn tell(&self, input: Input) {
        let name = input.name();
        if self.inbox.send(Msg::Core(input, None)).is_err() {
            tracing::debug!(input = name, "connector stopped: input dropped");
        }
    }

    /// Runs `f` on the core, read-only, and waits for its answer.
    fn query<R: Send + 'static>(
        &self,
        f: impl FnOnce(&ConnectorCore) -> R + Send + 'static,
    ) -> Result<R, ConnectorError> {
        let (tx, rx) = sync_channel::<R>(1);
        let query: Query = Box::new(move |core| {
            let r = f(core);
            Box::new(move || {
                let _ = tx.send(r);
            })
        });
        self.inbox
            .send(Msg::Query(query))
            .map_err(|_| ConnectorError::Stopped)?;
        rx.recv().map_err(|_| ConnectorError::Stopped)
    }

    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    pub fn side_channel_addr(&self) -> SocketAddr {
        self.side_addr
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    /// Every event since the last call (non-blocking).
    pub fn poll_events(&self) -> Vec<ConnectorEvent> {
        self.events.lock().try_iter().collect()
    }

    /// Has `wake` called whenever events were queued (once per batch). The first call wins.
    pub fn set_waker(&self, wake: impl Fn() + Send + Sync + 'static) {
        let _ = self.waker.set(Box::new(wake));
    }

    /// Waits up to `timeout` for the next event.
    pub fn wait_event(&self, timeout: Duration) -> Option<ConnectorEvent> {
        self.events.lock().recv_timeout(timeout).ok()
    }

    /// What a proxy needs to send D a push request for this P (`GET /v1/handoff/info`).
    pub fn info(&self) -> serde_json::Value {
        serde_json::json!({
            "engine_id": self.engine_id,
            "remote_host": self.advertise_host,
            "remote_port": self.side_addr.port(),
            "tp_size": self.spec.tp,
            "block_size": self.spec.block_size,
            "transfer_mode": self.mode.as_str(),
            "role": match self.role {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
                Role::Both => "both",
            },
            // This engine takes a layer-wise pull (`KvTransferParams::layerwise`; see
            // `ConnectorConfig::layerwise_pull`): the proxy sends both legs at once when P and
            // D both say so.
            "layerwise_pull": self.layerwise_pull
                && self.mode == handoff_proto::TransferMode::Pull,
            // A router pairs a P and a D only when their keys are equal.
            "compat_key": self.compat_key,
        })
    }

    /// This engine's compatibility key (see [`ConnectorCore::compat_key`]).
    pub fn compat_key(&self) -> &str {
        &self.compat_key
    }

    // ----- P -----

    /// A prompt's prefill ended: create the handoff under a fresh random id and return the
    /// `kv_transfer_params` for the response.
    pub fn on_prefill_finished(
        &self,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        let mut id = [0u8; 16];
        getrandom::getrandom(&mut id).map_err(|e| ConnectorError::Random(e.to_string()))?;
        self::params(self.call(Input::PrefillFinished {
            request_id: request_id.to_string(),
            handoff: HandoffId::from_bytes(id),
            blocks,
            num_tokens,
        })?)
    }

    pub fn on_push_prefill_start(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<HandoffId, ConnectorError> {
        handoff(self.call(Input::PushPrefillStart {
            params: params.clone(),
            blocks,
            num_tokens,
        })?)
    }

    /// See [`Input::PullPrefillStart`].
    pub fn on_pull_prefill_start(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
    ) -> Result<Option<HandoffId>, ConnectorError> {
        match self.call(Input::PullPrefillStart {
            params: params.clone(),
            blocks,
        })? {
            Answer::MaybeHandoff(h) => Ok(h),
            other => Err(unexpected(other)),
        }
    }

    /// See [`Input::PullPrefillFinished`].
    pub fn on_pull_prefill_finished(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        self::params(self.call(Input::PullPrefillFinished {
            params: params.clone(),
            request_id: request_id.to_string(),
            blocks,
            num_tokens,
        })?)
    }

    /// See [`Input::PullPrefillFailed`].
    pub fn on_pull_prefill_failed(&self, handoff: HandoffId) {
        self.tell(Input::PullPrefillFailed { handoff });
    }

    /// Worker point "layer saved": the layer leaves for D as soon as its grant allows (push), or
    /// D may read it (layer-wise pull).
    pub fn on_layer_saved(&self, handoff: HandoffId, layer: u32) {
        self.tell(Input::LayerSaved { handoff, layer });
    }

    /// See [`Input::PushPrefilled`].
    pub fn on_push_prefilled(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        self::params(self.call(Input::PushPrefilled {
            params: params.clone(),
            request_id: request_id.to_string(),
            blocks,
            num_tokens,
        })?)
    }

    /// See [`Input::PushForward`].
    pub fn on_push_forward(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<HandoffId, ConnectorError> {
        handoff(self.call(Input::PushForward {
            params: params.clone(),
            blocks,
            num_tokens,
        })?)
    }

    pub fn on_push_prefill_finished(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        self::params(self.call(Input::PushParams {
            params: params.clone(),
            request_id: request_id.to_string(),
            blocks,
            num_tokens,
        })?)
    }

    /// The proxy says D never got the request: release at once unless a D claimed it.
    pub fn release_from_proxy(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        self.call(Input::ReleaseFromProxy {
            params: params.clone(),
        })
        .map(drop)
    }

    // ----- D -----

    pub fn on_request_arrived(
        &self,
        request: u64,
        params: &KvTransferParams,
        prompt_tokens: u32,
    ) -> Result<(), ConnectorError> {
        self.call(Input::RequestArrived {
            request,
            params: params.clone(),
            prompt_tokens,
        })
        .map(drop)
    }

    pub fn on_blocks_allocated(
        &self,
        request: u64,
        blocks: Vec<u32>,
    ) -> Result<(), ConnectorError> {
        self.on_blocks_allocated_after_cached(request, Vec::new(), blocks)
    }

    /// See [`Input::BlocksAllocated`].
    pub fn on_blocks_allocated_after_cached(
        &self,
        request: u64,
        cached: Vec<u32>,
        blocks: Vec<u32>,
    ) -> Result<(), ConnectorError> {
        self.call(Input::BlocksAllocated {
            request,
            cached,
            blocks,
        })
        .map(drop)
    }

    pub fn on_request_ended(&self, request: u64, reason: ReleaseReason) {
        self.tell(Input::RequestEnded { request, reason });
    }

    /// D refuses a request it never tracked: its P is told to release, unless this engine
    /// still tracks the handoff for another request.
    pub fn reject(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        self.call(Input::Reject {
            params: params.clone(),
        })
        .map(drop)
    }

    // ----- snapshots -----

    pub fn held_blocks(&self) -> (usize, usize) {
        self.query(|core| core.held_blocks()).unwrap_or_default()
    }

    pub fn staged_messages(&self) -> usize {
        self.query(|core| core.staged_messages())
            .unwrap_or_default()
    }

    pub fn held_blocks_by_engine(&self) -> Vec<(String, usize)> {
        self.query(|core| core.held_blocks_by_engine())
            .unwrap_or_default()
    }

    /// Handoffs P holds now, and how many ended per reason so far.
    pub fn producer_stats(&self) -> Option<(usize, HashMap<&'static str, u64>)> {
        self.query(|core| core.producer_stats().map(|(n, s)| (n, s.ended.clone())))
            .ok()
            .flatten()
    }

    pub fn memory(&self) -> Option<CoreMemory> {
        self.query(|core| core.memory()).ok()
    }

    /// Brings the held-blocks gauges up to the ledgers' present state (before a scrape).
    pub fn refresh_metrics(&self) {
        // Any query does: the executor updates the gauges before it answers.
        let _ = self.query(|_| ());
    }

    /// Whether the connector takes work: not shut down, and its executor answers a query (the
    /// thread that owns the core, the side channel and the timers is alive).
    pub fn is_running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed) && self.query(|_| ()).is_ok()
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the executor, which closes every connection and lets the workers go.
        self.tell(Input::CloseAll);
    }
}

/// The answer a hook that creates parameters gets.
fn params(a: Answer) -> Result<KvTransferParams, ConnectorError> {
    match a {
        Answer::Params(p) => Ok(p),
        other => Err(unexpected(other)),
    }
}

fn handoff(a: Answer) -> Result<HandoffId, ConnectorError> {
    match a {
        Answer::Handoff(h) => Ok(h),
        other => Err(unexpected(other)),
    }
}

/// An answer of another kind than the input's: a core bug, said rather than panicked on.
fn unexpected(a: Answer) -> ConnectorError {
    ConnectorError::UnexpectedAnswer(format!("{a:?}"))
}

impl Drop for Connector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Side-channel events, timeouts and shutdown never fail in the core; should one ever do, it is
/// said, not dropped.
fn log_refused(r: Answered) {
    if let Err(e) = r {
        tracing::error!(error = %e, "the core refused an input no one asked for");
    }
}

struct Executor {
    core: ConnectorCore,
    start: Instant,
    inputs: Receiver<Msg>,
    side: SideChannel,
    conns: HashMap<ConnId, ConnWriter>,
    workers: Vec<Box<dyn WorkerLink>>,
    events: Sender<ConnectorEvent>,
    waker: Waker,
    metrics: Metrics,
    stop: Arc<AtomicBool>,
    counters_seen: LedgerCounters,
    gauges_at: Option<Instant>,
    fallbacks: FallbackLog,
    /// Writes every input and batch down, when the engine asked for a trace.
    recorder: Option<crate::recorder::Recorder>,
}

/// Warns when requests fall back (recomputed or failed) because a transfer failed: at once the
/// first time for a P engine and reason, then at most once per [`FallbackLog::EVERY`] with the
/// count since, so a broken link is never silent and never a flood.
#[derive(Default)]
struct FallbackLog {
    last: HashMap<(String, &'static str), (Instant, usize)>,
}

impl FallbackLog {
    const EVERY: Duration = Duration::from_secs(10);

    /// Counts a fallback; returns the warning when one is due now (and logs it).
    fn warn(
        &mut self,
        peer: &str,
        reason: &'static str,
        requests: usize,
        recomputed: bool,
    ) -> Option<String> {
        self.warn_at(Instant::now(), peer, reason, requests, recomputed)
    }

    fn warn_at(
        &mut self,
        now: Instant,
        peer: &str,
        reason: &'static str,
        requests: usize,
        recomputed: bool,
    ) -> Option<String> {
        let what = if recomputed {
            "recomputed locally"
        } else {
            "failed"
        };
        let msg = match self.last.get_mut(&(peer.to_string(), reason)) {
            Some((at, since)) if now.duration_since(*at) < Self::EVERY => {
                *since += requests;
                return None;
            }
            Some((at, since)) => {
                let msg = format!(
                    "KV transfers from P {peer} keep failing ({reason}): {} more request(s) {what} in the last {} s",
                    *since + requests,
                    now.duration_since(*at).as_secs()
                );
                *at = now;
                *since = 0;
                msg
            }
            None => {
                self.last.insert((peer.to_string(), reason), (now, 0));
                format!("KV transfer from P {peer} failed ({reason}): {requests} request(s) {what}")
            }
        };
        tracing::warn!("{msg}");
        Some(msg)
    }
}

impl Executor {
    fn now(&self) -> Time {
        self.start.elapsed()
    }

    /// Every input reaches the core here, and the recorder with it.
    fn give(&mut self, input: Input, now: Time) -> Answered {
        let Some(rec) = self.recorder.as_mut() else {
            return self.core.handle(input, now);
        };
        let answer = self.core.handle(input.clone(), now);
        rec.input(now, input, &answer);
        answer
    }

    fn run(mut self) {
        while !self.stop.load(Ordering::Relaxed) {
            let now = self.now();
            let wait = self
                .core
                .poll_timeout()
                .map_or(IDLE, |t| t.saturating_sub(now).min(IDLE));
            let mut replies = Vec::new();
            match self.inputs.recv_timeout(wait) {
                Ok(input) => {
                    self.handle(input, &mut replies);
                    for _ in 1..BATCH {
                        match self.inputs.try_recv() {
                            Ok(input) => self.handle(input, &mut replies),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            let now = self.now();
            if self.core.poll_timeout().is_some_and(|t| t <= now) {
                log_refused(self.give(Input::Timeout, now));
            }
            self.carry_out();
            if self.gauges_at.map_or(true, |t| t.elapsed() >= GAUGES_EVERY) {
                self.update_gauges();
            }
            // Answers go after the batch their calls caused, so its events are there first.
            for r in replies {
                r();
            }
        }
        let now = self.now();
        log_refused(self.give(Input::CloseAll, now));
        self.carry_out();
        for (_, w) in self.conns.drain() {
            w.close();
        }
    }

    fn handle(&mut self, msg: Msg, replies: &mut Vec<Reply>) {
        let now = self.now();
        let input = match msg {
            Msg::Core(input, reply) => {
                let answer = self.give(input, now);
                if let Some(tx) = reply {
                    replies.push(Box::new(move || {
                        let _ = tx.send(answer);
                    }));
                }
                return;
            }
            Msg::Query(f) => {
                replies.push(f(&self.core));
                // A snapshot refreshes the gauges too.
                self.gauges_at = None;
                return;
            }
            Msg::Side(ev) => ev,
        };
        let input = match input {
            SideEvent::Accepted {
                conn,
                writer,
                msg,
                proven,
            } => {
                self.conns.insert(conn, writer);
                Input::Accepted { conn, msg, proven }
            }
            SideEvent::Refused(why) => {
                self.metrics
                    .side_refused
                    .get_or_create(&ReasonLabels {
                        reason: why.as_str(),
                    })
                    .inc();
                return;
            }
            SideEvent::Frame { conn, msg, ticket } => {
                // The ticket goes once the frame was handled (it paces the connection's reader).
                let r = self.give(Input::Frame { conn, msg }, now);
                drop(ticket);
                log_refused(r);
                return;
            }
            SideEvent::Backpressured { conn } => {
                self.metrics.side_backpressured.inc();
                tracing::debug!(
                    conn,
                    "a side-channel peer sends faster than this engine handles; its reader waits"
                );
                return;
            }
            SideEvent::Connected {
                engine,
                attempt,
                conn,
                writer,
                reply,
            } => {
                self.conns.insert(conn, writer);
                Input::Connected {
                    engine,
                    attempt,
                    conn,
                    reply,
                }
            }
            SideEvent::ConnectFailed {
                engine,
                attempt,
                error,
            } => Input::ConnectFailed {
                engine,
                attempt,
                error,
            },
            SideEvent::Closed { conn } => {
                self.conns.remove(&conn);
                Input::Closed { conn }
            }
        };
        log_refused(self.give(input, now));
    }

    /// Carries out everything the core asked for.
    fn carry_out(&mut self) {
        while self.core.has_ready() {
            let mut ready = self.core.ready();
            if let Some(rec) = self.recorder.as_mut() {
                rec.batch(&ready);
            }
            self.dispatch(&mut ready);
            self.core.advance(ready);
        }
    }

    fn dispatch(&mut self, ready: &mut Ready) {
        for (conn, msg) in ready.messages.drain(..) {
            let Some(w) = self.conns.get(&conn) else {
                continue;
            };
            match w.try_send(&msg) {
                Ok(()) => {}
                Err(SendError::Full) => {
                    tracing::warn!(
                        conn,
                        queued = side_channel::SEND_QUEUE,
                        "peer stopped reading its side channel: closing the connection"
                    );
                    self.metrics.send_queue_full.inc();
                    w.close();
                }
                // The reading thread reports the close.
                Err(SendError::Closed) => {}
            }
        }
        for conn in ready.closes.drain(..) {
            if let Some(w) = self.conns.get(&conn) {
                w.finish();
            }
        }
        for c in ready.connects.drain(..) {
            self.side.connect(c.engine, c.attempt, c.addr, c.hello);
        }
        let mut steps: Vec<WorkerStep> = vec![WorkerStep::default(); self.workers.len()];
        let ops = ready
            .worker_ops
            .drain(..)
            .chain(
                ready
                    .transfers_to_post
                    .drain(..)
                    .map(|(rank, job)| (rank, WorkerOp::Post(job))),
            )
            .chain(
                ready
                    .transfers_to_abort
                    .drain(..)
                    .map(|(rank, job)| (rank, WorkerOp::Abort { job })),
            );
        for (rank, op) in ops {
            if let Some(step) = steps.get_mut(rank as usize) {
                step.ops.push(op);
            }
        }
        for (w, step) in self.workers.iter_mut().zip(steps) {
            if !step.ops.is_empty() && !w.send(step) {
                tracing::error!("a worker side is gone");
            }
        }
        let queued = !ready.events.is_empty();
        for ev in ready.events.drain(..) {
            let _ = self.events.send(ev);
        }
        if let (true, Some(wake)) = (queued, self.waker.get()) {
            wake();
        }
        let observations: Vec<Observation> = ready.observations.drain(..).collect();
        for o in observations {
            self.observe(o);
        }
    }

    fn observe(&mut self, o: Observation) {
        let m = &self.metrics;
        match o {
            Observation::HeartbeatSent => {
                m.heartbeats
                    .get_or_create(&DirLabels { direction: "sent" })
                    .inc();
            }
            Observation::HeartbeatReceived => {
                m.heartbeats
                    .get_or_create(&DirLabels {
                        direction: "received",
                    })
                    .inc();
            }
            Observation::HandshakeRefused => {
                m.handshakes_refused.inc();
            }
            Observation::UnknownNotification => {
                m.unknown_notifications.inc();
            }
            Observation::AnonymousRefused => {
                m.anonymous_refused.inc();
            }
            Observation::TransportRefused(n) => {
                m.transport_refused.inc_by(n);
            }
            Observation::TransferRefused(n) => {
                m.transfers_refused.inc_by(n);
            }
            Observation::RejectOfTrackedHandoff => {
                m.rejects_of_tracked_handoffs.inc();
            }
            Observation::ReadStage => {
                m.read_stages.inc();
            }
            Observation::QueuedDropped => {
                m.queued_dropped.inc();
            }
            Observation::HandoffEnded { reason, held_for } => {
                m.handoffs_ended
                    .get_or_create(&ReasonLabels { reason })
                    .inc();
                m.lease_age_at_release.observe(held_for.as_secs_f64());
            }
            Observation::RequestFailed {
                reason,
                peer,
                requests,
                recomputed,
            } => {
                m.requests_failed
                    .get_or_create(&ReasonLabels { reason })
                    .inc_by(requests as u64);
                self.fallbacks.warn(&peer, reason, requests, recomputed);
            }
            Observation::Transfer {
                bytes,
                duration,
                descriptors,
            } => {
                m.transfer_bytes.inc_by(bytes);
                m.transfer_duration.observe(duration.as_secs_f64());
                m.transfer_descriptors.observe(descriptors as f64);
            }
            Observation::DigestChecked { matched } => {
                let matched = if matched { "true" } else { "false" };
                m.digests_checked
                    .get_or_create(&crate::metrics::MatchedLabels { matched })
                    .inc();
            }
            Observation::KvWait(w) => {
                let observe = |phase: &'static str, t: Option<std::time::Duration>| {
                    if let Some(t) = t {
                        m.kv_wait
                            .get_or_create(&crate::metrics::PhaseLabels { phase })
                            .observe(t.as_secs_f64());
                    }
                };
                observe("blocks_answer", w.blocks_answer);
                observe("admission", Some(w.admission));
                observe("to_transfer", w.to_transfer);
                observe("transfer", Some(w.transfer));
            }
        }
    }

    fn update_gauges(&mut self) {
        self.gauges_at = Some(Instant::now());
        // These are counted by the ledgers; the metrics follow their totals.
        let now = self.core.ledger_counters();
        let seen = std::mem::replace(&mut self.counters_seen, now);
        let m = &self.metrics;
        m.late_notifications
            .inc_by(now.late_notifications - seen.late_notifications);
        m.stale_epoch.inc_by(now.stale_epoch - seen.stale_epoch);
        m.read_retries.inc_by(now.read_retries - seen.read_retries);
        if now.client_blocks_replaced > seen.client_blocks_replaced {
            tracing::warn!(
                total = now.client_blocks_replaced,
                "remote_block_ids in a request differed from the blocks P named: read P's"
            );
        }
        m.client_blocks_replaced
            .inc_by(now.client_blocks_replaced - seen.client_blocks_replaced);
        m.blocks_refused
            .inc_by(now.blocks_refused - seen.blocks_refused);
        m.not_from_reader
            .inc_by(now.not_from_reader - seen.not_from_reader);
        m.staged_over_quota
            .inc_by(now.staged_over_quota - seen.staged_over_quota);
        let spec = self.core.spec();
        let block_bytes = spec.block_bytes() * spec.shape.num_layers as u64 * spec.tp as u64;
        let set = |side: &'static str, state: &'static str, blocks: usize| {
            let l = HeldLabels { side, state };
            self.metrics
                .blocks_held
                .get_or_create(&l)
                .set(blocks as i64);
            self.metrics
                .bytes_held
                .get_or_create(&l)
                .set((blocks as u64 * block_bytes) as i64);
        };
        if let Some((leased, fencing)) = self.core.producer_blocks_by_state() {
            set("prefill", "leased", leased);
            set("prefill", "fencing", fencing);
        }
        if self.core.consumer_stats().is_some() {
            set("decode", "waiting", self.core.held_blocks().1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallbacks_are_said_at_once_then_summed_per_interval() {
        let mut log = FallbackLog::default();
        let t0 = Instant::now();
        let first = log.warn_at(t0, "p at 10.0.0.1:7000", "peer_dead", 1, true);
        assert!(first.is_some_and(|m| m.contains("10.0.0.1:7000") && m.contains("peer_dead")));
        // Within the interval: counted, not said.
        assert_eq!(
            log.warn_at(
                t0 + Duration::from_secs(1),
                "p at 10.0.0.1:7000",
                "peer_dead",
                2,
                true
            ),
            None
        );
        // Another reason or peer is said at once.
        assert!(log
            .warn_at(
                t0 + Duration::from_secs(1),
                "p at 10.0.0.1:7000",
                "read_failed",
                1,
                true
            )
            .is_some());
        assert!(log
            .warn_at(t0 + Duration::from_secs(1), "q", "peer_dead", 1, false)
            .is_some());
        // After the interval: said with what was counted meanwhile.
        let later = log.warn_at(
            t0 + Duration::from_secs(11),
            "p at 10.0.0.1:7000",
            "peer_dead",
            1,
            true,
        );
        assert!(
            later
                .as_ref()
                .is_some_and(|m| m.contains("3 more request(s)")),
            "{later:?}"
        );
    }
}
