//! The simulation's handle on one core: every call is an [`Input`] given to
//! [`ConnectorCore::handle`] (the entry point the executor uses), the engine's hooks through the
//! same typed [`Hooks`] the executor's `Connector` has, and every input and batch is written
//! down as a trace, so a schedule can be replayed with `handoff_core::trace`.

use std::cell::RefCell;
use std::time::Duration;

use handoff_core::trace::{Header, Line, TRACE_VERSION};
use handoff_core::{
    Answer, ConnectorCore, CoreConfig, CoreError, CoreMemory, Hooks, Input, Ready, WorkerHello,
};

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

    /// An input whose answer says nothing (a frame, a report, a timeout).
    pub fn input(&mut self, input: Input, now: Duration) {
        let _ = self.handle(input, now);
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

    /// The typed hooks ([`Hooks`]) on this core at `now`.
    pub fn at(&mut self, now: Duration) -> At<'_> {
        At {
            core: RefCell::new(self),
            now,
        }
    }
}

/// A [`SimCore`] at one moment: the engine's typed hooks, each an input the trace records.
pub struct At<'a> {
    core: RefCell<&'a mut SimCore>,
    now: Duration,
}

impl Hooks for At<'_> {
    type Error = CoreError;

    fn give(&self, input: Input) -> Result<Answer, CoreError> {
        self.core.borrow_mut().handle(input, self.now)
    }
}
