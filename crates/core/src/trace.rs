//! Traces: a core's inputs, written down as they happen, and fed back.
//!
//! A trace is JSON lines. The first line of each file is a [`Header`] (the core's config and
//! its workers' hellos: all a core needs to be built again); then every [`Input`] the core was
//! given, with the time it was given and a hash of its answer, and a `Batch` line with each
//! [`Ready`] batch the executor took (all of it but the observations, which only feed
//! metrics).
//!
//! A [`Replay`] checks the recorded batches with a [`Checker`], which keeps rules 1–7 from this
//! one engine's view: that is what happened in production, whatever the code replaying it does.
//! It also builds the same core again and gives it the same inputs at the same times; the core
//! is deterministic, so it must answer and batch the same. The first answer or batch that
//! differs is where the replaying code departs from the recorded one: a fix, or a regression.
//!
//! Writing the file (bounded, rotating) is I/O and lives in the connector (`recorder`); this
//! module is the format and the replay.

mod check;
mod cluster;

use std::time::Duration;

use handoff_ledger::Time;
use serde::{Deserialize, Serialize};

pub use check::{Checker, Violation};
pub use cluster::Cluster;

use crate::{Answer, ConnectorCore, CoreConfig, CoreError, Input, Ready, WorkerHello};

/// The trace format's version: a reader refuses others. 2: P's inputs are the engine events
/// (`PrefillStarted`, `LayersSaved`, `PrefillEnded`), D's arrival answers what to do.
pub const TRACE_VERSION: u32 = 2;

/// The first line of each trace file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    /// [`TRACE_VERSION`].
    pub handoff_trace: u32,
    pub config: CoreConfig,
    pub ranks: Vec<WorkerHello>,
    /// 0 for the file the core's life starts in; each rotation adds one.
    pub segment: u64,
    /// The number of the first input in this file (inputs are numbered from 0 over the life of
    /// the core).
    pub first_input: u64,
}

/// One line of a trace.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Line {
    Header(Box<Header>),
    /// Input number `n`, given at `at_ns` (the executor's clock, nanoseconds since it started).
    Input {
        n: u64,
        at_ns: u64,
        input: Input,
        /// [`answer_hash`] of what the core answered.
        answer: u64,
    },
    /// The executor took `batch` after input `after`.
    Batch {
        after: u64,
        batch: Ready,
    },
}

impl Line {
    pub fn input(n: u64, at: Time, input: Input, answer: &Result<Answer, CoreError>) -> Line {
        Line::Input {
            n,
            at_ns: at.as_nanos() as u64,
            input,
            answer: answer_hash(answer),
        }
    }
}

/// A 64-bit FNV-1a hash of a value's `Debug` text: stable across runs and builds of the same
/// code, because every collection the core emits is ordered.
pub fn debug_hash(value: &impl std::fmt::Debug) -> u64 {
    use std::fmt::Write;
    struct Fnv(u64);
    impl Write for Fnv {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            for b in s.bytes() {
                self.0 ^= b as u64;
                self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
            }
            Ok(())
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    let _ = write!(h, "{value:?}");
    h.0
}

/// What a line records of an answer: a hash of its value, or of the error's text.
pub fn answer_hash(answer: &Result<Answer, CoreError>) -> u64 {
    match answer {
        Ok(a) => debug_hash(a),
        Err(e) => debug_hash(&e.to_string()),
    }
}

/// Where a replay departed from the recording.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// The input after which it showed.
    pub input: u64,
    pub what: String,
}

/// Why a trace cannot be replayed at all.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("line {line}: {error}")]
    Parse {
        line: usize,
        error: serde_json::Error,
    },
    #[error("the trace does not start with a header")]
    NoHeader,
    #[error("trace version {0}, this build reads {TRACE_VERSION}")]
    Version(u32),
    #[error(
        "the trace starts at segment {segment} (input {first_input}): the inputs before it were \
         rotated out, and a replay must start where the core started (raise the recorder's \
         size limit, or give every segment from the first, oldest first)"
    )]
    NotFromStart { segment: u64, first_input: u64 },
    #[error("segment {got} follows segment {expected_before}: give the segments in order")]
    SegmentOrder { got: u64, expected_before: u64 },
    #[error("the recorded core cannot be built again: {0}")]
    Core(#[from] CoreError),
}

/// What a replay found.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    pub inputs: u64,
    pub batches: u64,
    /// The first answer or batch that differs from the recording, if any.
    pub divergence: Option<Divergence>,
    /// Broken rules, in the order they were found (the first one names the input after which
    /// it broke).
    pub violations: Vec<Violation>,
    /// Inputs the replay added after the trace's end: every job still in flight reported
    /// failed, then every timer up to [`Replay::HORIZON`] later, as if every peer had gone
    /// silent. Rules 5–7 are checked after them (not after a divergence: 0 then).
    pub settled_inputs: u64,
}

/// Feeds a trace through a fresh core and checks it.
pub struct Replay {
    core: ConnectorCore,
    checker: Checker,
    last_input: u64,
    last_at: Time,
    inputs: u64,
    batches: u64,
    segment: u64,
    divergence: Option<Divergence>,
}

impl Replay {
    /// How far past the trace's last input the replay lets time run before the final checks:
    /// longer than any deadline of the default configs (P's hard cap is 120 s).
    pub const HORIZON: Duration = Duration::from_secs(600);

    pub fn new(header: Header) -> Result<Replay, ReplayError> {
        if header.handoff_trace != TRACE_VERSION {
            return Err(ReplayError::Version(header.handoff_trace));
        }
        if header.segment != 0 || header.first_input != 0 {
            return Err(ReplayError::NotFromStart {
                segment: header.segment,
                first_input: header.first_input,
            });
        }
        let checker = Checker::new(&header.config, &header.ranks);
        let core = ConnectorCore::new(header.config, header.ranks)?;
        Ok(Replay {
            core,
            checker,
            last_input: 0,
            last_at: Time::ZERO,
            inputs: 0,
            batches: 0,
            segment: 0,
            divergence: None,
        })
    }

    /// Replays a whole trace given as lines of text (every segment, oldest first).
    pub fn run<'a>(lines: impl IntoIterator<Item = &'a str>) -> Result<ReplayReport, ReplayError> {
        let mut replay: Option<Replay> = None;
        for (i, text) in lines.into_iter().enumerate() {
            if text.trim().is_empty() {
                continue;
            }
            let line: Line = serde_json::from_str(text)
                .map_err(|error| ReplayError::Parse { line: i + 1, error })?;
            match (&mut replay, line) {
                (None, Line::Header(h)) => replay = Some(Replay::new(*h)?),
                (None, _) => return Err(ReplayError::NoHeader),
                (Some(r), Line::Header(h)) => r.next_segment(&h)?,
                (Some(r), line) => r.feed(line),
            }
        }
        Ok(replay.ok_or(ReplayError::NoHeader)?.finish())
    }

    fn next_segment(&mut self, h: &Header) -> Result<(), ReplayError> {
        if h.segment != self.segment + 1 {
            return Err(ReplayError::SegmentOrder {
                got: h.segment,
                expected_before: self.segment + 1,
            });
        }
        self.segment = h.segment;
        Ok(())
    }

    /// Feeds one recorded input or batch.
    pub fn feed(&mut self, line: Line) {
        match line {
            Line::Header(_) => {}
            Line::Input {
                n,
                at_ns,
                input,
                answer,
            } => {
                let at = Duration::from_nanos(at_ns);
                self.last_input = n;
                self.last_at = self.last_at.max(at);
                self.inputs += 1;
                let got = self.give(n, input, at);
                if answer_hash(&got) != answer {
                    self.diverged(n, format!("the answer differs: now {got:?}"));
                }
            }
            Line::Batch { after, batch } => {
                let mut ready = self.core.ready();
                ready.observations.clear();
                self.batches += 1;
                if ready != batch {
                    self.diverged(
                        after,
                        format!("the batch differs: recorded {batch:?}, now {ready:?}"),
                    );
                }
                self.checker.on_batch(after, self.last_at, &batch);
                self.core.advance(ready);
            }
        }
    }

    fn give(&mut self, n: u64, input: Input, at: Time) -> Result<Answer, CoreError> {
        let seen = input.clone();
        let got = self.core.handle(input, at);
        self.checker.on_input(n, at, &seen, &got);
        self.checker.on_memory(&self.core.memory());
        got
    }

    fn diverged(&mut self, input: u64, what: String) {
        if self.divergence.is_none() {
            let what: String = what.chars().take(2000).collect();
            self.divergence = Some(Divergence { input, what });
        }
    }

    /// Lets the core run past the trace's end with silent peers, then checks rules 5–7. Not
    /// when the replay diverged: the replayed core's state is then not the recorded one.
    pub fn finish(mut self) -> ReplayReport {
        let settled_inputs = if self.divergence.is_none() {
            self.settle()
        } else {
            0
        };
        ReplayReport {
            inputs: self.inputs,
            batches: self.batches,
            divergence: self.divergence,
            violations: self.checker.into_violations(),
            settled_inputs,
        }
    }

    /// Runs the core past the trace's end and checks rules 5–7; returns the inputs it added.
    fn settle(&mut self) -> u64 {
        let mut n = self.last_input + 1;
        let first_settled = n;
        // Whatever the recording left un-taken is the executor's next batch.
        self.drain(n - 1);
        // Workers eventually report every job in flight as ended (an abort is reported too).
        for (rank, jobs) in self.checker.jobs_in_flight() {
            let report = crate::WorkerReport {
                rank,
                ended: jobs.into_iter().map(|j| (j, false)).collect(),
                ..Default::default()
            };
            let at = self.last_at;
            let _ = self.give(n, Input::WorkerReport(report), at);
            self.drain(n);
            n += 1;
        }
        let end = self.last_at + Self::HORIZON;
        while let Some(t) = self.core.poll_timeout().filter(|t| *t <= end) {
            let at = t.max(self.last_at);
            self.last_at = at;
            let _ = self.give(n, Input::Timeout, at);
            self.drain(n);
            n += 1;
        }
        let memory = self.core.memory();
        self.checker.at_end(n.saturating_sub(1), &memory);
        n - first_settled
    }

    fn drain(&mut self, after: u64) {
        while self.core.has_ready() {
            let ready: Ready = self.core.ready();
            self.checker.on_batch(after, self.last_at, &ready);
            self.core.advance(ready);
        }
    }
}
