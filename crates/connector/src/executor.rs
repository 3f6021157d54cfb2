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
use handoff_plan::{KvGroups, KvSpec};
use handoff_proto::{HandoffId, KvTransferParams};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;

use crate::metrics::{DirLabels, HeldLabels, Metrics, ReasonLabels};
use crate::side_channel::{self, ConnWriter, SendError, SideChannel, SideConfig, SideEvent, Sink};
use crate::worker::{self, RankMemory, WorkerSide};
use crate::worker_protocol::{WorkerHello, WorkerOp, WorkerReport, WorkerStep};
use crate::{ConnectorConfig, ConnectorError, ConnectorEvent, Role};

mod hooks;
mod observe;

use handoff_core::{
    Answer, ConnId, ConnectorCore, CoreConfig, CoreMemory, Hooks, Input, LedgerCounters,
    Observation, Ready,
};
use observe::FallbackLog;

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
        Connector::start_grouped(cfg, ranks, KvGroups::single(), registry)
    }

    /// [`Connector::start`] for a model whose layers keep their KV in `groups` (a hybrid
    /// model: each group's blocks listed in its handoffs, see `handoff_plan::KvGroups`).
    pub fn start_grouped(
        cfg: ConnectorConfig,
        ranks: Vec<RankMemory>,
        groups: KvGroups,
        registry: &mut Registry,
    ) -> Result<Arc<Connector>, ConnectorError> {
        let mut workers = Vec::new();
        for mem in ranks {
            let mut w = WorkerSide::new(mem)?;
            w.set_groups(groups.clone())?;
            workers.push(w);
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
                protocol_version: cfg.protocol_version,
            },
            side_sink,
        );
        let side_addr = side
            .listen(cfg.side_channel_bind, stop.clone())
            .map_err(|e| ConnectorError::Listen(cfg.side_channel_bind, e))?;
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
                protocol_version: cfg.protocol_version,
                layerwise_pull: cfg.layerwise_pull,
                layer_reports: cfg.layer_reports,
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
        let recorder = match &cfg.record {
            Some(rc) => {
                match crate::recorder::Recorder::create(rc.clone(), core.config(), core.ranks()) {
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
            None => None,
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
}
