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

use crate::flow::{Arrival, PrefillOutcome};
use crate::machine::{ConnId, ConnectorCore};
use crate::worker_protocol::WorkerReport;
use crate::CoreError;

/// One input to a [`ConnectorCore`]. The variants' docs say when an engine gives them; the
/// method each one reaches documents what the core does with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    // ----- P: engine events -----
    /// A prefill for a remote decode starts on `blocks` (the prompt's `num_tokens` tokens). The
    /// core picks the flow from `params` and its config: a push starts its handoff now (under
    /// the router's id), a layer-wise pull holds the blocks now, a pull waits for the end (its
    /// handoff then takes `handoff`, 128 random bits from the caller). Answers
    /// [`Answer::Holding`].
    PrefillStarted {
        request_id: String,
        params: KvTransferParams,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
    },
    /// Layers `0..through` of the request's KV are in its blocks, or, when the config's
    /// [`LayerReports`] is `Planned`, are computed by the step about to run.
    LayersSaved {
        request_id: String,
        through: u32,
    },
    /// The prefill ended (every layer saved, when it finished). Answers [`Answer::Ended`].
    PrefillEnded {
        request_id: String,
        outcome: PrefillOutcome,
    },
    /// The proxy says D never got the request.
    ReleaseFromProxy {
        params: KvTransferParams,
    },

    // ----- D: scheduler hooks -----
    /// A request naming a remote prefill arrived. Answers [`Answer::Arrived`].
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
    /// [`Input::PrefillStarted`]: the handoff that holds the prompt's blocks from now on (they
    /// come back only through [`crate::ConnectorEvent::BlocksReleased`]), or `None` when the
    /// engine still owns them.
    Holding(Option<HandoffId>),
    /// [`Input::PrefillEnded`]: the `kv_transfer_params` for the response (none when it failed
    /// or nobody waits for it), and the handoff that holds the prompt's blocks (none: the
    /// engine frees them).
    Ended {
        params: Option<Box<KvTransferParams>>,
        holding: Option<HandoffId>,
    },
    /// [`Input::RequestArrived`]: what the engine does with the request, by its flow.
    Arrived(Arrival),
}

impl Input {
    /// The variant's name, for logs and replay reports.
    pub fn name(&self) -> &'static str {
        match self {
            Input::PrefillStarted { .. } => "prefill_started",
            Input::LayersSaved { .. } => "layers_saved",
            Input::PrefillEnded { .. } => "prefill_ended",
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
            Input::PrefillStarted {
                request_id,
                params,
                handoff,
                blocks,
                num_tokens,
            } => Answer::Holding(
                self.on_prefill_started(request_id, &params, handoff, blocks, num_tokens, now)?,
            ),
            Input::LayersSaved {
                request_id,
                through,
            } => {
                self.on_layers_saved(&request_id, through, now);
                Answer::Done
            }
            Input::PrefillEnded {
                request_id,
                outcome,
            } => {
                let (params, holding) = self.on_prefill_ended(&request_id, outcome, now)?;
                Answer::Ended {
                    params: params.map(Box::new),
                    holding,
                }
            }
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
                Answer::Arrived(Arrival {
                    reserve_now: params.flow() == handoff_proto::Flow::Push,
                    after_remote_start: params.flow() == handoff_proto::Flow::LayerwisePull,
                })
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
