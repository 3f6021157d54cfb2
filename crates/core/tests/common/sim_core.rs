//! The simulation's handle on one core: every call is an [`Input`] given to
//! [`ConnectorCore::handle`] (the entry point the executor uses), the engine's hooks through the
//! same typed [`Hooks`] the executor's `Connector` has, and every input and batch is written
//! down as a trace, so a schedule can be replayed with `handoff_core::trace`, and shown to the
//! cluster's [`Cluster`] checker as it happens.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use handoff_core::trace::{Checker, Cluster, Header, Line, TRACE_VERSION};
use handoff_core::{
    Answer, ConnectorCore, CoreConfig, CoreError, CoreMemory, Hooks, Input, Ready, WorkerHello,
};

pub struct SimCore {
    core: ConnectorCore,
    /// The trace so far: a header, then inputs and batches, as JSON lines.
    pub trace: Vec<String>,
    inputs: u64,
    /// The rules checker of the whole simulation, and this engine's index in it.
    cluster: Rc<RefCell<Cluster>>,
    member: usize,
}

fn line(l: &Line) -> String {
    serde_json::to_string(l).expect("a trace line encodes")
}

impl SimCore {
    /// A core checked by `cluster`, which learns of it here (its outcomes within the wait
    /// deadline and a timer tick: the simulated clock never stalls).
    pub fn new(
        config: CoreConfig,
        ranks: Vec<WorkerHello>,
        cluster: Rc<RefCell<Cluster>>,
    ) -> SimCore {
        let checker = Checker::new(&config, &ranks).with_deadlines(Duration::from_millis(100));
        let member = cluster.borrow_mut().add(checker, &ranks);
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
            cluster,
            member,
        }
    }

    /// The core itself, to re-insert a fixed bug before a run.
    pub fn core_mut(&mut self) -> &mut ConnectorCore {
        &mut self.core
    }

    pub fn handle(&mut self, input: Input, now: Duration) -> Result<Answer, CoreError> {
        let answer = self.core.handle(input.clone(), now);
        self.cluster.borrow_mut().on_input(
            self.member,
            self.inputs,
            now,
            &input,
            &answer,
            &self.core.memory(),
        );
        self.trace
            .push(line(&Line::input(self.inputs, now, input, &answer)));
        self.inputs += 1;
        answer
    }

    /// An input whose answer says nothing (a frame, a report, a timeout).
    pub fn input(&mut self, input: Input, now: Duration) {
        let _ = self.handle(input, now);
    }

    /// The next batch, taken at `now`.
    pub fn ready(&mut self, now: Duration) -> Ready {
        let r = self.core.ready();
        let after = self.inputs.saturating_sub(1);
        if !r.is_empty() {
            self.cluster
                .borrow_mut()
                .on_batch(self.member, after, now, &r);
            self.trace.push(line(&Line::Batch {
                after,
                batch: r.clone(),
            }));
        }
        r
    }

    /// The engine died: the checker forgets its memory.
    pub fn died(&mut self) {
        self.cluster.borrow_mut().on_death(self.member);
    }

    /// The final checks, once every job ended and every timer ran.
    pub fn at_end(&mut self) {
        let memory = self.core.memory();
        self.cluster
            .borrow_mut()
            .at_end(self.member, self.inputs.saturating_sub(1), &memory);
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
