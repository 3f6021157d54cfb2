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

use std::time::{Duration, Instant};

use handoff_proto::HandoffId;

use crate::step::{JobId, PushLayer, TransferJob, WorkerOp};

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

#[derive(Debug, Default)]
pub struct ForwardGate {
    /// Jobs waiting for their layer, with the instant they must be posted by.
    jobs: Vec<(Instant, PushLayer, TransferJob)>,
    /// Digests waiting for the forward's end.
    digests: Vec<WorkerOp>,
}

impl ForwardGate {
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
                WorkerOp::Abort { job } => match self.jobs.iter().position(|h| h.2.job == job) {
                    Some(i) => {
                        self.jobs.remove(i);
                        failed.push(job);
                    }
                    None => apply.push(WorkerOp::Abort { job }),
                },
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
        self.jobs.is_empty() && self.digests.is_empty()
    }

    /// The forward saved `layer`: its jobs go.
    pub fn layer_saved(&mut self, layer: u32, now: Instant) -> Vec<Released> {
        let (due, kept) = std::mem::take(&mut self.jobs)
            .into_iter()
            .partition(|h| h.1.layer == layer);
        self.jobs = kept;
        due.into_iter()
            .map(|h| {
                tracing::debug!(handoff = %h.1.handoff, layer, "push write leaves as its layer is saved");
                Self::release(h, now)
            })
            .collect()
    }

    /// The forward ended: every held job goes (a layer the engine never named as saved is in
    /// its blocks now), then the digests.
    pub fn forward_done(&mut self, now: Instant) -> Vec<Released> {
        let mut out: Vec<Released> = std::mem::take(&mut self.jobs)
            .into_iter()
            .map(|h| Self::release(h, now))
            .collect();
        out.extend(self.digests.drain(..).map(Released::Apply));
        out
    }

    fn release((by, p, job): (Instant, PushLayer, TransferJob), now: Instant) -> Released {
        if now <= by {
            Released::Post(job)
        } else {
            tracing::warn!(
                handoff = %p.handoff,
                layer = p.layer,
                "push write not posted: its registration grant ran out while the forward ran"
            );
            Released::Fail(job.job)
        }
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
        assert_eq!(posted(&gate.layer_saved(1, t0 + ms(5))), vec![2]);
        assert!(gate.layer_saved(1, t0 + ms(6)).is_empty());
        let end = gate.forward_done(t0 + ms(9));
        assert_eq!(posted(&end), vec![1], "a layer never named goes at the end");
        assert_eq!(end.last(), Some(&Released::Apply(digest(mine))));
        assert!(gate.is_empty());
    }

    #[test]
    fn a_write_whose_grant_ran_out_during_the_forward_fails_unposted() {
        let h = handoff(3);
        let t0 = Instant::now();
        let mut gate = ForwardGate::default();
        gate.admit(vec![write(7, h, 0, 50), write(8, h, 1, 500)], &[h], t0);
        let ms = Duration::from_millis;
        assert_eq!(
            gate.layer_saved(0, t0 + ms(51)),
            vec![Released::Fail(JobId(7))]
        );
        assert_eq!(posted(&gate.layer_saved(1, t0 + ms(500))), vec![8]);
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
        assert!(gate.forward_done(Instant::now()).is_empty());
    }
}
