//! Engine configuration: defaults, then a TOML file, then environment variables
//! (`HANDOFF_<FIELD>`), then flags. Every value is validated at start and an invalid one is
//! refused with a message naming the field.
//!
//! One file, over 800 lines: every engine setting with its default, its documentation and its
//! validation, one list that the generated reference page and the checks both follow.

use std::time::Duration;

use handoff_connector::{ClusterKey, Role};
use handoff_ledger::{ConsumerConfig, FailurePolicy, ProducerConfig};
use handoff_plan::{
    check_heads, BlockLayout, GroupKind, KvGroup, KvGroups, KvSpec, ModelShape, PoolLayout,
};
use handoff_proto::TransferMode;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// `prefill`, `decode` or `both` (monolithic; can also serve either side).
    pub role: String,
    /// Address every listener of the engine binds (HTTP API, side channel, tcp transport).
    pub host: String,
    /// Address peers dial to reach this engine (in `kv_transfer_params.remote_host` and the
    /// transport's metadata). Empty: `host`. Required when `host` is unspecified (`0.0.0.0`,
    /// `::`): nothing picks an address behind the user's back.
    pub advertise_host: String,
    /// HTTP port (0: any free port).
    pub port: u16,
    /// Side-channel port for handoff's control messages (0: any free port).
    pub side_channel_port: u16,
    /// First tcp transport data port; rank r listens on `data_port + r` (0: any free ports).
    pub data_port: u16,
    /// Unique in the cluster (default: role + random suffix).
    pub engine_id: String,
    /// Model name (in `/v1/models` and answers; P and D must agree, it is in the handshake's
    /// fingerprint).
    pub model: String,
    /// KV shape: layers of the (synthetic) model.
    pub num_layers: u32,
    /// KV shape: KV heads, split over the `tp` ranks (or, with more ranks than heads, each
    /// replicated on `tp / num_kv_heads` of them).
    pub num_kv_heads: u32,
    /// KV shape: elements per head.
    pub head_dim: u32,
    /// `bf16`, `fp16` (2 bytes) or `fp32` (4), `fp8` (1).
    pub dtype: String,
    /// Tokens per KV block (P and D may differ).
    pub block_size: u32,
    /// `head-major` (default) or `token-major`; with `-interleaved`, each token's K and V rows
    /// side by side in the block (as vLLM 0.33 keeps them on a GPU); `latent`: an MLA-shaped
    /// model, one latent vector of `head_dim` elements per token and no V (`num_kv_heads` 1, the
    /// same latent on every rank).
    pub block_layout: String,
    /// How the KV pool is arranged in memory: `layers-outermost` (default: a run of blocks is
    /// one descriptor per layer when P and D have equal TP and block size, for the whole model
    /// and for the layer ranges a layer-wise pull or a push moves), `blocks-outermost` (a run of
    /// blocks is one descriptor for the whole model, but a layer range is cut at every block)
    /// or `heads-outermost` (one descriptor per layer, plane and head for a run of blocks,
    /// whatever the two engines' TP and block sizes: the choice for heterogeneous P/D pairs).
    pub kv_pool_layout: String,
    /// A hybrid model (Gemma 3's shape): tokens of the sliding window its sliding layers keep;
    /// 0 (default): every layer keeps every token.
    pub sliding_window: u32,
    /// With a window: layer `l` keeps every token when `(l + 1)` is a multiple of this (Gemma
    /// 3: 6, one full-attention layer in six), the others the window. With `recurrent_state`,
    /// the others keep a state.
    pub full_attention_every: u32,
    /// A hybrid SSM model (Granite 4's shape): the layers `full_attention_every` does not name
    /// keep one recurrent state per request (Mamba, linear attention) in one block, and a
    /// handoff moves the state after every prompt token but the last (D computes the last).
    /// Not with `sliding_window`.
    pub recurrent_state: bool,
    /// Blocks in the KV pool (per rank).
    pub num_blocks: u32,
    /// Tensor-parallel size: worker ranks, each holding a slice of the KV heads.
    pub tp: u32,
    /// Longest prompt + generation, in tokens.
    pub max_model_len: u32,
    /// Sequences decoded together in one step.
    pub max_batch: usize,
    /// Requests that may wait for blocks before new ones are refused with 503.
    pub max_waiting: usize,
    /// Cost model: microseconds per prompt token (spread over the layers).
    pub prefill_us_per_token: f64,
    /// Cost model: milliseconds per decode step.
    pub decode_step_ms: f64,
    /// Cost model: extra microseconds per sequence in a decode step.
    pub decode_us_per_seq: f64,
    /// `tcp` (default), `nixl` or `mem` (in-process tests).
    pub transport: String,
    /// Fault injection on this engine's transport, for tests and demos of failure handling:
    /// `seed=N,drop=P,dup=P,delay=P,fail=P,corrupt=P` (percentages of notifications dropped,
    /// duplicated, delayed, of transfers failed, and of READs that land damaged). Empty: none.
    pub transport_faults: String,
    /// `pull` or `push`.
    pub mode: String,
    /// `recompute` or `fail`: what D does when a transfer fails.
    pub failure_policy: String,
    /// P: a handoff's initial lease, until its D first heartbeats (a handoff no D ever claims
    /// ends after it and the fence).
    pub lease_ms: u64,
    /// D: how often it heartbeats the P engines of the requests it tracks (off the forward loop).
    pub heartbeat_interval_ms: u64,
    /// P: how far each heartbeat extends a handoff's lease.
    pub heartbeat_extension_ms: u64,
    /// P: after a lease ends, how long it still waits before the blocks are free (a READ granted
    /// just before the end may still be landing; longer than D's read grace).
    pub fence_grace_ms: u64,
    /// P: the longest a handoff lives, heartbeats or not.
    pub hard_cap_ms: u64,
    /// D: a READ not finished in this long, plus the time its bytes take at
    /// `transfer_floor_mb_per_s`, fails (a READ also fails once P stops renewing its grant).
    pub read_timeout_ms: u64,
    /// The slowest rate (MB/s, per pair of ranks) a healthy transfer is expected to move its
    /// bytes at. D: a READ of a long prompt gets that time on top of `read_timeout_ms`. P: a
    /// push WRITE starts only while D's grant has that time left for its bytes (beside P's
    /// write margin), so it lands inside the grant. 0: neither.
    pub transfer_floor_mb_per_s: u64,
    /// D: a READ that finishes this long past its grant counts as failed.
    pub read_grace_ms: u64,
    /// D: the longest a request waits for its KV before it is recomputed or failed.
    pub wait_deadline_ms: u64,
    /// D, push: how long each grant D gives P on a registration lasts. P heartbeats renew it
    /// while P lives, however long its prefill runs; after P's last one, D's blocks come back
    /// this long plus the write grace later.
    pub registration_lease_ms: u64,
    /// D, push: the longest D keeps a registration P has not completed, heartbeats or not.
    pub push_deadline_ms: u64,
    /// P: messages kept for handoffs not created yet (early registrations and releases), in all
    /// (a peer over its quota, `staging_per_peer`, has its new ones dropped and counted).
    pub staging_capacity: usize,
    /// P: of `staging_capacity`, the most one sending peer may hold.
    pub staging_per_peer: usize,
    /// P: how long such a message is kept waiting for its handoff.
    pub staging_ttl_ms: u64,
    /// Ended handoffs each ledger remembers (so a late message is known as late), at most this
    /// many: the bound on the memory ended requests leave.
    pub tombstone_capacity: usize,
    /// How long an ended handoff is remembered (see `tombstone_capacity`).
    pub tombstone_ttl_ms: u64,
    /// HTTP API: from a request's first byte to the end of its headers (slowloris bound); 408.
    pub http_header_read_timeout_ms: u64,
    /// HTTP API: from the end of a request's headers to the end of its body; 408.
    pub http_body_read_timeout_ms: u64,
    /// HTTP API: a connection with no request in progress is closed after this.
    pub http_idle_timeout_ms: u64,
    /// A client that takes no byte of its answer (a stream) for this long loses its connection.
    pub http_write_stall_timeout_ms: u64,
    /// HTTP API: connections served at once; more are answered 503 and closed.
    pub http_max_connections: usize,
    /// HTTP API: largest request body; 413.
    pub http_max_body_bytes: usize,
    /// HTTP API: largest request head (8 KiB..=16 MiB); 431.
    pub http_max_header_bytes: usize,
    /// File holding the cluster key (64 hex digits, `handoff keygen` writes one). Every engine
    /// of a cluster has the same key; the side channel and the tcp transport prove it in both
    /// directions on every connection. Empty, and `cluster_key` empty: no key, and the engine
    /// binds loopback only unless `insecure`.
    pub cluster_key_file: String,
    /// The cluster key itself, for `HANDOFF_CLUSTER_KEY` (wins over `cluster_key_file`).
    pub cluster_key: String,
    /// Allows binding a non-loopback address without a cluster key.
    pub insecure: bool,
    /// Pull mode: take part in a layer-wise pull (say so in `/v1/handoff/info`, so that the
    /// proxy sends both legs at once and D reads while P prefills). False: every pull is a
    /// classic one.
    pub layerwise_pull: bool,
    /// D: the prefill hosts this engine may dial, comma-separated (`remote_host` as a P
    /// advertises it: host names or IP addresses, compared exactly); empty: any. A request
    /// naming another host is refused (400) before anything is dialled.
    pub peer_hosts: String,
    /// Most side-channel connections open at once.
    pub max_side_connections: usize,
    /// Most inbound side-channel handshakes open at once from one source address.
    pub max_side_handshakes_per_source: usize,
    /// Pull: check each handoff's KV digest (P computes it over its blocks, D over what landed;
    /// a mismatch fails the transfer). Costs one pass over the KV on each side.
    pub kv_digest: bool,
    /// The newest handoff protocol version this engine speaks (this build's own by default):
    /// the previous release's pins an upgraded engine to what the rest of its fleet speaks.
    /// It pairs with engines of either version both ways (guides/upgrading.md).
    pub protocol_version: u8,
    /// Drain (SIGTERM, or `POST /drain` on the admin listener): how long readiness is false
    /// while new requests are still taken, so that routers stop sending before this engine
    /// refuses (longer than their health-check period).
    pub drain_grace_ms: u64,
    /// Drain: the longest it waits, from its start, for the handoffs it holds and the requests
    /// it serves to end; then it exits anyway, and the peers of what was left recompute or fail
    /// per their policy.
    pub drain_timeout_ms: u64,
    /// Bearer token every admin call must present (`Authorization: Bearer …`), at least 16
    /// characters. Set, the engine opens its admin listener (`POST /drain` for a Kubernetes
    /// preStop hook); empty: no admin listener. Best given as `HANDOFF_ADMIN_TOKEN`.
    pub admin_token: String,
    /// Admin listener port (0: any free port).
    pub admin_port: u16,
    /// Address the admin listener binds (loopback: a preStop hook runs in the engine's pod).
    pub admin_host: String,
    /// Record every input of the connector core to this file (`handoff replay FILE` feeds it
    /// back and checks the rules): what to send with a bug report. Empty: no trace.
    pub record_trace: String,
    /// Size of one trace file before it rotates, in MiB.
    pub record_trace_max_mb: u64,
    /// Trace files kept, the current one included (a replay needs the first one).
    pub record_trace_files: usize,
}

/// Milliseconds of a default duration.
fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl Default for EngineConfig {
    /// Every timing and capacity of the ledgers comes from their own defaults, which vLLM's
    /// connector uses too: one set of defaults for every engine.
    fn default() -> Self {
        let producer = ProducerConfig::default();
        let consumer = ConsumerConfig::default();
        EngineConfig {
            role: "both".into(),
            host: "127.0.0.1".into(),
            advertise_host: String::new(),
            port: 8000,
            side_channel_port: 0,
            data_port: 0,
            engine_id: String::new(),
            model: "handoff-synthetic-8b".into(),
            // Small enough that several engines fit a laptop; benchmarks state their own shape.
            num_layers: 8,
            num_kv_heads: 4,
            head_dim: 32,
            dtype: "bf16".into(),
            block_size: 16,
            block_layout: "head-major".into(),
            kv_pool_layout: "layers-outermost".into(),
            sliding_window: 0,
            full_attention_every: 6,
            recurrent_state: false,
            num_blocks: 2048,
            tp: 1,
            max_model_len: 8192,
            max_batch: 64,
            max_waiting: 256,
            // An 8B-class model on one H100: ~15k prompt tokens/s, ~10 ms per decode step.
            prefill_us_per_token: 67.0,
            decode_step_ms: 10.0,
            decode_us_per_seq: 50.0,
            transport: "tcp".into(),
            transport_faults: String::new(),
            mode: "pull".into(),
            failure_policy: "recompute".into(),
            lease_ms: ms(producer.initial_lease),
            heartbeat_interval_ms: ms(consumer.heartbeat_interval),
            heartbeat_extension_ms: ms(producer.heartbeat_extension),
            fence_grace_ms: ms(producer.fence_grace),
            hard_cap_ms: ms(producer.hard_cap),
            read_timeout_ms: ms(consumer.read_timeout),
            transfer_floor_mb_per_s: consumer.read_floor_rate / 1_000_000,
            registration_lease_ms: ms(consumer.registration_lease),
            push_deadline_ms: ms(consumer.push_deadline),
            read_grace_ms: ms(consumer.read_grace),
            wait_deadline_ms: ms(consumer.wait_deadline),
            staging_capacity: producer.staging_capacity,
            staging_per_peer: producer.staging_per_peer,
            staging_ttl_ms: ms(producer.staging_ttl),
            tombstone_capacity: producer.tombstone_capacity,
            tombstone_ttl_ms: ms(producer.tombstone_ttl),
            http_header_read_timeout_ms: 10_000,
            http_body_read_timeout_ms: 30_000,
            http_idle_timeout_ms: 60_000,
            http_write_stall_timeout_ms: 30_000,
            http_max_connections: 1024,
            http_max_body_bytes: 4 << 20,
            http_max_header_bytes: 64 << 10,
            cluster_key_file: String::new(),
            cluster_key: String::new(),
            insecure: false,
            layerwise_pull: true,
            peer_hosts: String::new(),
            max_side_connections: handoff_connector::DEFAULT_MAX_SIDE_CONNECTIONS,
            max_side_handshakes_per_source:
                handoff_connector::DEFAULT_MAX_SIDE_HANDSHAKES_PER_SOURCE,
            kv_digest: false,
            protocol_version: handoff_proto::PROTOCOL_VERSION,
            drain_grace_ms: 5_000,
            drain_timeout_ms: 20_000,
            admin_token: String::new(),
            admin_port: 0,
            admin_host: "127.0.0.1".into(),
            record_trace: String::new(),
            record_trace_max_mb: 64,
            record_trace_files: 4,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid config field `{field}`: {reason}")]
pub struct ConfigError {
    pub field: &'static str,
    pub reason: String,
}

fn bad(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        reason: reason.into(),
    }
}

impl EngineConfig {
    /// Reads a TOML file (unknown keys are refused, naming them).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| bad("toml", e.to_string()))
    }

    /// Applies `HANDOFF_<FIELD>` environment variables over the current values.
    pub fn apply_env(
        &mut self,
        vars: impl Iterator<Item = (String, String)>,
    ) -> Result<(), ConfigError> {
        let mut table = toml::Table::try_from(&*self).map_err(|e| bad("env", e.to_string()))?;
        for (k, v) in vars {
            let Some(field) = k.strip_prefix("HANDOFF_") else {
                continue;
            };
            let field = field.to_ascii_lowercase();
            let Some(current) = table.get(&field) else {
                continue;
            };
            let value = match current {
                toml::Value::String(_) => toml::Value::String(v),
                toml::Value::Integer(_) => toml::Value::Integer(
                    v.parse()
                        .map_err(|_| bad("env", format!("{k}={v:?} is not an integer")))?,
                ),
                toml::Value::Float(_) => toml::Value::Float(
                    v.parse()
                        .map_err(|_| bad("env", format!("{k}={v:?} is not a number")))?,
                ),
                toml::Value::Boolean(_) => toml::Value::Boolean(match v.as_str() {
                    "1" | "true" => true,
                    "0" | "false" => false,
                    _ => return Err(bad("env", format!("{k}={v:?} is not true or false"))),
                }),
                _ => continue,
            };
            table.insert(field, value);
        }
        *self = table
            .try_into()
            .map_err(|e: toml::de::Error| bad("env", e.to_string()))?;
        Ok(())
    }

    pub fn role(&self) -> Result<Role, ConfigError> {
        match self.role.as_str() {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(bad(
                "role",
                format!("{other:?} is not prefill, decode or both"),
            )),
        }
    }

    pub fn dtype_size(&self) -> Result<u32, ConfigError> {
        match self.dtype.as_str() {
            "bf16" | "fp16" => Ok(2),
            "fp32" => Ok(4),
            "fp8" => Ok(1),
            other => Err(bad(
                "dtype",
                format!("{other:?} is not bf16, fp16, fp32 or fp8"),
            )),
        }
    }

    pub fn mode(&self) -> Result<TransferMode, ConfigError> {
        match self.mode.as_str() {
            "pull" => Ok(TransferMode::Pull),
            "push" => Ok(TransferMode::Push),
            other => Err(bad("mode", format!("{other:?} is not pull or push"))),
        }
    }

    pub fn spec(&self) -> Result<KvSpec, ConfigError> {
        let spec = KvSpec {
            shape: ModelShape {
                num_layers: self.num_layers,
                num_kv_heads: self.num_kv_heads,
                head_dim: self.head_dim,
                dtype_size: self.dtype_size()?,
            },
            tp: self.tp,
            block_size: self.block_size,
            block_layout: match self.block_layout.as_str() {
                "head-major" => BlockLayout::HeadMajor,
                "token-major" => BlockLayout::TokenMajor,
                "head-major-interleaved" => BlockLayout::HeadMajorInterleaved,
                "token-major-interleaved" => BlockLayout::TokenMajorInterleaved,
                "latent" => BlockLayout::Latent,
                other => {
                    return Err(bad(
                        "block_layout",
                        format!(
                            "{other:?} is not head-major, token-major, head-major-interleaved, \
                             token-major-interleaved or latent"
                        ),
                    ))
                }
            },
        };
        spec.validate().map_err(|e| {
            let field = match e {
                handoff_plan::SpecError::LatentHeads { .. } => "num_kv_heads",
                _ => "tp",
            };
            bad(field, e.to_string())
        })?;
        Ok(spec)
    }

    /// The model's KV cache groups: one full group, or (with a sliding window or a recurrent
    /// state) the full-attention layers and the others.
    pub fn kv_groups(&self) -> Result<KvGroups, ConfigError> {
        let other = match (self.sliding_window, self.recurrent_state) {
            (0, false) => return Ok(KvGroups::single()),
            (0, true) => GroupKind::State,
            (window, false) => GroupKind::Sliding { window },
            (_, true) => {
                return Err(bad(
                    "recurrent_state",
                    "a model with a recurrent state has no sliding window here (sliding_window must be 0)",
                ))
            }
        };
        if self.full_attention_every == 0 {
            return Err(bad("full_attention_every", "must be at least 1"));
        }
        let every = self.full_attention_every;
        let (full, others): (Vec<u32>, Vec<u32>) =
            (0..self.num_layers).partition(|l| (l + 1) % every == 0);
        let groups = [(GroupKind::Full, full), (other, others)]
            .into_iter()
            .filter(|(_, layers)| !layers.is_empty())
            .map(|(kind, layers)| KvGroup { kind, layers })
            .collect();
        KvGroups::new(groups, self.num_layers).map_err(|e| bad("sliding_window", e.to_string()))
    }

    pub fn pool_layout(&self) -> Result<PoolLayout, ConfigError> {
        match self.kv_pool_layout.as_str() {
            "layers-outermost" => Ok(PoolLayout::LayersOutermost),
            "blocks-outermost" => Ok(PoolLayout::BlocksOutermost),
            "heads-outermost" if self.block_layout != "head-major" => Err(bad(
                "kv_pool_layout",
                "heads-outermost keeps each head's tokens together, which needs block_layout \
                 head-major",
            )),
            "heads-outermost" => Ok(PoolLayout::HeadsOutermost),
            other => Err(bad(
                "kv_pool_layout",
                format!("{other:?} is not layers-outermost, blocks-outermost or heads-outermost"),
            )),
        }
    }

    /// [`EngineConfig::peer_hosts`] as a list.
    pub fn peer_hosts(&self) -> Vec<String> {
        self.peer_hosts
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// [`EngineConfig::record_trace`] as the recorder's settings (`None`: no trace).
    pub fn record(&self) -> Option<handoff_connector::recorder::RecordConfig> {
        (!self.record_trace.is_empty()).then(|| handoff_connector::recorder::RecordConfig {
            path: self.record_trace.clone().into(),
            max_bytes: self.record_trace_max_mb.saturating_mul(1 << 20),
            files: self.record_trace_files,
        })
    }

    /// The cluster key, from `cluster_key` or else `cluster_key_file`.
    pub fn cluster_key(&self) -> Result<Option<ClusterKey>, ConfigError> {
        if !self.cluster_key.is_empty() {
            return ClusterKey::from_hex(&self.cluster_key)
                .map(Some)
                .map_err(|e| bad("cluster_key", e.to_string()));
        }
        if !self.cluster_key_file.is_empty() {
            return ClusterKey::load(std::path::Path::new(&self.cluster_key_file))
                .map(Some)
                .map_err(|e| bad("cluster_key_file", e.to_string()));
        }
        Ok(None)
    }

    /// Whether `host` is a loopback address (a name other than `localhost` counts as not).
    fn binds_loopback(&self) -> bool {
        let h = self.host.trim_matches(|c| c == '[' || c == ']');
        h == "localhost" || h.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback())
    }

    /// Checks every field; the first problem is reported with its field name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let key = self.cluster_key()?;
        if key.is_none() && !self.insecure && !self.binds_loopback() {
            return Err(bad(
                "cluster_key_file",
                format!(
                    "host {} is not loopback and no cluster key is set: anyone who reaches it \
                     could read or overwrite KV memory. Give every engine the same key \
                     (`handoff keygen`), bind 127.0.0.1, or set insecure",
                    self.host
                ),
            ));
        }
        if self.max_side_connections == 0 {
            return Err(bad("max_side_connections", "must be at least 1"));
        }
        if self.max_side_handshakes_per_source == 0 {
            return Err(bad("max_side_handshakes_per_source", "must be at least 1"));
        }
        self.role()?;
        self.mode()?;
        if self.num_layers == 0 || self.num_layers > 512 {
            return Err(bad("num_layers", "must be 1..=512"));
        }
        if self.num_kv_heads == 0 || self.num_kv_heads > 1024 {
            return Err(bad("num_kv_heads", "must be 1..=1024"));
        }
        if self.head_dim == 0 || self.head_dim > 4096 {
            return Err(bad("head_dim", "must be 1..=4096"));
        }
        if !self.block_size.is_power_of_two() || self.block_size > 1024 {
            return Err(bad("block_size", "must be a power of two up to 1024"));
        }
        if self.tp == 0 || self.tp > 64 {
            return Err(bad("tp", "must be 1..=64"));
        }
        // Heads split evenly over the ranks, or each replicated on the same number of ranks: the
        // planner's own rule, reported against the `tp` setting.
        check_heads(self.tp, self.num_kv_heads).map_err(|e| bad("tp", e.to_string()))?;
        self.spec()?;
        self.pool_layout()?;
        self.kv_groups()?;
        if self.num_blocks == 0 {
            return Err(bad("num_blocks", "must be at least 1"));
        }
        let bytes = self.spec()?.block_bytes() as u128
            * self.num_layers as u128
            * self.num_blocks as u128
            * self.tp as u128;
        if bytes > 64 << 30 {
            return Err(bad(
                "num_blocks",
                format!("the KV pool would take {} GiB", bytes >> 30),
            ));
        }
        if self.max_model_len == 0 {
            return Err(bad("max_model_len", "must be at least 1"));
        }
        if self.max_batch == 0 {
            return Err(bad("max_batch", "must be at least 1"));
        }
        if !self.prefill_us_per_token.is_finite() || self.prefill_us_per_token < 0.0 {
            return Err(bad("prefill_us_per_token", "must be a finite number ≥ 0"));
        }
        if !self.decode_step_ms.is_finite() || self.decode_step_ms < 0.0 {
            return Err(bad("decode_step_ms", "must be a finite number ≥ 0"));
        }
        if !self.decode_us_per_seq.is_finite() || self.decode_us_per_seq < 0.0 {
            return Err(bad("decode_us_per_seq", "must be a finite number ≥ 0"));
        }
        if !matches!(self.transport.as_str(), "tcp" | "nixl" | "mem") {
            return Err(bad(
                "transport",
                format!("{:?} is not tcp, nixl or mem", self.transport),
            ));
        }
        self.fault_plan()?;
        if !matches!(self.failure_policy.as_str(), "recompute" | "fail") {
            return Err(bad(
                "failure_policy",
                format!("{:?} is not recompute or fail", self.failure_policy),
            ));
        }
        if self.heartbeat_interval_ms == 0 {
            return Err(bad("heartbeat_interval_ms", "must be at least 1"));
        }
        if self.heartbeat_extension_ms <= self.heartbeat_interval_ms {
            return Err(bad(
                "heartbeat_extension_ms",
                "must exceed heartbeat_interval_ms, or leases lapse between heartbeats",
            ));
        }
        // Rule 2: P's fence must outlast the time D may still finish a read after its grant.
        if self.fence_grace_ms <= self.read_grace_ms {
            return Err(bad(
                "fence_grace_ms",
                format!(
                    "must exceed read_grace_ms ({}): P may not reuse a block while a read can still count",
                    self.read_grace_ms
                ),
            ));
        }
        if self.hard_cap_ms < self.lease_ms {
            return Err(bad("hard_cap_ms", "must be at least lease_ms"));
        }
        if self.wait_deadline_ms == 0 {
            return Err(bad("wait_deadline_ms", "must be at least 1"));
        }
        if !handoff_proto::versions::speaks(self.protocol_version) {
            return Err(bad(
                "protocol_version",
                format!(
                    "this build speaks {} to {}",
                    handoff_proto::OLDEST_PROTOCOL_VERSION,
                    handoff_proto::PROTOCOL_VERSION
                ),
            ));
        }
        // P writes only while a grant has more than its write margin left, and renews it once
        // per heartbeat: a shorter grant lapses between two renewals.
        let margin = ProducerConfig::default().write_margin.as_millis() as u64;
        if self.registration_lease_ms <= self.heartbeat_interval_ms + margin {
            return Err(bad(
                "registration_lease_ms",
                format!(
                    "must exceed heartbeat_interval_ms + P's write margin ({} ms), or P's grants lapse between heartbeats",
                    self.heartbeat_interval_ms + margin
                ),
            ));
        }
        if self.push_deadline_ms == 0 {
            return Err(bad("push_deadline_ms", "must be at least 1"));
        }
        let ip = |h: &str| {
            h.trim_matches(|c| c == '[' || c == ']')
                .parse::<std::net::IpAddr>()
        };
        if self.host.is_empty() {
            return Err(bad("host", "must name an address to bind"));
        }
        if ip(&self.host).is_ok_and(|a| a.is_unspecified()) && self.advertise_host.is_empty() {
            return Err(bad(
                "advertise_host",
                format!(
                    "must be set when host is {} (an unspecified address): peers need an address they can reach",
                    self.host
                ),
            ));
        }
        if ip(&self.advertise_host).is_ok_and(|a| a.is_unspecified()) {
            return Err(bad(
                "advertise_host",
                "must be an address peers can dial, not an unspecified one",
            ));
        }
        if self.data_port != 0 && u32::from(self.data_port) + self.tp > 65_536 {
            return Err(bad("data_port", "data_port + tp must stay below 65536"));
        }
        if self.staging_per_peer == 0 || self.staging_per_peer > self.staging_capacity {
            return Err(bad(
                "staging_per_peer",
                "must be at least 1 and at most staging_capacity",
            ));
        }
        if self.staging_ttl_ms == 0 {
            return Err(bad("staging_ttl_ms", "must be at least 1"));
        }
        if self.tombstone_capacity == 0 {
            return Err(bad("tombstone_capacity", "must be at least 1"));
        }
        for (field, ms) in [
            (
                "http_header_read_timeout_ms",
                self.http_header_read_timeout_ms,
            ),
            ("http_body_read_timeout_ms", self.http_body_read_timeout_ms),
            ("http_idle_timeout_ms", self.http_idle_timeout_ms),
            (
                "http_write_stall_timeout_ms",
                self.http_write_stall_timeout_ms,
            ),
        ] {
            if ms == 0 {
                return Err(bad(field, "must be at least 1"));
            }
        }
        if self.http_max_connections == 0
            || self.http_max_connections > handoff_http::MAX_CONNECTIONS
        {
            return Err(bad(
                "http_max_connections",
                format!("must be 1..={}", handoff_http::MAX_CONNECTIONS),
            ));
        }
        if self.http_max_body_bytes == 0 {
            return Err(bad("http_max_body_bytes", "must be at least 1"));
        }
        if !(8 << 10..=16 << 20).contains(&self.http_max_header_bytes) {
            return Err(bad("http_max_header_bytes", "must be 8192..=16777216"));
        }
        self.http_limits()
            .validate()
            .map_err(|e| bad("http", e.to_string()))?;
        if self.drain_grace_ms >= self.drain_timeout_ms {
            return Err(bad(
                "drain_grace_ms",
                "must be shorter than drain_timeout_ms (the grace is part of the drain)",
            ));
        }
        if !self.record_trace.is_empty()
            && (self.record_trace_max_mb == 0 || self.record_trace_files == 0)
        {
            return Err(bad(
                "record_trace_max_mb",
                "a trace needs at least one file of at least 1 MiB",
            ));
        }
        if !self.admin_token.is_empty() && self.admin_token.chars().count() < 16 {
            return Err(bad(
                "admin_token",
                "must be at least 16 characters: the admin listener drains the engine, and \
                 only its operator may",
            ));
        }
        if !self.admin_token.is_empty() && self.admin_host.is_empty() {
            return Err(bad("admin_host", "must name an address to bind"));
        }
        if self.tombstone_ttl_ms < self.hard_cap_ms {
            return Err(bad(
                "tombstone_ttl_ms",
                "must be at least hard_cap_ms: a message may come as late as a handoff may live",
            ));
        }
        Ok(())
    }

    /// The parsed `transport_faults`, if any.
    pub fn fault_plan(&self) -> Result<Option<handoff_transport::faulty::FaultPlan>, ConfigError> {
        if self.transport_faults.trim().is_empty() {
            return Ok(None);
        }
        let mut plan = handoff_transport::faulty::FaultPlan {
            max_delay_calls: 50,
            ..Default::default()
        };
        for part in self.transport_faults.split(',') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad("transport_faults", format!("{part:?} is not key=value")))?;
            let pct = || -> Result<u8, ConfigError> {
                v.trim()
                    .parse::<u8>()
                    .ok()
                    .filter(|p| *p <= 100)
                    .ok_or_else(|| bad("transport_faults", format!("{k}={v}: not a percentage")))
            };
            match k.trim() {
                "seed" => {
                    plan.seed = v
                        .trim()
                        .parse()
                        .map_err(|_| bad("transport_faults", format!("seed={v}: not a number")))?
                }
                "drop" => plan.drop_notification_pct = pct()?,
                "dup" => plan.duplicate_notification_pct = pct()?,
                "delay" => plan.delay_notification_pct = pct()?,
                "fail" => plan.fail_transfer_pct = pct()?,
                "corrupt" => plan.corrupt_read_pct = pct()?,
                other => {
                    return Err(bad(
                        "transport_faults",
                        format!("unknown key {other:?} (seed, drop, dup, delay, fail)"),
                    ))
                }
            }
        }
        Ok(Some(plan))
    }

    /// The bounds of the HTTP API's listener.
    pub fn http_limits(&self) -> handoff_http::Limits {
        handoff_http::Limits {
            header_read_timeout: Duration::from_millis(self.http_header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(self.http_body_read_timeout_ms),
            idle_timeout: Duration::from_millis(self.http_idle_timeout_ms),
            write_stall_timeout: Duration::from_millis(self.http_write_stall_timeout_ms),
            max_connections: self.http_max_connections,
            max_body_bytes: self.http_max_body_bytes,
            max_header_bytes: self.http_max_header_bytes,
        }
    }

    /// The address peers dial.
    pub fn advertise(&self) -> &str {
        if self.advertise_host.is_empty() {
            &self.host
        } else {
            &self.advertise_host
        }
    }

    pub fn producer(&self) -> ProducerConfig {
        ProducerConfig {
            tp: self.tp as u16,
            initial_lease: Duration::from_millis(self.lease_ms),
            heartbeat_extension: Duration::from_millis(self.heartbeat_extension_ms),
            fence_grace: Duration::from_millis(self.fence_grace_ms),
            hard_cap: Duration::from_millis(self.hard_cap_ms),
            write_floor_rate: self.transfer_floor_mb_per_s.saturating_mul(1_000_000),
            heartbeat_interval: Duration::from_millis(self.heartbeat_interval_ms),
            staging_capacity: self.staging_capacity,
            staging_per_peer: self.staging_per_peer,
            staging_ttl: Duration::from_millis(self.staging_ttl_ms),
            tombstone_capacity: self.tombstone_capacity,
            tombstone_ttl: Duration::from_millis(self.tombstone_ttl_ms),
            ..ProducerConfig::default()
        }
    }

    pub fn consumer(&self) -> ConsumerConfig {
        ConsumerConfig {
            tp: self.tp as u16,
            heartbeat_interval: Duration::from_millis(self.heartbeat_interval_ms),
            read_timeout: Duration::from_millis(self.read_timeout_ms),
            read_floor_rate: self.transfer_floor_mb_per_s.saturating_mul(1_000_000),
            read_grace: Duration::from_millis(self.read_grace_ms),
            wait_deadline: Duration::from_millis(self.wait_deadline_ms),
            registration_lease: Duration::from_millis(self.registration_lease_ms),
            push_deadline: Duration::from_millis(self.push_deadline_ms),
            failure_policy: if self.failure_policy == "fail" {
                FailurePolicy::Fail
            } else {
                FailurePolicy::Recompute
            },
            tombstone_capacity: self.tombstone_capacity,
            tombstone_ttl: Duration::from_millis(self.tombstone_ttl_ms),
            ..ConsumerConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        EngineConfig::default().validate().unwrap();
    }

    #[test]
    fn invalid_values_name_their_field() {
        type Mutation = Box<dyn Fn(&mut EngineConfig)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("role", Box::new(|c| c.role = "router".into())),
            ("block_size", Box::new(|c| c.block_size = 12)),
            ("tp", Box::new(|c| c.tp = 3)),
            ("dtype", Box::new(|c| c.dtype = "int3".into())),
            ("transport", Box::new(|c| c.transport = "udp".into())),
            ("fence_grace_ms", Box::new(|c| c.fence_grace_ms = 100)),
            ("protocol_version", Box::new(|c| c.protocol_version = 6)),
            ("num_blocks", Box::new(|c| c.num_blocks = 0)),
            (
                "http_header_read_timeout_ms",
                Box::new(|c| c.http_header_read_timeout_ms = 0),
            ),
            (
                "http_max_connections",
                Box::new(|c| c.http_max_connections = 0),
            ),
            (
                "max_side_handshakes_per_source",
                Box::new(|c| c.max_side_handshakes_per_source = 0),
            ),
            (
                "http_max_body_bytes",
                Box::new(|c| c.http_max_body_bytes = 0),
            ),
            (
                "http_max_header_bytes",
                Box::new(|c| c.http_max_header_bytes = 100),
            ),
            ("mode", Box::new(|c| c.mode = "teleport".into())),
            (
                "registration_lease_ms",
                Box::new(|c| c.registration_lease_ms = 400),
            ),
            ("push_deadline_ms", Box::new(|c| c.push_deadline_ms = 0)),
            (
                "record_trace_max_mb",
                Box::new(|c| {
                    c.record_trace = "/tmp/t.jsonl".into();
                    c.record_trace_files = 0;
                }),
            ),
            (
                "kv_pool_layout",
                Box::new(|c| c.kv_pool_layout = "diagonal".into()),
            ),
            (
                "kv_pool_layout",
                Box::new(|c| {
                    c.kv_pool_layout = "heads-outermost".into();
                    c.block_layout = "token-major".into();
                }),
            ),
        ];
        for (field, f) in cases {
            let mut c = EngineConfig::default();
            f(&mut c);
            let e = c.validate().unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().contains(field));
        }
    }

    #[test]
    fn toml_and_env_override_defaults() {
        let mut c = EngineConfig::from_toml("role = \"decode\"\nnum_blocks = 77\n").unwrap();
        assert_eq!(c.role, "decode");
        assert_eq!(c.num_blocks, 77);
        c.apply_env(
            [
                ("HANDOFF_NUM_BLOCKS".to_string(), "99".to_string()),
                (
                    "HANDOFF_PREFILL_US_PER_TOKEN".to_string(),
                    "1.5".to_string(),
                ),
                ("PATH".to_string(), "/bin".to_string()),
            ]
            .into_iter(),
        )
        .unwrap();
        assert_eq!(c.num_blocks, 99);
        assert_eq!(c.prefill_us_per_token, 1.5);
        let e = EngineConfig::from_toml("num_blockz = 1").unwrap_err();
        assert!(e.to_string().contains("num_blockz"), "{e}");
        let mut c = EngineConfig::default();
        let e = c
            .apply_env([("HANDOFF_NUM_BLOCKS".to_string(), "many".to_string())].into_iter())
            .unwrap_err();
        assert!(e.to_string().contains("HANDOFF_NUM_BLOCKS"));
    }
}
