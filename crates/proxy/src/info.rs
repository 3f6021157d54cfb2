//! What an engine says about itself on `GET /v1/handoff/info`: the proxy's health checks read
//! it from every P and D (its compatibility key, whether it takes a layer-wise pull, push P's
//! side channel).

use serde::Deserialize;

use crate::TransferMode;

/// What an engine says about itself on `GET /v1/handoff/info`. The proxy needs P's to tell D
/// where to register its blocks: in push mode P's `kv_transfer_params` come too late for D.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(crate) struct EngineInfo {
    pub(crate) engine_id: String,
    pub(crate) remote_host: String,
    pub(crate) remote_port: u16,
    pub(crate) tp_size: u16,
    #[serde(default)]
    pub(crate) block_size: Option<u32>,
    #[serde(default)]
    pub(crate) transfer_mode: Option<TransferMode>,
    #[serde(default)]
    pub(crate) role: Option<String>,
    /// A pull-mode P that takes a layer-wise pull (both legs at once).
    #[serde(default)]
    pub(crate) layerwise_pull: Option<bool>,
    /// What a P and a D must share to exchange KV (see `pool::compatible`).
    #[serde(default)]
    pub(crate) compat_key: Option<String>,
}

impl EngineInfo {
    /// Whether this engine takes part in a layer-wise pull: as P, it prefills one; as D, it
    /// admits one only once P's prefill started (D holding blocks for requests P cannot start
    /// while P's pool waits on D's reads would deadlock the two).
    pub(crate) fn takes_layerwise_pull(&self) -> bool {
        self.layerwise_pull == Some(true) && self.transfer_mode != Some(TransferMode::Push)
    }
}
