//! The worker side of a connector: one per rank. It owns the rank's registered KV memory and its
//! transport agent, posts and aborts what the scheduler side's [`WorkerStep`]s say, and reports
//! what ended, what arrived and who died in [`WorkerReport`]s. It holds no ledger and makes no
//! decision: every rule is the scheduler side's (the [`crate::ConnectorCore`]).
//!
//! A `WorkerSide` is a plain object; [`spawn`] runs one on a thread of its own (the reference
//! engine), and [`crate::remote`] runs one in another process (vLLM's worker processes).
//!
//! One file, over 800 lines with its tests (about 370 lines, which drive a real tcp transport):
//! a rank's job table, grants and tail zeroing are one state that each step changes.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_plan::{KvGroups, RankLayout};
use handoff_transport::device::MemoryKind;
use handoff_transport::{
    Extent, GrantId, KvRegion, RegionId, Transport, TransportError, XferId, XferOp, XferStatus,
};

use crate::digest::{rank_digest, DigestOf};
use crate::forward_gate::{Fence, ForwardGate, Released};
use crate::worker_protocol::{
    Digested, JobId, TransferJob, WorkerHello, WorkerOp, WorkerReport, WorkerStep,
};
use crate::ConnectorError;
use handoff_proto::{HandoffId, Message};

/// How often a worker polls its transport for progress, notifications and dead peers.
pub const POLL: Duration = Duration::from_millis(1);

/// One rank's KV memory and transport agent.
pub struct RankMemory {
    pub layout: RankLayout,
    pub regions: Vec<(RegionId, Arc<KvRegion>)>,
    pub transport: Arc<dyn Transport>,
}

struct Job {
    xfers: Vec<XferId>,
    /// Transfers released (failed, or the job aborted) that the backend has not stopped yet
    /// (see `Transport::still_running`): the job ends once none is left, so the ledgers never
    /// free its blocks under a transfer still landing (rules 2 and 3).
    stopping: Vec<XferId>,
    failed: bool,
    zero_tail: Option<(Vec<u32>, u32)>,
    digest: Option<(Vec<u32>, DigestOf)>,
}

pub struct WorkerSide {
    rank: u16,
    mem: RankMemory,
    /// The model's KV cache groups (one full group unless set).
    groups: KvGroups,
    jobs: HashMap<JobId, Job>,
    report: WorkerReport,
    /// The transport's refused-connection and refused-transfer totals at the last report.
    refused_seen: (u64, u64),
    /// Push writes planned before the forward pass that produces their KV.
    gate: ForwardGate,
    /// D, push: the tail to zero on each `PushDone` of a handoff (`WorkerOp::ZeroTailOnPushDone`),
    /// oldest first; at most `MAX_PUSH_TAILS` (the core forgets each when its push ends).
    push_tails: HashMap<HandoffId, (Vec<u32>, u32)>,
    push_tail_order: VecDeque<HandoffId>,
}

/// Push tails a worker remembers at once: far more than pushes in flight (each holds D blocks);
/// a bound all the same, should the core never say a push ended.
const MAX_PUSH_TAILS: usize = 1 << 16;

impl WorkerSide {
    /// Registers the rank's regions with its transport.
    pub fn new(mem: RankMemory) -> Result<Self, ConnectorError> {
        mem.layout.validate().map_err(ConnectorError::Layout)?;
        let rank = mem.layout.rank as u16;
        if let Some((_, first)) = mem.regions.first() {
            if let Some((id, r)) = mem
                .regions
                .iter()
                .find(|(_, r)| r.memory() != first.memory())
            {
                return Err(ConnectorError::MixedMemory {
                    rank,
                    region: *id,
                    memory: r.memory(),
                    first: first.memory(),
                });
            }
        }
        for (id, region) in &mem.regions {
            let expected = mem.layout.region_len(*id);
            if expected != Some(region.len() as u64) {
                return Err(ConnectorError::RegionSize {
                    rank,
                    region: *id,
                    len: region.len() as u64,
                    expected,
                });
            }
            mem.transport.register(*id, region.clone())?;
        }
        Ok(WorkerSide {
            rank,
            mem,
            groups: KvGroups::single(),
            jobs: HashMap::new(),
            refused_seen: (0, 0),
            push_tails: HashMap::new(),
            push_tail_order: VecDeque::new(),
            gate: ForwardGate::default(),
            report: WorkerReport {
                rank,
                ..Default::default()
            },
        })
    }

    pub fn rank(&self) -> u16 {
        self.rank
    }

    /// The model keeps its layers in these KV cache groups (a hybrid model under vLLM's hybrid
    /// KV cache manager): said in the hello, and the digest reads each layer from its group's
    /// blocks. Refused unless they cover the layout's layers.
    pub fn set_groups(&mut self, groups: KvGroups) -> Result<(), ConnectorError> {
        groups
            .validate(self.mem.layout.spec.shape.num_layers)
            .map_err(ConnectorError::Groups)?;
        self.groups = groups;
        Ok(())
    }

    /// What the scheduler side needs to know of this worker.
    pub fn hello(&self) -> Result<WorkerHello, ConnectorError> {
        Ok(WorkerHello {
            rank: self.rank,
            layout: self.mem.layout.clone(),
            agent: self.mem.transport.name().to_string(),
            metadata: self.mem.transport.local_metadata()?,
            memory: self.memory(),
            groups: self.groups.clone(),
        })
    }

    /// Where this rank's KV lives (every region alike, checked in [`WorkerSide::new`]).
    pub fn memory(&self) -> MemoryKind {
        self.mem
            .regions
            .first()
            .map_or(MemoryKind::Host, |(_, r)| r.memory())
    }

    /// Jobs posted and not yet reported ended.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Carries out a step. Anything a previous step held for its forward pass goes first: that
    /// forward has run by now.
    pub fn apply(&mut self, step: WorkerStep) {
        self.forward_done(Instant::now());
        self.apply_ops(step.ops);
    }

    /// Carries out a step whose forward pass has not run yet (see [`crate::forward_gate`]): the
    /// writes of the handoffs in `forward` wait for [`WorkerSide::layer_saved`], their digests
    /// for [`WorkerSide::forward_done`]; everything else goes now, in order.
    pub fn apply_before_forward(&mut self, step: WorkerStep, forward: &[HandoffId], now: Instant) {
        self.forward_done(now);
        let (ops, failed) = self.gate.admit(step.ops, forward, now);
        self.report
            .ended
            .extend(failed.into_iter().map(|j| (j, false)));
        self.apply_ops(ops);
    }

    /// Where renewed push grants land: an engine whose steps cannot reach the worker during
    /// its forward pass (vLLM) hands this to whatever carries [`WorkerOp::RenewWrites`] then.
    pub fn write_grants(&self) -> Arc<crate::forward_gate::WriteGrants> {
        self.gate.write_grants()
    }

    /// Whether a held write waits for `layer` (an engine whose kernels run asynchronously must
    /// make that layer's KV visible to the transport before calling [`Self::layer_saved`]).
    pub fn waits_for_layer(&self, layer: u32) -> bool {
        self.gate.waits_for(layer)
    }

    /// The forward pass saved `layer` (its KV is in the blocks): its held writes go.
    pub fn layer_saved(&mut self, layer: u32, now: Instant) {
        self.layer_saved_after(layer, None, now);
    }

    /// The forward saved `layer` on a device: its writes go once `fence` (an event recorded
    /// after the layer's kernels) says they ran; see [`WorkerSide::poll`].
    pub fn layer_saved_after(&mut self, layer: u32, fence: Option<Fence>, now: Instant) {
        let out = self.gate.layer_saved(layer, fence.as_ref(), now);
        self.release(out);
    }

    /// The forward pass ended: every held write goes, then the held digests.
    pub fn forward_done(&mut self, now: Instant) {
        self.forward_done_after(None, now);
    }

    /// The forward pass ended on a device: what it held goes once `fence` (an event recorded
    /// after the forward's kernels) says they ran.
    pub fn forward_done_after(&mut self, fence: Option<Fence>, now: Instant) {
        if !self.gate.is_empty() {
            let out = self.gate.forward_done(fence.as_ref(), now);
            self.release(out);
        }
    }

    fn release(&mut self, out: Vec<Released>) {
        for r in out {
            match r {
                Released::Post(job) => self.post(job),
                Released::Fail(job) => self.report.ended.push((job, false)),
                Released::Apply(op) => self.apply_ops(vec![op]),
            }
        }
    }

    fn apply_ops(&mut self, ops: Vec<WorkerOp>) {
        for op in ops {
            match op {
                WorkerOp::LoadRemote { agent, metadata } => {
                    // A death the transport noticed before this load is the old connection's:
                    // reported after it, it would fail the peer that just came back (and its
                    // requests). Other agents' deaths are kept for the next report.
                    let dead = self.mem.transport.drain_dead_peers();
                    self.report.dead_agents.extend(dead);
                    self.report.dead_agents.retain(|a| *a != agent);
                    match self.mem.transport.load_remote(&metadata) {
                        Ok(name) if name == agent => {}
                        Ok(name) => {
                            // The metadata names another agent than the peer announced: drop it
                            // again, or the peer could take over someone else's name.
                            self.mem.transport.forget_remote(&name);
                            self.report.load_failed.push((
                                agent.clone(),
                                format!(
                                    "metadata names agent {name:?}, the peer announced {agent:?}"
                                ),
                            ));
                        }
                        Err(e) => self.report.load_failed.push((agent, e.to_string())),
                    }
                }
                WorkerOp::ForgetRemote { agent } => self.mem.transport.forget_remote(&agent),
                WorkerOp::Post(job) => self.post(job),
                // Ended (failed) at the next poll, once nothing it posted still runs.
                WorkerOp::Abort { job } => {
                    if let Some(j) = self.jobs.get_mut(&job) {
                        let transport = &self.mem.transport;
                        for id in j.xfers.drain(..) {
                            release(transport.as_ref(), id, "abort");
                            if transport.still_running(id) {
                                j.stopping.push(id);
                            }
                        }
                        j.failed = true;
                    }
                }
                WorkerOp::Grant {
                    grant,
                    op,
                    agents,
                    blocks,
                    digest,
                } => {
                    // Before the grant: once the peer hears of it, it may read.
                    if let Some(of) = digest {
                        if let Some(d) = self.digest(&blocks, of) {
                            self.report.digests.push((Digested::Grant(grant), d));
                        }
                    }
                    let ok = match self.grant(grant, op, &agents, &blocks) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::error!(rank = self.rank, error = %e, "cannot grant blocks");
                            false
                        }
                    };
                    self.report.granted.push((grant, ok));
                }
                WorkerOp::Revoke { grant } => self.mem.transport.revoke(grant),
                WorkerOp::Digest {
                    handoff,
                    blocks,
                    of,
                } => match self.digest(&blocks, of) {
                    Some(d) => self.report.digests.push((Digested::Handoff(handoff), d)),
                    None => self.report.undigested.push(handoff),
                },
                WorkerOp::ZeroTail { blocks, num_tokens } => {
                    if let Err(e) = self.zero_tail(&blocks, num_tokens) {
                        tracing::warn!(rank = self.rank, error = %e, "cannot zero a block tail");
                    }
                }
                WorkerOp::ZeroTailOnPushDone {
                    handoff,
                    blocks,
                    num_tokens,
                } => {
                    if self.push_tails.len() >= MAX_PUSH_TAILS {
                        if let Some(old) = self.push_tail_order.pop_front() {
                            self.push_tails.remove(&old);
                        }
                    }
                    if self
                        .push_tails
                        .insert(handoff, (blocks, num_tokens))
                        .is_none()
                    {
                        self.push_tail_order.push_back(handoff);
                    }
                }
                WorkerOp::ForgetPushTail { handoff } => {
                    if self.push_tails.remove(&handoff).is_some() {
                        self.push_tail_order.retain(|h| *h != handoff);
                    }
                }
                WorkerOp::RenewWrites {
                    handoff,
                    d_rank,
                    post_within_ms,
                } => {
                    let now = Instant::now();
                    let by = now + Duration::from_millis(post_within_ms.into());
                    self.gate.renew(handoff, d_rank, by, now);
                }
            }
        }
    }

    fn post(&mut self, t: TransferJob) {
        let mut job = Job {
            xfers: Vec::with_capacity(t.parts.len()),
            stopping: Vec::new(),
            failed: false,
            zero_tail: t.zero_tail,
            digest: t.digest,
        };
        for part in &t.parts {
            match self.mem.transport.post(
                t.op,
                &part.agent,
                &part.descs,
                part.notification.as_deref(),
            ) {
                Ok(id) => job.xfers.push(id),
                Err(e) => {
                    tracing::warn!(rank = self.rank, job = t.job.0, error = %e, "post failed");
                    job.failed = true;
                }
            }
        }
        self.jobs.insert(t.job, job);
    }

    /// Progress: jobs that ended, notifications, dead peers. `None` when there is nothing new.
    pub fn poll(&mut self) -> Option<WorkerReport> {
        // Writes whose layer's device work finished since the last call leave first.
        let out = self.gate.poll(Instant::now());
        self.release(out);
        let transport = &self.mem.transport;
        let mut ended = Vec::new();
        for (id, job) in self.jobs.iter_mut() {
            job.xfers.retain(|x| match transport.status(*x) {
                Ok(XferStatus::InProgress) => true,
                Ok(XferStatus::Done) => {
                    release(transport.as_ref(), *x, "done");
                    false
                }
                Ok(XferStatus::Failed(e)) => {
                    tracing::warn!(job = id.0, error = %e, "transfer failed");
                    release(transport.as_ref(), *x, "failed");
                    if transport.still_running(*x) {
                        job.stopping.push(*x);
                    }
                    job.failed = true;
                    false
                }
                Err(_) => {
                    job.failed = true;
                    false
                }
            });
            job.stopping.retain(|x| transport.still_running(*x));
            if job.xfers.is_empty() && job.stopping.is_empty() {
                ended.push(*id);
            }
        }
        for id in ended {
            if let Some(job) = self.jobs.remove(&id) {
                let mut ok = !job.failed;
                if let (true, Some((blocks, tokens))) = (ok, &job.zero_tail) {
                    if let Err(e) = self.zero_tail(blocks, *tokens) {
                        tracing::warn!(rank = self.rank, error = %e, "cannot zero a block tail");
                        ok = false;
                    }
                }
                if let (true, Some((blocks, of))) = (ok, &job.digest) {
                    if let Some(d) = self.digest(blocks, *of) {
                        self.report.digests.push((Digested::Job(id), d));
                    }
                }
                self.report.ended.push((id, ok));
            }
        }
        for n in self.mem.transport.drain_notifications() {
            self.zero_push_tail(&n.msg);
            self.report.notifications.push((n.from, n.msg));
        }
        self.report
            .dead_agents
            .extend(self.mem.transport.drain_dead_peers());
        let refused = (
            self.mem.transport.refused_connections(),
            self.mem.transport.refused_transfers(),
        );
        self.report.refused_connections += refused.0.saturating_sub(self.refused_seen.0);
        self.report.refused_transfers += refused.1.saturating_sub(self.refused_seen.1);
        self.refused_seen = refused;
        if self.report.is_empty() {
            return None;
        }
        let fresh = WorkerReport {
            rank: self.rank,
            ..Default::default()
        };
        Some(std::mem::replace(&mut self.report, fresh))
    }

    /// This rank's share of the KV digest of `blocks`; `None` (logged) when it cannot be
    /// computed, which the scheduler side treats as a digest it cannot check.
    fn digest(&self, blocks: &[u32], of: DigestOf) -> Option<u64> {
        match rank_digest(
            &self.mem.layout,
            &self.groups,
            &self.mem.regions,
            blocks,
            of,
        ) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(rank = self.rank, error = %e, "cannot compute a KV digest");
                None
            }
        }
    }

    /// Opens every byte of `blocks` on this rank to `agents` for `op`.
    fn grant(
        &self,
        grant: GrantId,
        op: XferOp,
        agents: &[String],
        blocks: &[u32],
    ) -> Result<(), ConnectorError> {
        let extents: Vec<Extent> = handoff_plan::block_spans(&self.mem.layout, blocks)
            .map_err(ConnectorError::Plan)?
            .into_iter()
            .map(|s| Extent {
                region: s.region,
                offset: s.offset,
                len: s.len,
            })
            .collect();
        self.mem.transport.grant(grant, op, agents, &extents)?;
        Ok(())
    }

    /// Zeroes the bytes of `blocks` past the prompt's last token, so no stale byte (P's or a
    /// previous request's) stays in a partially filled block.
    /// A `PushDone` for a push whose tail this rank zeroes: zeroed now, before the core hears
    /// of it (see `WorkerOp::ZeroTailOnPushDone`). Any other notification: nothing.
    fn zero_push_tail(&self, msg: &[u8]) {
        let Ok(Message::PushDone(done)) = handoff_proto::decode(msg) else {
            return;
        };
        if let Some((blocks, num_tokens)) = self.push_tails.get(&done.handoff) {
            if let Err(e) = self.zero_tail(blocks, *num_tokens) {
                tracing::warn!(rank = self.rank, error = %e, "cannot zero a pushed block's tail");
            }
        }
    }

    fn zero_tail(&self, blocks: &[u32], num_tokens: u32) -> Result<(), ConnectorError> {
        let spans = handoff_plan::uncovered_dst(&self.mem.layout, blocks, num_tokens)
            .map_err(ConnectorError::Plan)?;
        let zeros = vec![0u8; spans.iter().map(|s| s.len).max().unwrap_or(0) as usize];
        for s in &spans {
            let region = self
                .mem
                .regions
                .iter()
                .find(|(id, _)| *id == s.region)
                .map(|(_, r)| r)
                .ok_or(TransportError::UnknownRegion { region: s.region })?;
            region.write(s.offset as usize, &zeros[..s.len as usize])?;
        }
        Ok(())
    }

    /// Releases every job still posted (shutdown).
    pub fn abort_all(&mut self) {
        self.gate.clear();
        for (_, job) in self.jobs.drain() {
            for id in job.xfers {
                release(self.mem.transport.as_ref(), id, "shutdown");
            }
        }
    }
}

/// Runs `worker` on a thread of its own: applies every step from `steps` as it arrives, polls
/// the transport every [`POLL`], and hands each report to `report`. Ends when `steps` closes or
/// `report` returns false.
pub fn spawn(
    mut worker: WorkerSide,
    steps: Receiver<WorkerStep>,
    report: impl Fn(WorkerReport) -> bool + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("handoff-worker-{}", worker.rank()))
        .spawn(move || {
            loop {
                match steps.recv_timeout(POLL) {
                    Ok(step) => {
                        worker.apply(step);
                        while let Ok(step) = steps.try_recv() {
                            worker.apply(step);
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                if let Some(r) = worker.poll() {
                    if !report(r) {
                        break;
                    }
                }
            }
            worker.abort_all();
        })
}

/// Releases a transfer's request. A refusal leaves nothing to undo here (the job's state says
/// whether the transfer may still run: `still_running`), so it is said, not returned.
fn release(transport: &dyn Transport, id: XferId, when: &'static str) {
    if let Err(e) = transport.release(id) {
        tracing::warn!(xfer = id.0, %when, error = %e, "the transport refused to release a transfer");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_plan::{BlockLayout, KvSpec, ModelShape};
    use handoff_transport::tcp::{TcpConfig, TcpTransport};
    use std::time::{Duration, Instant};

    fn layout() -> RankLayout {
        let spec = KvSpec {
            shape: ModelShape {
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 8,
                dtype_size: 2,
            },
            tp: 1,
            block_size: 16,
            block_layout: BlockLayout::HeadMajor,
        };
        RankLayout::cross_layer(spec, 0, 4, 0).unwrap()
    }

    fn tcp(name: &str) -> Arc<TcpTransport> {
        TcpTransport::new(
            name,
            TcpConfig {
                keepalive: Duration::from_millis(50),
                dead_after: Duration::from_millis(300),
                ..TcpConfig::default()
            },
        )
        .unwrap()
    }

    /// A D worker whose transport says a released transfer not done still runs for `linger`
    /// questions (and fails every transfer when `fail_all`), with P loaded, and a P to read from.
    fn lingering_d(linger: u32, fail_all: bool) -> (WorkerSide, Arc<TcpTransport>) {
        use handoff_transport::faulty::{FaultPlan, FaultyTransport};
        let l = layout();
        let len = l.region_len(0).unwrap() as usize;
        let p = tcp("p-r0");
        p.register(0, Arc::new(KvRegion::new(len, 256))).unwrap();
        let faulty = FaultyTransport::new(
            tcp("d-r0"),
            FaultPlan {
                linger_released: linger,
                fail_transfer_pct: if fail_all { 100 } else { 0 },
                ..FaultPlan::default()
            },
        );
        let mut d = WorkerSide::new(RankMemory {
            layout: l,
            regions: vec![(0, Arc::new(KvRegion::new(len, 256)))],
            transport: faulty,
        })
        .unwrap();
        d.apply(WorkerStep {
            ops: vec![WorkerOp::LoadRemote {
                agent: "p-r0".into(),
                metadata: p.local_metadata().unwrap(),
            }],
        });
        (d, p)
    }

    /// A job reading P's first 64 bytes.
    fn read_job(job: JobId) -> WorkerOp {
        use crate::worker_protocol::{TransferJob, TransferPart};
        use handoff_transport::XferDesc;
        WorkerOp::Post(TransferJob {
            job,
            op: XferOp::Read,
            parts: vec![TransferPart {
                agent: "p-r0".into(),
                descs: vec![XferDesc {
                    local_region: 0,
                    local_offset: 0,
                    remote_region: 0,
                    remote_offset: 0,
                    len: 64,
                }],
                notification: None,
            }],
            zero_tail: None,
            digest: None,
            push_layer: None,
        })
    }

    /// Push, D: P writes whole blocks, so the tail of the last one is D's to zero, on every
    /// PushDone of that handoff, before the core hears of it (only then may anything digest or
    /// decode the blocks). Another handoff's PushDone, other notifications and a forgotten push
    /// change nothing.
    #[test]
    fn a_push_done_zeroes_the_tail_of_its_blocks_before_it_is_reported() {
        use handoff_proto::{encode, Epoch, PushDone};
        let l = layout();
        let len = l.region_len(0).unwrap() as usize;
        let region = Arc::new(KvRegion::new(len, 256));
        region.write(0, &vec![0xaa; len]).unwrap();
        let mut d = WorkerSide::new(RankMemory {
            layout: l,
            regions: vec![(0, region.clone())],
            transport: tcp("d-tail"),
        })
        .unwrap();
        let h: HandoffId = "0123456789abcdef0123456789abcdef".parse().unwrap();
        let other: HandoffId = "fedcba9876543210fedcba9876543210".parse().unwrap();
        // Blocks 1 and 2 hold the prompt's 20 tokens: block 2 keeps 4, the rest of it is tail.
        d.apply(WorkerStep {
            ops: vec![WorkerOp::ZeroTailOnPushDone {
                handoff: h,
                blocks: vec![1, 2],
                num_tokens: 20,
            }],
        });
        let done = |handoff| {
            encode(&Message::PushDone(PushDone {
                handoff,
                epoch: Epoch(1),
                p_rank: 0,
                d_rank: 0,
                digest: None,
            }))
            .unwrap()
        };
        let snapshot = || {
            let mut b = vec![0u8; len];
            region.read(0, &mut b).unwrap();
            b
        };
        d.zero_push_tail(&done(other));
        d.zero_push_tail(b"not a message");
        assert!(snapshot().iter().all(|b| *b == 0xaa), "nothing of ours");
        d.zero_push_tail(&done(h));
        // One layer, one head, 16 tokens × 8 × 2 bytes per plane: a row is 16 bytes.
        let block = l_block_bytes();
        let after = snapshot();
        let row = 16;
        let tail_start = 2 * block + 4 * row;
        let mut zeroed = 0;
        for (i, b) in after.iter().enumerate() {
            let in_block_2 = (2 * block..3 * block).contains(&i);
            if *b == 0 {
                assert!(
                    in_block_2 && i >= 2 * block,
                    "byte {i} zeroed outside block 2"
                );
                zeroed += 1;
            }
        }
        assert!(zeroed > 0 && after[tail_start..3 * block].contains(&0));
        assert!(
            after[..2 * block + 4 * row].iter().all(|b| *b == 0xaa),
            "the prompt kept"
        );
        region.write(0, &vec![0xaa; len]).unwrap();
        d.apply(WorkerStep {
            ops: vec![WorkerOp::ForgetPushTail { handoff: h }],
        });
        d.zero_push_tail(&done(h));
        assert!(
            snapshot().iter().all(|b| *b == 0xaa),
            "a forgotten push zeroes nothing"
        );
    }

    /// Push from device memory: P's write of layer 0 is held for the forward, whose "kernel"
    /// writes the layer's KV 200 ms after `save_kv_layer` was called (as a GPU runs work the
    /// host enqueued). Saved with the kernel's event, the write leaves once the kernel ran and
    /// D's device memory holds the kernel's bytes; saved without it (the mechanism removed), it
    /// leaves at once and D gets what was there before the kernel: zeros.
    fn push_from_device_memory(fenced: bool) -> Vec<u8> {
        use crate::worker_protocol::{PushLayer, TransferJob, TransferPart};
        use handoff_transport::device::fake::FakeDevice;
        use handoff_transport::XferDesc;
        let l = layout();
        let len = l.region_len(0).unwrap() as usize;
        let (p_dev, d_dev) = (FakeDevice::new(0), FakeDevice::new(1));
        let p_region = Arc::new(p_dev.region(len, 256));
        let d_region = Arc::new(d_dev.region(len, 256));
        let tag = if fenced { "f" } else { "u" };
        let d_t = tcp(&format!("d-dev-{tag}"));
        d_t.register(0, d_region.clone()).unwrap();
        let mut p = WorkerSide::new(RankMemory {
            layout: l,
            regions: vec![(0, p_region.clone())],
            transport: tcp(&format!("p-dev-{tag}")),
        })
        .unwrap();
        assert_eq!(
            p.memory(),
            handoff_transport::device::MemoryKind::Cuda { device: 0 }
        );
        let d_agent = format!("d-dev-{tag}");
        let h: HandoffId = "0123456789abcdef0123456789abcdef".parse().unwrap();
        let write = WorkerOp::Post(TransferJob {
            job: JobId(1),
            op: XferOp::Write,
            parts: vec![TransferPart {
                agent: d_agent.clone(),
                descs: vec![XferDesc {
                    local_region: 0,
                    local_offset: 0,
                    remote_region: 0,
                    remote_offset: 0,
                    len: 64,
                }],
                notification: None,
            }],
            zero_tail: None,
            digest: None,
            push_layer: Some(PushLayer {
                handoff: h,
                d_rank: 0,
                layer: 0,
                post_within_ms: 10_000,
            }),
        });
        let load = WorkerOp::LoadRemote {
            agent: d_agent,
            metadata: d_t.local_metadata().unwrap(),
        };
        p.apply_before_forward(
            WorkerStep {
                ops: vec![load, write],
            },
            &[h],
            Instant::now(),
        );
        let stream = 1;
        p_dev.late_kernel(
            stream,
            p_region.base_addr(),
            vec![7; 64],
            Duration::from_millis(200),
        );
        let fence = fenced.then(|| Fence::record(p_dev.clone(), stream).unwrap());
        p.layer_saved_after(0, fence, Instant::now());
        let start = Instant::now();
        loop {
            let report = p.poll();
            if report.is_some_and(|r| r.ended.contains(&(JobId(1), true))) {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the write never ended"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut landed = vec![0u8; 64];
        d_region.read(0, &mut landed).unwrap();
        landed
    }

    #[test]
    fn a_push_write_from_device_memory_never_overtakes_the_kernel_that_wrote_its_layer() {
        assert_eq!(
            push_from_device_memory(true),
            vec![7; 64],
            "the kernel's bytes"
        );
        // Negative control: without the event the write overtakes the kernel.
        assert_eq!(push_from_device_memory(false), vec![0; 64]);
    }

    fn l_block_bytes() -> usize {
        layout().spec.block_bytes() as usize
    }

    /// An aborted job's end is what lets the ledgers free its blocks: while the backend still
    /// runs one of its transfers (NIXL cannot always abort at once), the job is not reported
    /// ended.
    #[test]
    fn an_aborted_job_ends_only_once_the_backend_stopped_its_transfers() {
        let linger = 3;
        let (mut d, _p) = lingering_d(linger, false);
        let job = JobId(7);
        d.apply(WorkerStep {
            ops: vec![read_job(job), WorkerOp::Abort { job }],
        });
        let mut polls = 0;
        let ended = loop {
            let ended: Vec<(JobId, bool)> = d.poll().map(|r| r.ended).unwrap_or_default();
            if !ended.is_empty() {
                break ended;
            }
            polls += 1;
            assert!(polls < 100, "the aborted job never ended");
        };
        assert_eq!(ended, vec![(job, false)]);
        // The backend said "still running" `linger` times: when the abort asked, then at each
        // poll before the one that reported the end.
        assert_eq!(
            polls + 1,
            linger,
            "reported ended while the backend still ran its transfer"
        );
    }

    /// A transfer that failed is released too, and the backend may keep running it: its job
    /// ends (and its blocks may go back) only once the backend stopped it.
    #[test]
    fn a_failed_job_ends_only_once_the_backend_stopped_its_transfers() {
        let linger = 3;
        let (mut d, _p) = lingering_d(linger, true);
        let job = JobId(8);
        d.apply(WorkerStep {
            ops: vec![read_job(job)],
        });
        let t0 = Instant::now();
        let mut asked_after_failure = 0;
        let ended = loop {
            let ended: Vec<(JobId, bool)> = d.poll().map(|r| r.ended).unwrap_or_default();
            if !ended.is_empty() {
                break ended;
            }
            if d.jobs.get(&job).is_some_and(|j| j.xfers.is_empty()) {
                asked_after_failure += 1;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the failed job never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(ended, vec![(job, false)]);
        // Asked at the failure and again in that poll, then once per poll until it stopped.
        assert_eq!(
            asked_after_failure + 1,
            linger,
            "reported ended while the backend still ran its failed transfer"
        );
    }

    #[test]
    fn a_death_noticed_before_the_peer_was_loaded_again_is_not_reported() {
        let l = layout();
        let len = l.region_len(0).unwrap() as usize;
        let mut d = WorkerSide::new(RankMemory {
            layout: l,
            regions: vec![(0, Arc::new(KvRegion::new(len, 256)))],
            transport: tcp("d-r0"),
        })
        .unwrap();
        let p1 = tcp("p-r0");
        let load = |p: &Arc<TcpTransport>| WorkerStep {
            ops: vec![WorkerOp::LoadRemote {
                agent: "p-r0".into(),
                metadata: p.local_metadata().unwrap(),
            }],
        };
        d.apply(load(&p1));
        // P's agent goes away; D's transport notices, but the worker does not poll (vLLM's
        // worker polls once per engine step, which can be seconds apart under load).
        p1.shutdown();
        drop(p1);
        std::thread::sleep(Duration::from_millis(800));
        // P comes back (its side channel said hello again): the agent is loaded again.
        let p2 = tcp("p-r0");
        d.apply(load(&p2));
        let t0 = Instant::now();
        let mut dead = Vec::new();
        while t0.elapsed() < Duration::from_millis(200) {
            if let Some(r) = d.poll() {
                dead.extend(r.dead_agents);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            dead.is_empty(),
            "the old death failed the new peer: {dead:?}"
        );
        drop(p2);
    }
}
