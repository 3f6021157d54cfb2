//! handoff as vLLM's KV connector (`KVConnectorBase_V1`).
//! In the book (`docs/` in the repository): `docs/src/guides/vllm.md`.
//!
//! vLLM builds the connector twice: once in EngineCore with the scheduler role and once in each
//! worker process with the worker role; the two talk only through the metadata vLLM pickles
//! between them every step. handoff's connector is split the same way (`handoff-connector`), so
//! the mapping is direct:
//!
//! - [`scheduler::SchedulerSide`] runs the connector's executor and core (ledgers, side channel,
//!   timers) behind the scheduler hooks; its worker steps go out in [`scheduler::StepMeta`]
//!   (`build_connector_meta`), worker reports come back in `update_connector_output`.
//! - [`worker::WorkerBridge`] registers vLLM's KV tensors ([`kv_tensors`] derives handoff's
//!   layout from their shape and strides) with a transport agent and carries out the steps.
//!
//! - [`grant_line`]: D's renewed push grants, from EngineCore to the workers while a forward pass
//!   runs (vLLM's metadata reaches them only once per step).
//! - [`engine_socket`]: what vLLM's API server asks EngineCore's connector: D's names requests
//!   vLLM refused before any hook ran (so that P releases at once), P's asks for the info a push
//!   proxy needs (`GET /v1/handoff/info`).
//!
//! The Python module (`handoff_vllm._native`, feature `python`) is a thin binding over these;
//! the connector class itself is Python (`python/handoff_vllm`). Rust threads never call into
//! Python; every hook returns after a short call.

#![deny(unsafe_code)]

pub mod address;
pub mod engine_socket;
pub mod grant_line;
pub mod kv_tensors;
#[cfg(feature = "python")]
mod python;
pub mod scheduler;
#[cfg(feature = "test-switches")]
pub mod test_switches;
pub mod worker;

use handoff_transport::auth::{AuthError, ClusterKey};

/// The cluster key both sides of the connector prove: `HANDOFF_CLUSTER_KEY` (64 hex digits) if
/// set, else the file `kv_connector_extra_config.cluster_key_file` names, else none (loopback
/// only unless `insecure`).
pub fn cluster_key(file: Option<&str>) -> Result<Option<ClusterKey>, AuthError> {
    if let Ok(hex) = std::env::var("HANDOFF_CLUSTER_KEY") {
        if !hex.is_empty() {
            return ClusterKey::from_hex(&hex).map(Some);
        }
    }
    match file {
        Some(f) if !f.is_empty() => ClusterKey::load(std::path::Path::new(f)).map(Some),
        _ => Ok(None),
    }
}
