//! The reference engine of handoff: a paged KV pool, a scheduler with a waiting queue and
//! batching, a deterministic synthetic model whose output depends on every KV byte, a cost model
//! anchored to real hardware, and an OpenAI-compatible API with vLLM's `kv_transfer_params`.
//! It exists so that the whole system runs, and is tested, without GPUs or model weights.
//! In the book (`docs/` in the repository): `docs/src/reference/engine-settings.md`.

#![forbid(unsafe_code)]

mod api;
pub mod config;
mod kv;
mod metrics;
pub mod model;
mod pool;
mod scheduler;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use handoff_connector::{Connector, ConnectorConfig, RankMemory, Role};
use handoff_transport::mem::{MemFabric, MemTransport};
use handoff_transport::{open_backend_at, Endpoint, Transport};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

pub use config::{ConfigError, EngineConfig};

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
    shutdown: Option<oneshot::Sender<()>>,
    scheduler: std::sync::mpsc::Sender<scheduler::Command>,
    server: tokio::task::JoinHandle<()>,
}

impl RunningEngine {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = self.scheduler.send(scheduler::Command::Shutdown);
        if let Some(c) = &self.connector {
            c.shutdown();
        }
        let _ = (&mut self.server).await;
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
    let kv = Arc::new(
        kv::KvMemory::new(spec, cfg.num_blocks, cfg.pool_layout()?).map_err(anyhow::Error::msg)?,
    );
    let mut registry = Registry::default();
    let metrics = metrics::EngineMetrics::new(&mut registry);
    let http_metrics =
        handoff_http::HttpMetrics::register(registry.sub_registry_with_prefix("engine"))
            .listener("api");
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
    let connector = Connector::start(
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
            peer_hosts: cfg.peer_hosts(),
            key: key.clone(),
            insecure: cfg.insecure,
            max_side_connections: cfg.max_side_connections,
            max_side_handshakes_per_source: cfg.max_side_handshakes_per_source,
        },
        ranks,
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

    let state = Arc::new(api::ApiState {
        model: cfg.model.clone(),
        role,
        scheduler: Mutex::new(sched_tx.clone()),
        connector: connector.clone(),
        registry: Arc::new(Mutex::new(registry)),
        next_id: AtomicU64::new(1),
    });
    let (shutdown, rx) = oneshot::channel::<()>();
    let app = api::router(state);
    let limits = cfg.http_limits();
    let server = tokio::spawn(async move {
        let stopped = async {
            let _ = rx.await;
        };
        if let Err(e) = handoff_http::serve(listener, app, limits, http_metrics, stopped).await {
            tracing::error!(error = %e, "the HTTP API stopped");
        }
    });
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
        engine_id: cfg.engine_id,
        connector,
        shutdown: Some(shutdown),
        scheduler: sched_tx,
        server,
    })
}

/// Runs an engine until the process is stopped.
pub async fn run(cfg: EngineConfig) -> anyhow::Result<()> {
    let engine = start(cfg).await?;
    println!(
        "handoff engine {} listening on {}",
        engine.engine_id,
        engine.url()
    );
    std::future::pending::<()>().await;
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
