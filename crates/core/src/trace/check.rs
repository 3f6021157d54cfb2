//! [`Checker`]: rules 1–7 as one engine can see them, from its core's inputs and outputs alone.
//!
//! The simulation (`crates/core/tests/common`) checks the rules across engines against pools it
//! owns. A trace has one engine, so the checker keeps the part of each rule that engine's
//! inputs and outputs decide:
//!
//! - **1** every block the engine gave the core comes back exactly once: P's through the
//!   `BlocksReleased` of the handoff it was given to; D's through one `BlocksReleased` or the
//!   `Ready` of the request it was allocated to; never a block of D's prefix cache.
//! - **2, 3** no block leaves the core while one of this engine's own READs may still land in
//!   it (the engine would give it to another request under the copy), and D never tells P to
//!   release a handoff while its READ of it is in flight (P would reuse the blocks under it).
//!   A push WRITE only reads its local blocks: when P lets them go under one (its D died),
//!   only that transfer's bytes can spoil, and D decodes a push only after P's `PushDone`,
//!   which P sends once the write ended.
//! - **4** no request is decoded from a block a job may still write.
//! - **2** (P's prefill) no handoff's blocks leave the core while the engine's forward pass
//!   still writes them: a layer-wise pull's until the engine said the prefill ended, a push's
//!   until its last layer is saved.
//! - **6** (with [`Checker::with_deadlines`]) every outcome within the request's wait deadline
//!   and a timer's slack of its arrival: a simulation's clock is exact, a recording's may stall.
//! - **7** the ledgers' staged messages and tombstones never over their caps.
//! - **5, 6, 7** after the trace's end, every job reported ended and every timer run with all
//!   peers silent ([`super::Replay::finish`]): P holds no handoff (but those of a layer-wise
//!   prefill the engine never said ended: it still writes their blocks), D holds no block,
//!   every request has exactly one outcome, no read, push or job is left.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use handoff_ledger::Time;
use handoff_plan::RankLayout;
use handoff_proto::xfer::XferOp;
use handoff_proto::{HandoffId, Message};
use serde::Serialize;

use crate::{
    Answer, ConnectorEvent, CoreConfig, CoreError, CoreMemory, Input, JobId, Ready, Role,
    WorkerHello,
};

/// A broken rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub rule: u8,
    /// The input after which it showed.
    pub input: u64,
    /// The trace's time then, in milliseconds.
    pub at_ms: u64,
    pub what: String,
}

/// A local byte range a job touches: (rank, region, offset, len).
type Extent = (u16, u32, u64, u64);

#[derive(Debug, Default)]
pub(super) struct Request {
    pub(super) handoff: Option<HandoffId>,
    arrived: Option<Time>,
    ended: bool,
    outcomes: u8,
}

/// Follows one core's inputs and batches and records every rule they break.
pub struct Checker {
    pub(super) config: CoreConfig,
    pub(super) layouts: Vec<RankLayout>,
    /// With [`Checker::with_deadlines`]: the slack a request's outcome may take past its wait
    /// deadline.
    deadline_slack: Option<Duration>,
    /// P: the blocks of each live handoff.
    pub(super) p_held: BTreeMap<HandoffId, BTreeSet<u32>>,
    /// P: each prefill for a remote decode between its start and its end: its blocks.
    p_prefills: BTreeMap<String, Vec<u32>>,
    /// P: the handoff of each prefill the core holds one for.
    p_prefill_handoff: BTreeMap<String, HandoffId>,
    /// P: layers `0..n` of each filling handoff are saved.
    pub(super) p_saved: BTreeMap<HandoffId, u32>,
    /// P: handoffs whose prefill started and was not said to end (a layer-wise pull, a push:
    /// the engine still writes their blocks, so the core rightly keeps them).
    pub(super) p_filling: BTreeSet<HandoffId>,
    /// The pushes among them (the core keeps their state too).
    p_pushing: BTreeSet<HandoffId>,
    /// D: blocks allocated to a request and not yet back.
    pub(super) d_held: BTreeMap<u32, u64>,
    /// D: blocks the engine named as its prefix cache.
    d_cached: BTreeSet<u32>,
    pub(super) requests: BTreeMap<u64, Request>,
    jobs: BTreeMap<JobId, (u16, Vec<Extent>)>,
    violations: Vec<Violation>,
    input: u64,
    at: Time,
}

impl Checker {
    pub fn new(config: &CoreConfig, ranks: &[WorkerHello]) -> Checker {
        Checker {
            config: config.clone(),
            layouts: ranks.iter().map(|r| r.layout.clone()).collect(),
            deadline_slack: None,
            p_held: BTreeMap::new(),
            p_prefills: BTreeMap::new(),
            p_prefill_handoff: BTreeMap::new(),
            p_saved: BTreeMap::new(),
            p_filling: BTreeSet::new(),
            p_pushing: BTreeSet::new(),
            d_held: BTreeMap::new(),
            d_cached: BTreeSet::new(),
            requests: BTreeMap::new(),
            jobs: BTreeMap::new(),
            violations: Vec::new(),
            input: 0,
            at: Time::ZERO,
        }
    }

    /// Also checks that every request ends within its wait deadline plus `slack` (rule 6): for
    /// a clock that does not stall, as a simulation's.
    pub fn with_deadlines(mut self, slack: Duration) -> Checker {
        self.deadline_slack = Some(slack);
        self
    }

    pub fn into_violations(self) -> Vec<Violation> {
        self.violations
    }

    /// Jobs posted and not reported ended, per rank.
    pub fn jobs_in_flight(&self) -> BTreeMap<u16, Vec<JobId>> {
        let mut out: BTreeMap<u16, Vec<JobId>> = BTreeMap::new();
        for (job, (rank, _)) in &self.jobs {
            out.entry(*rank).or_default().push(*job);
        }
        out
    }

    pub(super) fn broke(&mut self, rule: u8, what: String) {
        self.violations.push(Violation {
            rule,
            input: self.input,
            at_ms: self.at.as_millis() as u64,
            what,
        });
    }

    /// What the engine gave the core with input `n` at `at`, and what the core answered.
    pub fn on_input(
        &mut self,
        n: u64,
        at: Time,
        input: &Input,
        answer: &Result<Answer, CoreError>,
    ) {
        self.input = n;
        self.at = self.at.max(at);
        // Refused or not, an ended prefill is forgotten.
        let ended = match input {
            Input::PrefillEnded { request_id, .. } => {
                self.p_prefill_handoff.remove(request_id);
                self.p_prefills.remove(request_id)
            }
            _ => None,
        };
        if let Input::LayersSaved {
            request_id,
            through,
        } = input
        {
            if let Some(h) = self.p_prefill_handoff.get(request_id) {
                let saved = self.p_saved.entry(*h).or_default();
                *saved = (*saved).max(*through);
            }
        }
        let Ok(answer) = answer else {
            // Refused: the core took nothing.
            return;
        };
        match (input, answer) {
            (
                Input::PrefillStarted {
                    request_id,
                    params,
                    blocks,
                    ..
                },
                Answer::Holding(holding),
            ) => {
                self.p_prefills.insert(request_id.clone(), blocks.clone());
                if let Some(h) = holding {
                    self.p_prefill_handoff.insert(request_id.clone(), *h);
                    self.p_saved.insert(*h, 0);
                    // Its blocks are written until its prefill ends: the core rightly keeps
                    // them (and a push's state) until the engine says so.
                    self.p_filling.insert(*h);
                    if !params.is_layerwise_pull() {
                        self.p_pushing.insert(*h);
                    }
                    self.give_p(*h, blocks);
                }
            }
            (
                Input::PrefillEnded { .. },
                Answer::Ended {
                    holding: Some(h), ..
                },
            ) => {
                self.p_filling.remove(h);
                self.p_pushing.remove(h);
                self.p_saved.remove(h);
                self.give_p(*h, &ended.unwrap_or_default());
            }
            _ => {}
        }
        match input {
            Input::RequestArrived {
                request, params, ..
            } => {
                let r = self.requests.entry(*request).or_default();
                r.handoff = params.handoff_id;
                r.arrived = Some(at);
            }
            Input::BlocksAllocated {
                request,
                cached,
                blocks,
            } => {
                self.d_cached.extend(cached.iter().copied());
                for &b in blocks {
                    self.d_held.insert(b, *request);
                }
            }
            Input::RequestEnded { request, .. } => {
                self.requests.entry(*request).or_default().ended = true;
            }
            Input::WorkerReport(report) => {
                for (job, _) in &report.ended {
                    self.jobs.remove(job);
                }
            }
            _ => {}
        }
    }

    fn give_p(&mut self, handoff: HandoffId, blocks: &[u32]) {
        self.p_held
            .entry(handoff)
            .or_default()
            .extend(blocks.iter().copied());
    }

    /// Dates what is found next: the batch after input `after`, at `at`.
    pub(super) fn note_batch(&mut self, after: u64, at: Time) {
        self.input = after;
        self.at = at;
    }

    /// A batch the executor carried out after input `after`, at `at`.
    pub fn on_batch(&mut self, after: u64, at: Time, ready: &Ready) {
        self.note_batch(after, at);
        for (rank, job) in &ready.transfers_to_post {
            // Only a READ writes local memory (see the module docs).
            let extents = if job.op == XferOp::Read {
                job.parts
                    .iter()
                    .flat_map(|p| &p.descs)
                    .map(|d| (*rank, d.local_region, d.local_offset, d.len))
                    .collect()
            } else {
                Vec::new()
            };
            self.jobs.insert(job.job, (*rank, extents));
        }
        for (_, msg) in &ready.messages {
            if let Message::Release(r) = msg {
                if self.config.role != Role::Prefill {
                    self.release_told(r.handoff);
                }
            }
        }
        for ev in &ready.events {
            match ev {
                ConnectorEvent::BlocksReleased {
                    handoff, blocks, ..
                } => self.released(*handoff, blocks),
                ConnectorEvent::Ready { requests, blocks } => {
                    self.handed_over(requests, blocks);
                    self.outcome(requests, "ready");
                }
                ConnectorEvent::Recompute { requests, .. } => self.outcome(requests, "recompute"),
                ConnectorEvent::Failed { requests, .. } => self.outcome(requests, "failed"),
                ConnectorEvent::RemoteStarted { .. } => {}
            }
        }
    }

    /// D told P to release `handoff`: none of its READs may be in flight.
    fn release_told(&mut self, handoff: HandoffId) {
        let blocks: Vec<u32> = self
            .d_held
            .iter()
            .filter(|(_, r)| self.requests.get(r).and_then(|r| r.handoff) == Some(handoff))
            .map(|(b, _)| *b)
            .collect();
        if let Some((b, job)) = self.under_job(&blocks) {
            self.broke(
                2,
                format!(
                    "D tells P to release handoff {handoff} while its job {} still reads into block {b}: P may reuse the block under the READ",
                    job.0
                ),
            );
        }
    }

    fn released(&mut self, handoff: HandoffId, blocks: &[u32]) {
        let on_p = self.p_held.contains_key(&handoff);
        let rule = if on_p { 2 } else { 3 };
        if on_p && !blocks.is_empty() && self.still_written(handoff) {
            self.broke(
                2,
                format!(
                    "P releases blocks of handoff {handoff} while its prefill still writes them"
                ),
            );
        }
        if let Some((b, job)) = self.under_job(blocks) {
            self.broke(
                rule,
                format!(
                    "releases block {b} of handoff {handoff} while job {} may still touch it",
                    job.0
                ),
            );
        }
        if on_p {
            let held = self.p_held.get_mut(&handoff);
            let mut missing = Vec::new();
            if let Some(held) = held {
                for b in blocks {
                    if !held.remove(b) {
                        missing.push(*b);
                    }
                }
                if held.is_empty() {
                    self.p_held.remove(&handoff);
                }
            }
            if !missing.is_empty() {
                self.broke(
                    1,
                    format!("P releases blocks {missing:?} of handoff {handoff}, which it was not given for it (or released already)"),
                );
            }
            return;
        }
        for &b in blocks {
            if self.d_held.remove(&b).is_none() {
                let whose = if self.d_cached.contains(&b) {
                    "of the prefix cache, which no transfer owns"
                } else {
                    "that it does not hold (or released already)"
                };
                self.broke(1, format!("releases block {b} (handoff {handoff}) {whose}"));
            }
        }
    }

    fn handed_over(&mut self, requests: &[u64], blocks: &[u32]) {
        if let Some((b, job)) = self.under_job(blocks) {
            self.broke(
                4,
                format!(
                    "requests {requests:?} decode from block {b} while job {} may still write it",
                    job.0
                ),
            );
        }
        for &b in blocks {
            match self.d_held.remove(&b) {
                Some(r) if requests.contains(&r) => {}
                Some(r) => self.broke(
                    1,
                    format!("hands block {b} of request {r} to requests {requests:?}"),
                ),
                None => self.broke(
                    1,
                    format!("hands block {b} to requests {requests:?}, but it does not hold it"),
                ),
            }
        }
    }

    /// Whether the engine's forward pass may still write `handoff`'s blocks: a layer-wise
    /// pull's until its prefill ended, a push's until its last layer is saved.
    fn still_written(&self, handoff: HandoffId) -> bool {
        if !self.p_filling.contains(&handoff) {
            return false;
        }
        let layers = self.layouts.first().map_or(0, |l| l.spec.shape.num_layers);
        !self.p_pushing.contains(&handoff)
            || self.p_saved.get(&handoff).copied().unwrap_or(0) < layers
    }

    fn outcome(&mut self, requests: &[u64], what: &str) {
        let (now, deadline) = (self.at, self.config.consumer.wait_deadline);
        for r in requests {
            let req = self.requests.entry(*r).or_default();
            req.outcomes += 1;
            let late = match (req.arrived, self.deadline_slack) {
                (Some(arrived), Some(slack)) => now > arrived + deadline + slack,
                _ => false,
            };
            if req.outcomes > 1 {
                self.broke(6, format!("request {r} gets a second outcome ({what})"));
            }
            if late {
                self.broke(
                    6,
                    format!("request {r} ends ({what}) past its wait deadline {deadline:?}"),
                );
            }
        }
    }

    /// The core's memory after an input: staged messages and tombstones within their caps.
    pub fn on_memory(&mut self, memory: &CoreMemory) {
        let p = &self.config.producer;
        for (what, used, cap) in [
            (
                "staged messages",
                memory.producer.staged_messages,
                p.staging_capacity,
            ),
            (
                "tombstones",
                memory.producer.tombstones,
                p.tombstone_capacity,
            ),
        ] {
            if used > cap {
                self.broke(
                    7,
                    format!("P's ledger keeps {used} {what}, over its cap {cap}"),
                );
            }
        }
    }

    /// A block of `blocks` that an in-flight job's local bytes overlap, on any rank.
    fn under_job(&self, blocks: &[u32]) -> Option<(u32, JobId)> {
        if self.jobs.is_empty() || blocks.is_empty() {
            return None;
        }
        for (rank, layout) in self.layouts.iter().enumerate() {
            for &b in blocks {
                let Ok(spans) = handoff_plan::block_spans(layout, &[b]) else {
                    continue;
                };
                for (job, (jrank, extents)) in &self.jobs {
                    if *jrank as usize != rank {
                        continue;
                    }
                    let hit = extents.iter().any(|&(_, region, off, len)| {
                        spans.iter().any(|s| {
                            s.region == region && off < s.offset + s.len && s.offset < off + len
                        })
                    });
                    if hit {
                        return Some((b, *job));
                    }
                }
            }
        }
        None
    }

    /// The final checks, once every job ended and every timer ran.
    pub fn at_end(&mut self, last_input: u64, memory: &CoreMemory) {
        self.input = last_input;
        let stuck: Vec<&BTreeSet<u32>> = self
            .p_held
            .iter()
            .filter(|(h, _)| !self.p_filling.contains(h))
            .map(|(_, b)| b)
            .collect();
        if !stuck.is_empty() {
            let held: usize = stuck.iter().map(|b| b.len()).sum();
            let handoffs = stuck.len();
            self.broke(
                5,
                format!(
                    "P still holds {held} blocks of {handoffs} handoffs after every deadline passed"
                ),
            );
        }
        if !self.d_held.is_empty() {
            self.broke(
                1,
                format!(
                    "D still holds {} blocks after every deadline passed",
                    self.d_held.len()
                ),
            );
        }
        let open: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| !r.ended && r.outcomes == 0)
            .map(|(n, _)| *n)
            .collect();
        if !open.is_empty() {
            self.broke(
                6,
                format!("requests {open:?} never ended, after every deadline passed"),
            );
        }
        let pushes = memory.pushes.saturating_sub(self.p_pushing.len());
        if memory.reads + pushes + memory.jobs > 0 {
            self.broke(
                7,
                format!(
                    "the core keeps {} reads, {} pushes, {} jobs after every deadline passed",
                    memory.reads, pushes, memory.jobs
                ),
            );
        }
    }
}
