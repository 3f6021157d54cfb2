//! The simulation's handle on one core: every call is an [`Input`] given to
//! [`ConnectorCore::handle`] (the entry point the executor uses), and every input and batch is
//! written down as a trace, so a schedule can be replayed with `handoff_core::trace`.

use std::time::Duration;

use handoff_core::trace::{Header, Line, TRACE_VERSION};
use handoff_core::{
    Answer, ConnId, ConnectorCore, CoreConfig, CoreError, CoreMemory, Input, Ready, WorkerHello,
    WorkerReport,
};
use handoff_proto::{HandoffId, KvTransferParams, Message, ReleaseReason};

pub struct SimCore {
    core: ConnectorCore,
    /// The trace so far: a header, then inputs and batches, as JSON lines.
    pub trace: Vec<String>,
    inputs: u64,
}

fn line(l: &Line) -> String {
    serde_json::to_string(l).expect("a trace line encodes")
}

impl SimCore {
    pub fn new(config: CoreConfig, ranks: Vec<WorkerHello>) -> SimCore {
        let header = Header {
            handoff_trace: TRACE_VERSION,
            config: config.clone(),
            ranks: ranks.clone(),
            segment: 0,
            first_input: 0,
        };
        SimCore {
            core: ConnectorCore::new(config, ranks).expect("a valid core"),
            trace: vec![line(&Line::Header(Box::new(header)))],
            inputs: 0,
        }
    }

    /// The core itself, to re-insert a fixed bug before a run.
    pub fn core_mut(&mut self) -> &mut ConnectorCore {
        &mut self.core
    }

    pub fn handle(&mut self, input: Input, now: Duration) -> Result<Answer, CoreError> {
        let answer = self.core.handle(input.clone(), now);
        self.trace
            .push(line(&Line::input(self.inputs, now, input, &answer)));
        self.inputs += 1;
        answer
    }

    pub fn ready(&mut self) -> Ready {
        let r = self.core.ready();
        if !r.is_empty() {
            self.trace.push(line(&Line::Batch {
                after: self.inputs.saturating_sub(1),
                batch: r.clone(),
            }));
        }
        r
    }

    pub fn advance(&mut self, r: Ready) {
        self.core.advance(r)
    }

    pub fn has_ready(&self) -> bool {
        self.core.has_ready()
    }

    pub fn poll_timeout(&self) -> Option<Duration> {
        self.core.poll_timeout()
    }

    pub fn memory(&self) -> CoreMemory {
        self.core.memory()
    }

    // ----- the hooks, as inputs -----

    pub fn handle_timeout(&mut self, now: Duration) {
        let _ = self.handle(Input::Timeout, now);
    }

    pub fn on_prefill_finished(
        &mut self,
        request_id: &str,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Duration,
    ) -> Result<KvTransferParams, CoreError> {
        params(self.handle(
            Input::PrefillFinished {
                request_id: request_id.into(),
                handoff,
                blocks,
                num_tokens,
            },
            now,
        )?)
    }

    pub fn on_push_prefill_start(
        &mut self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Duration,
    ) -> Result<HandoffId, CoreError> {
        match self.handle(
            Input::PushPrefillStart {
                params: params.clone(),
                blocks,
                num_tokens,
            },
            now,
        )? {
            Answer::Handoff(h) => Ok(h),
            other => panic!("answered {other:?}"),
        }
    }

    pub fn push_params(
        &mut self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Duration,
    ) -> Result<KvTransferParams, CoreError> {
        self::params(self.handle(
            Input::PushParams {
                params: params.clone(),
                request_id: request_id.into(),
                blocks,
                num_tokens,
            },
            now,
        )?)
    }

    pub fn on_pull_prefill_start(
        &mut self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        now: Duration,
    ) -> Result<Option<HandoffId>, CoreError> {
        match self.handle(
            Input::PullPrefillStart {
                params: params.clone(),
                blocks,
            },
            now,
        )? {
            Answer::MaybeHandoff(h) => Ok(h),
            other => panic!("answered {other:?}"),
        }
    }

    pub fn on_pull_prefill_finished(
        &mut self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Duration,
    ) -> Result<KvTransferParams, CoreError> {
        self::params(self.handle(
            Input::PullPrefillFinished {
                params: params.clone(),
                request_id: request_id.into(),
                blocks,
                num_tokens,
            },
            now,
        )?)
    }

    pub fn on_layer_saved(&mut self, handoff: HandoffId, layer: u32, now: Duration) {
        let _ = self.handle(Input::LayerSaved { handoff, layer }, now);
    }

    pub fn release_from_proxy(
        &mut self,
        params: &KvTransferParams,
        now: Duration,
    ) -> Result<Answer, CoreError> {
        self.handle(
            Input::ReleaseFromProxy {
                params: params.clone(),
            },
            now,
        )
    }

    pub fn reject(
        &mut self,
        params: &KvTransferParams,
        now: Duration,
    ) -> Result<Answer, CoreError> {
        self.handle(
            Input::Reject {
                params: params.clone(),
            },
            now,
        )
    }

    pub fn on_request_arrived(
        &mut self,
        request: u64,
        params: &KvTransferParams,
        prompt_tokens: u32,
        now: Duration,
    ) -> Result<(), CoreError> {
        self.handle(
            Input::RequestArrived {
                request,
                params: params.clone(),
                prompt_tokens,
            },
            now,
        )
        .map(drop)
    }

    pub fn on_blocks_allocated_after_cached(
        &mut self,
        request: u64,
        cached: Vec<u32>,
        blocks: Vec<u32>,
        now: Duration,
    ) -> Result<(), CoreError> {
        self.handle(
            Input::BlocksAllocated {
                request,
                cached,
                blocks,
            },
            now,
        )
        .map(drop)
    }

    pub fn on_request_ended(&mut self, request: u64, reason: ReleaseReason, now: Duration) {
        let _ = self.handle(Input::RequestEnded { request, reason }, now);
    }

    pub fn handle_accepted(
        &mut self,
        conn: ConnId,
        msg: Message,
        proven: Option<&str>,
        now: Duration,
    ) {
        let _ = self.handle(
            Input::Accepted {
                conn,
                msg,
                proven: proven.map(str::to_string),
            },
            now,
        );
    }

    pub fn handle_frame(&mut self, conn: ConnId, msg: Message, now: Duration) {
        let _ = self.handle(Input::Frame { conn, msg }, now);
    }

    pub fn handle_connected(
        &mut self,
        engine: &str,
        attempt: u64,
        conn: ConnId,
        reply: Message,
        now: Duration,
    ) {
        let _ = self.handle(
            Input::Connected {
                engine: engine.into(),
                attempt,
                conn,
                reply,
            },
            now,
        );
    }

    pub fn handle_connect_failed(
        &mut self,
        engine: &str,
        attempt: u64,
        error: String,
        now: Duration,
    ) {
        let _ = self.handle(
            Input::ConnectFailed {
                engine: engine.into(),
                attempt,
                error,
            },
            now,
        );
    }

    pub fn handle_closed(&mut self, conn: ConnId, now: Duration) {
        let _ = self.handle(Input::Closed { conn }, now);
    }

    pub fn handle_worker_report(&mut self, report: WorkerReport, now: Duration) {
        let _ = self.handle(Input::WorkerReport(report), now);
    }
}

fn params(a: Answer) -> Result<KvTransferParams, CoreError> {
    match a {
        Answer::Params(p) => Ok(p),
        other => panic!("answered {other:?}"),
    }
}
