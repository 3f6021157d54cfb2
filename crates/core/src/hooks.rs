//! [`Hooks`]: an engine's calls on a connector core, typed.
//!
//! An engine talks to its core through one method, [`Hooks::give`], which hands over an
//! [`Input`] and returns the core's [`Answer`] (raft-rs's `RawNode` has the same shape: `step`
//! takes a message, `propose` and friends build one). The provided methods build each input and
//! return the answer as the type the engine needs. The executor's `Connector` implements `give`
//! by forwarding to the thread that owns the core, the simulation by calling
//! [`crate::ConnectorCore::handle`] in place: both run the same hook code.

use handoff_proto::{HandoffId, KvTransferParams, ReleaseReason};

use crate::{Answer, Arrival, CoreError, Input, PrefillOutcome};

/// The typed hooks of a connector core (see the module docs).
pub trait Hooks {
    type Error: From<CoreError>;

    /// Hands `input` to the core, now, and returns what it answered.
    fn give(&self, input: Input) -> Result<Answer, Self::Error>;

    /// Hands over an input whose answer says nothing the engine acts on (a worker point,
    /// an ending): a refusal is logged by whoever implements `give`.
    fn tell(&self, input: Input) {
        let _ = self.give(input);
    }

    // ----- P -----

    /// See [`Input::PrefillStarted`]: the handoff that holds `blocks` from now on, if any (the
    /// engine must not free them then; they come back through `BlocksReleased`).
    fn prefill_started(
        &self,
        request_id: &str,
        params: &KvTransferParams,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<Option<HandoffId>, Self::Error> {
        let answer = self.give(Input::PrefillStarted {
            request_id: request_id.to_string(),
            params: params.clone(),
            handoff,
            blocks,
            num_tokens,
        })?;
        match answer {
            Answer::Holding(h) => Ok(h),
            other => answered_wrong("PrefillStarted", &other),
        }
    }

    /// See [`Input::LayersSaved`].
    fn layers_saved(&self, request_id: &str, through: u32) {
        self.tell(Input::LayersSaved {
            request_id: request_id.to_string(),
            through,
        });
    }

    /// See [`Input::PrefillEnded`]: the response's params, if any, and the handoff that holds
    /// the prompt's blocks (none: the engine frees them).
    fn prefill_ended(
        &self,
        request_id: &str,
        outcome: PrefillOutcome,
    ) -> Result<PrefillEnd, Self::Error> {
        let answer = self.give(Input::PrefillEnded {
            request_id: request_id.to_string(),
            outcome,
        })?;
        match answer {
            Answer::Ended { params, holding } => Ok(PrefillEnd {
                params: params.map(|p| *p),
                holding,
            }),
            other => answered_wrong("PrefillEnded", &other),
        }
    }

    /// For an engine that learns of a prefill only once it finished: started and finished at
    /// once (every layer is in the blocks).
    fn prefilled(
        &self,
        request_id: &str,
        params: &KvTransferParams,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<PrefillEnd, Self::Error> {
        self.prefill_started(request_id, params, handoff, blocks, num_tokens)?;
        self.prefill_ended(request_id, PrefillOutcome::Finished)
    }

    /// The proxy says D never got the request: release at once unless a D claimed it.
    fn release_from_proxy(&self, params: &KvTransferParams) -> Result<(), Self::Error> {
        self.give(Input::ReleaseFromProxy {
            params: params.clone(),
        })
        .map(drop)
    }

    // ----- D -----

    /// See [`Input::RequestArrived`]: what the engine does with the request.
    fn request_arrived(
        &self,
        request: u64,
        params: &KvTransferParams,
        prompt_tokens: u32,
    ) -> Result<Arrival, Self::Error> {
        let answer = self.give(Input::RequestArrived {
            request,
            params: params.clone(),
            prompt_tokens,
        })?;
        match answer {
            Answer::Arrived(a) => Ok(a),
            other => answered_wrong("RequestArrived", &other),
        }
    }

    /// See [`Input::BlocksAllocated`].
    fn blocks_allocated(
        &self,
        request: u64,
        cached: Vec<u32>,
        blocks: Vec<u32>,
    ) -> Result<(), Self::Error> {
        self.give(Input::BlocksAllocated {
            request,
            cached,
            blocks,
        })
        .map(drop)
    }

    /// See [`Input::RequestEnded`].
    fn request_ended(&self, request: u64, reason: ReleaseReason) {
        self.tell(Input::RequestEnded { request, reason });
    }

    /// D refuses a request it never tracked: its P is told to release, unless this engine
    /// still tracks the handoff for another request.
    fn reject(&self, params: &KvTransferParams) -> Result<(), Self::Error> {
        self.give(Input::Reject {
            params: params.clone(),
        })
        .map(drop)
    }
}

/// What [`Hooks::prefill_ended`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillEnd {
    /// The `kv_transfer_params` for the response (none when it failed or nobody waits).
    pub params: Option<KvTransferParams>,
    /// The handoff that holds the prompt's blocks; none: the engine frees them.
    pub holding: Option<HandoffId>,
}

/// [`crate::ConnectorCore::handle`] answers each input with its one kind of answer, in one match
/// arm per input (and `every_input_gets_its_kind_of_answer` checks it): another kind is a bug
/// in this crate, not something an engine or a peer can cause.
fn answered_wrong<T>(input: &str, answer: &Answer) -> T {
    unreachable!("the core answered {input} with {answer:?}")
}
