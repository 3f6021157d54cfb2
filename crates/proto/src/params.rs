//! `kv_transfer_params`: the JSON object that travels with a request through the proxy, with
//! vLLM's keys (so vLLM's example proxy can drive handoff engines) plus handoff's own.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::ids::HandoffId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// D reads P's blocks (vLLM's default NixlConnector).
    #[default]
    Pull,
    /// P writes into blocks D reserved up front.
    Push,
}

impl TransferMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        }
    }

    /// The mode [`Self::as_str`] names (an engine's setting).
    pub fn from_name(name: &str) -> Option<Self> {
        [TransferMode::Pull, TransferMode::Push]
            .into_iter()
            .find(|m| m.as_str() == name)
    }
}

/// How a request's KV goes from P to D. The router chooses it when it routes the request and
/// writes it into both legs' `kv_transfer_params` ([`Flow::write_into`]); every engine reads it
/// back with [`KvTransferParams::flow`], the one place that interprets those keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flow {
    /// P prefills, then D reads the whole KV (vLLM's NixlConnector does this).
    Pull,
    /// Both legs at once: P holds the KV under the router's handoff id from its prefill's start,
    /// and D reads each layer once P saved it.
    LayerwisePull,
    /// Both legs at once: D reserves blocks and registers them with P, which writes each layer
    /// into them as its forward pass saves it.
    Push,
}

impl Flow {
    /// Who moves the bytes: the reader (pull) or the writer (push).
    pub fn mode(self) -> TransferMode {
        match self {
            Flow::Pull | Flow::LayerwisePull => TransferMode::Pull,
            Flow::Push => TransferMode::Push,
        }
    }

    /// Whether the router sends both legs at once (under its own handoff id).
    pub fn both_legs_at_once(self) -> bool {
        self != Flow::Pull
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Flow::Pull => "pull",
            Flow::LayerwisePull => "layerwise_pull",
            Flow::Push => "push",
        }
    }

    /// Writes the flow into a leg's `kv_transfer_params` JSON, as [`KvTransferParams::flow`]
    /// reads it (`transfer_mode`, and `layerwise` for a layer-wise pull).
    pub fn write_into(self, params: &mut Map<String, Value>) {
        params.insert("transfer_mode".into(), self.mode().as_str().into());
        if self == Flow::LayerwisePull {
            params.insert("layerwise".into(), true.into());
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("kv_transfer_params is not valid: {0}")]
    Invalid(String),
    #[error("kv_transfer_params is missing `{0}`, which a remote prefill needs")]
    Missing(&'static str),
}

/// The typed form of `kv_transfer_params`. Every field is optional on input, as vLLM's proxy
/// sends nulls for what it does not know yet; unknown keys are kept and written back unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    /// vLLM 0.33 writes one list per KV-cache group (`[[1,2,3]]`), older versions a flat list;
    /// both are accepted, the per-group form is written.
    #[serde(
        default,
        deserialize_with = "block_ids_any_form",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_block_ids: Option<Vec<Vec<u32>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_mode: Option<TransferMode>,
    // handoff's own keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_id: Option<HandoffId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u32>,
    /// Layer-wise pull (the proxy sends both legs at once, as for a push): P creates the handoff
    /// under `handoff_id` when its prefill starts and D reads each layer once it is saved. D's
    /// leg then names no `remote_block_ids` (D reads only the blocks P names anyway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layerwise: Option<bool>,
    /// Keys this build does not know, kept so a newer peer's params survive a round trip.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn block_ids_any_form<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Vec<u32>>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum AnyForm {
        Grouped(Vec<Vec<u32>>),
        Flat(Vec<u32>),
    }
    Ok(match Option::<AnyForm>::deserialize(d)? {
        None => None,
        Some(AnyForm::Grouped(g)) => Some(g),
        Some(AnyForm::Flat(f)) => Some(vec![f]),
    })
}

impl KvTransferParams {
    pub fn from_json(v: &Value) -> Result<Self, ParamsError> {
        serde_json::from_value(v.clone()).map_err(|e| ParamsError::Invalid(e.to_string()))
    }

    /// Only what is needed to tell P to release (engine, side channel, handoff id, epoch), read
    /// key by key so that params invalid elsewhere still let D release P's blocks at once.
    pub fn release_target(v: &Value) -> Option<Self> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let handoff_id = s("handoff_id")?.parse().ok()?;
        Some(KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some(s("remote_engine_id")?),
            remote_host: Some(s("remote_host")?),
            remote_port: Some(u16::try_from(v.get("remote_port")?.as_u64()?).ok()?),
            handoff_id: Some(handoff_id),
            epoch: v
                .get("epoch")
                .and_then(Value::as_u64)
                .and_then(|e| u32::try_from(e).ok()),
            ..Default::default()
        })
    }

    pub fn to_json(&self) -> Value {
        // Serializing this struct cannot fail: every field is a plain JSON type.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// The block ids of the first (only) KV-cache group.
    pub fn block_ids(&self) -> Option<&[u32]> {
        self.remote_block_ids
            .as_ref()
            .and_then(|g| g.first())
            .map(Vec::as_slice)
    }

    pub fn mode(&self) -> TransferMode {
        self.transfer_mode.unwrap_or_default()
    }

    /// The request's flow: `transfer_mode` (pull when absent, as vLLM sends it) refined by
    /// `layerwise`.
    pub fn flow(&self) -> Flow {
        match (self.mode(), self.layerwise) {
            (TransferMode::Push, _) => Flow::Push,
            (TransferMode::Pull, Some(true)) => Flow::LayerwisePull,
            (TransferMode::Pull, _) => Flow::Pull,
        }
    }

    /// A layer-wise pull (see [`KvTransferParams::layerwise`]).
    pub fn is_layerwise_pull(&self) -> bool {
        self.flow() == Flow::LayerwisePull
    }

    /// What P must ask for: "prefill, keep the KV for a remote decode" (the proxy's first leg).
    pub fn for_prefill_leg() -> Self {
        KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        }
    }

    /// Checks that params meant for D's remote prefill name everything D needs.
    pub fn validate_remote_prefill(&self) -> Result<(), ParamsError> {
        if !self.do_remote_prefill {
            return Ok(());
        }
        if self.remote_engine_id.is_none() {
            return Err(ParamsError::Missing("remote_engine_id"));
        }
        if self.remote_host.is_none() {
            return Err(ParamsError::Missing("remote_host"));
        }
        if self.remote_port.is_none() {
            return Err(ParamsError::Missing("remote_port"));
        }
        if self.handoff_id.is_none() {
            return Err(ParamsError::Missing("handoff_id"));
        }
        if self.mode() == TransferMode::Pull
            && !self.is_layerwise_pull()
            && self.block_ids().is_none()
        {
            return Err(ParamsError::Missing("remote_block_ids"));
        }
        Ok(())
    }
}
