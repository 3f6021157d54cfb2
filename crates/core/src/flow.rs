//! How an engine and its core split a flow. The engine says what happened to a prompt (a
//! prefill started, layers saved, the prefill ended: [`PrefillOutcome`]) and what its layer
//! reports mean ([`LayerReports`], a setting); the core reads the request's params and decides
//! pull, layer-wise pull or push, and tells a decode engine what to do with a request that
//! arrived ([`Arrival`]). No engine reads the flow from the params itself.

use serde::{Deserialize, Serialize};

/// How a prefill for a remote decode ended ([`crate::Input::PrefillEnded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PrefillOutcome {
    /// Every layer is in the blocks and the response goes out with the params.
    Finished,
    /// Every layer is in the blocks, but nobody waits for the response (its client left): a
    /// pull creates no handoff, a flow whose D got its leg already goes on.
    Abandoned,
    /// The prefill failed or was stopped before its end.
    Failed,
}

/// What an engine's [`crate::Input::LayersSaved`] means (the core's config says it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerReports {
    /// The layers are in the blocks (the reference engine says so after each layer).
    #[default]
    Saved,
    /// A forward pass that saves them is planned, and the workers hold each push write until
    /// their forward pass saved its layer (vLLM: the scheduler side plans a step, the workers
    /// run it), so renewals of D's grants reach the workers mid-forward.
    Planned,
}

/// What a D engine does with a request that arrived ([`crate::Input::RequestArrived`]): the core read
/// its flow, the engine need not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// Push: reserve the prompt's blocks now and name them (`BlocksAllocated`): P writes into
    /// them as soon as its KV exists.
    pub reserve_now: bool,
    /// Layer-wise pull: admit it only after [`crate::ConnectorEvent::RemoteStarted`] (blocks
    /// held for a prefill P cannot start yet, while P's pool is full of requests waiting for
    /// D's blocks, would deadlock the two engines).
    pub after_remote_start: bool,
}
