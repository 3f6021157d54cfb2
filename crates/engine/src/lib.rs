//! The reference engine of handoff: a paged KV pool, a scheduler with a waiting queue and
//! batching, a deterministic synthetic model whose output depends on every KV byte, a cost model
//! anchored to real hardware, and an OpenAI-compatible API with vLLM's `kv_transfer_params`.
//! It exists so that the whole system runs, and is tested, without GPUs or model weights.
//! In the book (`docs/` in the repository): `docs/src/reference/engine-settings.md`.

#![forbid(unsafe_code)]

mod api;
pub mod config;
mod drain;
mod kv;
mod metrics;
pub mod model;
mod pool;
mod prompt;
mod scheduler;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use handoff_connector::{Connector, ConnectorConfig, RankMemory, Role};
use handoff_transport::mem::{MemFabric, MemTransport};
use handoff_transport::{open_backend_at, Endpoint, Transport};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

pub use config::{ConfigError, EngineConfig};
pub use drain::DrainReport;

/// The fabric every `mem`-transport engine of this process shares (tests run clusters
/// in-process with it).
pub fn mem_fabric() -> Arc<MemFabric> {
    static FABRIC: OnceLock<Arc<MemFabric>> = OnceLock::new();
    FABRIC.get_or_init(MemFabric::new).clone()
}

/// A running engine.
pub struct RunningEngine {
    pub addr: SocketAddr,
    pub engine_id: String,
    pub connector: Option<Arc<Connector>>,
    /// The admin listener's address, when `admin_token` is set.
    pub admin_addr: Option<SocketAddr>,
    shutdown: Vec<oneshot::Sender<()>>,
    scheduler: std::sync::mpsc::Sender<scheduler::Command>,
    servers: Vec<tokio::task::JoinHandle<()>>,
    drain: Arc<drain::Drain>,
}

impl RunningEngine {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(mut self) {
        for tx in self.shutdown.drain(..) {
            let _ = tx.send(());
        }
        let _ = self.scheduler.send(scheduler::Command::Shutdown);
        if let Some(c) = &self.connector {
            c.shutdown();
        }
        for server in self.servers.drain(..) {
            let _ = server.await;
        }
    }

    /// Drains the engine (see `drain.rs`: readiness false, then new requests refused, until
    /// nothing is in flight or `drain_timeout_ms`) and says how it went. The engine still runs
    /// afterwards: `stop` it.
    pub async fn drain(&self) -> DrainReport {
        self.drain.begin("asked by the embedding program");
        self.drain.finished().await
    }

    /// Resolves when a drain has been asked for (an admin call).
    async fn drain_requested(&self) {
        self.drain.requested().await
    }
}

/// Eight random hex digits for a default engine id. An error instead of a fixed fallback: two
/// engines with one id would mix up their peers' handoffs.
fn random_suffix() -> std::io::Result<String> {
    let mut b = [0u8; 4];
    getrandom_fill(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn getrandom_fill(b: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(b)
}

/// Starts an engine on the current tokio runtime.
pub async fn start(mut cfg: EngineConfig) -> anyhow::Result<RunningEngine> {
    cfg.validate()?;
    if cfg.engine_id.is_empty() {
        let suffix = random_suffix().context("cannot make a random engine id (set engine_id)")?;
        cfg.engine_id = format!("{}-{}", cfg.role, suffix);
    }
    let role = cfg.role()?;
    let spec = cfg.spec()?;
    let kv = Arc::new(kv::KvMemory::new(spec, cfg.num_blocks, cfg.pool_layout()?)?);
    let mut registry = Registry::default();
    let metrics = metrics::EngineMetrics::new(&mut registry);
    let http_admin_metrics =
        handoff_http::HttpMetrics::register(registry.sub_registry_with_prefix("engine"));
    let http_metrics = http_admin_metrics.listener("api");
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", cfg.host, cfg.port))?;
    let addr = listener.local_addr()?;

    let key = cfg.cluster_key()?;
    if key.is_none() {
        tracing::warn!(
            host = %cfg.host,
            "no cluster key: peers are not authenticated{}",
            if cfg.insecure { " (insecure)" } else { "; loopback only" }
        );
    }
    // Every role gets a connector: a monolithic engine (`both`) can also serve either side.
    let mut ranks = Vec::new();
    for (rank, layout) in kv.layouts.iter().enumerate() {
        let name = format!("{}-r{rank}", cfg.engine_id);
        let mut transport: Arc<dyn Transport> = match cfg.transport.as_str() {
            "mem" => MemTransport::new(&mem_fabric(), &name)
                .with_context(|| format!("cannot open the mem transport {name:?}"))?,
            other => {
                let port = match cfg.data_port {
                    0 => 0,
                    first => first + rank as u16,
                };
                let at = Endpoint {
                    bind: SocketAddr::new(addr.ip(), port),
                    advertise_host: cfg.advertise().to_string(),
                    key: key.clone(),
                    // The connector grants each handoff's blocks to its reader or writer.
                    check_grants: true,
                };
                open_backend_at(other, &name, &at)
                    .with_context(|| format!("cannot open the {other} transport at {}", at.bind))?
            }
        };
        if let Some(plan) = cfg.fault_plan()? {
            transport = handoff_transport::faulty::FaultyTransport::new(transport, plan);
        }
        ranks.push(RankMemory {
            layout: layout.clone(),
            regions: vec![(0, kv.regions[rank].clone())],
            transport,
        });
    }
    let connector = Connector::start_grouped(
        ConnectorConfig {
            engine_id: cfg.engine_id.clone(),
            role,
            mode: cfg.mode()?,
            model: cfg.model.clone(),
            dtype: cfg.dtype.clone(),
            side_channel_bind: SocketAddr::new(addr.ip(), cfg.side_channel_port),
            advertise_host: cfg.advertise().to_string(),
            producer: cfg.producer(),
            consumer: cfg.consumer(),
            opaque_blocks: false,
            kv_digest: cfg.kv_digest,
            layerwise_pull: cfg.layerwise_pull,
            // The scheduler says each layer once its KV is in the blocks.
            layer_reports: handoff_connector::LayerReports::Saved,
            peer_hosts: cfg.peer_hosts(),
            key: key.clone(),
            insecure: cfg.insecure,
            max_side_connections: cfg.max_side_connections,
            max_side_handshakes_per_source: cfg.max_side_handshakes_per_source,
            record: cfg.record(),
            protocol_version: cfg.protocol_version,
        },
        ranks,
        cfg.kv_groups()?,
        &mut registry,
    )?;
    let connector = Some(connector);

    let (sched_tx, sched_rx) = std::sync::mpsc::channel();
    if let Some(c) = &connector {
        let wake = sched_tx.clone();
        c.set_waker(move || {
            let _ = wake.send(scheduler::Command::Wake);
        });
    }
    let sched = scheduler::Scheduler::new(cfg.clone(), kv.clone(), connector.clone(), metrics);
    std::thread::Builder::new()
        .name(format!("engine-{}", cfg.engine_id))
        .spawn(move || sched.run(sched_rx))?;

    let queue = Arc::new(Mutex::new(sched_tx.clone()));
    let drain = drain::Drain::new();
    tokio::spawn(drain::run(
        drain.clone(),
        drain::Engine {
            scheduler: queue.clone(),
            connector: connector.clone(),
            grace: Duration::from_millis(cfg.drain_grace_ms),
            timeout: Duration::from_millis(cfg.drain_timeout_ms),
        },
    ));
    let admin = match cfg.admin_token.is_empty() {
        true => None,
        false => Some(
            tokio::net::TcpListener::bind((cfg.admin_host.as_str(), cfg.admin_port))
                .await
                .with_context(|| {
                    format!(
                        "cannot listen on {}:{} (admin)",
                        cfg.admin_host, cfg.admin_port
                    )
                })?,
        ),
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
    let state = Arc::new(api::ApiState {
        model: cfg.model.clone(),
        role,
        scheduler: queue,
        connector: connector.clone(),
        drain: drain.clone(),
        registry: Arc::new(Mutex::new(registry)),
        next_id: AtomicU64::new(1),
    });
    let limits = cfg.http_limits();
    let mut shutdown = Vec::new();
    let mut servers = Vec::new();
    let mut listeners = vec![(listener, api::router(state), http_metrics, "HTTP API")];
    if let Some(l) = admin {
        let m = http_admin_metrics.listener("admin");
        let app = drain::admin_router(drain.clone(), cfg.admin_token.clone());
        listeners.push((l, app, m, "admin listener"));
    }
    for (listener, app, m, what) in listeners {
        let (tx, rx) = oneshot::channel::<()>();
        let limits = limits.clone();
        servers.push(tokio::spawn(async move {
            let stopped = async {
                let _ = rx.await;
            };
            if let Err(e) = handoff_http::serve(listener, app, limits, m, stopped).await {
                tracing::error!(error = %e, "the {what} stopped");
            }
        }));
        shutdown.push(tx);
    }
    tracing::info!(
        engine = %cfg.engine_id,
        role = %cfg.role,
        %addr,
        advertise = cfg.advertise(),
        side_channel = %connector.as_ref().map(|c| c.side_channel_addr().to_string()).unwrap_or_default(),
        "engine listening"
    );
    Ok(RunningEngine {
        addr,
        admin_addr,
        engine_id: cfg.engine_id,
        connector,
        shutdown,
        scheduler: sched_tx,
        servers,
        drain,
    })
}

/// Runs an engine until it is drained: by SIGTERM, or by `POST /drain` on the admin listener.
/// A drained engine stops and returns (the process exits 0).
pub async fn run(cfg: EngineConfig) -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot handle SIGTERM")?;
    let engine = start(cfg).await?;
    println!(
        "handoff engine {} listening on {}",
        engine.engine_id,
        engine.url()
    );
    tokio::select! {
        _ = term.recv() => engine.drain.begin("SIGTERM"),
        _ = engine.drain_requested() => {}
    }
    let report = engine.drain.finished().await;
    // The line a supervisor (or `handoff demo --drain`) reads.
    println!("drained {}", serde_json::to_string(&report)?);
    engine.stop().await;
    Ok(())
}

#[doc(hidden)]
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}
