//! Transfers in flight: D's reads (pull) and P's per-layer writes (push), as jobs the workers
//! post. The write gate lives here: a layer is posted only once it was saved, and only on a
//! registration grant the producer ledger still honours (rule 3).
//!
//! A read goes in stages: one READ job per D rank for the layers P has saved, the next stage
//! for the layers saved meanwhile once every rank's job of the one before landed. A classic pull
//! is one stage of every layer; a layer-wise pull has as many as P's saves outpace the READs.
//! Only the stage of the last layers carries the `PullDone`s, zeroes the tail and digests what
//! landed, and the ledger hears of the read once, when it is over.
//!
//! One file, over 800 lines: reads and writes share the job table, the stages and the gate that
//! posts a job only on a grant still honoured.

use std::collections::{BTreeMap, HashMap};

use handoff_ledger::{PeerId, PushWrite, StartRead, Time};
use handoff_plan::RankLayout;
use handoff_proto::xfer::{XferDesc, XferOp};
use handoff_proto::{encode_as, HandoffId, Message, PushDone};

use super::peers::PeerState;
use super::push_digest::PushDigest;
use super::runs::{self, SideBlocks};
use super::{ConnectorCore, Observation};
use crate::digest::{DigestOf, Shares};
use crate::worker_protocol::{JobId, PushLayer, TransferJob, TransferPart, WorkerOp};

#[derive(Debug, Clone, Copy)]
enum JobOwner {
    Read { handoff: HandoffId, d_rank: u16 },
    Write { handoff: HandoffId, d_rank: u16 },
}

#[derive(Debug)]
struct ReadInFlight {
    /// What the ledger asked for; its `p_digest` is P's latest.
    read: StartRead,
    started: Time,
    bytes: u64,
    descs: usize,
    /// Per D rank, its job of the stage in flight still running.
    jobs: BTreeMap<u16, JobId>,
    /// Layers posted so far, and saved on P (as P's latest list says; all of them in a classic
    /// pull).
    posted: u32,
    saved: u32,
    /// A job failed, or the ledger cancelled the read: no stage follows.
    failed: bool,
    cancelled: bool,
    /// Posted with the last stage, with a KV digest from P: P's digest, and D's ranks' shares.
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
    /// The writes were planned before the forward pass that produces their layers (vLLM):
    /// the workers hold them until each layer is saved, so D's renewed grants must reach them
    /// mid-forward ([`WorkerOp::RenewWrites`]).
    pub(super) held_for_forward: bool,
    writes: BTreeMap<u16, ActiveWrite>,
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
    /// The most bytes one P rank writes of one layer here (each layer's WRITEs are alike):
    /// what a held WRITE needs its grant to have time left for.
    layer_bytes: u64,
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
                held_for_forward: false,
                writes: BTreeMap::new(),
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
                layer_bytes: 0,
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
    /// D: a handoff's read starts with the layers P saved (every one in a classic pull), on the
    /// grant the ledger checked.
    pub(super) fn start_read(&mut self, r: StartRead, now: Time) {
        let num_layers = self.spec.shape.num_layers;
        let handoff = r.handoff;
        let saved = layers_saved(r.layers, num_layers);
        self.transfers.reads.insert(
            handoff,
            ReadInFlight {
                read: r,
                started: now,
                bytes: 0,
                descs: 0,
                jobs: BTreeMap::new(),
                posted: 0,
                saved,
                failed: false,
                cancelled: false,
                digest: None,
            },
        );
        self.advance_read(handoff, true, now);
    }

    /// D, layer-wise pull: P saved more layers of a handoff being read.
    pub(super) fn read_more(
        &mut self,
        handoff: HandoffId,
        layers: Option<u32>,
        p_digest: Option<u64>,
        now: Time,
    ) {
        let num_layers = self.spec.shape.num_layers;
        let Some(read) = self.transfers.reads.get_mut(&handoff) else {
            return;
        };
        read.saved = read.saved.max(layers_saved(layers, num_layers));
        read.read.p_digest = p_digest;
        self.advance_read(handoff, false, now);
    }

    /// Posts the next stage of a read when none is in flight and P saved layers not read yet;
    /// a stage after the first only on the ledger's word that its grant still holds
    /// (`permitted`: the ledger checked it for this one already).
    fn advance_read(&mut self, handoff: HandoffId, permitted: bool, now: Time) {
        let num_layers = self.spec.shape.num_layers;
        let Some(read) = self.transfers.reads.get(&handoff) else {
            return;
        };
        if !read.jobs.is_empty() || read.failed || read.cancelled || read.saved <= read.posted {
            return;
        }
        let layers = read.posted..read.saved;
        let last = read.saved == num_layers;
        if !permitted
            && !self
                .consumer
                .as_mut()
                .is_some_and(|c| c.permit_read_more(handoff, now))
        {
            return;
        }
        match self.plan_read_stage(handoff, layers.clone(), last) {
            Ok(posts) => {
                let read = self
                    .transfers
                    .reads
                    .get_mut(&handoff)
                    .expect("looked up above");
                read.posted = layers.end;
                self.out.observations.push(Observation::ReadStage);
                for (d_rank, job, bytes, descs) in posts {
                    read.jobs.insert(d_rank, job.job);
                    read.bytes += bytes;
                    read.descs += descs;
                    self.out.transfers_to_post.push((d_rank, job));
                }
                if last {
                    let comparable = Self::digest_comparable(&read.read.cached_blocks);
                    read.digest = read
                        .read
                        .p_digest
                        .filter(|_| self.cfg.kv_digest && comparable)
                        .map(|p| (p, Shares::default()));
                }
            }
            Err(why) => {
                tracing::warn!(%handoff, %why, "read not started");
                if let Some(read) = self.transfers.reads.get_mut(&handoff) {
                    read.failed = true;
                }
                self.finish_read(handoff, now);
            }
        }
    }

    /// One READ job per D rank for `layers` of a handoff's read (each rank reads from every P
    /// rank it pairs with); the last stage's READ of each pair carries that pair's `PullDone`.
    /// Each job comes with its bytes and descriptors.
    fn plan_read_stage(
        &mut self,
        handoff: HandoffId,
        layers: std::ops::Range<u32>,
        last: bool,
    ) -> Result<Vec<(u16, TransferJob, u64, usize)>, String> {
        let d_tp = self.spec.tp as u16;
        let opaque = self.cfg.opaque_blocks;
        let kv_digest = self.cfg.kv_digest;
        let r = &self.transfers.reads.get(&handoff).ok_or("no read")?.read;
        let peer = self.peers.get(r.p_peer).ok_or("unknown P")?;
        if peer.state != PeerState::Ready || peer.layouts.is_empty() {
            return Err("P not connected".into());
        }
        let d_layouts: Vec<RankLayout> = self.ranks.iter().map(|x| x.layout.clone()).collect();
        // A prefix cache hit on D: its blocks hold the prompt's first tokens and other requests
        // may be reading them, so the READ starts after them (P's blocks from the same token).
        let skip = r.cached_blocks.len() as u32 * self.spec.block_size;
        // Whole blocks where both sides have them: the tail of the last block costs a
        // descriptor per head and layer when cut at the last token, and nothing when moved with
        // the rest of its run. The bytes past the prompt are zeroed on arrival.
        let moved = runs::moved_runs(
            &self.groups,
            self.spec.shape.num_layers,
            (
                SideBlocks {
                    blocks: &r.src_blocks,
                    block_size: peer.layouts[0].spec.block_size,
                },
                SideBlocks {
                    blocks: &r.dst_blocks,
                    block_size: self.spec.block_size,
                },
            ),
            r.num_tokens,
            skip,
            opaque,
        )?;
        // The prompt's tokens D's blocks take (its hit's are not moved).
        let tokens = r.num_tokens - skip;
        let plan =
            runs::plan(&peer.layouts, &d_layouts, &moved, layers).map_err(|e| e.to_string())?;
        // Ordered by rank: the jobs go out in the same order for the same inputs.
        let mut parts: BTreeMap<u16, (Vec<TransferPart>, u64, usize)> = BTreeMap::new();
        for pair in &plan.pairs {
            let d_rank = pair.d_rank as u16;
            let p_rank = pair.p_rank as u16;
            // D reads: its own memory is the destination.
            let list = xfer_descs(&pair.descriptors, XferOp::Read);
            let notification = r
                .done
                .iter()
                .find(|n| last && n.consumer_rank == d_rank && n.p_rank == p_rank)
                .and_then(|n| encode_as(&Message::PullDone(*n), peer.version).ok());
            let agent = peer
                .agents
                .get(p_rank as usize)
                .filter(|_| d_rank < d_tp)
                .ok_or_else(|| format!("no agent for P rank {p_rank} or D rank {d_rank}"))?;
            let entry = parts.entry(d_rank).or_default();
            entry.1 += list.iter().map(|d| d.len).sum::<u64>();
            entry.2 += list.len();
            entry.0.push(TransferPart {
                agent: agent.clone(),
                descs: list,
                notification,
            });
        }
        // The whole prompt's KV is digested: P's digest covers every token (and so none is
        // asked for when D's prefix cache held the first blocks).
        let comparable = Self::digest_comparable(&r.cached_blocks);
        let digested = r
            .p_digest
            .filter(|_| last && kv_digest && comparable)
            .map(|_| {
                let blocks = [&r.cached_blocks[..], &r.dst_blocks[..]].concat();
                let of = DigestOf {
                    num_tokens: r.num_tokens,
                    whole_blocks: opaque,
                };
                (blocks, of)
            });
        // A hybrid model's runs move exactly the prompt (runs.rs): no tail to zero.
        let zero_tail =
            (last && !opaque && self.groups.is_single()).then(|| (r.dst_blocks.clone(), tokens));
        let mut out = Vec::new();
        for d_rank in 0..d_tp {
            let (parts, bytes, descs) = parts
                .remove(&d_rank)
                .ok_or_else(|| format!("the plan leaves D rank {d_rank} nothing to read"))?;
            let job = self.transfers.new_job(JobOwner::Read { handoff, d_rank });
            out.push((
                d_rank,
                TransferJob {
                    job,
                    op: XferOp::Read,
                    parts,
                    zero_tail: zero_tail.clone(),
                    digest: digested.clone(),
                    push_layer: None,
                },
                bytes,
                descs,
            ));
        }
        Ok(out)
    }

    /// D: whether the KV digest can be compared for a handoff whose first `cached` blocks came
    /// from D's prefix cache. P's digest covers the whole prompt; D did not receive those
    /// blocks, and what they hold may be D's own computation of the same tokens (the KV of
    /// tokens D generated, cached once their block filled), right but not bit for bit P's: the
    /// sum would differ although nothing was damaged (a vLLM run under load failed one request
    /// in 36 this way). Comparing only what moved needs P's digest of the blocks D reads, which
    /// P does not know when it digests (a pull) — so such a handoff is not compared, and
    /// counted as such.
    pub(super) fn digest_comparable<T>(cached: &[T]) -> bool {
        cached.is_empty()
    }

    /// D: the ledger gave up on a read (deadline, dead P, every request gone). Every rank's job
    /// is aborted; the ledger hears of the read's end once each confirmed it stopped (at once
    /// between two stages, when none is in flight).
    pub(super) fn cancel_read(&mut self, handoff: HandoffId, now: Time) {
        let Some(read) = self.transfers.reads.get_mut(&handoff) else {
            return;
        };
        read.cancelled = true;
        if read.jobs.is_empty() {
            return self.finish_read(handoff, now);
        }
        for (rank, job) in &read.jobs {
            self.out.transfers_to_abort.push((*rank, *job));
        }
    }

    /// D: the read is over (its last stage landed, or it failed or was cancelled with nothing
    /// in flight): the digest is checked and every rank's end reported to the ledger.
    fn finish_read(&mut self, handoff: HandoffId, now: Time) {
        let Some(read) = self.transfers.reads.remove(&handoff) else {
            return;
        };
        let d_tp = self.spec.tp as u16;
        let ok = !read.failed && !read.cancelled;
        if read.posted > 0 {
            self.out.observations.push(Observation::Transfer {
                bytes: read.bytes,
                duration: now.saturating_sub(read.started),
                descriptors: read.descs,
            });
        }
        let check = match read.digest {
            Some((p, d)) if ok => match d.total(d_tp as usize) {
                Some(d) if d == p => DigestCheck::Matched,
                Some(_) => DigestCheck::Mismatched,
                None => DigestCheck::Unchecked,
            },
            _ => DigestCheck::Unchecked,
        };
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
            // P sent a digest and every stage landed, but D's prefix cache held the first blocks.
            DigestCheck::Unchecked
                if ok
                    && self.cfg.kv_digest
                    && read.read.p_digest.is_some()
                    && !Self::digest_comparable(&read.read.cached_blocks) =>
            {
                tracing::debug!(%handoff, "KV digest not compared: D's prefix cache held the prompt's first blocks");
                self.out.observations.push(Observation::DigestNotCompared);
            }
            DigestCheck::Unchecked => {}
        }
        if let Some(c) = self.consumer.as_mut() {
            for d_rank in 0..d_tp {
                if matches!(check, DigestCheck::Mismatched) {
                    c.on_read_mismatch(handoff, d_rank, now);
                } else {
                    c.on_read_done(handoff, d_rank, ok, now);
                }
            }
        }
    }

    pub(super) fn job_ended(&mut self, job: JobId, ok: bool, now: Time) {
        let Some(owner) = self.transfers.jobs.remove(&job) else {
            return; // aborted with its handoff, or never ours
        };
        match owner {
            JobOwner::Read { handoff, d_rank } => {
                let num_layers = self.spec.shape.num_layers;
                let Some(read) = self.transfers.reads.get_mut(&handoff) else {
                    return;
                };
                read.jobs.remove(&d_rank);
                read.failed |= !ok;
                if !read.jobs.is_empty() {
                    return; // the stage goes on on other ranks
                }
                if read.failed || read.cancelled || read.posted == num_layers {
                    self.finish_read(handoff, now);
                } else {
                    self.advance_read(handoff, false, now);
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

    /// P, push: D renewed its grants on `handoff`'s registrations. Writes planned before the
    /// forward pass wait in their workers under the grant they were planned on; each worker
    /// holding one of a registration's writes learns the grant's new end, so a forward pass
    /// of any length streams every layer while D keeps granting (and none once it stops).
    pub(super) fn renew_held_writes(&mut self, handoff: HandoffId, now: Time) {
        let Some(st) = self.transfers.pushes.get(&handoff) else {
            return;
        };
        if !st.held_for_forward {
            return;
        }
        for (d_rank, w) in &st.writes {
            if w.aborted || w.failed || w.jobs.is_empty() {
                continue;
            }
            let Some(post_within_ms) =
                post_window(self.producer.as_ref(), handoff, *d_rank, w.layer_bytes, now)
            else {
                continue;
            };
            let mut ranks: Vec<u16> = w.jobs.iter().map(|(r, _)| *r).collect();
            ranks.sort_unstable();
            ranks.dedup();
            for rank in ranks {
                self.out.worker_ops.push((
                    rank,
                    WorkerOp::RenewWrites {
                        handoff,
                        d_rank: *d_rank,
                        post_within_ms,
                    },
                ));
            }
        }
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
        let my_block_size = self.spec.block_size;
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
            // Whole blocks where both sides have them (a layer of a contiguous run is one
            // descriptor, not one per head and plane for the last, partial block); D's
            // workers zero the tail as the PushDones arrive. Opaque pages go whole anyway.
            let moved = match runs::moved_runs(
                &self.groups,
                num_layers,
                (
                    SideBlocks {
                        blocks: &st.blocks,
                        block_size: my_block_size,
                    },
                    SideBlocks {
                        blocks: &w.d_blocks,
                        block_size: d_block_size,
                    },
                ),
                st.num_tokens,
                skip,
                self.cfg.opaque_blocks,
            ) {
                Ok(m) => m,
                Err(why) => {
                    tracing::warn!(%handoff, %why, "push not planned");
                    w.failed = true;
                    if w.jobs.is_empty() {
                        ended.push((*d_rank, false));
                    }
                    continue;
                }
            };
            while w.layers_posted < st.layers_saved.min(num_layers) {
                let layer = w.layers_posted;
                let last = layer + 1 == num_layers;
                // The completion rides on the last layer's WRITE, posted only once every
                // earlier one landed (a backend may complete transfers out of order), and once
                // the digest it carries is known.
                if last && (!w.jobs.is_empty() || !st.digest.settled()) {
                    break;
                }
                let plan = match runs::plan(&my_layouts, &peer.layouts, &moved, layer..layer + 1) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(%handoff, error = %e, "push plan failed");
                        w.failed = true;
                        break;
                    }
                };
                // The most a layer writes: a hybrid model's layers differ (a window's are
                // fewer blocks).
                w.layer_bytes = plan
                    .pairs
                    .iter()
                    .filter(|p| p.d_rank as u16 == *d_rank)
                    .map(|p| p.descriptors.iter().map(|d| d.len).sum::<u64>())
                    .max()
                    .unwrap_or(0)
                    .max(w.layer_bytes);
                // Rule 3: post only on a registration grant that is still valid, with time
                // left for the layer's bytes.
                let Some(post_within_ms) =
                    post_window(self.producer.as_ref(), handoff, *d_rank, w.layer_bytes, now)
                else {
                    break;
                };
                let push_layer = PushLayer {
                    handoff,
                    d_rank: *d_rank,
                    layer,
                    post_within_ms,
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
                                let done = Message::PushDone(PushDone { digest, ..*n });
                                encode_as(&done, peer.version).ok()
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

/// How long from `now` a write of `bytes` into (`handoff`, `d_rank`) may still be posted, in
/// ms: D's registration grant's end less the write's lead (P's write margin and the bytes'
/// time at the floor rate), so that it lands inside the grant (`None`: no valid grant, or too
/// little of it left for these bytes; rule 3).
fn post_window(
    producer: Option<&handoff_ledger::ProducerLedger>,
    handoff: HandoffId,
    d_rank: u16,
    bytes: u64,
    now: Time,
) -> Option<u32> {
    let producer = producer?;
    let until = producer.write_permit(handoff, d_rank, now).ok()?;
    let lead = producer.config().write_lead(bytes);
    let within = until.checked_sub(now)?.checked_sub(lead)?;
    (!within.is_zero()).then(|| within.as_millis().min(u128::from(u32::MAX)) as u32)
}

/// The layers P's block list says are saved (`None`: every one), at most the model's: a larger
/// count from P is not believed.
fn layers_saved(layers: Option<u32>, num_layers: u32) -> u32 {
    layers.map_or(num_layers, |n| n.min(num_layers))
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
