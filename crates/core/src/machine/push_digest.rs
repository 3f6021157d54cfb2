//! The KV digest of a pushed handoff (see [`crate::digest`]). P's ranks digest P's blocks once
//! every layer is in them; the sum rides on every `PushDone` (the last layer's WRITEs wait for
//! it). D's ranks digest D's blocks once every write landed; the request is ready only if the
//! two agree — a mismatch fails it (or recomputes it) like a failed transfer, never decoded.
//! A rank that cannot compute its share leaves the handoff unchecked (logged), as in pull. A
//! rank that never answers (its worker stopped) fails the request once D's read timeout passed
//! (`kv_digest_timeout`): the check is bounded like every other wait on D (rules 6 and 7).

use handoff_ledger::{
    ConsumerConfig, FailReason, FailurePolicy, PeerId, RequestId, Time, WaitTimeline,
};
use handoff_proto::HandoffId;

use super::{ConnectorCore, Observation};
use crate::digest::{DigestOf, Shares};
use crate::worker_protocol::WorkerOp;

/// P: where a push's digest stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PushDigest {
    /// No digest (`kv_digest` off).
    Off,
    /// Asked for once every layer is saved.
    Wanted,
    /// Asked of every rank; their shares so far.
    Asked(Shares),
    /// Every rank answered: the digest, or `None` when a rank could not compute its share.
    Known(Option<u64>),
}

impl PushDigest {
    /// Whether the `PushDone`s may go: the digest is known or none is computed.
    pub(crate) fn settled(&self) -> bool {
        matches!(self, PushDigest::Off | PushDigest::Known(_))
    }

    /// What the `PushDone`s carry.
    pub(crate) fn value(&self) -> Option<u64> {
        match self {
            PushDigest::Known(d) => *d,
            _ => None,
        }
    }
}

/// D: what every write of a pushed handoff brought, and P's digest of it.
#[derive(Debug)]
pub(crate) struct Landed {
    pub(crate) p_digest: u64,
    pub(crate) num_tokens: u32,
    pub(crate) requests: Vec<RequestId>,
    pub(crate) blocks: Vec<u32>,
    /// D's prefix-cache blocks before `blocks`: P's digest covers the whole prompt, so D's
    /// would have to as well; with any, the digest is not compared (`digest_comparable`).
    pub(crate) cached: Vec<u32>,
    pub(crate) waited: WaitTimeline,
    pub(crate) peer: PeerId,
}

/// D: a landed push waiting for its ranks' shares.
#[derive(Debug)]
pub(crate) struct Check {
    landed: Landed,
    shares: Shares,
    unchecked: bool,
    answers: usize,
    /// Past it, the ranks that have not answered never will: the request fails.
    deadline: Time,
}

impl ConnectorCore {
    fn digest_of(&self, num_tokens: u32) -> DigestOf {
        DigestOf {
            num_tokens,
            whole_blocks: self.cfg.opaque_blocks,
        }
    }

    /// P: once every layer of `handoff` is in its blocks, asks each rank for its share.
    pub(super) fn ask_push_digest(&mut self, handoff: HandoffId) {
        let num_layers = self.spec.shape.num_layers;
        let ranks = self.ranks.len() as u16;
        let Some(st) = self.transfers.push_mut(handoff) else {
            return;
        };
        if st.digest != PushDigest::Wanted || st.layers_saved < num_layers {
            return;
        }
        st.digest = PushDigest::Asked(Shares::default());
        let (blocks, num_tokens) = (st.blocks.clone(), st.num_tokens);
        let of = self.digest_of(num_tokens);
        for rank in 0..ranks {
            self.out.worker_ops.push((
                rank,
                WorkerOp::Digest {
                    handoff,
                    blocks: blocks.clone(),
                    of,
                },
            ));
        }
    }

    /// D: every write of `handoff` landed; its ranks digest what landed before it is ready.
    pub(super) fn check_push(&mut self, handoff: HandoffId, landed: Landed, now: Time) {
        if !Self::digest_comparable(&landed.cached) {
            tracing::debug!(%handoff, "KV digest not compared: D's prefix cache held the prompt's first blocks");
            self.out.observations.push(Observation::DigestNotCompared);
            self.kv_ready(landed.requests, landed.blocks, landed.waited);
            return;
        }
        let read_timeout = self
            .consumer
            .as_ref()
            .map_or(ConsumerConfig::default().read_timeout, |c| {
                c.config().read_timeout
            });
        let deadline = now + read_timeout;
        let of = self.digest_of(landed.num_tokens);
        let blocks = [&landed.cached[..], &landed.blocks[..]].concat();
        for rank in 0..self.ranks.len() as u16 {
            self.out.worker_ops.push((
                rank,
                WorkerOp::Digest {
                    handoff,
                    blocks: blocks.clone(),
                    of,
                },
            ));
        }
        self.push_checks.insert(
            handoff,
            Check {
                landed,
                shares: Shares::default(),
                unchecked: false,
                answers: 0,
                deadline,
            },
        );
    }

    /// D: whether a request whose KV cannot be used is computed here (else it fails).
    fn recomputes(&self) -> bool {
        self.consumer
            .as_ref()
            .is_some_and(|c| c.config().failure_policy == FailurePolicy::Recompute)
    }

    /// D: when the oldest push digest check in progress gives up.
    pub(super) fn next_push_check_deadline(&self) -> Option<Time> {
        self.push_checks.values().map(|c| c.deadline).min()
    }

    /// D: fails the requests of every check whose ranks did not all answer in time.
    pub(super) fn expire_push_checks(&mut self, now: Time) {
        let late: Vec<HandoffId> = self
            .push_checks
            .iter()
            .filter(|(_, c)| c.deadline <= now)
            .map(|(h, _)| *h)
            .collect();
        for handoff in late {
            let Some(check) = self.push_checks.remove(&handoff) else {
                continue;
            };
            tracing::warn!(%handoff, answers = check.answers, "KV digest not answered in time; not decoded");
            let Landed {
                requests,
                peer,
                blocks,
                ..
            } = check.landed;
            let recompute = self.recomputes();
            self.failed(requests, "kv_digest_timeout", peer, recompute, None);
            // No request decodes these blocks, and nobody else releases them (see below).
            self.blocks_back(handoff, blocks, "kv_digest_timeout");
        }
    }

    /// A worker's share of a push digest (`None`: it could not compute one), on P or on D.
    pub(super) fn push_digest_share(&mut self, handoff: HandoffId, share: Option<u64>, now: Time) {
        let ranks = self.ranks.len();
        if let Some(st) = self.transfers.push_mut(handoff) {
            if let PushDigest::Asked(shares) = &mut st.digest {
                match share {
                    Some(s) => {
                        shares.add(s);
                        if let Some(total) = shares.total(ranks) {
                            st.digest = PushDigest::Known(Some(total));
                        }
                    }
                    None => st.digest = PushDigest::Known(None),
                }
                if st.digest.settled() {
                    self.advance_push(handoff, now);
                }
            }
            return;
        }
        let Some(check) = self.push_checks.get_mut(&handoff) else {
            return;
        };
        check.answers += 1;
        match share {
            Some(s) => check.shares.add(s),
            None => check.unchecked = true,
        }
        if check.answers < ranks {
            return;
        }
        let Some(check) = self.push_checks.remove(&handoff) else {
            return;
        };
        let Landed {
            p_digest,
            requests,
            blocks,
            waited,
            peer,
            ..
        } = check.landed;
        match check.shares.total(ranks).filter(|_| !check.unchecked) {
            None => {
                tracing::warn!(%handoff, "KV digest not checked: a rank could not compute its share");
                self.kv_ready(requests, blocks, waited);
            }
            Some(d) if d == p_digest => {
                tracing::debug!(%handoff, "KV digest matched P's");
                self.out
                    .observations
                    .push(Observation::DigestChecked { matched: true });
                self.kv_ready(requests, blocks, waited);
            }
            Some(_) => {
                tracing::warn!(%handoff, "KV digest mismatch: the landed KV differs from P's; not decoded");
                self.out
                    .observations
                    .push(Observation::DigestChecked { matched: false });
                let recompute = self.recomputes();
                self.failed(
                    requests,
                    FailReason::DigestMismatch.as_str(),
                    peer,
                    recompute,
                    None,
                );
                // Every write into them ended (the ledger saw every PushDone, and their grant
                // was revoked), and the ledger handed them over with its ready outcome: no
                // request decodes them and nobody else ever releases them.
                self.blocks_back(handoff, blocks, FailReason::DigestMismatch.as_str());
            }
        }
    }
}
