//! The sans-IO core of a handoff connector: everything one engine decides, and nothing it does.
//! In the book (`docs/` in the repository): `docs/src/design/connector.md`.
//!
//! [`ConnectorCore`] owns both ledgers, the peer table, the grants and the transfers in flight.
//! Every input — a scheduler hook, a side-channel frame, a connect outcome, a worker report, a
//! timeout — is one [`Input`] given to [`ConnectorCore::handle`] with the time it happened; every
//! output is one [`Ready`] batch, pulled and given back as raft-rs's `RawNode` does. The same
//! inputs at the same times give the same outputs, byte for byte, which is what lets a
//! simulation drive the code that ships and a recorded trace ([`trace`]) replay a user's run.
//!
//! This crate depends on the protocol, the ledgers and the planner only: no thread, socket,
//! lock, clock or random source is reachable from here (`crates/cli/tests/architecture.rs`
//! checks it). The executor, side channel and workers that do the I/O live in
//! `handoff-connector`.

#![forbid(unsafe_code)]

pub mod digest;
mod error;
mod flow;
mod hooks;
mod input;
mod machine;
pub mod trace;
pub mod worker_protocol;

pub use error::CoreError;
pub use flow::{Arrival, LayerReports, PrefillOutcome};
pub use hooks::{Hooks, PrefillEnd};
pub use input::{Answer, Input};
pub use machine::{
    ConnId, Connect, ConnectorCore, CoreConfig, CoreMemory, HandshakeRefusal, LedgerCounters,
    Observation, Ready,
};
pub use worker_protocol::{
    Digested, JobId, PushLayer, TransferJob, TransferPart, WorkerHello, WorkerOp, WorkerReport,
    WorkerStep,
};

/// Bugs fixed in the core that a test can put back ([`ConnectorCore::reinsert`]), to show that
/// the simulation and a replay catch them. Feature `testing`: not API.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownBug {
    /// D's `reject` tells P to release at once, without asking D's ledger: a retried request
    /// rejected while the first one reads makes P free the blocks under the READ (rule 2).
    RejectWithoutLedger,
}

/// What an engine does in a P/D cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    Prefill,
    Decode,
    /// Both ledgers: the engine can serve either side (and runs monolithic requests).
    Both,
}

/// What the connector tells the engine's scheduler.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ConnectorEvent {
    /// These blocks are the pool's again (P: handoff ended; D: a transfer that will not be used).
    /// `handoff` names whose they were: block ids alone do not (on P a prefix cache shares a
    /// prompt's first blocks between requests, so two handoffs may hold the same ones).
    BlocksReleased {
        handoff: handoff_proto::HandoffId,
        blocks: Vec<u32>,
        reason: String,
    },
    /// The KV of these requests is in `blocks`, which now belong to the requests.
    Ready {
        requests: Vec<u64>,
        blocks: Vec<u32>,
    },
    /// D: P holds the handoff of these requests, still waiting for admission (in a layer-wise
    /// pull: P's prefill started). An engine admits a layer-wise pull only from then on
    /// (`ConsumerLedger::poll_started` says why); others may ignore it.
    RemoteStarted { requests: Vec<u64> },
    /// Transfer failed: prefill these requests locally.
    Recompute { requests: Vec<u64>, reason: String },
    /// Transfer failed: fail these requests with `reason`.
    Failed { requests: Vec<u64>, reason: String },
}
