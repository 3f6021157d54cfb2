//! The scheduler side, in vLLM's EngineCore process: the connector's executor (and with it the
//! core: both ledgers, the side channel, the timers) behind vLLM's scheduler hooks. Worker steps
//! leave through [`StepMeta`] (vLLM's `build_connector_meta`, pickled to every worker), worker
//! reports come back through `update_connector_output`: no socket or shared memory between the
//! two processes but vLLM's own.
//!
//! Request ids: vLLM names requests with strings; the ledgers with numbers. The maps between the
//! two hold one entry per request in flight and lose it when the request's outcome is known.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

use handoff_connector::{
    Connector, ConnectorConfig, ConnectorError, ConnectorEvent, Hooks, Input, PrefillOutcome,
    ReportSink, Role, WorkerHello, WorkerLink, WorkerOp, WorkerReport, WorkerStep,
};
use handoff_ledger::{ConsumerConfig, FailurePolicy, ProducerConfig};
use handoff_plan::KvGroups;
use handoff_proto::{HandoffId, KvTransferParams, ReleaseReason, TransferMode};
use serde::{Deserialize, Serialize};

use crate::address;
use crate::engine_socket::{socket_path, EngineSocket};
use crate::grant_line::{GrantLine, Renewal};

/// What the scheduler tells every worker for one engine step (vLLM's `KVConnectorMetadata`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMeta {
    /// Work per rank (index = rank).
    pub steps: Vec<WorkerStep>,
    /// P: requests whose blocks the connector gave back (vLLM frees them).
    pub finished_sending: Vec<String>,
    /// D: requests whose KV landed.
    pub finished_recving: Vec<String>,
    /// D: requests whose KV will not come (vLLM's `kv_load_failure_policy` decides).
    pub failed_recving: Vec<String>,
    /// P: push handoffs whose prompt this step's forward pass completes: their writes wait in
    /// the worker for the layer they move (see `handoff_connector::forward_gate`).
    pub forward: Vec<HandoffId>,
}

impl StepMeta {
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self, postcard::Error> {
        postcard::from_bytes(b)
    }

    pub fn is_empty(&self) -> bool {
        self.steps.iter().all(|s| s.ops.is_empty())
            && self.finished_sending.is_empty()
            && self.finished_recving.is_empty()
            && self.failed_recving.is_empty()
            && self.forward.is_empty()
    }
}

/// D's answer to vLLM's `get_num_new_matched_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matched {
    /// Nothing comes from P for this request: vLLM computes its prompt itself (not a remote
    /// prefill, or a sibling whose KV is in vLLM's prefix cache now).
    Local,
    /// This many prompt tokens arrive from P.
    Remote(u32),
    /// Ask again at a later step: a sibling's READ is bringing this prompt's KV.
    Later,
}

/// `kv_connector_extra_config`, plus what the Python side reads from vLLM's config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    pub engine_id: String,
    pub model: String,
    pub dtype: String,
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Where the side channel listens.
    #[serde(default = "default_host")]
    pub side_channel_host: String,
    #[serde(default)]
    pub side_channel_port: u16,
    /// The host peers dial (default: `side_channel_host`).
    #[serde(default)]
    pub advertise_host: Option<String>,
    #[serde(default)]
    pub initial_lease_ms: Option<u64>,
    #[serde(default)]
    pub wait_deadline_ms: Option<u64>,
    /// D: a READ not finished in this long (plus its bytes' time at `transfer_floor_mb_per_s`)
    /// fails (default 5 s).
    #[serde(default)]
    pub read_timeout_ms: Option<u64>,
    /// The slowest rate (MB/s per pair of ranks) a healthy transfer is expected to reach
    /// (default 1000): D gives a READ its bytes' time at it, P starts a push WRITE only while
    /// D's grant has its bytes' time left.
    #[serde(default)]
    pub transfer_floor_mb_per_s: Option<u64>,
    /// D, push: the longest D keeps a registration P has not completed (default 30 s).
    #[serde(default)]
    pub push_deadline_ms: Option<u64>,
    /// P: the longest a handoff lives, heartbeats or not (default 120 s).
    #[serde(default)]
    pub hard_cap_ms: Option<u64>,
    /// D, push: how long each grant D gives P on a registration lasts (renewed by P's
    /// heartbeats, during P's forward pass too: see [`crate::grant_line`]). D frees a dead or
    /// partitioned P's registered blocks this long (plus the write grace) after its last grant
    /// (default 2 s).
    #[serde(default)]
    pub registration_lease_ms: Option<u64>,
    /// The newest handoff protocol version this engine speaks (default: this build's own). Set
    /// it to the previous version while a fleet upgrades, so that no upgraded engine says
    /// hello in a version the others do not know (they pair either way: see the upgrade page).
    #[serde(default)]
    pub protocol_version: Option<u8>,
    /// Workers' KV blocks are opaque pages (set from the layout the workers found).
    #[serde(default)]
    pub opaque_blocks: bool,
    /// The cluster key's file (`HANDOFF_CLUSTER_KEY` wins); see [`crate::cluster_key`].
    #[serde(default)]
    pub cluster_key_file: Option<String>,
    /// Allows a non-loopback side channel without a key.
    #[serde(default)]
    pub insecure: bool,
    /// D dials a P only at these hosts (see `CoreConfig::peer_hosts`); empty: any.
    #[serde(default)]
    pub peer_hosts: Vec<String>,
    /// Check each handoff's KV digest (see `handoff_connector::digest`).
    #[serde(default)]
    pub kv_digest: bool,
    /// Record every core input to this trace file (`handoff replay` reads it): 4 files of
    /// 64 MiB at most, rotating.
    #[serde(default)]
    pub record_trace: Option<String>,
    /// vLLM's `kv_load_failure_policy` (`recompute` or `fail`): vLLM carries it out; the
    /// connector's logs and metrics say the same.
    #[serde(default)]
    pub failure_policy: Option<String>,
}

fn default_mode() -> String {
    "pull".into()
}

fn default_host() -> String {
    "127.0.0.1".into()
}

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error("invalid connector configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    #[error("invalid kv_transfer_params: {0}")]
    Params(String),
    #[error("cannot decode a worker report: {0}")]
    Report(postcard::Error),
    #[error(transparent)]
    Key(#[from] handoff_transport::auth::AuthError),
    #[error(transparent)]
    Address(#[from] address::AddressError),
}

/// A worker's steps, queued until the next `build_connector_meta`; renewed push grants go to
/// the worker at once on the grant line (its forward pass may be running).
struct QueueLink {
    rank: u16,
    steps: std::sync::mpsc::Sender<WorkerStep>,
    line: Option<Arc<GrantLine>>,
}

impl WorkerLink for QueueLink {
    fn send(&mut self, mut step: WorkerStep) -> bool {
        step.ops.retain(|op| match op {
            WorkerOp::RenewWrites {
                handoff,
                d_rank,
                post_within_ms,
            } => {
                if let Some(line) = &self.line {
                    line.send(
                        self.rank,
                        &Renewal::within(*handoff, *d_rank, *post_within_ms),
                    );
                }
                // A renewal in the next step's metadata would come after the forward it is
                // for: moot.
                false
            }
            _ => true,
        });
        step.ops.is_empty() || self.steps.send(step).is_ok()
    }
}

/// vLLM's null block: the block id its hybrid KV cache manager puts where it freed a block (the
/// first block of its pool, never a request's).
const VLLM_NULL_BLOCK: u32 = 0;

pub struct SchedulerSide {
    connector: Arc<Connector>,
    /// The model's KV cache groups, as the workers said (one group unless vLLM's hybrid KV
    /// cache manager keeps several).
    groups: KvGroups,
    sink: ReportSink,
    steps: Vec<Receiver<WorkerStep>>,
    /// P: the handoff that holds a finished vLLM request's blocks → the request. vLLM frees
    /// them when the request is named in `finished_sending`. Keyed by handoff, not by block:
    /// vLLM's prefix cache gives prompts that start alike the same first blocks.
    sending: HashMap<HandoffId, String>,
    /// D: first block of a request that ended while its READ may still land → the request
    /// (named in `finished_sending` once the ledger let the blocks go). D's blocks for a
    /// transfer are its own (never prefix-cache blocks), so the first one names the request.
    ended_reading: HashMap<u32, String>,
    /// D: the first block given to each tracked request (its KV lands there).
    first_block: HashMap<u64, u32>,
    /// D: first blocks of the requests whose blocks D's ledger still holds (a READ or a WRITE
    /// may land in them) until their KV is ready or the ledger lets them go. vLLM must neither
    /// free nor recompute into them before.
    held: HashSet<u32>,
    /// D: requests whose KV will not come, told to vLLM once the ledger let their blocks go
    /// (first block → request).
    failed_later: HashMap<u32, String>,
    /// D: requests vLLM gave blocks for their KV (from then on vLLM waits for it:
    /// `WAITING_FOR_REMOTE_KVS`).
    given_blocks: HashSet<u64>,
    /// D: requests whose handoff failed before vLLM gave them blocks. vLLM asserts that a
    /// request it hears of a load for waits for remote KV, so the failure is told only once
    /// vLLM gave the blocks (and then at once: its failure policy recomputes or fails it).
    failed_unallocated: HashSet<u64>,
    /// D: vLLM request id ↔ the ledgers' number, while the request waits for its KV.
    ids: HashMap<String, u64>,
    names: HashMap<u64, String>,
    /// D: the handoff each tracked request's KV comes from (n>1 siblings wait on it).
    by_handoff: HashMap<HandoffId, u64>,
    handoff_of: HashMap<u64, HandoffId>,
    next_id: u64,
    pending: StepMeta,
    /// D requests vLLM must not be told about twice.
    settled: HashSet<u64>,
    /// P: requests whose handoff holds their blocks since their last prefill step
    /// ([`Self::prefill_planned`]), until vLLM finishes them.
    planned: HashSet<String>,
    /// What the API server asks: requests it refused before any hook ran, this engine's info
    /// (none if the socket could not be bound: refused handoffs then end at P's lease, and a
    /// push proxy needs P's side channel from its own configuration).
    _engine_socket: Option<EngineSocket>,
}

impl SchedulerSide {
    /// Starts the scheduler side once every worker said hello (vLLM:
    /// `set_xfer_handshake_metadata`).
    pub fn start(cfg: SchedulerConfig, hellos: Vec<WorkerHello>) -> Result<Self, SchedulerError> {
        let mode = TransferMode::from_name(&cfg.mode)
            .ok_or_else(|| SchedulerError::Config(format!("mode {:?}", cfg.mode)))?;
        let side_channel_bind = address::resolve_bind(
            "side_channel_host",
            &cfg.side_channel_host,
            cfg.side_channel_port,
        )?;
        let advertise_host = address::advertised(
            "side_channel_host",
            &side_channel_bind,
            cfg.advertise_host.as_deref(),
        )?;
        let mut producer = ProducerConfig {
            tp: hellos.len() as u16,
            ..Default::default()
        };
        if let Some(ms) = cfg.initial_lease_ms {
            producer.initial_lease = std::time::Duration::from_millis(ms);
        }
        if let Some(ms) = cfg.hard_cap_ms {
            producer.hard_cap = std::time::Duration::from_millis(ms);
        }
        let mut consumer = ConsumerConfig {
            tp: hellos.len() as u16,
            ..Default::default()
        };
        if let Some(ms) = cfg.wait_deadline_ms {
            consumer.wait_deadline = std::time::Duration::from_millis(ms);
        }
        if let Some(ms) = cfg.registration_lease_ms {
            consumer.registration_lease = std::time::Duration::from_millis(ms);
        }
        if let Some(ms) = cfg.read_timeout_ms {
            consumer.read_timeout = std::time::Duration::from_millis(ms);
        }
        if let Some(rate) = cfg.transfer_floor_mb_per_s {
            consumer.read_floor_rate = rate.saturating_mul(1_000_000);
            producer.write_floor_rate = consumer.read_floor_rate;
        }
        if let Some(ms) = cfg.push_deadline_ms {
            consumer.push_deadline = std::time::Duration::from_millis(ms);
        }
        for (key, ms) in [
            ("hard_cap_ms", cfg.hard_cap_ms),
            ("read_timeout_ms", cfg.read_timeout_ms),
            ("push_deadline_ms", cfg.push_deadline_ms),
            ("wait_deadline_ms", cfg.wait_deadline_ms),
            ("initial_lease_ms", cfg.initial_lease_ms),
        ] {
            if ms == Some(0) {
                return Err(SchedulerError::Config(format!("{key} must be at least 1")));
            }
        }
        if producer.hard_cap < producer.initial_lease {
            return Err(SchedulerError::Config(
                "hard_cap_ms must be at least initial_lease_ms".into(),
            ));
        }
        let margin = producer.write_margin + producer.heartbeat_interval;
        if consumer.registration_lease <= margin {
            return Err(SchedulerError::Config(format!(
                "registration_lease_ms must exceed {} ms (P's heartbeat interval + write margin), or P's grants lapse between heartbeats",
                margin.as_millis()
            )));
        }
        consumer.failure_policy = match cfg.failure_policy.as_deref() {
            None | Some("recompute") => FailurePolicy::Recompute,
            Some("fail") => FailurePolicy::Fail,
            Some(other) => {
                return Err(SchedulerError::Config(format!(
                    "kv_load_failure_policy {other:?} (recompute or fail)"
                )))
            }
        };
        let ranks = hellos.len();
        let groups = hellos.first().map(|h| h.groups.clone()).unwrap_or_default();
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..ranks).map(|_| channel::<WorkerStep>()).unzip();
        let line = GrantLine::new(&cfg.engine_id, ranks as u16)
            .map_err(|e| tracing::warn!(error = %e, "no grant line: a push forward pass longer than D's registration grant fails its writes"))
            .ok()
            .map(Arc::new);
        let mut registry = prometheus_client::registry::Registry::default();
        let (connector, sink) = Connector::start_with(
            ConnectorConfig {
                engine_id: cfg.engine_id.clone(),
                role: Role::Both,
                mode,
                model: cfg.model.clone(),
                dtype: cfg.dtype.clone(),
                side_channel_bind,
                advertise_host,
                producer,
                consumer,
                opaque_blocks: cfg.opaque_blocks,
                kv_digest: cfg.kv_digest,
                // vLLM's P says no layer before its forward pass (no layer-wise pull); its
                // workers learn each layer from the forward itself (`save_kv_layer`).
                layerwise_pull: false,
                layer_reports: handoff_connector::LayerReports::Planned,
                peer_hosts: cfg.peer_hosts.clone(),
                key: crate::cluster_key(cfg.cluster_key_file.as_deref())?,
                insecure: cfg.insecure,
                max_side_connections: handoff_connector::DEFAULT_MAX_SIDE_CONNECTIONS,
                max_side_handshakes_per_source:
                    handoff_connector::DEFAULT_MAX_SIDE_HANDSHAKES_PER_SOURCE,
                record: cfg.record_trace.as_ref().map(|path| {
                    handoff_connector::recorder::RecordConfig {
                        path: path.into(),
                        max_bytes: 64 << 20,
                        files: 4,
                    }
                }),
                protocol_version: cfg
                    .protocol_version
                    .unwrap_or(handoff_proto::PROTOCOL_VERSION),
            },
            hellos,
            &mut registry,
            move |_| {
                Ok(txs
                    .into_iter()
                    .enumerate()
                    .map(|(rank, steps)| {
                        Box::new(QueueLink {
                            rank: rank as u16,
                            steps,
                            line: line.clone(),
                        }) as Box<dyn WorkerLink>
                    })
                    .collect())
            },
        )?;
        // Kept for the engine socket's `metrics`: vLLM's API server appends them to its /metrics.
        let registry = Arc::new(registry);
        let engine_socket = EngineSocket::start(&socket_path(&cfg.engine_id), connector.clone(), registry)
            .map_err(|e| tracing::warn!(error = %e, "no engine socket: P keeps a refused request's blocks until its lease ends, and GET /v1/handoff/info is not answered"))
            .ok();
        Ok(SchedulerSide {
            _engine_socket: engine_socket,
            groups,
            connector,
            sink,
            steps: rxs,
            sending: HashMap::new(),
            ended_reading: HashMap::new(),
            given_blocks: HashSet::new(),
            failed_unallocated: HashSet::new(),
            first_block: HashMap::new(),
            held: HashSet::new(),
            failed_later: HashMap::new(),
            ids: HashMap::new(),
            names: HashMap::new(),
            by_handoff: HashMap::new(),
            handoff_of: HashMap::new(),
            next_id: 1,
            pending: StepMeta::default(),
            settled: HashSet::new(),
            planned: HashSet::new(),
        })
    }

    pub fn side_channel_port(&self) -> u16 {
        self.connector.side_channel_addr().port()
    }

    // ----- P -----

    /// A handoff's one block list from vLLM's per-group lists (each cut to the prompt's blocks
    /// by the Python side), from block `skip` of every group on (D's prefix-cache hit): the one
    /// group's list as it is for a model of one group; for a hybrid model each group's moved
    /// blocks ([`KvGroups::clip_after`]), refused if a window reaches vLLM's null block (KV P
    /// freed and D still needs) or, on P (`producer`), a block vLLM frees when the request
    /// finishes ([`KvGroups::check_producer_keeps`]).
    fn handoff_blocks(
        &self,
        mut lists: Vec<Vec<u32>>,
        num_tokens: u32,
        skip: usize,
        producer: bool,
    ) -> Result<Vec<u32>, SchedulerError> {
        if self.groups.is_single() {
            return match lists.len() {
                1 => {
                    let mut list = lists.swap_remove(0);
                    Ok(list.split_off(skip.min(list.len())))
                }
                n => Err(SchedulerError::Params(format!(
                    "{n} block lists for a model of one KV cache group"
                ))),
            };
        }
        let block_size = self.connector.spec().block_size;
        if producer {
            self.groups
                .check_producer_keeps(num_tokens, block_size)
                .map_err(|e| SchedulerError::Params(e.to_string()))?;
        }
        self.groups
            .clip_after(
                &lists,
                num_tokens,
                block_size,
                skip as u32,
                Some(VLLM_NULL_BLOCK),
            )
            .map_err(|e| SchedulerError::Params(e.to_string()))
    }

    /// vLLM `request_finished`, answered as vLLM wants it: whether the connector keeps the
    /// request's blocks (vLLM frees them once `finished_sending` names the request), and the
    /// params for the response.
    ///
    /// P: a prompt that D decodes keeps its blocks; the params go to the client (and the
    /// proxy) as `kv_transfer_params`. D: a request that ends before its KV landed (client gone,
    /// aborted) keeps its blocks while its READ may still write into them (rule 3).
    pub fn request_finished(
        &mut self,
        request_id: &str,
        params: Option<&KvTransferParams>,
        lists: Vec<Vec<u32>>,
        num_tokens: u32,
    ) -> Result<(bool, Option<KvTransferParams>), SchedulerError> {
        if let Some(&n) = self.ids.get(request_id) {
            if !self.settled.contains(&n) {
                self.connector.request_ended(n, ReleaseReason::Aborted);
            }
            let mut keep = false;
            if let Some(&first) = self.first_block.get(&n) {
                self.failed_later.remove(&first);
                if self.held.contains(&first) {
                    self.ended_reading.insert(first, request_id.to_string());
                    keep = true;
                }
            }
            self.forget(n);
            return Ok((keep, None));
        }
        // The prefill started at its last step (`prefill_planned`), or vLLM tells of it only
        // now, once every layer of every chunk is in P's blocks. `params` none: vLLM did not
        // finish it normally, or an n>1 sibling keeps the handoff.
        let remote_decode = params.filter(|p| p.do_remote_decode);
        let blocks = match remote_decode.map(|_| self.handoff_blocks(lists, num_tokens, 0, true)) {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                // A window reaching a block vLLM freed: D would compute on KV that is gone.
                // The prefill fails (nothing is held), D computes the prompt.
                tracing::warn!(request_id, error = %e, "no handoff for this prefill");
                Vec::new()
            }
            None => Vec::new(),
        };
        let finished = remote_decode.filter(|_| !blocks.is_empty());
        let outcome = match finished {
            Some(_) => PrefillOutcome::Finished,
            None => PrefillOutcome::Failed,
        };
        if !self.planned.remove(request_id) {
            let Some(params) = finished else {
                return Ok((false, None));
            };
            if let Err(e) = self
                .connector
                .prefill_started_now(request_id, params, blocks, num_tokens)
            {
                // vLLM frees the blocks; the response carries no params for a D.
                tracing::warn!(request_id, error = %e, "no handoff for this prefill");
                return Ok((false, None));
            }
        }
        let end = match self.connector.prefill_ended(request_id, outcome) {
            Ok(end) => end,
            Err(e) => {
                tracing::warn!(request_id, error = %e, "no handoff for this prefill");
                return Ok((false, None));
            }
        };
        let Some(handoff) = end.holding else {
            return Ok((false, end.params));
        };
        // Its writes or reads may use the blocks: they stay until the handoff ends (a push D
        // registered for gets the KV even if this request was aborted meanwhile).
        tracing::debug!(request_id, %handoff, "P keeps blocks for D");
        self.sending.insert(handoff, request_id.to_string());
        Ok((true, end.params))
    }

    /// P, from vLLM's `build_connector_meta`: the step being built completes the prompt of
    /// `request_id` in `blocks` (its last prefill chunk), a request vLLM finishes right after
    /// that step (one output token: a request that ran on could be preempted, and vLLM frees a
    /// preempted request's blocks without asking the connector). The connector is told the
    /// prefill starts; when its flow holds the blocks from now on (a push), each layer's
    /// writes go from the workers as soon as the forward saved it, while the next layers
    /// compute. Returns whether the blocks are held. On error the prefill is told of at
    /// `request_finished` instead.
    pub fn prefill_planned(
        &mut self,
        request_id: &str,
        params: &KvTransferParams,
        lists: Vec<Vec<u32>>,
        num_tokens: u32,
    ) -> Result<bool, SchedulerError> {
        let blocks = self.handoff_blocks(lists, num_tokens, 0, true)?;
        if blocks.is_empty() || !params.do_remote_decode {
            return Err(SchedulerError::Params(
                "a planned prefill needs blocks and do_remote_decode".into(),
            ));
        }
        let holding = self
            .connector
            .prefill_started_now(request_id, params, blocks, num_tokens)?;
        let Some(handoff) = holding else {
            // Nothing holds the blocks before the prefill ends (a pull): vLLM may still move
            // them (a preemption), so the core forgets this start and hears of the prefill at
            // `request_finished`, with the blocks vLLM has then.
            self.connector
                .prefill_ended(request_id, PrefillOutcome::Failed)?;
            return Ok(false);
        };
        self.planned.insert(request_id.to_string());
        // The step about to run computes every layer ([`LayerReports::Planned`]). Waited for:
        // the writes it plans must be in this step's metadata, built right after.
        let layers = self.connector.spec().shape.num_layers;
        self.connector.give(Input::LayersSaved {
            request_id: request_id.to_string(),
            through: layers,
        })?;
        self.pending.forward.push(handoff);
        Ok(true)
    }

    // ----- D -----

    /// vLLM `get_num_new_matched_tokens` on D: a request whose prompt P prefilled. Starts
    /// tracking it (heartbeats begin while it still waits in vLLM's queue) and says how many
    /// prompt tokens will arrive from P.
    ///
    /// n>1: vLLM fans a request out into children with blocks of their own, all carrying the
    /// same `kv_transfer_params`. The first child's READ brings the KV (one transfer, P freed
    /// once); the others wait ([`Matched::Later`]) until it has landed, then compute their
    /// prompt locally, which vLLM's prefix cache serves from the first child's blocks.
    pub fn remote_prefill_arrived(
        &mut self,
        request_id: &str,
        params: &KvTransferParams,
        prompt_tokens: u32,
    ) -> Matched {
        let Some(handoff) = params.handoff_id.filter(|_| params.do_remote_prefill) else {
            return Matched::Local;
        };
        if self.ids.contains_key(request_id) {
            return Matched::Remote(prompt_tokens);
        }
        if let Some(first) = self.by_handoff.get(&handoff) {
            // A sibling: wait while the first child's KV is on its way.
            return if self.settled.contains(first) {
                Matched::Local
            } else {
                Matched::Later
            };
        }
        let n = self.next_id;
        self.next_id += 1;
        if let Err(e) = self.connector.request_arrived(n, params, prompt_tokens) {
            // What a client sends must not stop vLLM's scheduler: the request is served
            // without P's KV (its prompt computed here), and nothing else changes.
            tracing::warn!(request_id, error = %e, "kv_transfer_params refused; computing the prompt locally");
            return Matched::Local;
        }
        self.ids.insert(request_id.to_string(), n);
        self.names.insert(n, request_id.to_string());
        self.by_handoff.insert(handoff, n);
        self.handoff_of.insert(n, handoff);
        Matched::Remote(prompt_tokens)
    }

    /// vLLM `update_state_after_alloc` on D: the request got `blocks` for its prompt.
    pub fn blocks_allocated(
        &mut self,
        request_id: &str,
        blocks: Vec<u32>,
    ) -> Result<(), SchedulerError> {
        self.blocks_allocated_after_cached(request_id, vec![blocks], 0, 0)
    }

    /// vLLM `update_state_after_alloc` on D: the request got `blocks` for its prompt, the first
    /// `cached` of them a hit in vLLM's prefix cache (computed here, shared with other
    /// requests). A pull reads only into the others.
    pub fn blocks_allocated_after_cached(
        &mut self,
        request_id: &str,
        lists: Vec<Vec<u32>>,
        cached: usize,
        num_tokens: u32,
    ) -> Result<(), SchedulerError> {
        let Some(&n) = self.ids.get(request_id) else {
            return Ok(());
        };

        self.given_blocks.insert(n);
        if self.failed_unallocated.remove(&n) {
            // Its handoff failed while it waited for blocks: vLLM now waits for its KV, and
            // hears at once that it will not come.
            if let Some(name) = self.names.get(&n) {
                self.pending.failed_recving.push(name.clone());
            }
            return Ok(());
        }
        // The hit's blocks, the first group's (a hybrid model's digest is not compared after
        // a hit: only their count matters there).
        let hit: Vec<u32> = lists
            .first()
            .map(|l| l[..cached.min(l.len())].to_vec())
            .unwrap_or_default();
        let blocks = match self.handoff_blocks(lists, num_tokens, cached, false) {
            Ok(b) => b,
            Err(e) => {
                // vLLM waits for this request's KV now: it hears at once that none comes (its
                // failure policy recomputes or fails it), and P lets its blocks go.
                tracing::warn!(request_id, error = %e, "blocks refused");
                self.connector.request_ended(n, ReleaseReason::Cancelled);
                self.pending.failed_recving.push(request_id.to_string());
                self.forget(n);
                return Ok(());
            }
        };
        let cached = hit;
        // The request's own first block names it in the ledger's events (a cached block may
        // start several requests' prompts).
        let first = blocks.first().copied();
        match self.connector.blocks_allocated(n, cached, blocks) {
            Ok(()) => {
                if let Some(b) = first {
                    self.first_block.insert(n, b);
                    self.held.insert(b);
                }
            }
            // The handoff already ended (P gone, refused): its outcome is queued as an event,
            // and the blocks stay vLLM's.
            Err(e) => tracing::info!(request_id, error = %e, "blocks refused"),
        }
        Ok(())
    }

    /// vLLM `update_state_after_alloc` on D with nothing to load: vLLM computes the request's
    /// prompt itself (a full prefix-cache hit, or a request that skips every cached prefix, as
    /// `prompt_logprobs` do). D will not read: P is told to release now, and the request is
    /// forgotten, so no later outcome of its handoff reaches vLLM for a request that does not
    /// wait for remote KV.
    pub fn no_load(&mut self, request_id: &str) {
        let Some(&n) = self.ids.get(request_id) else {
            return;
        };
        if self.given_blocks.contains(&n) {
            return;
        }
        if !self.settled.contains(&n) {
            self.connector.request_ended(n, ReleaseReason::Done);
        }
        self.forget(n);
    }

    fn forget(&mut self, n: u64) {
        self.given_blocks.remove(&n);
        self.failed_unallocated.remove(&n);
        if let Some(name) = self.names.remove(&n) {
            self.ids.remove(&name);
        }
        if let Some(h) = self.handoff_of.remove(&n) {
            self.by_handoff.remove(&h);
        }
        self.settled.remove(&n);
        self.first_block.remove(&n);
    }

    // ----- every step -----

    /// vLLM `build_connector_meta`: what every worker must do this step, and what vLLM must
    /// learn (blocks to free, KV landed or failed).
    pub fn build_meta(&mut self) -> StepMeta {
        for ev in self.connector.poll_events() {
            match ev {
                ConnectorEvent::BlocksReleased {
                    handoff,
                    blocks,
                    reason,
                } => {
                    // P: a handoff ended.
                    if let Some(req) = self.sending.remove(&handoff) {
                        tracing::debug!(request = %req, %reason, blocks = blocks.len(), "blocks back");
                        self.pending.finished_sending.push(req);
                        continue;
                    }
                    // D: no transfer can land in these blocks any more.
                    let Some(&first) = blocks.first() else {
                        continue;
                    };
                    self.held.remove(&first);
                    if let Some(req) = self.ended_reading.remove(&first) {
                        tracing::debug!(request = %req, %reason, blocks = blocks.len(), "blocks back");
                        self.pending.finished_sending.push(req);
                    }
                    if let Some(req) = self.failed_later.remove(&first) {
                        self.pending.failed_recving.push(req);
                    }
                }
                // vLLM admits requests itself; a layer-wise pull is not asked of vLLM's P.
                ConnectorEvent::RemoteStarted { .. } => {}
                ConnectorEvent::Ready { requests, .. } => {
                    for n in requests {
                        if let Some(b) = self.first_block.get(&n) {
                            self.held.remove(b);
                        }
                        if let Some(name) = self.names.get(&n) {
                            self.pending.finished_recving.push(name.clone());
                            self.settled.insert(n);
                        }
                    }
                }
                ConnectorEvent::Recompute { requests, reason }
                | ConnectorEvent::Failed { requests, reason } => {
                    for n in requests {
                        let Some(name) = self.names.get(&n) else {
                            continue;
                        };
                        tracing::warn!(request = %name, %reason, "KV transfer failed");
                        self.settled.insert(n);
                        // A transfer may still land in the request's blocks (a READ not yet
                        // ended, a WRITE inside its grant): vLLM hears of the failure, and frees
                        // or recomputes into them, only once the ledger let them go.
                        match self.first_block.get(&n) {
                            Some(b) if self.held.contains(b) => {
                                self.failed_later.insert(*b, name.clone());
                            }
                            _ if !self.given_blocks.contains(&n) => {
                                self.failed_unallocated.insert(n);
                            }
                            _ => self.pending.failed_recving.push(name.clone()),
                        }
                    }
                }
            }
        }
        let mut meta = std::mem::take(&mut self.pending);
        meta.steps = self
            .steps
            .iter()
            .map(|rx| {
                let mut step = WorkerStep::default();
                while let Ok(s) = rx.try_recv() {
                    step.ops.extend(s.ops);
                }
                step
            })
            .collect();
        meta
    }

    /// vLLM `update_connector_output`: the workers' reports of the last step.
    pub fn worker_reports(&mut self, reports: &[Vec<u8>]) -> Result<(), SchedulerError> {
        for r in reports {
            let report: WorkerReport = postcard::from_bytes(r).map_err(SchedulerError::Report)?;
            self.sink.report(report);
        }
        Ok(())
    }

    /// Whether vLLM must keep stepping (blocks held, transfers waited for, news to deliver).
    /// Every block the connector holds is named here (`sending`, `ended_reading`: kept for a
    /// finished request; `ids`: a D request waiting for its KV), so vLLM's loop asks no round trip of the
    /// executor thread.
    pub fn has_pending_work(&self) -> bool {
        !self.ids.is_empty()
            || !self.sending.is_empty()
            || !self.ended_reading.is_empty()
            || !self.pending.is_empty()
    }

    pub fn shutdown(&self) {
        self.connector.shutdown();
    }
}
