//! [`Input`]: everything that can happen to a connector core, as one value.
//!
//! A scheduler hook, a side-channel event, a worker report and a timeout are all an `Input`,
//! handed to [`ConnectorCore::handle`] with the time it happened. One entry point is what lets
//! the executor forward instead of mirror, a recorder write every input down ([`crate::trace`]),
//! and a replay feed them back: the core's state is a function of its inputs and their times.
//! Every value here is plain, serialisable data (the handoff id of a new prefill comes from the
//! caller, who drew it from a random source: the core has none).

use handoff_ledger::Time;
use handoff_proto::{HandoffId, KvTransferParams, Message, ReleaseReason};
use serde::{Deserialize, Serialize};

use crate::machine::{ConnId, ConnectorCore};
use crate::worker_protocol::WorkerReport;
use crate::CoreError;

/// One input to a [`ConnectorCore`]. The variants' docs say when an engine gives them; the
/// method each one reaches documents what the core does with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    // ----- P: scheduler hooks -----
    /// A prompt's prefill ended (pull): create handoff `handoff` over `blocks`. Answers
    /// [`Answer::Params`].
    PrefillFinished {
        request_id: String,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// Push: the prefill of a request D registered blocks for starts. Answers
    /// [`Answer::Handoff`].
    PushPrefillStart {
        params: KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// The forward pass saved `layer` of `handoff` (push, layer-wise pull).
    LayerSaved {
        handoff: HandoffId,
        layer: u32,
    },
    /// Layer-wise pull: the prefill starts. Answers [`Answer::MaybeHandoff`].
    PullPrefillStart {
        params: KvTransferParams,
        blocks: Vec<u32>,
    },
    /// Layer-wise pull: the prefill ended. Answers [`Answer::Params`].
    PullPrefillFinished {
        params: KvTransferParams,
        request_id: String,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// Layer-wise pull: the prefill failed before it ended.
    PullPrefillFailed {
        handoff: HandoffId,
    },
    /// Push, learnt once the whole prefill ended (vLLM). Answers [`Answer::Params`].
    PushPrefilled {
        params: KvTransferParams,
        request_id: String,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// Push, every layer at once after a forward pass. Answers [`Answer::Handoff`].
    PushForward {
        params: KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// Push: the response's parameters once the prefill ended. Answers [`Answer::Params`].
    PushParams {
        params: KvTransferParams,
        request_id: String,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// The proxy says D never got the request.
    ReleaseFromProxy {
        params: KvTransferParams,
    },

    // ----- D: scheduler hooks -----
    /// A request naming a remote prefill arrived.
    RequestArrived {
        request: u64,
        params: KvTransferParams,
        prompt_tokens: u32,
    },
    /// The scheduler gave the request `blocks`, after `cached` ones of its prefix cache.
    BlocksAllocated {
        request: u64,
        cached: Vec<u32>,
        blocks: Vec<u32>,
    },
    /// The request ended in the engine (finished, aborted).
    RequestEnded {
        request: u64,
        reason: ReleaseReason,
    },
    /// D refuses a request it never tracked.
    Reject {
        params: KvTransferParams,
    },

    // ----- side channel -----
    /// The first frame of a connection a peer opened; `proven`: the engine id it proved.
    Accepted {
        conn: ConnId,
        msg: Message,
        proven: Option<String>,
    },
    /// A frame on an established connection.
    Frame {
        conn: ConnId,
        msg: Message,
    },
    /// Our connect attempt `attempt` to `engine` got `reply` on `conn`.
    Connected {
        engine: String,
        attempt: u64,
        conn: ConnId,
        reply: Message,
    },
    ConnectFailed {
        engine: String,
        attempt: u64,
        error: String,
    },
    /// The connection closed (either side).
    Closed {
        conn: ConnId,
    },

    // ----- workers and time -----
    WorkerReport(WorkerReport),
    /// [`ConnectorCore::poll_timeout`] passed.
    Timeout,
    /// The engine shuts down: close every connection.
    CloseAll,
}

/// What [`ConnectorCore::handle`] answers besides its [`crate::Ready`] batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// The input needs no answer.
    Done,
    /// The `kv_transfer_params` for the prefill's response.
    Params(KvTransferParams),
    /// The handoff the prefill's KV belongs to.
    Handoff(HandoffId),
    /// Layer-wise pull: the handoff, or `None` when the request is no layer-wise pull.
    MaybeHandoff(Option<HandoffId>),
}

impl Input {
    /// The variant's name, for logs and replay reports.
    pub fn name(&self) -> &'static str {
        match self {
            Input::PrefillFinished { .. } => "prefill_finished",
            Input::PushPrefillStart { .. } => "push_prefill_start",
            Input::LayerSaved { .. } => "layer_saved",
            Input::PullPrefillStart { .. } => "pull_prefill_start",
            Input::PullPrefillFinished { .. } => "pull_prefill_finished",
            Input::PullPrefillFailed { .. } => "pull_prefill_failed",
            Input::PushPrefilled { .. } => "push_prefilled",
            Input::PushForward { .. } => "push_forward",
            Input::PushParams { .. } => "push_params",
            Input::ReleaseFromProxy { .. } => "release_from_proxy",
            Input::RequestArrived { .. } => "request_arrived",
            Input::BlocksAllocated { .. } => "blocks_allocated",
            Input::RequestEnded { .. } => "request_ended",
            Input::Reject { .. } => "reject",
            Input::Accepted { .. } => "accepted",
            Input::Frame { .. } => "frame",
            Input::Connected { .. } => "connected",
            Input::ConnectFailed { .. } => "connect_failed",
            Input::Closed { .. } => "closed",
            Input::WorkerReport(_) => "worker_report",
            Input::Timeout => "timeout",
            Input::CloseAll => "close_all",
        }
    }
}

impl ConnectorCore {
    /// The one entry point: applies `input`, which happened at `now`. What it asks the executor
    /// to do is in the next [`crate::Ready`] batch. An error leaves the core as it was.
    pub fn handle(&mut self, input: Input, now: Time) -> Result<Answer, CoreError> {
        Ok(match input {
            Input::PrefillFinished {
                request_id,
                handoff,
                blocks,
                num_tokens,
            } => Answer::Params(self.on_prefill_finished(
                &request_id,
                handoff,
                blocks,
                num_tokens,
                now,
            )?),
            Input::PushPrefillStart {
                params,
                blocks,
                num_tokens,
            } => Answer::Handoff(self.on_push_prefill_start(&params, blocks, num_tokens, now)?),
            Input::LayerSaved { handoff, layer } => {
                self.on_layer_saved(handoff, layer, now);
                Answer::Done
            }
            Input::PullPrefillStart { params, blocks } => {
                Answer::MaybeHandoff(self.on_pull_prefill_start(&params, blocks, now)?)
            }
            Input::PullPrefillFinished {
                params,
                request_id,
                blocks,
                num_tokens,
            } => Answer::Params(self.on_pull_prefill_finished(
                &params,
                &request_id,
                blocks,
                num_tokens,
                now,
            )?),
            Input::PullPrefillFailed { handoff } => {
                self.on_pull_prefill_failed(handoff, now);
                Answer::Done
            }
            Input::PushPrefilled {
                params,
                request_id,
                blocks,
                num_tokens,
            } => Answer::Params(self.on_push_prefilled(
                &params,
                &request_id,
                blocks,
                num_tokens,
                now,
            )?),
            Input::PushForward {
                params,
                blocks,
                num_tokens,
            } => Answer::Handoff(self.on_push_forward(&params, blocks, num_tokens, now)?),
            Input::PushParams {
                params,
                request_id,
                blocks,
                num_tokens,
            } => Answer::Params(self.push_params(&params, &request_id, blocks, num_tokens)?),
            Input::ReleaseFromProxy { params } => {
                self.release_from_proxy(&params, now)?;
                Answer::Done
            }
            Input::RequestArrived {
                request,
                params,
                prompt_tokens,
            } => {
                self.on_request_arrived(request, &params, prompt_tokens, now)?;
                Answer::Done
            }
            Input::BlocksAllocated {
                request,
                cached,
                blocks,
            } => {
                self.on_blocks_allocated_after_cached(request, cached, blocks, now)?;
                Answer::Done
            }
            Input::RequestEnded { request, reason } => {
                self.on_request_ended(request, reason, now);
                Answer::Done
            }
            Input::Reject { params } => {
                self.reject(&params, now)?;
                Answer::Done
            }
            Input::Accepted { conn, msg, proven } => {
                self.handle_accepted(conn, msg, proven.as_deref(), now);
                Answer::Done
            }
            Input::Frame { conn, msg } => {
                self.handle_frame(conn, msg, now);
                Answer::Done
            }
            Input::Connected {
                engine,
                attempt,
                conn,
                reply,
            } => {
                self.handle_connected(&engine, attempt, conn, reply, now);
                Answer::Done
            }
            Input::ConnectFailed {
                engine,
                attempt,
                error,
            } => {
                self.handle_connect_failed(&engine, attempt, error, now);
                Answer::Done
            }
            Input::Closed { conn } => {
                self.handle_closed(conn, now);
                Answer::Done
            }
            Input::WorkerReport(report) => {
                self.handle_worker_report(report, now);
                Answer::Done
            }
            Input::Timeout => {
                self.handle_timeout(now);
                Answer::Done
            }
            Input::CloseAll => {
                self.close_all();
                Answer::Done
            }
        })
    }
}
