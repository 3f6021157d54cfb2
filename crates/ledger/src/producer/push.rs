//! The producer's push flow: P takes D's registration, asks D for write grants with heartbeats,
//! and writes each layer only on a valid grant (`write_permit`), so no WRITE lands after D may
//! have reused the blocks (rule 3).

use super::*;

impl ProducerLedger {
    /// Push: may P post a WRITE into D rank `d_rank` of `handoff` now? Returns the end of the
    /// grant; nothing may be posted after it (rule 3).
    pub fn write_permit(
        &self,
        handoff: HandoffId,
        d_rank: u16,
        now: Time,
    ) -> Result<Time, WriteRefused> {
        let h = self
            .handoffs
            .get(&handoff)
            .ok_or(WriteRefused::UnknownHandoff)?;
        if h.phase != Phase::Leased || h.cancel_acked() {
            return Err(WriteRefused::Cancelled);
        }
        let r = h
            .registrations()
            .iter()
            .find(|r| r.d_rank == d_rank && r.epoch == h.epoch)
            .ok_or(WriteRefused::NotRegistered)?;
        match r.state {
            RegState::Waiting | RegState::Writing => {}
            _ => return Err(WriteRefused::Cancelled),
        }
        match r.grant_until {
            Some(until) if until > now + self.cfg.write_margin => Ok(until),
            _ => Err(WriteRefused::GrantExpired),
        }
    }

    /// Push: every WRITE of `handoff` into D rank `d_rank` has ended (`ok` = all landed, with
    /// their `PushDone` notifications). A failure is reported to D at once.
    pub fn on_push_write_done(&mut self, handoff: HandoffId, d_rank: u16, ok: bool, now: Time) {
        self.last_now = self.last_now.max(now);
        let Some(h) = self.handoffs.get_mut(&handoff) else {
            return;
        };
        let epoch = h.epoch;
        let Some(r) = h.registrations_mut().iter_mut().find(|r| {
            r.d_rank == d_rank && matches!(r.state, RegState::Writing | RegState::CancelPending)
        }) else {
            return;
        };
        let peer = r.peer;
        match r.state {
            RegState::CancelPending => {
                r.state = RegState::Cancelled;
                // The ack promises that *no* write into any of D's ranks is in flight.
                let still_writing = h.registrations().iter().any(|x| {
                    x.peer == peer && matches!(x.state, RegState::Writing | RegState::CancelPending)
                });
                if !still_writing {
                    if let ProducerFlow::Push { cancel_acked, .. } = &mut h.flow {
                        *cancel_acked = true;
                    }
                    self.messages.push_back((
                        peer,
                        Message::PushCancelAck(PushCancelAck {
                            handoff,
                            epoch,
                            p_rank: 0,
                        }),
                    ));
                }
            }
            _ if ok && !r.timed_out => r.state = RegState::Written,
            _ => {
                r.state = RegState::Failed;
                self.messages.push_back((
                    peer,
                    Message::PushFailed(PushFailed {
                        handoff,
                        epoch,
                        p_rank: 0,
                        reason: "write failed".into(),
                    }),
                ));
                if h.phase == Phase::Leased {
                    self.begin_end(handoff, EndReason::Failed, now);
                }
            }
        }
        self.evaluate(handoff, now);
    }

    pub(super) fn on_push_register(&mut self, from: PeerId, r: PushRegister, now: Time) {
        let Some(h) = self.handoffs.get_mut(&r.handoff) else {
            if self.tombstones.get(&r.handoff).is_some() {
                // Tell D at once that nothing will be written, so it frees and moves on.
                self.messages.push_back((
                    from,
                    Message::PushFailed(PushFailed {
                        handoff: r.handoff,
                        epoch: r.epoch,
                        p_rank: 0,
                        reason: "handoff already ended on P".into(),
                    }),
                ));
            } else {
                let ask = HeartbeatEntry {
                    handoff: r.handoff,
                    epoch: r.epoch,
                };
                // Asked early only when staged: a registration the bounded staging dropped is
                // not asked about, so a flood of made-up ids costs P no more asks than its
                // staging quota.
                if self.unknown(r.handoff, Some(from), Message::PushRegister(r), now) {
                    self.early_asks.entry(from).or_default().push(ask);
                }
            }
            return;
        };
        if h.epoch != r.epoch {
            self.stats.stale_epoch += 1;
            return;
        }
        if h.is_pull() || r.d_tp == 0 || r.d_rank >= r.d_tp {
            self.stats.ignored += 1;
            return;
        }
        if h.reader.is_some_and(|reader| reader != from) {
            self.stats.not_from_reader += 1;
            return;
        }
        if h.registrations().iter().any(|x| x.d_rank == r.d_rank) {
            self.stats.duplicate_notifications += 1;
            return;
        }
        if h.phase != Phase::Leased || h.cancel_acked() {
            self.stats.late_notifications += 1;
            return;
        }
        let ProducerFlow::Push { registrations, .. } = &mut h.flow else {
            return;
        };
        registrations.push(Registration {
            peer: from,
            d_rank: r.d_rank,
            d_tp: r.d_tp,
            epoch: r.epoch,
            blocks: r.block_ids,
            num_tokens: r.num_tokens,
            cached_blocks: r.cached_blocks,
            grant_until: None,
            state: RegState::Waiting,
            timed_out: false,
        });
        if h.reader.is_none() {
            h.reader = Some(from);
            self.by_peer.entry(from).or_default().insert(r.handoff);
        }
        self.push_waiting.entry(from).or_default().insert(r.handoff);
        // Ask for a grant at once rather than at the next heartbeat tick.
        self.urgent.entry(from).or_default().insert(r.handoff);
        if self.next_push_heartbeat.is_none() {
            self.next_push_heartbeat = Some(now + self.cfg.heartbeat_interval);
        }
    }

    pub(super) fn on_push_cancel(&mut self, from: PeerId, c: PushCancel, now: Time) {
        let ack = Message::PushCancelAck(PushCancelAck {
            handoff: c.handoff,
            epoch: c.epoch,
            p_rank: 0,
        });
        let Some(h) = self.handoffs.get_mut(&c.handoff) else {
            if self.tombstones.get(&c.handoff).is_none() {
                // The ack below promises D that no write will start: the registration and any
                // early grant staged for it must not come back when the handoff is created.
                let epoch = c.epoch;
                self.staging.discard(c.handoff, |f, m| {
                    f == Some(from)
                        && match m {
                            Message::PushRegister(r) => r.epoch == epoch,
                            Message::GrantBatch(g) => g.grants.iter().all(|x| x.epoch == epoch),
                            _ => false,
                        }
                });
                // Early cancel: keep it so a later create ends the handoff at once.
                self.unknown(c.handoff, Some(from), Message::PushCancel(c), now);
            }
            // No write can be in flight for a handoff P does not hold, and none will start: a
            // write needs a grant D no longer gives for a cancelled registration.
            self.messages.push_back((from, ack));
            return;
        };
        if h.epoch != c.epoch {
            self.stats.stale_epoch += 1;
            return;
        }
        // A cancel ends the handoff without a fence: only the D whose registration it cancels
        // may send it, and only for a push. From anyone else (or for a pull, whose reader may be
        // mid-READ) it would free blocks under a transfer it cannot promise is over.
        if h.is_pull() {
            self.stats.ignored += 1;
            return;
        }
        if h.reader.is_some_and(|reader| reader != from) {
            self.stats.not_from_reader += 1;
            return;
        }
        let mut pending = false;
        for r in h.registrations_mut().iter_mut().filter(|r| r.peer == from) {
            match r.state {
                RegState::Writing => {
                    r.state = RegState::CancelPending;
                    pending = true;
                    self.actions.push_back(ProducerAction::AbortWrite {
                        handoff: c.handoff,
                        d_rank: r.d_rank,
                    });
                }
                RegState::CancelPending => pending = true,
                RegState::Waiting => r.state = RegState::Cancelled,
                _ => {}
            }
        }
        if !pending {
            if let ProducerFlow::Push { cancel_acked, .. } = &mut h.flow {
                *cancel_acked = true;
            }
            self.messages.push_back((from, ack));
        }
        self.begin_end(c.handoff, EndReason::Cancelled, now);
    }

    pub(super) fn on_grants(&mut self, from: PeerId, g: GrantBatch, now: Time) {
        let Some(sent_at) = self.heartbeats.anchor(g.seq, from) else {
            self.stats.ignored += 1;
            return;
        };
        for grant in g.grants {
            let Some(h) = self.handoffs.get_mut(&grant.handoff) else {
                if self.tombstones.get(&grant.handoff).is_none() {
                    // The answer to an early ask: staged with its registration, it is replayed
                    // when the handoff is created, still anchored at our ask's send time.
                    let early = GrantBatch {
                        seq: g.seq,
                        grants: vec![grant],
                        gone: Vec::new(),
                    };
                    self.unknown(grant.handoff, Some(from), Message::GrantBatch(early), now);
                }
                continue;
            };
            if h.phase != Phase::Leased {
                continue;
            }
            for r in h.registrations_mut().iter_mut() {
                if r.peer == from
                    && r.epoch == grant.epoch
                    && matches!(r.state, RegState::Waiting | RegState::Writing)
                {
                    // Anchored at our send time: D's grant started no earlier (rule 3).
                    let until = sent_at + Duration::from_millis(grant.lease_ms as u64);
                    r.grant_until = Some(r.grant_until.map_or(until, |u| u.max(until)));
                }
            }
            self.start_writes(grant.handoff, now);
        }
        for e in g.gone {
            let Some(h) = self.handoffs.get_mut(&e.handoff) else {
                continue;
            };
            for r in h.registrations_mut().iter_mut() {
                if r.peer == from && r.epoch == e.epoch {
                    match r.state {
                        RegState::Waiting => r.state = RegState::Cancelled,
                        RegState::Writing => {
                            r.state = RegState::CancelPending;
                            self.actions.push_back(ProducerAction::AbortWrite {
                                handoff: e.handoff,
                                d_rank: r.d_rank,
                            });
                        }
                        _ => {}
                    }
                }
            }
            // D dropped the handoff: nothing more will be written, so end it now (after any
            // aborted write drains) instead of holding the blocks until the lease runs out.
            let nothing_left = h.registrations().iter().all(|r| {
                matches!(
                    r.state,
                    RegState::Cancelled | RegState::CancelPending | RegState::Failed
                )
            });
            if nothing_left && !h.registrations().is_empty() && h.phase == Phase::Leased {
                self.begin_end(e.handoff, EndReason::Cancelled, now);
            }
        }
    }

    pub(super) fn start_writes(&mut self, id: HandoffId, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        if h.phase != Phase::Leased || h.cancel_acked() {
            return;
        }
        let p_tp = self.cfg.tp.max(1);
        let Handoff {
            flow: ProducerFlow::Push { registrations, .. },
            blocks,
            timer,
            ..
        } = h
        else {
            return;
        };
        for r in registrations.iter_mut() {
            let valid = r
                .grant_until
                .is_some_and(|u| u > now + self.cfg.write_margin);
            if r.state == RegState::Waiting && valid {
                r.state = RegState::Writing;
                let done = rank_pairs(p_tp, r.d_tp)
                    .into_iter()
                    .filter(|(d, _)| *d == r.d_rank)
                    .map(|(d, p)| PushDone {
                        digest: None,
                        handoff: id,
                        epoch: r.epoch,
                        p_rank: p,
                        d_rank: d,
                    })
                    .collect();
                self.actions.push_back(ProducerAction::PushWrite(PushWrite {
                    handoff: id,
                    epoch: r.epoch,
                    d_peer: r.peer,
                    d_rank: r.d_rank,
                    d_tp: r.d_tp,
                    src_blocks: blocks.clone(),
                    dst_blocks: r.blocks.clone(),
                    num_tokens: r.num_tokens,
                    cached_blocks: r.cached_blocks,
                    grant_until: r.grant_until.unwrap_or(now),
                    done,
                }));
                let deadline = r.grant_until.unwrap_or(now) + self.cfg.write_timeout;
                timer.arm(&mut self.timers, id, deadline);
            }
        }
    }

    pub(super) fn send_push_heartbeats(&mut self, now: Time) {
        let mut any = false;
        let peers: Vec<PeerId> = self.push_waiting.keys().copied().collect();
        for peer in peers {
            let Some(ids) = self.push_waiting.get_mut(&peer) else {
                continue;
            };
            let handoffs = &self.handoffs;
            ids.retain(|id| {
                handoffs.get(id).is_some_and(|h| {
                    h.phase == Phase::Leased
                        && h.registrations().iter().any(|r| {
                            r.peer == peer
                                && matches!(r.state, RegState::Waiting | RegState::Writing)
                        })
                })
            });
            let entries: Vec<HeartbeatEntry> = ids
                .iter()
                .map(|id| HeartbeatEntry {
                    handoff: *id,
                    epoch: handoffs[id].epoch,
                })
                .collect();
            if entries.is_empty() {
                self.push_waiting.remove(&peer);
                continue;
            }
            any = true;
            self.heartbeats
                .send(peer, &entries, now, &mut self.messages);
        }
        self.next_push_heartbeat = any.then(|| now + self.cfg.heartbeat_interval);
    }
}
