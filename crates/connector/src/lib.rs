//! The connector: drives the ledgers, the planner and the transports for one engine.
//!
//! It plugs into an engine at the points of vLLM's `KVConnectorBase_V1` (DESIGN.md, "Engine
//! integration points"): the scheduler side calls [`Connector::on_prefill_finished`] (P),
//! [`Connector::on_request_arrived`], [`Connector::on_blocks_allocated`] and
//! [`Connector::on_request_ended`] (D), and takes [`ConnectorEvent`]s back (blocks to free,
//! requests ready or failed). The worker side — registered KV memory and one transport agent per
//! rank — is handed over at [`Connector::start`].
//!
//! A driver thread of its own owns every clock read and every I/O: it runs the ledgers' timers
//! (so heartbeats never wait for a forward pass), moves control messages over the side channel,
//! posts and polls transfers, and feeds dead-peer events to the ledgers.

mod driver;
mod metrics;
pub mod side_channel;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_ledger::{
    ConsumerConfig, ConsumerLedger, IncomingHandoff, ProducerConfig, ProducerLedger, RequestId,
};
use handoff_plan::{KvSpec, RankLayout};
use handoff_proto::{
    Epoch, Fingerprint, HandoffId, KvTransferParams, Message, Release, ReleaseReason, TransferMode,
};
use handoff_transport::{KvRegion, RegionId, Transport};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;

pub use driver::PROTOCOL_VERSION;
use driver::{Inner, PeerState};
pub use metrics::Metrics;
use side_channel::SideEvent;

/// What an engine does in a P/D cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Both ledgers: the engine can serve either side (and runs monolithic requests).
    Both,
}

#[derive(Debug, Clone)]
pub struct ConnectorConfig {
    pub engine_id: String,
    pub role: Role,
    pub mode: TransferMode,
    /// Model name and dtype for the compatibility fingerprint.
    pub model: String,
    pub dtype: String,
    /// Where the side channel listens (port 0: any free port).
    pub side_channel_bind: SocketAddr,
    /// Host that peers should dial (returned in `kv_transfer_params.remote_host`).
    pub advertise_host: String,
    pub producer: ProducerConfig,
    pub consumer: ConsumerConfig,
}

/// One rank's KV memory and transport agent (the worker side).
pub struct RankMemory {
    pub layout: RankLayout,
    pub regions: Vec<(RegionId, Arc<KvRegion>)>,
    pub transport: Arc<dyn Transport>,
}

/// What the connector tells the engine's scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorEvent {
    /// These blocks are the pool's again (P: handoff ended; D: a transfer that will not be used).
    BlocksReleased { blocks: Vec<u32>, reason: String },
    /// The KV of these requests is in `blocks`, which now belong to the requests.
    Ready {
        requests: Vec<u64>,
        blocks: Vec<u32>,
    },
    /// Transfer failed: prefill these requests locally.
    Recompute { requests: Vec<u64>, reason: String },
    /// Transfer failed: fail these requests with `reason`.
    Failed { requests: Vec<u64>, reason: String },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectorError {
    #[error("invalid kv_transfer_params: {0}")]
    BadParams(String),
    #[error("this engine does not {0}")]
    WrongRole(&'static str),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Ledger(String),
    #[error("side channel: {0}")]
    SideChannel(String),
    #[error("transport: {0}")]
    Transport(String),
}

pub struct Connector {
    pub(crate) cfg: ConnectorConfig,
    pub(crate) spec: KvSpec,
    pub(crate) ranks: Vec<RankMemory>,
    pub(crate) inner: Mutex<Inner>,
    pub(crate) wake: Sender<SideEvent>,
    pub(crate) out: Sender<ConnectorEvent>,
    out_rx: Mutex<Receiver<ConnectorEvent>>,
    side_addr: SocketAddr,
    pub(crate) start: Instant,
    stop: Arc<AtomicBool>,
    pub(crate) metrics: Metrics,
    pub(crate) fingerprint: Fingerprint,
}

impl Connector {
    /// Registers every rank's regions with its transport, opens the side channel and starts the
    /// driver thread.
    pub fn start(
        cfg: ConnectorConfig,
        ranks: Vec<RankMemory>,
        registry: &mut Registry,
    ) -> Result<Arc<Connector>, ConnectorError> {
        let first = ranks
            .first()
            .ok_or_else(|| ConnectorError::Config("no rank".into()))?;
        let spec = first.layout.spec;
        spec.validate()
            .map_err(|e| ConnectorError::Config(e.to_string()))?;
        if ranks.len() != spec.tp as usize {
            return Err(ConnectorError::Config(format!(
                "{} ranks given for tp {}",
                ranks.len(),
                spec.tp
            )));
        }
        for (i, r) in ranks.iter().enumerate() {
            r.layout
                .validate()
                .map_err(|e| ConnectorError::Config(format!("rank {i}: {e}")))?;
            if r.layout.rank as usize != i || r.layout.spec != spec {
                return Err(ConnectorError::Config(format!(
                    "rank {i}: layout names rank {} or another spec",
                    r.layout.rank
                )));
            }
            for (id, region) in &r.regions {
                if r.layout.region_len(*id) != Some(region.len() as u64) {
                    return Err(ConnectorError::Config(format!(
                        "rank {i}: region {id} is {} bytes, the layout says {:?}",
                        region.len(),
                        r.layout.region_len(*id)
                    )));
                }
                r.transport
                    .register(*id, region.clone())
                    .map_err(|e| ConnectorError::Transport(e.to_string()))?;
            }
        }
        let fingerprint = Fingerprint {
            protocol_version: PROTOCOL_VERSION,
            model: cfg.model.clone(),
            num_layers: spec.shape.num_layers,
            num_kv_heads: spec.shape.num_kv_heads,
            head_dim: spec.shape.head_dim,
            dtype: cfg.dtype.clone(),
            mode: cfg.mode,
        };
        let (wake, events) = channel();
        let (out, out_rx) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let side_addr = side_channel::listen(cfg.side_channel_bind, wake.clone(), stop.clone())
            .map_err(|e| ConnectorError::SideChannel(e.to_string()))?;
        let mut producer_cfg = cfg.producer.clone();
        producer_cfg.tp = spec.tp as u16;
        let mut consumer_cfg = cfg.consumer.clone();
        consumer_cfg.tp = spec.tp as u16;
        let inner = Inner::new(
            matches!(cfg.role, Role::Prefill | Role::Both)
                .then(|| ProducerLedger::new(producer_cfg)),
            matches!(cfg.role, Role::Decode | Role::Both)
                .then(|| ConsumerLedger::new(consumer_cfg)),
        );
        let metrics = Metrics::new(registry);
        let c = Arc::new(Connector {
            cfg,
            spec,
            ranks,
            inner: Mutex::new(inner),
            wake,
            out,
            out_rx: Mutex::new(out_rx),
            side_addr,
            start: Instant::now(),
            stop,
            metrics,
            fingerprint,
        });
        let driver = c.clone();
        std::thread::Builder::new()
            .name(format!("handoff-driver-{}", c.cfg.engine_id))
            .spawn(move || driver.run(events))
            .map_err(|e| ConnectorError::Config(e.to_string()))?;
        Ok(c)
    }

    pub fn engine_id(&self) -> &str {
        &self.cfg.engine_id
    }

    pub fn side_channel_addr(&self) -> SocketAddr {
        self.side_addr
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    pub(crate) fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn kick(&self) {
        let _ = self.wake.send(SideEvent::Wake);
    }

    /// Brings the held-blocks gauges up to the ledgers' present state. The driver refreshes them
    /// after each of its steps; a scrape calls this first so it never sees a handoff created (or
    /// ended) since the driver's last step as missing.
    pub fn refresh_metrics(&self) {
        let mut inner = self.inner.lock();
        self.update_gauges(&mut inner);
    }

    /// Every event since the last call (non-blocking).
    pub fn poll_events(&self) -> Vec<ConnectorEvent> {
        self.out_rx.lock().try_iter().collect()
    }

    /// Waits up to `timeout` for the next event.
    pub fn wait_event(&self, timeout: Duration) -> Option<ConnectorEvent> {
        self.out_rx.lock().recv_timeout(timeout).ok()
    }

    // ----- P (scheduler side) -----

    /// A prompt's prefill ended and its blocks hold its KV: create the handoff (one, whatever n
    /// is) and return the `kv_transfer_params` for the response. The blocks stay out of the pool
    /// until a [`ConnectorEvent::BlocksReleased`] names them.
    pub fn on_prefill_finished(
        &self,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        let mut id = [0u8; 16];
        getrandom::getrandom(&mut id).map_err(|e| ConnectorError::Ledger(e.to_string()))?;
        let handoff = HandoffId::from_bytes(id);
        let now = self.now();
        let grant = {
            let mut inner = self.inner.lock();
            let p = inner
                .producer
                .as_mut()
                .ok_or(ConnectorError::WrongRole("prefill for remote decode"))?;
            let grant = p
                .create_handoff(handoff, blocks.clone(), TransferMode::Pull, now)
                .map_err(|e| ConnectorError::Ledger(e.to_string()))?;
            inner.redeclare_dead(now);
            grant
        };
        self.kick();
        Ok(self.params_for(
            handoff,
            request_id,
            blocks,
            num_tokens,
            grant.lease_ms,
            TransferMode::Pull,
        ))
    }

    fn params_for(
        &self,
        handoff: HandoffId,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
        lease_ms: u32,
        mode: TransferMode,
    ) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: Some(self.cfg.engine_id.clone()),
            remote_request_id: Some(request_id.to_string()),
            remote_block_ids: Some(vec![blocks]),
            remote_host: Some(self.cfg.advertise_host.clone()),
            remote_port: Some(self.side_addr.port()),
            tp_size: Some(self.spec.tp as u16),
            remote_num_tokens: Some(num_tokens),
            remote_block_size: Some(self.spec.block_size),
            transfer_mode: Some(mode),
            handoff_id: Some(handoff),
            lease_ms: Some(lease_ms),
            epoch: Some(1),
            extra: Default::default(),
        }
    }

    /// What a proxy needs to send D a push request for this P (`GET /v1/handoff/info`).
    pub fn info(&self) -> serde_json::Value {
        serde_json::json!({
            "engine_id": self.cfg.engine_id,
            "remote_host": self.cfg.advertise_host,
            "remote_port": self.side_addr.port(),
            "tp_size": self.spec.tp,
            "block_size": self.spec.block_size,
            "transfer_mode": self.cfg.mode.as_str(),
            "role": match self.cfg.role {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
                Role::Both => "both",
            },
        })
    }

    /// P, push mode: the request (handoff id chosen by the proxy) got `blocks` and its prefill
    /// starts now. D's registration may already be waiting (staged) or come later.
    pub fn on_push_prefill_start(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<(), ConnectorError> {
        let handoff = params
            .handoff_id
            .ok_or_else(|| ConnectorError::BadParams("push without handoff_id".into()))?;
        let now = self.now();
        {
            let mut inner = self.inner.lock();
            let p = inner
                .producer
                .as_mut()
                .ok_or(ConnectorError::WrongRole("prefill for remote decode"))?;
            p.create_handoff(handoff, blocks.clone(), TransferMode::Push, now)
                .map_err(|e| ConnectorError::Ledger(e.to_string()))?;
            inner
                .pushes
                .insert(handoff, driver::PushState::new(blocks, num_tokens));
            // A registration staged before the handoff existed may come from a D that died
            // since: its death was reported when nothing was bound to it yet.
            inner.redeclare_dead(now);
        }
        self.kick();
        Ok(())
    }

    /// P, push mode (worker side): layer `layer` of the handoff's KV is in its blocks; it is
    /// written to D as soon as D's registration holds a valid grant.
    pub fn on_layer_saved(&self, handoff: HandoffId, layer: u32) {
        {
            let mut inner = self.inner.lock();
            if let Some(p) = inner.pushes.get_mut(&handoff) {
                p.layers_saved = p.layers_saved.max(layer + 1);
            }
        }
        self.kick();
    }

    /// P, push mode: the prefill ended; the parameters for the response.
    pub fn on_push_prefill_finished(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> KvTransferParams {
        let handoff = params.handoff_id.unwrap_or(HandoffId(0));
        self.params_for(
            handoff,
            request_id,
            blocks,
            num_tokens,
            self.cfg.producer.initial_lease.as_millis() as u32,
            TransferMode::Push,
        )
    }

    /// The proxy says D never got the request: release at once.
    pub fn release_from_proxy(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        let handoff = params
            .handoff_id
            .ok_or_else(|| ConnectorError::BadParams("no handoff_id".into()))?;
        let msg = Message::Release(Release {
            handoff,
            epoch: Epoch(params.epoch.unwrap_or(1)),
            reason: ReleaseReason::Aborted,
        });
        let now = self.now();
        {
            let mut inner = self.inner.lock();
            let p = inner
                .producer
                .as_mut()
                .ok_or(ConnectorError::WrongRole("prefill for remote decode"))?;
            p.handle_message(driver::PROXY_PEER, msg, now);
        }
        self.kick();
        Ok(())
    }

    // ----- D (scheduler side) -----

    fn incoming(
        &self,
        inner: &mut Inner,
        params: &KvTransferParams,
    ) -> Result<IncomingHandoff, ConnectorError> {
        params
            .validate_remote_prefill()
            .map_err(|e| ConnectorError::BadParams(e.to_string()))?;
        let (Some(engine), Some(host), Some(port), Some(handoff)) = (
            params.remote_engine_id.clone(),
            params.remote_host.clone(),
            params.remote_port,
            params.handoff_id,
        ) else {
            return Err(ConnectorError::BadParams(
                "incomplete remote prefill".into(),
            ));
        };
        if params.mode() != self.cfg.mode {
            return Err(ConnectorError::BadParams(format!(
                "transfer_mode {} but this engine runs {}",
                params.mode().as_str(),
                self.cfg.mode.as_str()
            )));
        }
        let p_tp = params.tp_size.unwrap_or(1);
        let num_tokens = params.remote_num_tokens.unwrap_or(0);
        let peer = inner.peer_for(&engine, format!("{host}:{port}"));
        if let Some(PeerState::Connecting { started: false }) = inner.peers.state(peer) {
            self.connect(inner, peer);
        }
        Ok(IncomingHandoff {
            handoff,
            epoch: Epoch(params.epoch.unwrap_or(1)),
            peer,
            p_tp,
            mode: params.mode(),
            p_blocks: params.block_ids().map(<[u32]>::to_vec).unwrap_or_default(),
            num_tokens,
        })
    }

    /// A request naming a remote prefill arrived (before admission): start tracking it and
    /// heartbeating its P at once.
    pub fn on_request_arrived(
        &self,
        request: u64,
        params: &KvTransferParams,
        prompt_tokens: u32,
    ) -> Result<(), ConnectorError> {
        let now = self.now();
        {
            let mut inner = self.inner.lock();
            if inner.consumer.is_none() {
                return Err(ConnectorError::WrongRole("decode remote prefills"));
            }
            let mut inc = self.incoming(&mut inner, params)?;
            if inc.num_tokens == 0 {
                inc.num_tokens = prompt_tokens;
            }
            inner
                .handoff_tokens
                .insert(inc.handoff, (inc.num_tokens, inc.mode));
            let handoff = inc.handoff;
            inner
                .consumer
                .as_mut()
                .ok_or(ConnectorError::WrongRole("decode remote prefills"))?
                .on_request_arrived(RequestId(request), inc, now)
                .map_err(|e| ConnectorError::Ledger(e.to_string()))?;
            inner.requests.insert(request, handoff);
            let peer = inner
                .peers
                .peer_of_engine(params.remote_engine_id.as_deref().unwrap_or_default());
            if let Some(peer) = peer {
                inner.handoff_peer.insert(handoff, peer);
            }
        }
        self.kick();
        Ok(())
    }

    /// The request was admitted and `blocks` allocated for its prompt's KV.
    pub fn on_blocks_allocated(
        &self,
        request: u64,
        blocks: Vec<u32>,
    ) -> Result<(), ConnectorError> {
        let now = self.now();
        {
            let mut inner = self.inner.lock();
            let handoff = *inner
                .requests
                .get(&request)
                .ok_or_else(|| ConnectorError::Ledger(format!("request {request} not tracked")))?;
            inner
                .consumer
                .as_mut()
                .ok_or(ConnectorError::WrongRole("decode remote prefills"))?
                .on_blocks_allocated(handoff, blocks, now)
                .map_err(|e| ConnectorError::Ledger(e.to_string()))?;
        }
        self.kick();
        Ok(())
    }

    /// The client went away or D refused the request: P is told at once when no transfer is in
    /// flight.
    pub fn on_request_ended(&self, request: u64, reason: ReleaseReason) {
        let now = self.now();
        {
            let mut inner = self.inner.lock();
            inner.requests.remove(&request);
            if let Some(c) = inner.consumer.as_mut() {
                c.on_request_ended(RequestId(request), reason, now);
            }
        }
        self.kick();
    }

    /// D refuses a request it never tracked (bad prompt, full queue): tell its P to release now.
    pub fn reject(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        let mut inner = self.inner.lock();
        let (Some(engine), Some(host), Some(port), Some(handoff)) = (
            params.remote_engine_id.clone(),
            params.remote_host.clone(),
            params.remote_port,
            params.handoff_id,
        ) else {
            return Err(ConnectorError::BadParams(
                "cannot name the P to release".into(),
            ));
        };
        let peer = inner.peer_for(&engine, format!("{host}:{port}"));
        if let Some(PeerState::Connecting { started: false }) = inner.peers.state(peer) {
            self.connect(&mut inner, peer);
        }
        inner.send(
            peer,
            Message::Release(Release {
                handoff,
                epoch: Epoch(params.epoch.unwrap_or(1)),
                reason: ReleaseReason::Rejected,
            }),
        );
        drop(inner);
        self.kick();
        Ok(())
    }

    /// Snapshot of what the ledgers hold, for health checks and tests.
    pub fn held_blocks(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (
            inner.producer.as_ref().map_or(0, |p| p.held_blocks()),
            inner.consumer.as_ref().map_or(0, |c| c.held_blocks()),
        )
    }

    /// Messages P keeps for handoffs its prefill has not created yet (a push registration that
    /// arrived first waits here), bounded by the ledger's staging capacity.
    pub fn staged_messages(&self) -> usize {
        self.inner
            .lock()
            .producer
            .as_ref()
            .map_or(0, |p| p.staged_messages())
    }

    /// Blocks P holds per D engine that reads them (handoffs no D claimed yet are not listed).
    pub fn held_blocks_by_engine(&self) -> Vec<(String, usize)> {
        let inner = self.inner.lock();
        let Some(p) = inner.producer.as_ref() else {
            return Vec::new();
        };
        inner
            .peers
            .engines()
            .map(|(engine, peer)| (engine.to_string(), p.held_blocks_for(peer)))
            .collect()
    }

    /// Handoffs P still holds per end reason so far, and live ones.
    pub fn producer_stats(&self) -> Option<(usize, HashMap<&'static str, u64>)> {
        let inner = self.inner.lock();
        inner
            .producer
            .as_ref()
            .map(|p| (p.len(), p.stats().ended.clone()))
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        // Close every side-channel connection, so their reading threads end and their sockets
        // go now rather than when the peer closes its end.
        {
            let mut inner = self.inner.lock();
            inner.close_connections();
        }
        self.kick();
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

impl Drop for Connector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
