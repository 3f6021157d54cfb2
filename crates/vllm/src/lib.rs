//! handoff as vLLM's KV connector (`KVConnectorBase_V1`).
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
//! The Python module (`handoff_vllm._native`, feature `python`) is a thin binding over these;
//! the connector class itself is Python (`python/handoff_vllm`). Rust threads never call into
//! Python; every hook returns after a short call.

#![deny(unsafe_code)]

pub mod kv_tensors;
#[cfg(feature = "python")]
mod python;
pub mod scheduler;
pub mod worker;
