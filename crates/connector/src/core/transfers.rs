//! Transfers in flight: D's reads (pull) and P's per-layer writes (push), as jobs the workers
//! post. The write gate lives here: a layer is posted only once it was saved, and only on a
//! registration grant the producer ledger still honours (rule 3).

use std::collections::HashMap;

use handoff_ledger::{PeerId, PushWrite, StartRead, Time};
use handoff_plan::RankLayout;
use handoff_proto::{encode, HandoffId, Message, PushDone};
use handoff_transport::{XferDesc, XferOp};

use super::peers::PeerState;
use super::push_digest::PushDigest;
use super::{ConnectorCore, Observation};
use crate::digest::{DigestOf, Shares};
use crate::step::{JobId, PushLayer, TransferJob, TransferPart};

#[derive(Debug, Clone, Copy)]
enum JobOwner {
    Read { handoff: HandoffId, d_rank: u16 },
    Write { handoff: HandoffId, d_rank: u16 },
}

#[derive(Debug)]
struct ReadInFlight {
    started: Time,
    bytes: u64,
    descs: usize,
    /// Per D rank, its job still running.
    jobs: HashMap<u16, JobId>,
    /// With a KV digest from P: P's digest, and D's ranks' shares so far.
    digest: Option<(u64, Shares)>,
}

/// What D's KV digest check found once every rank's read ended.
enum DigestCheck {
    Matched,
    Mismatched,
    /// Not asked for, or a share is missing (a failed rank, a worker that could not compute it).
    Unchecked,
}

/// P, push mode: one handoff's prefill and the writes into each registered D rank.
#[derive(Debug)]
pub(super) struct PushState {
    pub(super) blocks: Vec<u32>,
    pub(super) num_tokens: u32,
    pub(super) layers_saved: u32,
    writes: HashMap<u16, ActiveWrite>,
    /// The KV digest the `PushDone`s carry (see `push_digest`).
    pub(super) digest: PushDigest,
}

#[derive(Debug)]
struct ActiveWrite {
    d_peer: PeerId,
    d_blocks: Vec<u32>,
    /// D's prefix-cache hit (D's blocks): `d_blocks` take the prompt from there on.
    cached_blocks: u32,
    done: Vec<PushDone>,
    layers_posted: u32,
    /// Jobs posted and not yet ended: (posting P rank, job).
    jobs: Vec<(u16, JobId)>,
    failed: bool,
    aborted: bool,
    started: Time,
    bytes: u64,
    descs: usize,
}

/// Bookkeeping of the transfers in flight. Entries end with their handoff: reads when every
/// rank's job ended, pushes when the producer ledger releases the handoff.
#[derive(Debug, Default)]
pub(super) struct Transfers {
    reads: HashMap<HandoffId, ReadInFlight>,
    pushes: HashMap<HandoffId, PushState>,
    jobs: HashMap<JobId, JobOwner>,
    next_job: u64,
}

impl Transfers {
    fn new_job(&mut self, owner: JobOwner) -> JobId {
        self.next_job += 1;
        let id = JobId(self.next_job);
        self.jobs.insert(id, owner);
        id
    }

    pub fn start_push(
        &mut self,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
        digest: bool,
    ) {
        self.pushes.insert(
            handoff,
            PushState {
                blocks,
                num_tokens,
                layers_saved: 0,
                writes: HashMap::new(),
                digest: if digest {
                    PushDigest::Wanted
                } else {
                    PushDigest::Off
                },
            },
        );
    }

    pub(super) fn push_mut(&mut self, handoff: HandoffId) -> Option<&mut PushState> {
        self.pushes.get_mut(&handoff)
    }

    /// Returns whether the handoff is a push in flight.
    pub fn layer_saved(&mut self, handoff: HandoffId, layer: u32) -> bool {
        match self.pushes.get_mut(&handoff) {
            Some(p) => {
                p.layers_saved = p.layers_saved.max(layer.saturating_add(1));
                true
            }
            None => false,
        }
    }

    /// The producer ledger says: write into this registration. False when the handoff has no
    /// push in flight here.
    pub fn add_write(&mut self, w: PushWrite, now: Time) -> bool {
        let Some(st) = self.pushes.get_mut(&w.handoff) else {
            return false;
        };
        st.writes.insert(
            w.d_rank,
            ActiveWrite {
                d_peer: w.d_peer,
                d_blocks: w.dst_blocks,
                cached_blocks: w.cached_blocks,
                done: w.done,
                layers_posted: 0,
                jobs: Vec::new(),
                failed: false,
                aborted: false,
                started: now,
                bytes: 0,
                descs: 0,
            },
        );
        true
    }

    /// The handoff ended on P: forget its push; returns the jobs still posted (to abort).
    pub fn end_push(&mut self, handoff: HandoffId) -> Vec<(u16, JobId)> {
        let Some(st) = self.pushes.remove(&handoff) else {
            return Vec::new();
        };
        let mut left = Vec::new();
        for w in st.writes.into_values() {
            for (rank, job) in w.jobs {
                self.jobs.remove(&job);
                left.push((rank, job));
            }
        }
        left
    }

    pub fn reads_len(&self) -> usize {
        self.reads.len()
    }

    pub fn pushes_len(&self) -> usize {
        self.pushes.len()
    }

    pub fn jobs_len(&self) -> usize {
        self.jobs.len()
    }

    /// A D worker's share of the KV digest of what its read job landed.
    pub fn add_digest_share(&mut self, job: JobId, share: u64) {
        let Some(JobOwner::Read { handoff, .. }) = self.jobs.get(&job) else {
            return;
        };
        if let Some((_, shares)) = self.reads.get_mut(handoff).and_then(|r| r.digest.as_mut()) {
            shares.add(share);
        }
    }
}

impl ConnectorCore {
    /// D: plan a handoff's reads and post one job per D rank (each rank reads from every P rank
    /// it pairs with; the READ of each pair carries that pair's `PullDone`).
    pub(super) fn start_read(&mut self, r: StartRead, now: Time) {
        let d_tp = self.spec.tp as u16;
        let opaque = self.cfg.opaque_blocks;
        let digest = r.p_digest.filter(|_| self.cfg.kv_digest);
        let fail_all = |core: &mut ConnectorCore, why: String| {
            tracing::warn!(handoff = %r.handoff, %why, "read not started");
            if let Some(c) = core.consumer.as_mut() {
                for rank in 0..d_tp {
                    c.on_read_done(r.handoff, rank, false, now);
                }
            }
        };
        let Some(peer) = self.peers.get(r.p_peer) else {
            return fail_all(self, "unknown P".into());
        };
        if peer.state != PeerState::Ready || peer.layouts.is_empty() {
            return fail_all(self, "P not connected".into());
        }
        let d_layouts: Vec<RankLayout> = self.ranks.iter().map(|x| x.layout.clone()).collect();
        // A prefix cache hit on D: its blocks hold the prompt's first tokens and other requests
        // may be reading them, so the READ starts after them (P's blocks from the same token).
        let p_block_size = peer.layouts[0].spec.block_size;
        let skip = r.cached_blocks.len() as u32 * self.spec.block_size;
        let src_blocks = match r.src_blocks.get((skip / p_block_size.max(1)) as usize..) {
            Some(src) if skip % p_block_size.max(1) == 0 && skip < r.num_tokens => src,
            _ => {
                return fail_all(
                    self,
                    format!(
                        "{skip} cached tokens do not end a block of P's ({p_block_size} tokens) \
                         inside the prompt"
                    ),
                )
            }
        };
        let tokens = r.num_tokens - skip;
        // Move whole blocks where both sides have them: the tail of the last block costs a
        // descriptor per head and layer when cut at the last token, and nothing when moved with
        // the rest of its run. The bytes past the prompt are zeroed on arrival.
        let planned_tokens = whole_blocks(
            (src_blocks, p_block_size),
            (&r.dst_blocks, self.spec.block_size),
            tokens,
        );
        let plan = match handoff_plan::plan(
            &peer.layouts,
            &d_layouts,
            src_blocks,
            &r.dst_blocks,
            planned_tokens,
        ) {
            Ok(p) => p,
            Err(e) => return fail_all(self, e.to_string()),
        };
        let mut parts: HashMap<u16, Vec<TransferPart>> = HashMap::new();
        let mut broken: Vec<u16> = Vec::new();
        let mut bytes = 0;
        let mut descs = 0;
        for pair in &plan.pairs {
            let d_rank = pair.d_rank as u16;
            let p_rank = pair.p_rank as u16;
            // D reads: its own memory is the destination.
            let list = xfer_descs(&pair.descriptors, XferOp::Read);
            bytes += list.iter().map(|d| d.len).sum::<u64>();
            descs += list.len();
            let notification = r
                .done
                .iter()
                .find(|n| n.consumer_rank == d_rank && n.p_rank == p_rank)
                .and_then(|n| encode(&Message::PullDone(*n)).ok());
            match peer.agents.get(p_rank as usize) {
                Some(agent) if d_rank < d_tp => {
                    parts.entry(d_rank).or_default().push(TransferPart {
                        agent: agent.clone(),
                        descs: list,
                        notification,
                    })
                }
                _ => broken.push(d_rank),
            }
        }
        // The whole prompt's KV is digested, the cached prefix included: P's digest covers
        // every token.
        let digested = digest.map(|_| {
            let blocks = [&r.cached_blocks[..], &r.dst_blocks[..]].concat();
            let of = DigestOf {
                num_tokens: r.num_tokens,
                whole_blocks: opaque,
            };
            (blocks, of)
        });
        let mut jobs = HashMap::new();
        let mut failed_ranks = Vec::new();
        for d_rank in 0..d_tp {
            match parts.remove(&d_rank) {
                Some(parts) if !broken.contains(&d_rank) => {
                    let job = self.transfers.new_job(JobOwner::Read {
                        handoff: r.handoff,
                        d_rank,
                    });
                    self.out.transfers_to_post.push((
                        d_rank,
                        TransferJob {
                            job,
                            op: XferOp::Read,
                            parts,
                            zero_tail: (!opaque).then(|| (r.dst_blocks.clone(), tokens)),
                            digest: digested.clone(),
                            push_layer: None,
                        },
                    ));
                    jobs.insert(d_rank, job);
                }
                _ => failed_ranks.push(d_rank),
            }
        }
        if !jobs.is_empty() {
            self.transfers.reads.insert(
                r.handoff,
                ReadInFlight {
                    started: now,
                    bytes,
                    descs,
                    jobs,
                    digest: digest.map(|p| (p, Shares::default())),
                },
            );
        }
        if let Some(c) = self.consumer.as_mut() {
            for rank in failed_ranks {
                c.on_read_done(r.handoff, rank, false, now);
            }
        }
    }

    /// D: the ledger gave up on a read (deadline, dead P). Every rank's job is aborted; each
    /// reports its end, which the ledger waits for before it frees the blocks.
    pub(super) fn cancel_read(&mut self, handoff: HandoffId) {
        if let Some(read) = self.transfers.reads.get(&handoff) {
            for (rank, job) in &read.jobs {
                self.out.transfers_to_abort.push((*rank, *job));
            }
        }
    }

    pub(super) fn job_ended(&mut self, job: JobId, ok: bool, now: Time) {
        let Some(owner) = self.transfers.jobs.remove(&job) else {
            return; // aborted with its handoff, or never ours
        };
        match owner {
            JobOwner::Read { handoff, d_rank } => {
                let mut check = DigestCheck::Unchecked;
                if let Some(read) = self.transfers.reads.get_mut(&handoff) {
                    read.jobs.remove(&d_rank);
                    if read.jobs.is_empty() {
                        if let Some(read) = self.transfers.reads.remove(&handoff) {
                            self.out.observations.push(Observation::Transfer {
                                bytes: read.bytes,
                                duration: now.saturating_sub(read.started),
                                descriptors: read.descs,
                            });
                            let d_tp = self.spec.tp as usize;
                            check = match read.digest {
                                Some((p, d)) if ok => match d.total(d_tp) {
                                    Some(d) if d == p => DigestCheck::Matched,
                                    Some(_) => DigestCheck::Mismatched,
                                    None => DigestCheck::Unchecked,
                                },
                                _ => DigestCheck::Unchecked,
                            };
                        }
                    }
                }
                match check {
                    DigestCheck::Matched => {
                        tracing::debug!(%handoff, "KV digest matched P's");
                        self.out
                            .observations
                            .push(Observation::DigestChecked { matched: true })
                    }
                    DigestCheck::Mismatched => {
                        tracing::warn!(%handoff, "KV digest mismatch: the landed KV differs from P's; not decoded");
                        self.out
                            .observations
                            .push(Observation::DigestChecked { matched: false });
                    }
                    DigestCheck::Unchecked => {}
                }
                if let Some(c) = self.consumer.as_mut() {
                    if matches!(check, DigestCheck::Mismatched) {
                        c.on_read_mismatch(handoff, d_rank, now);
                    } else {
                        c.on_read_done(handoff, d_rank, ok, now);
                    }
                }
            }
            JobOwner::Write { handoff, d_rank } => {
                if let Some(w) = self
                    .transfers
                    .pushes
                    .get_mut(&handoff)
                    .and_then(|st| st.writes.get_mut(&d_rank))
                {
                    w.jobs.retain(|(_, j)| *j != job);
                    w.failed |= !ok;
                }
                self.advance_push(handoff, now);
            }
        }
    }

    /// P: the ledger aborts the writes of one registration (cancelled, expired, peer gone). Its
    /// end is reported once every posted job confirmed it stopped.
    pub(super) fn abort_write(&mut self, handoff: HandoffId, d_rank: u16, now: Time) {
        if let Some(w) = self
            .transfers
            .pushes
            .get_mut(&handoff)
            .and_then(|st| st.writes.get_mut(&d_rank))
        {
            w.aborted = true;
            for (rank, job) in &w.jobs {
                self.out.transfers_to_abort.push((*rank, *job));
            }
        }
        self.advance_push(handoff, now);
    }

    /// P, push mode: posts the layers that are ready into every granted registration of
    /// `handoff`, and reports each registration's writes to the ledger once they all ended.
    pub(super) fn advance_push(&mut self, handoff: HandoffId, now: Time) {
        let num_layers = self.spec.shape.num_layers;
        let Some(st) = self.transfers.pushes.get_mut(&handoff) else {
            return;
        };
        let mut ended: Vec<(u16, bool)> = Vec::new();
        let mut posts: Vec<(u16, TransferJob)> = Vec::new();
        let mut new_jobs: Vec<(JobId, u16)> = Vec::new();
        let mut observations = Vec::new();
        let my_layouts: Vec<RankLayout> = self.ranks.iter().map(|x| x.layout.clone()).collect();
        let (opaque, my_block_size) = (self.cfg.opaque_blocks, self.spec.block_size);
        let next_job = &mut self.transfers.next_job;
        for (d_rank, w) in st.writes.iter_mut() {
            if w.aborted || w.failed {
                if w.jobs.is_empty() {
                    ended.push((*d_rank, false));
                }
                continue;
            }
            if w.layers_posted == num_layers {
                if w.jobs.is_empty() {
                    observations.push(Observation::Transfer {
                        bytes: w.bytes,
                        duration: now.saturating_sub(w.started),
                        descriptors: w.descs,
                    });
                    ended.push((*d_rank, true));
                }
                continue;
            }
            let Some(peer) = self.peers.get(w.d_peer) else {
                w.failed = true;
                if w.jobs.is_empty() {
                    ended.push((*d_rank, false));
                }
                continue;
            };
            // D's prefix-cache hit: D's blocks before `d_blocks` hold the prompt's first tokens
            // (and other requests may be reading them), so the writes start at the token after
            // them, from P's block that holds it.
            let d_block_size = peer.layouts[0].spec.block_size;
            let skip = w.cached_blocks.saturating_mul(d_block_size);
            let src_blocks = match st.blocks.get((skip / my_block_size.max(1)) as usize..) {
                Some(src) if skip % my_block_size.max(1) == 0 && skip < st.num_tokens => src,
                _ => {
                    tracing::warn!(
                        %handoff,
                        skip,
                        "D's cached prefix does not end on a block of P's inside the prompt"
                    );
                    w.failed = true;
                    if w.jobs.is_empty() {
                        ended.push((*d_rank, false));
                    }
                    continue;
                }
            };
            let prompt_left = st.num_tokens - skip;
            while w.layers_posted < st.layers_saved.min(num_layers) {
                let layer = w.layers_posted;
                let last = layer + 1 == num_layers;
                // The completion rides on the last layer's WRITE, posted only once every
                // earlier one landed (a backend may complete transfers out of order), and once
                // the digest it carries is known.
                if last && (!w.jobs.is_empty() || !st.digest.settled()) {
                    break;
                }
                // Rule 3: post only on a registration grant that is still valid.
                let Some(until) = self
                    .producer
                    .as_ref()
                    .and_then(|p| p.write_permit(handoff, *d_rank, now).ok())
                else {
                    break;
                };
                let post_within = until
                    .saturating_sub(now)
                    .saturating_sub(self.cfg.producer.write_margin);
                let push_layer = PushLayer {
                    handoff,
                    layer,
                    post_within_ms: post_within.as_millis().min(u32::MAX as u128) as u32,
                };
                // Opaque pages go whole (no one knows where a token's bytes are in them);
                // otherwise only the prompt's tokens, D zeroed the rest when it registered.
                let tokens = if opaque {
                    whole_blocks(
                        (src_blocks, my_block_size),
                        (&w.d_blocks, d_block_size),
                        prompt_left,
                    )
                } else {
                    prompt_left
                };
                let plan = match handoff_plan::plan_layers(
                    &my_layouts,
                    &peer.layouts,
                    src_blocks,
                    &w.d_blocks,
                    tokens,
                    layer..layer + 1,
                ) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(%handoff, error = %e, "push plan failed");
                        w.failed = true;
                        break;
                    }
                };
                for pair in plan.pairs.iter().filter(|p| p.d_rank as u16 == *d_rank) {
                    let p_rank = pair.p_rank as u16;
                    let Some(agent) = peer.agents.get(*d_rank as usize) else {
                        w.failed = true;
                        continue;
                    };
                    // P writes: its own memory is the source.
                    let descs = xfer_descs(&pair.descriptors, XferOp::Write);
                    w.bytes += descs.iter().map(|d| d.len).sum::<u64>();
                    w.descs += descs.len();
                    let notification = if last {
                        w.done
                            .iter()
                            .find(|n| n.p_rank == p_rank && n.d_rank == *d_rank)
                            .and_then(|n| {
                                let digest = st.digest.value();
                                encode(&Message::PushDone(PushDone { digest, ..*n })).ok()
                            })
                    } else {
                        None
                    };
                    *next_job += 1;
                    let job = JobId(*next_job);
                    new_jobs.push((job, *d_rank));
                    w.jobs.push((p_rank, job));
                    posts.push((
                        p_rank,
                        TransferJob {
                            job,
                            op: XferOp::Write,
                            parts: vec![TransferPart {
                                agent: agent.clone(),
                                descs,
                                notification,
                            }],
                            zero_tail: None,
                            digest: None,
                            push_layer: Some(push_layer),
                        },
                    ));
                }
                w.layers_posted += 1;
            }
            if w.failed && w.jobs.is_empty() {
                ended.push((*d_rank, false));
            }
        }
        for (d_rank, _) in &ended {
            st.writes.remove(d_rank);
        }
        for (job, d_rank) in new_jobs {
            self.transfers
                .jobs
                .insert(job, JobOwner::Write { handoff, d_rank });
        }
        self.out.transfers_to_post.extend(posts);
        self.out.observations.extend(observations);
        if let Some(p) = self.producer.as_mut() {
            for (d_rank, ok) in ended {
                p.on_push_write_done(handoff, d_rank, ok, now);
            }
        }
    }
}

/// How many tokens to move so that whole blocks go where both sides have them (the planner
/// cuts at this many tokens): at least the prompt's `num_tokens`.
fn whole_blocks(p: (&[u32], u32), d: (&[u32], u32), num_tokens: u32) -> u32 {
    let p_cap = p.0.len() as u64 * p.1 as u64;
    let d_cap = d.0.len() as u64 * d.1 as u64;
    p_cap.min(d_cap).max(num_tokens as u64) as u32
}

/// The planner's descriptors (P memory → D memory) as the transport's, seen from the side that
/// posts: D posts READs into its memory, P posts WRITEs from its memory.
fn xfer_descs(descs: &[handoff_plan::Descriptor], op: XferOp) -> Vec<XferDesc> {
    descs
        .iter()
        .map(|d| match op {
            XferOp::Read => XferDesc {
                local_region: d.dst_region,
                local_offset: d.dst_offset,
                remote_region: d.src_region,
                remote_offset: d.src_offset,
                len: d.len,
            },
            XferOp::Write => XferDesc {
                local_region: d.src_region,
                local_offset: d.src_offset,
                remote_region: d.dst_region,
                remote_offset: d.dst_offset,
                len: d.len,
            },
        })
        .collect()
}
