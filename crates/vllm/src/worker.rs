//! The worker side, in each of vLLM's worker processes: the rank's KV tensors registered with its
//! transport agent, and the steps the scheduler side sent (in [`StepMeta`]) carried out. It holds
//! no ledger and decides nothing.

use std::sync::Arc;
use std::time::Instant;

use handoff_connector::{Fence, RankMemory, WorkerHello, WorkerReport, WorkerSide};
use handoff_plan::{GroupKind, KvGroup, KvGroups};
use handoff_transport::device::cuda::CudaDevice;
use handoff_transport::device::{Device, DeviceError, MemoryKind};
use handoff_transport::{open_backend_at, Endpoint, KvRegion, TransportError};
use serde::Deserialize;

use crate::address;
use crate::grant_line::{self, GrantLineReceiver};
use crate::kv_tensors::{self, KvTensorInfo, KvTensors, ModelFacts};
use crate::scheduler::StepMeta;
#[cfg(feature = "test-switches")]
use crate::test_switches::Switches;

/// How a worker reaches its peers.
#[derive(Debug, Clone, Deserialize)]
pub struct WorkerConfig {
    pub engine_id: String,
    /// `tcp` (default) or `nixl`.
    #[serde(default = "default_transport")]
    pub transport: String,
    /// Where the tcp transport's data listener binds, `host:port` (an IP or a name; port 0: any
    /// free port, else rank r listens on port + r).
    #[serde(default = "default_bind")]
    pub data_bind: String,
    /// The host peers dial for data (default: the bind's host).
    #[serde(default)]
    pub advertise_host: Option<String>,
    /// The cluster key's file (`HANDOFF_CLUSTER_KEY` wins); see [`crate::cluster_key`].
    #[serde(default)]
    pub cluster_key_file: Option<String>,
    /// Allows a non-loopback data listener without a key.
    #[serde(default)]
    pub insecure: bool,
    pub facts: ModelFacts,
    /// vLLM's KV cache groups under its hybrid KV cache manager, layers numbered as the tensors
    /// are; none (or one full group): every layer alike.
    #[serde(default)]
    pub groups: Vec<GroupConfig>,
}

/// One KV cache group as the Python side describes it.
#[derive(Debug, Clone, Deserialize)]
pub struct GroupConfig {
    /// Tokens of its sliding window; none: full attention.
    #[serde(default)]
    pub window: Option<u32>,
    pub layers: Vec<u32>,
}

/// The groups of `cfg`, checked against a model of `num_layers` layers.
fn kv_groups(groups: &[GroupConfig], num_layers: u32) -> Result<KvGroups, WorkerError> {
    if groups.is_empty() {
        return Ok(KvGroups::single());
    }
    let groups = groups
        .iter()
        .map(|g| KvGroup {
            kind: g
                .window
                .map_or(GroupKind::Full, |window| GroupKind::Sliding { window }),
            layers: g.layers.clone(),
        })
        .collect();
    KvGroups::new(groups, num_layers).map_err(|e| WorkerError::Config(e.to_string()))
}

fn default_transport() -> String {
    "tcp".into()
}

fn default_bind() -> String {
    "127.0.0.1:0".into()
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid worker configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Tensors(#[from] kv_tensors::KvTensorError),
    #[error(transparent)]
    Transport(#[from] handoff_transport::TransportError),
    #[error(transparent)]
    Connector(#[from] handoff_connector::ConnectorError),
    #[error("cannot decode the step metadata: {0}")]
    Meta(postcard::Error),
    #[error(transparent)]
    Key(#[from] handoff_transport::auth::AuthError),
    #[error(transparent)]
    Address(#[from] address::AddressError),
}

pub struct WorkerBridge {
    side: WorkerSide,
    rank: usize,
    opaque_blocks: bool,
    /// Fault injection for the vLLM suite (not in the release wheel).
    #[cfg(feature = "test-switches")]
    switches: Switches,
    /// Renewed push grants from EngineCore during a forward pass (none if its socket could
    /// not be bound: held writes then keep the grant they were planned on).
    _grant_line: Option<GrantLineReceiver>,
    /// The GPU holding the KV cache (`None`: host memory).
    device: Option<Arc<dyn Device>>,
}

impl WorkerBridge {
    /// Registers the rank's KV tensors (vLLM `register_kv_caches`).
    ///
    /// The tensors' memory must stay allocated for the life of the process, as vLLM's KV cache
    /// does: handoff reads and writes it in place (see `KvRegion::from_foreign`).
    pub fn register(cfg: WorkerConfig, tensors: &[KvTensorInfo]) -> Result<Self, WorkerError> {
        #[cfg(feature = "test-switches")]
        if let Some((aliased, fake)) = Switches::fake_device(tensors) {
            let mut bridge = Self::register_on(cfg, &aliased, Some(fake))?;
            bridge.switches.host_kernels = true;
            return Ok(bridge);
        }
        let device = match tensors.first().and_then(|t| t.device) {
            None => None,
            Some(ordinal) => {
                Some(CudaDevice::open(ordinal).map_err(TransportError::from)? as Arc<dyn Device>)
            }
        };
        Self::register_on(cfg, tensors, device)
    }

    /// [`WorkerBridge::register`] with the tensors on `device` (when they say they are on one):
    /// the CUDA device they name, or a fake one in tests.
    pub fn register_on(
        cfg: WorkerConfig,
        tensors: &[KvTensorInfo],
        device: Option<Arc<dyn Device>>,
    ) -> Result<Self, WorkerError> {
        let KvTensors {
            layout,
            regions,
            block_bytes,
            opaque_blocks,
            device: on,
        } = kv_tensors::derive(tensors, cfg.facts)?;
        let device = match (on, device) {
            (None, _) => None,
            (Some(ordinal), Some(d)) if d.memory() == (MemoryKind::Cuda { device: ordinal }) => {
                Some(d)
            }
            (Some(ordinal), d) => {
                return Err(WorkerError::Config(format!(
                    "the KV cache is on cuda:{ordinal}, the device given is {}",
                    d.map_or("none".into(), |d| d.memory().to_string())
                )))
            }
        };
        // Rank r listens on data_bind's port + r (0: any free port), so that a firewall or a
        // pod spec can list each rank's port.
        let (host, port) = address::split_host_port("data_bind", &cfg.data_bind)?;
        let port = address::rank_port("data_bind", port, cfg.facts.rank as u16)?;
        let bind = address::resolve_bind("data_bind", host, port)?;
        let key = crate::cluster_key(cfg.cluster_key_file.as_deref())?;
        handoff_connector::check_exposure(bind.ip(), key.as_ref(), cfg.insecure)?;
        let at = Endpoint {
            advertise_host: address::advertised("data_bind", &bind, cfg.advertise_host.as_deref())?,
            bind,
            key,
            // The connector grants each handoff's blocks to its reader or writer.
            check_grants: true,
        };
        let name = format!("{}-r{}", cfg.engine_id, cfg.facts.rank);
        let transport = open_backend_at(&cfg.transport, &name, &at)?;
        #[cfg(feature = "test-switches")]
        let (transport, switches) = Switches::read(transport);
        let regions: Vec<(u32, Arc<KvRegion>)> = regions
            .into_iter()
            .map(|(id, base, len)| {
                let (base, len, chunk) = (base as usize, len as usize, block_bytes as usize);
                // vLLM allocates its KV cache once per worker process and keeps it for the
                // process's life; handoff accesses it only through this region.
                #[allow(unsafe_code)]
                let r = match &device {
                    // SAFETY: host memory vLLM keeps allocated (above), `len` bytes from `base`.
                    None => unsafe { KvRegion::from_foreign(base, len, chunk) },
                    // SAFETY: device memory vLLM keeps allocated (above), touched only through
                    // the driver's copies and NIXL.
                    Some(d) => unsafe { KvRegion::on_device(d.clone(), base, len, chunk)? },
                };
                Ok((id, Arc::new(r)))
            })
            .collect::<Result<_, TransportError>>()?;
        let groups = kv_groups(&cfg.groups, layout.spec.shape.num_layers)?;
        let mut side = WorkerSide::new(RankMemory {
            layout,
            regions,
            transport,
        })?;
        side.set_groups(groups)?;
        let grant_line = GrantLineReceiver::start(
            &grant_line::socket_path(&cfg.engine_id, cfg.facts.rank as u16),
            side.write_grants(),
        )
        .map_err(|e| tracing::warn!(error = %e, "no grant line: a push forward pass longer than D's registration grant fails its writes"))
        .ok();
        Ok(WorkerBridge {
            device,
            _grant_line: grant_line,
            side,
            rank: cfg.facts.rank as usize,
            opaque_blocks,
            #[cfg(feature = "test-switches")]
            switches,
        })
    }

    /// What the scheduler side needs of this worker (vLLM `get_handshake_metadata`).
    pub fn hello(&self) -> Result<WorkerHello, WorkerError> {
        Ok(self.side.hello()?)
    }

    pub fn opaque_blocks(&self) -> bool {
        self.opaque_blocks
    }

    /// Carries out this rank's part of a step (vLLM `start_load_kv`).
    pub fn apply(&mut self, meta: &StepMeta) {
        if let Some(step) = meta.steps.get(self.rank) {
            let step = step.clone();
            #[cfg(feature = "test-switches")]
            let step = self.switches.filter(step);
            if meta.forward.is_empty() {
                self.side.apply(step);
            } else {
                self.side
                    .apply_before_forward(step, &meta.forward, Instant::now());
            }
        }
    }

    /// Whether a write waits for layer `layer` (vLLM `save_kv_layer`: on a GPU the layer's
    /// kernels must have finished before [`Self::layer_saved`]).
    pub fn waits_for_layer(&self, layer: u32) -> bool {
        self.side.waits_for_layer(layer)
    }

    /// The forward pass saved layer `layer` (vLLM `save_kv_layer`): its writes go. On a GPU,
    /// `stream` is the forward's CUDA stream, where the layer's kernels were only enqueued: the
    /// writes go once an event recorded there now has passed.
    pub fn layer_saved(&mut self, layer: u32, stream: Option<u64>) {
        let now = Instant::now();
        match self.fence(stream) {
            Ok(fence) => self.side.layer_saved_after(layer, fence, now),
            // Held: they go at the forward's end, or with the next step (by then its kernels
            // ran: vLLM read the step's sampled tokens back).
            Err(e) => {
                tracing::error!(layer, error = %e, "cannot order the layer's writes after its kernels: held")
            }
        }
    }

    /// The forward pass ended (vLLM `wait_for_save`): every write it held goes (on a GPU, once
    /// an event recorded on `stream` now has passed).
    pub fn forward_done(&mut self, stream: Option<u64>) {
        match self.fence(stream) {
            Ok(fence) => self.side.forward_done_after(fence, Instant::now()),
            Err(e) => {
                tracing::error!(error = %e, "cannot order the forward's writes after its kernels: held to the next step")
            }
        }
    }

    /// A fence on `stream` when the KV is in device memory.
    fn fence(&self, stream: Option<u64>) -> Result<Option<Fence>, DeviceError> {
        match (&self.device, stream) {
            (Some(d), Some(s)) => Fence::record(d.clone(), s).map(Some),
            #[cfg(feature = "test-switches")]
            (Some(_), None) if self.switches.host_kernels => Ok(None),
            (Some(d), None) => Err(DeviceError::Call {
                device: match d.memory() {
                    MemoryKind::Cuda { device } => device,
                    MemoryKind::Host => 0,
                },
                call: "no CUDA stream given for the forward pass",
                code: 0,
            }),
            (None, _) => Ok(None),
        }
    }

    /// What ended, arrived or died since the last call (vLLM `get_finished`).
    pub fn poll(&mut self) -> Option<WorkerReport> {
        self.side.poll()
    }

    pub fn shutdown(&mut self) {
        self.side.abort_all();
    }
}
