//! The consumer's pull flows (classic and layer-wise): D keeps P's lease alive with heartbeats,
//! asks P where the blocks are, and reads them once admitted on a valid grant (in stages as P
//! saves layers, for a layer-wise pull); a failed read is retried under a new epoch or ends in
//! quarantine until every rank's READ has stopped (rules 2, 4 and 6).

use super::*;

impl ConsumerLedger {
    /// Layer-wise pull: may the next stage of `handoff`'s read be posted now? Only while it is
    /// read and nothing failed, before the request's deadline, and on a grant still valid minus
    /// the margin (rule 2); the read's deadline then counts from now. Refused for want of a
    /// grant, the next grant brings the `ReadMore` again.
    pub fn permit_read_more(&mut self, handoff: HandoffId, now: Time) -> bool {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&handoff) else {
            return false;
        };
        let State::Reading {
            failed: None,
            deadline,
            posted,
            ..
        } = &mut h.state
        else {
            return false;
        };
        if now >= h.deadline {
            return false;
        }
        let Some(grant_until) = h.grant_until.filter(|g| *g > now + self.cfg.read_margin) else {
            if let FlowState::Pull(p) = &mut h.flow {
                p.more_waiting = true;
            }
            return false;
        };
        *posted = now;
        let blocks = h.local.as_ref().map_or(0, Vec::len);
        *deadline = read_deadline(&self.cfg, now, grant_until, h.deadline, blocks);
        let d = *deadline;
        h.timer.arm(&mut self.timers, handoff, d);
        true
    }

    /// One D rank's reads of `handoff` ended (`ok`: every byte landed).
    /// Like [`Self::on_read_done`] with `ok` false, for a read whose bytes landed but whose KV
    /// digest differs from P's: the handoff fails with [`FailReason::DigestMismatch`] (not
    /// retried: P's blocks would give the same bytes) and its requests never see the KV.
    pub fn on_read_mismatch(&mut self, handoff: HandoffId, d_rank: u16, now: Time) {
        if let Some(Handoff {
            state: State::Reading { failed, .. },
            ..
        }) = self.handoffs.get_mut(&handoff)
        {
            if failed.is_none() {
                *failed = Some(FailReason::DigestMismatch);
                self.fail_requests(handoff, FailReason::DigestMismatch);
            }
        }
        self.on_read_done(handoff, d_rank, false, now);
    }

    pub fn on_read_done(&mut self, handoff: HandoffId, d_rank: u16, ok: bool, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&handoff) else {
            return;
        };
        match &mut h.state {
            State::Reading {
                deadline,
                pending,
                failed,
                ..
            } => {
                let Some(pos) = pending.iter().position(|r| *r == d_rank) else {
                    return;
                };
                pending.remove(pos);
                if failed.is_none() {
                    if !ok {
                        *failed = Some(FailReason::ReadFailed);
                    } else if now > *deadline {
                        *failed = Some(FailReason::ReadAfterGrace);
                    }
                    // A failed read that may be tried again keeps its requests until every
                    // rank's read ended; otherwise they learn at once.
                    let retry = *failed == Some(FailReason::ReadFailed) && h.retries_left > 0;
                    if let (Some(reason), false) = (*failed, retry) {
                        self.fail_requests(handoff, reason);
                    }
                }
                let Some(h) = self.handoffs.get_mut(&handoff) else {
                    return;
                };
                let State::Reading {
                    pending, failed, ..
                } = &h.state
                else {
                    return;
                };
                if !pending.is_empty() {
                    return;
                }
                match *failed {
                    None => {
                        let blocks = h.local.take().unwrap_or_default();
                        self.held_blocks -= blocks.len();
                        // Never empty here: a read whose last request went away was cancelled
                        // and its handoff quarantined (`on_request_ended`).
                        let requests = std::mem::take(&mut h.requests);
                        for r in &requests {
                            self.by_request.remove(r);
                        }
                        self.stats.ready += 1;
                        let waited = h.waited(now);
                        self.outcomes.push_back(Outcome::Ready {
                            handoff,
                            requests,
                            blocks,
                            waited,
                            p_digest: None,
                            num_tokens: h.info.num_tokens,
                            peer: h.info.peer,
                            cached: h.cached.clone(),
                        });
                        self.end_handoff(handoff, now);
                    }
                    Some(reason) => {
                        if reason == FailReason::ReadFailed && self.retry_read(handoff, now) {
                            return;
                        }
                        self.fail_requests(handoff, reason);
                        self.after_read_ended(handoff, ReleaseReason::Failed, now);
                    }
                }
            }
            State::Quarantine {
                pending, tell_p, ..
            } => {
                let tell_p = *tell_p;
                pending.retain(|r| *r != d_rank);
                if pending.is_empty() {
                    self.after_read_ended(handoff, tell_p, now);
                }
            }
            _ => {}
        }
    }

    pub(super) fn on_grants(&mut self, from: PeerId, g: GrantBatch, now: Time) {
        let Some(sent_at) = self.heartbeats.anchor(g.seq, from) else {
            self.stats.ignored += 1;
            return;
        };
        for grant in g.grants {
            self.stats.grants_received += 1;
            let Some(h) = self.handoffs.get_mut(&grant.handoff) else {
                continue;
            };
            if h.info.peer != from {
                continue;
            }
            if h.info.epoch != grant.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            // Anchored at the moment the heartbeat left: P's lease began no earlier, so this
            // end is never later than P's (rule 2), however late the reply arrived.
            let until = sent_at + Duration::from_millis(grant.lease_ms as u64);
            let grant_until = h.grant_until.map_or(until, |u| u.max(until));
            h.grant_until = Some(grant_until);
            let blocks = h.local.as_ref().map_or(0, Vec::len);
            match &mut h.state {
                State::Admitted => self.try_start_read(grant.handoff, now),
                // A read in flight may run until this later grant's end + the grace (P's lease
                // covers it; P renews it while D heartbeats), within its own timeout: a long
                // prompt or a slow link is not cut at the grant the read started on. A
                // layer-wise read spans P's prefill, and a stage refused for want of a grant may
                // go now.
                State::Reading {
                    failed: None,
                    deadline,
                    posted,
                    ..
                } => {
                    *deadline = read_deadline(&self.cfg, *posted, grant_until, h.deadline, blocks)
                        .max(*deadline);
                    let d = *deadline;
                    h.timer.arm(&mut self.timers, grant.handoff, d);
                    let more = match &mut h.flow {
                        FlowState::Pull(p) => std::mem::take(&mut p.more_waiting),
                        FlowState::Push => false,
                    };
                    if more {
                        self.actions.push_back(ConsumerAction::ReadMore {
                            handoff: grant.handoff,
                            layers: h.flow.p_layers(),
                            p_digest: h.p_digest,
                        });
                    }
                }
                _ => {}
            }
        }
        for e in g.gone {
            let Some(h) = self.handoffs.get(&e.handoff) else {
                continue;
            };
            if h.info.peer != from {
                continue;
            }
            if h.info.epoch != e.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            match h.state {
                State::Waiting | State::Admitted => {
                    self.fail_requests(e.handoff, FailReason::HandoffGone);
                    self.release_local(e.handoff, EndReason::Cancelled, now);
                    self.end_handoff(e.handoff, now);
                }
                // P is ending it and may still be writing: cancel and wait for the ack.
                State::Registered { .. } => {
                    self.fail_requests(e.handoff, FailReason::HandoffGone);
                    self.cancel_push(e.handoff, EndReason::Cancelled, now);
                }
                // A layer-wise read whose layers will never all come (P's prefill failed, or P
                // ended the handoff): stop the stage in flight, and P hears once it ended.
                State::Reading { ref pending, .. } if h.flow.p_layers().is_some() => {
                    let pending = pending.clone();
                    self.fail_requests(e.handoff, FailReason::HandoffGone);
                    self.actions
                        .push_back(ConsumerAction::CancelRead { handoff: e.handoff });
                    self.quarantine(e.handoff, pending, ReleaseReason::Failed, now);
                }
                // A read in flight ends by its own deadline, which P's fence outlasts.
                _ => {}
            }
        }
    }

    /// P names the blocks to read: they replace whatever the client claimed.
    pub(super) fn on_pull_blocks(&mut self, from: PeerId, b: PullBlocks, now: Time) {
        for list in b.lists {
            let Some(h) = self.handoffs.get_mut(&list.handoff) else {
                self.stats.late_notifications += 1;
                continue;
            };
            let FlowState::Pull(pull) = &mut h.flow else {
                self.stats.ignored += 1;
                continue;
            };
            if h.info.peer != from {
                self.stats.ignored += 1;
                continue;
            }
            if h.info.epoch != list.epoch {
                self.stats.stale_epoch += 1;
                continue;
            }
            if pull.blocks_from_p {
                // Only a layer-wise pull's next list: the same blocks, more layers saved.
                let more = match (pull.p_layers, list.layers) {
                    (Some(had), Some(now)) => now > had,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                if !more || list.blocks != h.info.p_blocks {
                    self.stats.ignored += 1;
                    continue;
                }
                pull.p_layers = list.layers;
                h.p_digest = list.digest;
                match h.state {
                    State::Admitted => self.try_start_read(list.handoff, now),
                    State::Reading { failed: None, .. } => {
                        self.actions.push_back(ConsumerAction::ReadMore {
                            handoff: list.handoff,
                            layers: list.layers,
                            p_digest: list.digest,
                        })
                    }
                    _ => {}
                }
                continue;
            }
            if list.blocks.is_empty() {
                self.stats.ignored += 1;
                continue;
            }
            if h.info.p_blocks != list.blocks {
                // Counted (the connector's metrics and logs follow the counter), unless the
                // client named none (a layer-wise pull's D leg leaves before P has blocks).
                if !h.info.p_blocks.is_empty() {
                    self.stats.client_blocks_replaced += 1;
                }
                h.info.p_blocks = list.blocks;
            }
            *pull = PullState {
                blocks_from_p: true,
                p_layers: list.layers,
                more_waiting: false,
            };
            h.blocks_answer_at = Some(now);
            h.p_digest = list.digest;
            if h.state == State::Waiting {
                self.started.push_back(h.requests.clone());
            }
            if h.state == State::Admitted {
                self.try_start_read(list.handoff, now);
            }
        }
    }

    pub(super) fn try_start_read(&mut self, id: HandoffId, now: Time) {
        let tp = self.cfg.tp.max(1);
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        // A layer-wise pull starts once P saved a layer.
        if h.state != State::Admitted || !h.flow.blocks_from_p() || h.flow.p_layers() == Some(0) {
            return;
        }
        let Some(grant_until) = h.grant_until else {
            return;
        };
        // Rule 2: start only on a grant still valid minus a safety margin.
        if grant_until <= now + self.cfg.read_margin {
            return;
        }
        // Rule 6: a read started late in the request's wait is cut at the request's deadline,
        // so the request gets its outcome in time however late it was admitted.
        if now >= h.deadline {
            return; // the deadline timer ends it
        }
        let blocks = h.local.as_ref().map_or(0, Vec::len);
        let deadline = read_deadline(&self.cfg, now, grant_until, h.deadline, blocks);
        let p_tp = h.info.p_tp;
        let done = rank_pairs(p_tp, tp)
            .into_iter()
            .map(|(d, p)| PullDone {
                handoff: id,
                epoch: h.info.epoch,
                p_rank: p,
                consumer_rank: d,
                consumers: rank_consumers(p_tp, tp, p),
            })
            .collect();
        self.actions.push_back(ConsumerAction::StartRead(StartRead {
            handoff: id,
            epoch: h.info.epoch,
            p_peer: h.info.peer,
            p_tp,
            src_blocks: h.info.p_blocks.clone(),
            dst_blocks: h.local.clone().unwrap_or_default(),
            cached_blocks: h.cached.clone(),
            num_tokens: h.info.num_tokens,
            deadline,
            done,
            p_digest: h.p_digest,
            layers: h.flow.p_layers(),
        }));
        h.state = State::Reading {
            deadline,
            pending: (0..tp).collect(),
            failed: None,
            posted: now,
        };
        h.transfer_at = Some(now);
        h.timer.arm(&mut self.timers, id, deadline);
        self.stats.reads_started += 1;
    }

    /// Every rank's read of `id` ended and one failed: try again if a retry is left and the
    /// request may still wait. The retry runs under the next epoch, so nothing the first attempt
    /// left on its way (a `PullDone` riding a READ that landed, a grant for the old epoch) can
    /// count for the new one; it starts only on a grant P issued for the new epoch.
    pub(super) fn retry_read(&mut self, id: HandoffId, now: Time) -> bool {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return false;
        };
        if h.retries_left == 0 || h.requests.is_empty() || now >= h.deadline {
            return false;
        }
        h.retries_left -= 1;
        h.info.epoch = h.info.epoch.next();
        h.grant_until = None;
        h.state = State::Admitted;
        let deadline = h.deadline;
        h.timer.arm(&mut self.timers, id, deadline);
        self.urgent.entry(h.info.peer).or_default().insert(id);
        self.stats.read_retries += 1;
        true
    }

    /// Every rank's read of a handoff that did not become ready (failed, cancelled, or every
    /// request gone) has ended: nothing is in flight, P may free at once.
    pub(super) fn after_read_ended(&mut self, id: HandoffId, reason: ReleaseReason, now: Time) {
        let Some(h) = self.handoffs.get(&id) else {
            return;
        };
        let msg = Release {
            handoff: id,
            epoch: h.info.epoch,
            reason,
        };
        self.messages
            .push_back((h.info.peer, Message::Release(msg)));
        self.stats.releases_sent += 1;
        self.release_local(id, EndReason::from(reason), now);
        self.end_handoff(id, now);
    }

    /// Holds a read's blocks until every rank in `pending` reported its read ended (or the fence
    /// is over); then P is told `tell_p`.
    pub(super) fn quarantine(
        &mut self,
        id: HandoffId,
        pending: Vec<u16>,
        tell_p: ReleaseReason,
        now: Time,
    ) {
        let fence = self.cfg.read_fence;
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if pending.is_empty() {
            self.after_read_ended(id, tell_p, now);
            return;
        }
        let until = now + fence;
        h.state = State::Quarantine {
            until,
            pending,
            tell_p,
        };
        h.timer.arm(&mut self.timers, id, until);
    }

    pub(super) fn send_heartbeats(&mut self, now: Time) {
        let mut any = false;
        let peers: Vec<PeerId> = self.by_peer.keys().copied().collect();
        for peer in peers {
            let entries: Vec<HeartbeatEntry> = self.by_peer[&peer]
                .iter()
                .filter_map(|id| {
                    let h = &self.handoffs[id];
                    h.wants_heartbeat().then_some(HeartbeatEntry {
                        handoff: *id,
                        epoch: h.info.epoch,
                    })
                })
                .collect();
            if entries.is_empty() {
                continue;
            }
            any = true;
            self.stats.heartbeats_sent +=
                self.heartbeats
                    .send(peer, &entries, now, &mut self.messages) as u64;
            self.ask_blocks(peer, entries.iter().map(|e| e.handoff));
        }
        self.urgent.clear();
        self.next_heartbeat = any.then(|| now + self.cfg.heartbeat_interval);
    }

    /// With each heartbeat, asks P for the blocks of every pull handoff it has not named yet
    /// (usually once: the answer comes back within a round trip).
    pub(super) fn ask_blocks(&mut self, peer: PeerId, ids: impl Iterator<Item = HandoffId>) {
        let entries: Vec<HeartbeatEntry> = ids
            .filter_map(|id| {
                let h = self.handoffs.get(&id)?;
                matches!(
                    h.flow,
                    FlowState::Pull(PullState {
                        blocks_from_p: false,
                        ..
                    })
                )
                .then_some(HeartbeatEntry {
                    handoff: id,
                    epoch: h.info.epoch,
                })
            })
            .collect();
        for chunk in entries.chunks(MAX_BATCH_ENTRIES) {
            let q = BlocksQuery {
                entries: chunk.to_vec(),
            };
            self.messages.push_back((peer, Message::BlocksQuery(q)));
        }
    }
}
