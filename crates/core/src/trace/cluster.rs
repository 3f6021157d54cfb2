//! [`Cluster`]: rules 1–7 across engines that share one clock, as a simulation's do.
//!
//! Each engine keeps its own [`Checker`] (what its inputs and outputs decide alone); the cluster
//! adds what only both ends of a transfer see together:
//!
//! - **2, 3** a job touches, on each side, only blocks that side holds for one handoff (P) and
//!   one request (D); P releases no block a job of any engine may still read, D none a job may
//!   still write; the target's transport has granted every byte touched to the poster's agent;
//!   a READ starts only while the lease P last gave for the handoff has more than D's read
//!   margin left; and no job touches a layer the prefill has not saved yet.
//! - **4** a job moves a handoff's blocks into the request that handoff is for, and D decodes a
//!   request only from blocks a transfer of that request filled.
//!
//! The simulation feeds it live, in the order the cores act, so the checks are exact; a
//! recorded trace has one engine's clock and goes through its [`Checker`] alone
//! ([`super::Replay`]). Block lookups walk every block of a pool: fine for a simulation's.

use std::collections::{BTreeMap, BTreeSet};

use handoff_ledger::Time;
use handoff_plan::{block_spans, layer_block_spans, RankLayout, Span};
use handoff_proto::xfer::{GrantId, XferOp};
use handoff_proto::{HandoffId, Message};

use super::{Checker, Violation};
use crate::{
    Answer, ConnectorEvent, CoreError, CoreMemory, Input, JobId, LayerReports, Ready, Role,
    TransferJob, WorkerHello, WorkerOp,
};

/// Follows every engine of a cluster and records the rules they break, alone or together.
#[derive(Default)]
pub struct Cluster {
    members: Vec<Member>,
}

struct Member {
    checker: Checker,
    alive: bool,
    /// Each rank's transport agent.
    agents: Vec<String>,
    /// Per rank, per block: its bytes.
    spans: Vec<Vec<Vec<Span>>>,
    /// Jobs this engine posted that have not been reported ended.
    jobs: BTreeMap<JobId, Job>,
    /// What this engine's transports let peers do: grant → (op, agents, blocks).
    grants: BTreeMap<GrantId, (XferOp, Vec<String>, BTreeSet<u32>)>,
    /// D: each block a transfer filled, and for which request.
    landed: BTreeMap<u32, u64>,
    /// P: the end of the lease it last gave each handoff, on the shared clock.
    leases: BTreeMap<HandoffId, Time>,
}

/// A job between two engines: P's blocks it reads, D's it writes.
struct Job {
    p: usize,
    d: usize,
    src: BTreeSet<u32>,
    dst: BTreeSet<u32>,
}

impl Cluster {
    pub fn new() -> Cluster {
        Cluster::default()
    }

    /// Adds an engine, checked by `checker` (built from its config and these ranks); returns
    /// its index for the other calls.
    pub fn add(&mut self, checker: Checker, ranks: &[WorkerHello]) -> usize {
        let spans = ranks.iter().map(|r| spans_of_pool(&r.layout)).collect();
        self.members.push(Member {
            checker,
            alive: true,
            agents: ranks.iter().map(|r| r.agent.clone()).collect(),
            spans,
            jobs: BTreeMap::new(),
            grants: BTreeMap::new(),
            landed: BTreeMap::new(),
            leases: BTreeMap::new(),
        });
        self.members.len() - 1
    }

    /// What engine `e` was given with its input `n` at `at`, and what its core answered.
    pub fn on_input(
        &mut self,
        e: usize,
        n: u64,
        at: Time,
        input: &Input,
        answer: &Result<Answer, CoreError>,
        memory: &CoreMemory,
    ) {
        self.members[e].checker.on_input(n, at, input, answer);
        self.members[e].checker.on_memory(memory);
        match (input, answer) {
            (Input::PrefillStarted { .. }, Ok(Answer::Holding(Some(h)))) => {
                let lease = self.members[e].checker.config.producer.initial_lease;
                self.lease(e, *h, at + lease);
            }
            (
                Input::PrefillEnded { .. },
                Ok(Answer::Ended {
                    params: Some(params),
                    holding: Some(h),
                }),
            ) => {
                if let Some(ms) = params.lease_ms {
                    self.lease(e, *h, at + Time::from_millis(u64::from(ms)));
                }
            }
            (Input::BlocksAllocated { blocks, .. }, Ok(_)) => {
                for b in blocks {
                    self.members[e].landed.remove(b);
                }
            }
            (Input::WorkerReport(report), _) => {
                for (job, ok) in &report.ended {
                    let Some(j) = self.members[e].jobs.remove(job) else {
                        continue;
                    };
                    let d = &mut self.members[j.d];
                    if *ok && d.alive {
                        for b in &j.dst {
                            if let Some(&r) = d.checker.d_held.get(b) {
                                d.landed.insert(*b, r);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn lease(&mut self, p: usize, handoff: HandoffId, until: Time) {
        let end = self.members[p].leases.entry(handoff).or_insert(until);
        *end = (*end).max(until);
    }

    /// A batch engine `e`'s executor carried out after input `after`, at `at`.
    pub fn on_batch(&mut self, e: usize, after: u64, at: Time, ready: &Ready) {
        // The checker learns the input number and time first, so what the cluster finds is
        // dated like what the checker finds.
        self.members[e].checker.note_batch(after, at);
        for (_, op) in &ready.worker_ops {
            match op {
                WorkerOp::Grant {
                    grant,
                    op,
                    agents,
                    blocks,
                    ..
                } => {
                    let blocks = blocks.iter().copied().collect();
                    self.members[e]
                        .grants
                        .insert(*grant, (*op, agents.clone(), blocks));
                }
                WorkerOp::Revoke { grant } => {
                    self.members[e].grants.remove(grant);
                }
                _ => {}
            }
        }
        for (_, msg) in &ready.messages {
            if let Message::GrantBatch(batch) = msg {
                for g in &batch.grants {
                    let until = at + Time::from_millis(u64::from(g.lease_ms));
                    self.lease(e, g.handoff, until);
                }
            }
        }
        for (rank, job) in &ready.transfers_to_post {
            self.posted(e, *rank, at, job);
        }
        for ev in &ready.events {
            match ev {
                ConnectorEvent::BlocksReleased {
                    handoff, blocks, ..
                } => self.released(e, *handoff, blocks),
                ConnectorEvent::Ready { requests, blocks } => {
                    let m = &mut self.members[e];
                    for b in blocks {
                        let filled = m.landed.get(b).copied();
                        if !filled.is_some_and(|r| requests.contains(&r)) {
                            m.checker.broke(
                                4,
                                format!(
                                    "requests {requests:?} decode from block {b}, which no transfer of theirs filled"
                                ),
                            );
                        }
                    }
                }
                _ => {}
            }
        }
        self.members[e].checker.on_batch(after, at, ready);
    }

    /// Engine `e` died: its memory, jobs and grants are gone.
    pub fn on_death(&mut self, e: usize) {
        let m = &mut self.members[e];
        m.alive = false;
        m.jobs.clear();
        m.grants.clear();
    }

    /// The final checks of every engine still alive, once every job ended and every timer ran.
    pub fn at_end(&mut self, e: usize, last_input: u64, memory: &CoreMemory) {
        if self.members[e].alive {
            self.members[e].checker.at_end(last_input, memory);
        }
    }

    /// Every broken rule, with the index of the engine that saw it.
    pub fn into_violations(self) -> Vec<(usize, Violation)> {
        self.members
            .into_iter()
            .enumerate()
            .flat_map(|(e, m)| m.checker.into_violations().into_iter().map(move |v| (e, v)))
            .collect()
    }

    fn find_agent(&self, agent: &str) -> Option<(usize, usize)> {
        self.members.iter().enumerate().find_map(|(i, m)| {
            let rank = m.agents.iter().position(|a| a == agent)?;
            Some((i, rank))
        })
    }

    /// Engine `e`'s rank `rank` posts `job` at `at`.
    fn posted(&mut self, e: usize, rank: u16, at: Time, job: &TransferJob) {
        let rank = usize::from(rank);
        let rule = if job.op == XferOp::Read { 2 } else { 3 };
        let mut local = BTreeSet::new();
        let mut remote = BTreeSet::new();
        let mut peer = None;
        for part in &job.parts {
            let Some((f, frank)) = self.find_agent(&part.agent) else {
                self.members[e]
                    .checker
                    .broke(rule, format!("posts a job to unknown agent {}", part.agent));
                return;
            };
            let (me, them) = (&self.members[e], &self.members[f]);
            for d in &part.descs {
                let Some(mine) = me.spans.get(rank) else {
                    continue;
                };
                local.extend(blocks_under(mine, d.local_region, d.local_offset, d.len));
                remote.extend(blocks_under(
                    &them.spans[frank],
                    d.remote_region,
                    d.remote_offset,
                    d.len,
                ));
            }
            peer = Some((f, frank));
        }
        let Some((f, frank)) = peer else { return };
        let role = |i: usize| self.members[i].checker.config.role;
        let (p, d, src, dst, p_rank) = match (job.op, role(e), role(f)) {
            (XferOp::Read, Role::Decode, Role::Prefill) => (f, e, remote.clone(), local, frank),
            (XferOp::Write, Role::Prefill, Role::Decode) => (e, f, local, remote.clone(), rank),
            (op, mine, theirs) => {
                self.members[e].checker.broke(
                    rule,
                    format!("posts a {op:?} as {mine:?} to a {theirs:?} engine"),
                );
                return;
            }
        };
        let (p_alive, d_alive) = (self.members[p].alive, self.members[d].alive);
        // Whose blocks the job touches, on each side.
        let handoffs: BTreeSet<HandoffId> = self.members[p]
            .checker
            .p_held
            .iter()
            .filter(|(_, held)| src.iter().any(|b| held.contains(b)))
            .map(|(h, _)| *h)
            .collect();
        let handoff = handoffs.iter().next().copied().filter(|h| {
            handoffs.len() == 1
                && src
                    .iter()
                    .all(|b| self.members[p].checker.p_held[h].contains(b))
        });
        let requests: BTreeSet<u64> = dst
            .iter()
            .filter_map(|b| self.members[d].checker.d_held.get(b).copied())
            .collect();
        let request = requests.iter().next().copied().filter(|_| {
            requests.len() == 1
                && dst
                    .iter()
                    .all(|b| self.members[d].checker.d_held.contains_key(b))
        });
        if p_alive && handoff.is_none() {
            self.members[e].checker.broke(
                2,
                format!(
                    "posts a {:?} of P blocks {src:?} that P does not hold for one handoff",
                    job.op
                ),
            );
        }
        if d_alive && request.is_none() {
            self.members[e].checker.broke(
                3,
                format!(
                    "posts a {:?} into D blocks {dst:?} that D does not hold for one request",
                    job.op
                ),
            );
        }
        if let (Some(h), Some(r)) = (handoff, request) {
            let of = self.members[d]
                .checker
                .requests
                .get(&r)
                .and_then(|q| q.handoff);
            if of != Some(h) {
                self.members[e].checker.broke(
                    4,
                    format!(
                        "a {:?} moves handoff {h}'s blocks into request {r}'s",
                        job.op
                    ),
                );
            }
        }
        if let (true, Some(h)) = (p_alive, handoff) {
            self.check_layers(e, p, p_rank, h, job);
            if job.op == XferOp::Read {
                let margin = self.members[d].checker.config.consumer.read_margin;
                match self.members[p].leases.get(&h).copied() {
                    Some(end) if end > at + margin => {}
                    end => self.members[e].checker.broke(
                        2,
                        format!(
                            "starts a READ of handoff {h} on a lease P holds until {end:?}: less than the read margin {margin:?} left"
                        ),
                    ),
                }
            }
        }
        // The target's transport serves only what it granted to the poster's agent.
        let poster = self.members[e]
            .agents
            .get(rank)
            .cloned()
            .unwrap_or_default();
        let target = &self.members[f];
        let granted = remote.iter().all(|b| {
            target.grants.values().any(|(op, agents, blocks)| {
                *op == job.op && agents.contains(&poster) && blocks.contains(b)
            })
        });
        if target.alive && !granted {
            self.members[e].checker.broke(
                rule,
                format!(
                    "posts a {:?} of blocks {remote:?} outside any grant to {poster}",
                    job.op
                ),
            );
        }
        self.members[e].jobs.insert(job.job, Job { p, d, src, dst });
    }

    /// A job of a handoff whose prefill still runs touches only the layers already saved (when
    /// the engine reports layers as it saves them).
    fn check_layers(&mut self, e: usize, p: usize, p_rank: usize, h: HandoffId, job: &TransferJob) {
        let pm = &self.members[p];
        if !pm.checker.p_filling.contains(&h)
            || pm.checker.config.layer_reports != LayerReports::Saved
        {
            return;
        }
        let saved = pm.checker.p_saved.get(&h).copied().unwrap_or(0);
        let Some(layout) = pm.checker.layouts.get(p_rank) else {
            return;
        };
        let blocks: Vec<u32> = pm.checker.p_held[&h].iter().copied().collect();
        let p_side: Vec<(u32, u64, u64)> = job
            .parts
            .iter()
            .flat_map(|part| &part.descs)
            .map(|d| match job.op {
                XferOp::Read => (d.remote_region, d.remote_offset, d.len),
                XferOp::Write => (d.local_region, d.local_offset, d.len),
            })
            .collect();
        let unsaved = (saved..layout.spec.shape.num_layers).find(|&layer| {
            let Ok(spans) = layer_block_spans(layout, layer, &blocks) else {
                return false;
            };
            p_side
                .iter()
                .any(|&(region, off, len)| spans.iter().any(|s| overlaps(s, region, off, len)))
        });
        if let Some(layer) = unsaved {
            self.members[e].checker.broke(
                2,
                format!(
                    "a {:?} touches layer {layer} of handoff {h} with {saved} layers saved",
                    job.op
                ),
            );
        }
    }

    /// Engine `e` gave `blocks` back: no job of any live engine may still touch them on its
    /// side (P: a job's source, D: its destination). But P's own WRITE to a dead D: only that
    /// transfer's bytes can spoil, in a D that is gone.
    fn released(&mut self, e: usize, handoff: HandoffId, blocks: &[u32]) {
        let as_p = self.members[e].checker.config.role == Role::Prefill;
        let mut hits = Vec::new();
        for (i, m) in self.members.iter().enumerate() {
            if !m.alive {
                continue;
            }
            for (id, j) in &m.jobs {
                if as_p && i == e && !self.members[j.d].alive {
                    continue;
                }
                let side = match (as_p, j.p == e, j.d == e) {
                    (true, true, _) => &j.src,
                    (false, _, true) => &j.dst,
                    _ => continue,
                };
                if let Some(b) = blocks.iter().find(|b| side.contains(b)) {
                    hits.push((*b, i, id.0));
                }
            }
        }
        let rule = if as_p { 2 } else { 3 };
        for (b, i, job) in hits {
            self.members[e].checker.broke(
                rule,
                format!("releases block {b} of handoff {handoff} while engine {i}'s job {job} touches it"),
            );
        }
    }
}

/// Every block's spans of one rank's pool.
fn spans_of_pool(layout: &RankLayout) -> Vec<Vec<Span>> {
    (0..layout.num_blocks)
        .map(|b| block_spans(layout, &[b]).unwrap_or_default())
        .collect()
}

fn overlaps(s: &Span, region: u32, off: u64, len: u64) -> bool {
    s.region == region && off < s.offset + s.len && s.offset < off + len
}

/// The blocks whose bytes `(region, off, len)` overlaps.
fn blocks_under(
    spans: &[Vec<Span>],
    region: u32,
    off: u64,
    len: u64,
) -> impl Iterator<Item = u32> + '_ {
    (0u32..)
        .zip(spans)
        .filter(move |(_, s)| s.iter().any(|s| overlaps(s, region, off, len)))
        .map(|(b, _)| b)
}
