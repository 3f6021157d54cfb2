//! The producer's pull flows (classic and layer-wise): P grants leases on D's heartbeats, names
//! a handoff's blocks to its reader only, learns the read ended from D's completion, and for a
//! layer-wise pull tells D which layers are saved and never frees a block its prefill still
//! writes (rules 2 and 5).

use super::*;

impl ProducerLedger {
    /// A handoff created when P's prefill into `blocks` starts, under `id` (the proxy's, sent
    /// to D at the same time): a layer-wise pull (`Pull`) or a push. D's messages may be staged
    /// already. The blocks cannot go back before [`Self::prefill_ended`], whatever ends the
    /// handoff meanwhile: the forward pass still writes them (rules 2 and 5). A layer-wise
    /// pull's reader is told of each layer saved ([`Self::layers_saved`]).
    pub fn create_filling_handoff(
        &mut self,
        id: HandoffId,
        blocks: Vec<BlockId>,
        mode: TransferMode,
        now: Time,
    ) -> Result<Grant, CreateError> {
        self.create(id, blocks, mode, Some(Filling::default()), now)
    }

    /// Layer-wise pull: the first `layers` layers of the handoff's blocks hold their KV. The
    /// reader, once it asked, gets the list again with that count.
    pub fn layers_saved(&mut self, id: HandoffId, layers: u32) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let (true, Some(f)) = (matches!(h.flow, ProducerFlow::Pull { .. }), &mut h.filling) else {
            return;
        };
        if layers <= f.layers {
            return;
        }
        f.layers = layers;
        if let (true, Phase::Leased, Some(reader)) = (h.asked(), h.phase, h.reader) {
            self.messages.push_back((reader, h.block_list_message(id)));
        }
    }

    /// P's prefill into a handoff created at its start ended (`ok`: every layer is saved); an
    /// end that came meanwhile takes effect now. Layer-wise pull: the reader gets the final
    /// list, and a failed prefill ends the handoff: at once when no reader was told where the
    /// blocks are, else under the fence (it may be reading the layers saved so far, rule 2). A
    /// push goes on under its own deadlines.
    pub fn prefill_ended(&mut self, id: HandoffId, ok: bool, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let Some(f) = h.filling.take() else {
            return;
        };
        if let Some(reason) = f.ended {
            self.release_now(id, reason, now);
        } else if !h.is_pull() {
            // A push ends by its own deadlines, its blocks back with it from now on.
        } else if !ok && h.asked() {
            // Already fencing (the lease ran out, the proxy released): that fence, armed, ends it.
            if h.phase == Phase::Leased {
                let until = h.lease_end.max(now) + self.cfg.fence_grace;
                h.phase = Phase::Fencing {
                    until,
                    reason: EndReason::Failed,
                };
                h.timer.arm(&mut self.timers, id, until);
            }
        } else if !ok {
            self.begin_end(id, EndReason::Failed, now);
        } else if let (true, Phase::Leased, Some(reader)) = (h.asked(), h.phase, h.reader) {
            self.messages.push_back((reader, h.block_list_message(id)));
        }
    }

    pub(super) fn on_heartbeat(&mut self, from: PeerId, hb: Heartbeat, now: Time) {
        self.stats.heartbeats_received += 1;
        let mut grants = Vec::new();
        let mut gone = Vec::new();
        for e in hb.entries {
            if let Some(h) = self.handoffs.get_mut(&e.handoff) {
                if h.epoch != e.epoch && h.adopt_epoch(from, e.epoch) && h.asked() {
                    // The retry reads under the new epoch: a list it ignored as stale (a
                    // layer-wise pull's last, sent before the move) is sent again under it.
                    self.messages
                        .push_back((from, h.block_list_message(e.handoff)));
                } else if h.epoch != e.epoch {
                    // The reader moved on to an epoch we cannot follow (fencing, or out of
                    // moves): tell it at once rather than let it wait out its deadline.
                    if e.epoch > h.epoch && h.reader == Some(from) {
                        gone.push(e);
                    } else {
                        self.stats.stale_epoch += 1;
                    }
                    continue;
                }
            }
            match self.handoffs.get_mut(&e.handoff) {
                Some(h) if h.phase == Phase::Leased => {
                    let extended = (now + self.cfg.heartbeat_extension).min(h.cap_end);
                    h.lease_end = h.lease_end.max(extended);
                    grants.push(Grant {
                        handoff: e.handoff,
                        epoch: h.epoch,
                        lease_ms: ms_floor(h.lease_end.saturating_sub(now)),
                    });
                    if h.reader.is_none() {
                        h.reader = Some(from);
                        self.by_peer.entry(from).or_default().insert(e.handoff);
                    }
                }
                // Fencing or draining: the lease is over, no new grant (rule 2).
                Some(_) => gone.push(e),
                // Ended well: its completions may still be on their way to D (they ride on the
                // transfers, not on this channel), so "gone" would race them. Say nothing --
                // unless D is retrying a read (a later epoch): nothing of the retry is in
                // flight, and it must not wait for a grant that will never come.
                None if self.tombstones.get(&e.handoff) == Some(&EndReason::Done)
                    && e.epoch == Epoch::FIRST => {}
                None if self.tombstones.get(&e.handoff).is_some() => gone.push(e),
                None => {
                    let single = Heartbeat {
                        seq: hb.seq,
                        mode: hb.mode,
                        entries: vec![e],
                    };
                    self.stage_once(from, Message::Heartbeat(single), e.handoff, now);
                }
            }
        }
        self.stats.grants_sent += grants.len() as u64;
        for batch in split_grants(hb.seq, grants, gone) {
            self.messages.push_back((from, Message::GrantBatch(batch)));
        }
    }

    /// D asks which blocks to read. Only a handoff's reader (the first D that heartbeats or
    /// asks for it) is answered: a client that names a handoff id learns nothing through another
    /// D, and D never reads the block ids a client wrote into its request.
    pub(super) fn on_blocks_query(&mut self, from: PeerId, q: BlocksQuery, now: Time) {
        let mut lists = Vec::new();
        for e in q.entries {
            let Some(h) = self.handoffs.get_mut(&e.handoff) else {
                // Not created yet (a layer-wise pull's D asks as P's prefill is about to start):
                // answered at creation. Ended: D hears "gone" in the grant reply.
                let single = BlocksQuery { entries: vec![e] };
                self.stage_once(from, Message::BlocksQuery(single), e.handoff, now);
                continue;
            };
            if h.epoch != e.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            if !h.is_pull() || h.phase != Phase::Leased {
                self.stats.ignored += 1;
                continue;
            }
            match h.reader {
                Some(reader) if reader != from => {
                    self.stats.blocks_refused += 1;
                    continue;
                }
                Some(_) => {}
                None => {
                    h.reader = Some(from);
                    self.by_peer.entry(from).or_default().insert(e.handoff);
                }
            }
            if let ProducerFlow::Pull { asked, .. } = &mut h.flow {
                *asked = true;
            }
            lists.push(h.block_list(e.handoff));
        }
        // A handoff too long to name in one message was refused at creation (see
        // `create_handoff`), so nothing is left over here.
        let (answers, _too_long) = split_block_lists(lists);
        for a in answers {
            self.messages.push_back((from, Message::PullBlocks(a)));
        }
    }

    pub(super) fn on_pull_done(&mut self, from: PeerId, pd: PullDone, now: Time) {
        let Some(h) = self.handoffs.get_mut(&pd.handoff) else {
            self.unknown(pd.handoff, Some(from), Message::PullDone(pd), now);
            return;
        };
        if h.epoch != pd.epoch {
            self.stats.stale_epoch += 1;
            return;
        }
        // A push handoff ends on P's own writes (and their grants), never on a reader's word
        // that it read: freeing now would free blocks under P's WRITE.
        if !h.is_pull() {
            self.stats.ignored += 1;
            return;
        }
        // Only the reader was told where the blocks are (PullBlocks goes to it alone), so only
        // the reader can have read them.
        if h.reader != Some(from) {
            self.stats.not_from_reader += 1;
            return;
        }
        let Some(part) = h.parts.get_mut(pd.p_rank as usize) else {
            self.stats.ignored += 1;
            return;
        };
        part.expected = part.expected.max(pd.consumers.max(1));
        if part.done.contains(&pd.consumer_rank) {
            self.stats.duplicate_notifications += 1;
            return;
        }
        part.done.push(pd.consumer_rank);
        if h.all_read() {
            // The notification rides on the READ and is delivered after its bytes: nothing is in
            // flight any more, so the blocks go back now, whatever the phase.
            let reason = match h.phase {
                Phase::Leased => EndReason::Done,
                Phase::Fencing { reason, .. } | Phase::Draining { reason, .. } => reason,
            };
            self.release_now(pd.handoff, reason, now);
        }
    }
}
