//! Push work a worker holds until the forward pass that produces its KV has run.
//!
//! Where the scheduler side plans a step before the workers run its forward pass (vLLM: the
//! step's metadata is built first, and every layer's KV is written during the forward), a push
//! handoff whose prompt that forward completes starts with its writes already planned, one job
//! per layer ([`PushLayer`]). The worker holds each until the forward saved that layer (vLLM's
//! `save_kv_layer`), so the layer leaves for D while the next layers compute, and holds the
//! handoff's digest until the forward ended (it covers every layer). A job is posted only within
//! the time its registration grant allows; past it, it ends failed without moving a byte (D
//! recomputes), never late (rule 3).
//!
//! The grant that counts is the one in force when the layer is saved, not the one the step was
//! planned on: D renews its grants on every P heartbeat, and a forward pass may run far longer
//! than one grant (a long prompt; a slow machine). The scheduler side passes each renewal on
//! ([`crate::WorkerOp::RenewWrites`]) and it lands in the gate's [`WriteGrants`], which whatever
//! carries renewals during the forward (vLLM's grant line) shares. A renewal may reach the gate
//! late (on a loaded host each process on its way can be descheduled for a second), so a write
//! whose grant ended before its layer was saved is not failed at once: it waits, unposted, for
//! a grant D issued that still runs ([`RENEWAL_WAIT`] at most). When D stops granting (P
//! partitioned, D gone) no renewal comes and held writes fail then.
//!
//! On a GPU the engine calls `save_kv_layer` once the layer's kernels are *enqueued*, not run:
//! the layer is saved with a [`Fence`] (a CUDA event recorded after those kernels), and its
//! writes wait, fenced, until the event's work finished ([`ForwardGate::poll`], never blocking
//! the forward thread); the forward's end likewise fences what is still held and the digests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_proto::HandoffId;
use handoff_transport::device::{Device, DeviceError};
use parking_lot::Mutex;

use crate::worker_protocol::{JobId, PushLayer, TransferJob, WorkerOp};

/// What leaves the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// Post this job now.
    Post(TransferJob),
    /// The job ends failed without being posted (its grant's time ran out while it waited, or
    /// the scheduler side aborted it first).
    Fail(JobId),
    /// Apply this op now (a held digest).
    Apply(WorkerOp),
}

/// Renewed registration grants, as a worker learned them: per (handoff, D rank), the instant
/// until which its held writes may be posted. Shared between the gate (read as each layer is
/// saved) and whoever delivers renewals while the forward runs.
#[derive(Debug, Default)]
pub struct WriteGrants {
    by: Mutex<HashMap<(HandoffId, u16), Instant>>,
}

/// Registrations a worker remembers renewals of: far more than pushes in flight at once; a
/// bound all the same (entries past their instant are dropped first).
const MAX_RENEWED: usize = 4096;

impl WriteGrants {
    /// Held writes into (`handoff`, `d_rank`) may be posted until `by` (a later renewal wins;
    /// an earlier or duplicate one changes nothing).
    pub fn renew(&self, handoff: HandoffId, d_rank: u16, by: Instant, now: Instant) {
        let mut m = self.by.lock();
        if m.len() >= MAX_RENEWED && !m.contains_key(&(handoff, d_rank)) {
            m.retain(|_, b| *b > now);
            if m.len() >= MAX_RENEWED {
                tracing::warn!(%handoff, "too many renewed push grants: renewal dropped");
                return;
            }
        }
        let e = m.entry((handoff, d_rank)).or_insert(by);
        *e = (*e).max(by);
    }

    fn until(&self, handoff: HandoffId, d_rank: u16) -> Option<Instant> {
        self.by.lock().get(&(handoff, d_rank)).copied()
    }

    /// Forgets renewals that ended before `now` (none can let a write go any more).
    fn prune(&self, now: Instant) {
        self.by.lock().retain(|_, b| *b > now);
    }

    pub fn len(&self) -> usize {
        self.by.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The device work that produced a layer's KV: an event recorded on the engine's stream right
/// after that work was enqueued. Shared by every job it holds; destroyed with the last.
#[derive(Debug, Clone)]
pub struct Fence(Arc<FenceEvent>);

#[derive(Debug)]
struct FenceEvent {
    device: Arc<dyn Device>,
    event: u64,
}

impl Drop for FenceEvent {
    fn drop(&mut self) {
        self.device.destroy_event(self.event);
    }
}

impl Fence {
    /// A fence after everything enqueued on `stream` of `device` so far.
    pub fn record(device: Arc<dyn Device>, stream: u64) -> Result<Fence, DeviceError> {
        let event = device.record_event(stream)?;
        Ok(Fence(Arc::new(FenceEvent { device, event })))
    }

    /// Whether that work finished (never blocks).
    pub fn passed(&self) -> Result<bool, DeviceError> {
        self.0.device.event_done(self.0.event)
    }
}

/// A held job, with the instant it must be posted by as planned.
type HeldJob = (Instant, PushLayer, TransferJob);

/// How long a saved layer's write whose grant had ended waits for a renewal before it fails. D
/// keeps granting while P heartbeats and its registration stands; a renewal that has not
/// arrived this long after the grant's end will not (P's ledger aborts the writes 400 ms after
/// it by default), and D fails the request then anyway.
pub const RENEWAL_WAIT: Duration = Duration::from_millis(1000);

/// What waits for a fence.
#[derive(Debug)]
enum Fenced {
    Job(HeldJob),
    Digest(WorkerOp),
}

#[derive(Debug, Default)]
pub struct ForwardGate {
    /// Jobs waiting for their layer.
    jobs: Vec<HeldJob>,
    /// Digests waiting for the forward's end.
    digests: Vec<WorkerOp>,
    /// Saved, waiting for the device work that wrote their KV.
    fenced: Vec<(Fence, Fenced)>,
    /// Saved and written, but their grant ended first: waiting, until the instant given, for
    /// a renewal that lets them go.
    lapsed: Vec<(Instant, HeldJob)>,
    /// Renewals of the grants the jobs were planned on.
    grants: Arc<WriteGrants>,
}

impl ForwardGate {
    /// The renewals this gate reads (to be shared with a renewal carrier).
    pub fn write_grants(&self) -> Arc<WriteGrants> {
        self.grants.clone()
    }

    /// D renewed the grant of (`handoff`, `d_rank`): its held writes may go until `by`.
    pub fn renew(&self, handoff: HandoffId, d_rank: u16, by: Instant, now: Instant) {
        self.grants.renew(handoff, d_rank, by, now);
    }

    /// Drops every held job and digest (shutdown); renewals stay with their carrier.
    pub fn clear(&mut self) {
        self.jobs.clear();
        self.digests.clear();
        self.fenced.clear();
        self.lapsed.clear();
    }

    /// Splits a step planned before its forward pass: the writes and digests of the handoffs in
    /// `forward` are held; the rest is returned, in order, to apply now. An abort of a held job
    /// fails it here (returned in the second list).
    pub fn admit(
        &mut self,
        ops: Vec<WorkerOp>,
        forward: &[HandoffId],
        now: Instant,
    ) -> (Vec<WorkerOp>, Vec<JobId>) {
        let mut apply = Vec::with_capacity(ops.len());
        let mut failed = Vec::new();
        for op in ops {
            match op {
                WorkerOp::Post(job) => match job.push_layer {
                    Some(p) if forward.contains(&p.handoff) => {
                        let by = now + Duration::from_millis(p.post_within_ms.into());
                        self.jobs.push((by, p, job));
                    }
                    _ => apply.push(WorkerOp::Post(job)),
                },
                WorkerOp::Digest { handoff, .. } if forward.contains(&handoff) => {
                    self.digests.push(op)
                }
                WorkerOp::Abort { job } => {
                    let fenced = self
                        .fenced
                        .iter()
                        .position(|(_, f)| matches!(f, Fenced::Job(h) if h.2.job == job));
                    let lapsed = self.lapsed.iter().position(|(_, h)| h.2.job == job);
                    match (
                        self.jobs.iter().position(|h| h.2.job == job),
                        fenced,
                        lapsed,
                    ) {
                        (Some(i), _, _) => {
                            self.jobs.remove(i);
                            failed.push(job);
                        }
                        (None, Some(i), _) => {
                            self.fenced.remove(i);
                            failed.push(job);
                        }
                        (None, None, Some(i)) => {
                            self.lapsed.remove(i);
                            failed.push(job);
                        }
                        (None, None, None) => apply.push(WorkerOp::Abort { job }),
                    }
                }
                other => apply.push(other),
            }
        }
        (apply, failed)
    }

    /// Whether a job waits for `layer` (an engine with asynchronous kernels must make the
    /// layer's KV visible before [`ForwardGate::layer_saved`]).
    pub fn waits_for(&self, layer: u32) -> bool {
        self.jobs.iter().any(|h| h.1.layer == layer)
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
            && self.digests.is_empty()
            && self.fenced.is_empty()
            && self.lapsed.is_empty()
    }

    /// The forward saved `layer`: its jobs go, at once or, with `fence`, once the device work
    /// it marks finished ([`ForwardGate::poll`]).
    pub fn layer_saved(
        &mut self,
        layer: u32,
        fence: Option<&Fence>,
        now: Instant,
    ) -> Vec<Released> {
        let (due, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.jobs)
            .into_iter()
            .partition(|h| h.1.layer == layer);
        self.jobs = kept;
        let mut out = Vec::new();
        for h in due {
            match fence {
                Some(f) => self.fenced.push((f.clone(), Fenced::Job(h))),
                None => {
                    tracing::debug!(handoff = %h.1.handoff, layer, "push write leaves as its layer is saved");
                    out.extend(self.release(h, now));
                }
            }
        }
        out.extend(self.poll(now));
        out
    }

    /// The forward ended: every held job goes (a layer the engine never named as saved is in
    /// its blocks now), then the digests; with `fence`, once the forward's device work
    /// finished.
    pub fn forward_done(&mut self, fence: Option<&Fence>, now: Instant) -> Vec<Released> {
        let jobs = std::mem::take(&mut self.jobs);
        let digests = std::mem::take(&mut self.digests);
        let mut out = Vec::new();
        match fence {
            Some(f) => {
                let held = jobs
                    .into_iter()
                    .map(Fenced::Job)
                    .chain(digests.into_iter().map(Fenced::Digest));
                self.fenced.extend(held.map(|h| (f.clone(), h)));
            }
            None => {
                for h in jobs {
                    out.extend(self.release(h, now));
                }
                out.extend(digests.into_iter().map(Released::Apply));
            }
        }
        out.extend(self.poll(now));
        self.grants.prune(now);
        out
    }

    /// Releases what waited for device work that has finished now, in the order it was saved
    /// (a job under the grant as it stands now), and the lapsed writes a renewal lets go (or
    /// that waited for one long enough). A fence the device cannot answer for fails its job
    /// and drops its digest (D then recomputes): nothing leaves before its KV is written.
    pub fn poll(&mut self, now: Instant) -> Vec<Released> {
        let mut out = self.retry_lapsed(now);
        if self.fenced.is_empty() {
            return out;
        }
        let mut kept = Vec::new();
        for (fence, held) in std::mem::take(&mut self.fenced) {
            match (fence.passed(), held) {
                (Ok(false), held) => kept.push((fence, held)),
                (Ok(true), Fenced::Job(h)) => out.extend(self.release(h, now)),
                (Ok(true), Fenced::Digest(op)) => out.push(Released::Apply(op)),
                (Err(e), Fenced::Job(h)) => {
                    tracing::error!(handoff = %h.1.handoff, layer = h.1.layer, error = %e, "push write not posted: the device cannot say whether its layer is written");
                    out.push(Released::Fail(h.2.job));
                }
                (Err(e), Fenced::Digest(_)) => {
                    tracing::error!(error = %e, "KV digest dropped: the device cannot say whether the forward ended");
                }
            }
        }
        self.fenced = kept;
        out
    }

    /// The grant of a saved, written layer's job as it stands `now`: posted within it, else
    /// kept for a renewal (nothing returned).
    fn release(&mut self, (by, p, job): HeldJob, now: Instant) -> Option<Released> {
        if now <= self.grant_end(by, &p) {
            return Some(Released::Post(job));
        }
        tracing::debug!(handoff = %p.handoff, layer = p.layer, "push write waits: its grant ended before its layer was saved");
        self.lapsed.push((now + RENEWAL_WAIT, (by, p, job)));
        None
    }

    /// Where the grant a job was planned on (`by`) ends as D last renewed it.
    fn grant_end(&self, by: Instant, p: &PushLayer) -> Instant {
        match self.grants.until(p.handoff, p.d_rank) {
            Some(renewed) => by.max(renewed),
            None => by,
        }
    }

    /// Posts the lapsed writes a renewal D issued now covers; fails those that waited
    /// [`RENEWAL_WAIT`] for one. Only a grant still running lets a write go (rule 3).
    fn retry_lapsed(&mut self, now: Instant) -> Vec<Released> {
        let mut out = Vec::new();
        for (give_up, (by, p, job)) in std::mem::take(&mut self.lapsed) {
            if now <= self.grant_end(by, &p) {
                tracing::info!(handoff = %p.handoff, layer = p.layer, "push write posted under a renewal that came after its grant ended");
                out.push(Released::Post(job));
            } else if now >= give_up {
                tracing::warn!(
                    handoff = %p.handoff,
                    layer = p.layer,
                    "push write not posted: D's registration grant ran out while the forward ran and no renewal came (D stopped granting)"
                );
                out.push(Released::Fail(job.job));
            } else {
                self.lapsed.push((give_up, (by, p, job)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::DigestOf;
    use handoff_transport::XferOp;

    fn handoff(n: u8) -> HandoffId {
        format!("{n:02x}").repeat(16).parse().unwrap()
    }

    fn write(job: u64, h: HandoffId, layer: u32, within_ms: u32) -> WorkerOp {
        WorkerOp::Post(TransferJob {
            job: JobId(job),
            op: XferOp::Write,
            parts: Vec::new(),
            zero_tail: None,
            digest: None,
            push_layer: Some(PushLayer {
                handoff: h,
                d_rank: 0,
                layer,
                post_within_ms: within_ms,
            }),
        })
    }

    fn digest(h: HandoffId) -> WorkerOp {
        WorkerOp::Digest {
            handoff: h,
            blocks: vec![1],
            of: DigestOf {
                num_tokens: 1,
                whole_blocks: true,
            },
        }
    }

    fn posted(r: &[Released]) -> Vec<u64> {
        r.iter()
            .filter_map(|x| match x {
                Released::Post(j) => Some(j.job.0),
                _ => None,
            })
            .collect()
    }

    /// On a device, a saved layer's write waits for the event recorded after its kernel (the
    /// "kernel" here finishes 150 ms late), and the digest for the forward's end event; both
    /// leave from `poll` once the work is done, never from the call that saved them, and the
    /// events are destroyed once nothing waits on them.
    #[test]
    fn a_fenced_write_leaves_only_once_its_kernel_finished() {
        use handoff_transport::device::fake::FakeDevice;
        let dev = FakeDevice::new(0);
        let at = dev.alloc(64);
        let stream = 3;
        dev.late_kernel(stream, at, vec![1; 64], Duration::from_millis(150));
        let layer0 = Fence::record(dev.clone(), stream).unwrap();
        dev.late_kernel(stream, at, vec![2; 64], Duration::from_millis(250));
        let end = Fence::record(dev.clone(), stream).unwrap();
        let h = handoff(1);
        let t0 = Instant::now();
        let mut gate = ForwardGate::default();
        let ops = vec![write(1, h, 0, 10_000), write(2, h, 1, 10_000), digest(h)];
        assert!(gate.admit(ops, &[h], t0).0.is_empty());
        assert!(gate
            .layer_saved(0, Some(&layer0), Instant::now())
            .is_empty());
        assert!(gate.forward_done(Some(&end), Instant::now()).is_empty());
        assert!(!gate.is_empty());
        let mut got = Vec::new();
        while !gate.is_empty() {
            let out = gate.poll(Instant::now());
            if !out.is_empty() {
                assert!(
                    layer0.passed().unwrap(),
                    "a write left before layer 0's kernel ran"
                );
            }
            got.extend(out);
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(end.passed().unwrap());
        assert_eq!(posted(&got), vec![1, 2]);
        assert_eq!(got.last(), Some(&Released::Apply(digest(h))));
        drop((layer0, end));
        assert_eq!(dev.live_events(), 0, "every event destroyed");
        // An event the device cannot answer for: the write fails, never leaves unordered.
        let bogus = Fence::record(dev.clone(), stream).unwrap();
        dev.destroy_event(1);
        dev.destroy_event(2);
        dev.destroy_event(3);
        assert!(gate
            .admit(vec![write(3, h, 0, 10_000)], &[h], t0)
            .0
            .is_empty());
        assert_eq!(
            gate.layer_saved(0, Some(&bogus), Instant::now()),
            vec![Released::Fail(JobId(3))]
        );
    }

    #[test]
    fn writes_of_the_forward_s_handoffs_wait_for_their_layer_and_the_digest_for_its_end() {
        let (mine, other) = (handoff(1), handoff(2));
        let t0 = Instant::now();
        let mut gate = ForwardGate::default();
        let load = WorkerOp::LoadRemote {
            agent: "d".into(),
            metadata: vec![],
        };
        let ops = vec![
            load.clone(),
            write(1, mine, 0, 1000),
            write(2, mine, 1, 1000),
            write(3, other, 0, 1000),
            digest(mine),
            digest(other),
        ];
        let (now_ops, failed) = gate.admit(ops, &[mine], t0);
        assert!(failed.is_empty());
        assert_eq!(
            now_ops,
            vec![load, write(3, other, 0, 1000), digest(other)],
            "only the forward's handoff waits; the rest keeps its order"
        );
        assert!(gate.waits_for(1) && gate.waits_for(0) && !gate.waits_for(2));
        let ms = Duration::from_millis;
        assert_eq!(posted(&gate.layer_saved(1, None, t0 + ms(5))), vec![2]);
        assert!(gate.layer_saved(1, None, t0 + ms(6)).is_empty());
        let end = gate.forward_done(None, t0 + ms(9));
        assert_eq!(posted(&end), vec![1], "a layer never named goes at the end");
        assert_eq!(end.last(), Some(&Released::Apply(digest(mine))));
        assert!(gate.is_empty());
    }

    #[test]
    fn a_write_whose_grant_ran_out_during_the_forward_fails_unposted_once_no_renewal_came() {
        let h = handoff(3);
        let t0 = Instant::now();
        let mut gate = ForwardGate::default();
        gate.admit(vec![write(7, h, 0, 50), write(8, h, 1, 500)], &[h], t0);
        let ms = Duration::from_millis;
        assert!(
            gate.layer_saved(0, None, t0 + ms(51)).is_empty(),
            "past its grant: neither posted nor failed yet"
        );
        assert_eq!(posted(&gate.layer_saved(1, None, t0 + ms(500))), vec![8]);
        assert!(gate.poll(t0 + ms(1050)).is_empty(), "still waiting");
        assert!(!gate.is_empty());
        assert_eq!(gate.poll(t0 + ms(1051)), vec![Released::Fail(JobId(7))]);
        assert!(gate.is_empty());
    }

    /// A renewal can reach the worker after the grant it extends ended (every process on its
    /// way may stall on a loaded host): a write saved in that gap waits and goes under it.
    #[test]
    fn a_write_saved_after_its_grant_ended_goes_under_a_renewal_that_came_late() {
        let h = handoff(6);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut gate = ForwardGate::default();
        gate.admit(
            vec![write(1, h, 0, 50), write(2, h, 1, 50), write(3, h, 2, 50)],
            &[h],
            t0,
        );
        assert!(gate.layer_saved(0, None, t0 + ms(60)).is_empty());
        assert!(gate.layer_saved(1, None, t0 + ms(70)).is_empty());
        // A renewal that had ended already lets nothing go (negative control).
        gate.renew(h, 0, t0 + ms(75), t0 + ms(80));
        assert!(gate.poll(t0 + ms(80)).is_empty());
        // Another D rank's grant is not this one's.
        gate.renew(h, 1, t0 + ms(5000), t0 + ms(90));
        assert!(gate.poll(t0 + ms(90)).is_empty());
        // D's renewal arrives: both go, and the next layer goes at once.
        gate.renew(h, 0, t0 + ms(1500), t0 + ms(400));
        assert_eq!(posted(&gate.poll(t0 + ms(400))), vec![1, 2]);
        assert_eq!(posted(&gate.layer_saved(2, None, t0 + ms(410))), vec![3]);
        assert!(gate.is_empty());
    }

    #[test]
    fn a_grant_renewed_during_the_forward_lets_a_held_write_go_past_its_planned_end() {
        let h = handoff(5);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut gate = ForwardGate::default();
        gate.admit(
            vec![write(1, h, 0, 50), write(2, h, 1, 50), write(3, h, 2, 50)],
            &[h],
            t0,
        );
        // D renewed its grant twice while layer 0 computed (the carrier shares the board).
        let carrier = gate.write_grants();
        carrier.renew(h, 0, t0 + ms(400), t0 + ms(40));
        carrier.renew(h, 0, t0 + ms(900), t0 + ms(390));
        // An older renewal arriving late changes nothing; another D rank's is not this one's.
        carrier.renew(h, 0, t0 + ms(300), t0 + ms(395));
        carrier.renew(h, 1, t0 + ms(5000), t0 + ms(395));
        assert_eq!(posted(&gate.layer_saved(0, None, t0 + ms(800))), vec![1]);
        // D stopped granting: the last grant's end holds; past the wait for a renewal, the
        // writes fail without a byte moved.
        assert!(gate.layer_saved(1, None, t0 + ms(901)).is_empty());
        assert_eq!(
            gate.forward_done(None, t0 + ms(2000)),
            vec![Released::Fail(JobId(2))]
        );
        assert_eq!(gate.poll(t0 + ms(3000)), vec![Released::Fail(JobId(3))]);
        // Renewals that ended are forgotten once the forward is over.
        assert_eq!(
            carrier.len(),
            1,
            "only rank 1's still-running renewal is left"
        );
    }

    #[test]
    fn renewals_are_bounded_and_the_ended_ones_go_first() {
        let grants = WriteGrants::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        for i in 0..MAX_RENEWED as u32 {
            let h: HandoffId = format!("{i:032x}").parse().unwrap();
            grants.renew(h, 0, t0 + ms(10), t0);
        }
        let late = handoff(9);
        grants.renew(late, 0, t0 + ms(500), t0 + ms(5));
        assert_eq!(grants.len(), MAX_RENEWED, "full of live renewals: dropped");
        assert_eq!(grants.until(late, 0), None);
        grants.renew(late, 0, t0 + ms(500), t0 + ms(20));
        assert_eq!(grants.len(), 1, "the ended ones made room");
        assert_eq!(grants.until(late, 0), Some(t0 + ms(500)));
    }

    #[test]
    fn an_abort_of_a_held_job_fails_it_without_a_post() {
        let h = handoff(4);
        let mut gate = ForwardGate::default();
        let (now_ops, failed) = gate.admit(
            vec![
                write(5, h, 0, 1000),
                WorkerOp::Abort { job: JobId(5) },
                WorkerOp::Abort { job: JobId(6) },
            ],
            &[h],
            Instant::now(),
        );
        assert_eq!(failed, vec![JobId(5)]);
        assert_eq!(now_ops, vec![WorkerOp::Abort { job: JobId(6) }]);
        assert!(gate.forward_done(None, Instant::now()).is_empty());
        // A write waiting for a renewal is aborted the same way.
        let t0 = Instant::now();
        gate.admit(vec![write(7, h, 0, 10)], &[h], t0);
        assert!(gate
            .layer_saved(0, None, t0 + Duration::from_millis(20))
            .is_empty());
        let (_, failed) = gate.admit(vec![WorkerOp::Abort { job: JobId(7) }], &[], t0);
        assert_eq!(failed, vec![JobId(7)]);
        assert!(gate.is_empty());
    }
}
