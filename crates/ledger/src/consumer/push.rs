//! The consumer's push flow: D registers the blocks it reserved with P, grants P the right to
//! write them while P heartbeats, takes P's `PushDone`s, and on a cancel or a dead P waits out
//! every WRITE that may still land before its blocks go back (rule 3).

use super::*;

impl ConsumerLedger {
    /// Push: P asks for grants on the registrations it waits to write into.
    pub(super) fn on_heartbeat(&mut self, from: PeerId, hb: Heartbeat, now: Time) {
        let mut grants = Vec::new();
        let mut gone = Vec::new();
        for e in hb.entries {
            match self.handoffs.get_mut(&e.handoff) {
                Some(h) if h.info.peer == from && h.info.epoch == e.epoch => match h.state {
                    State::Registered {
                        watchdog,
                        ref mut last_heard,
                        ..
                    } if now < watchdog => {
                        *last_heard = now;
                        let until = (now + self.cfg.registration_lease).min(watchdog);
                        h.issued_until = Some(h.issued_until.map_or(until, |u| u.max(until)));
                        grants.push(Grant {
                            handoff: e.handoff,
                            epoch: e.epoch,
                            lease_ms: ms_floor(until - now),
                        });
                    }
                    // Not registered yet: nothing to grant, nothing to declare gone.
                    State::Waiting => {}
                    _ => gone.push(e),
                },
                Some(_) => self.stats.ignored += 1,
                // Every write landed: P learns that from its own transfers' completion, which
                // may trail this heartbeat. "Gone" would race it and make P abort writes that
                // succeeded (and hold its blocks until its lease ran out). Say nothing.
                None if self.tombstones.get(&e.handoff) == Some(&true) => {}
                None => gone.push(e),
            }
        }
        for batch in split_grants(hb.seq, grants, gone) {
            self.messages.push_back((from, Message::GrantBatch(batch)));
        }
    }

    pub(super) fn on_push_done(&mut self, from: PeerId, d: PushDone, now: Time) {
        let write_grace = self.cfg.write_grace;
        let Some(h) = self.handoffs.get_mut(&d.handoff) else {
            self.stats.late_notifications += 1;
            return;
        };
        if h.info.peer != from || h.info.epoch != d.epoch {
            self.stats.ignored += 1;
            return;
        }
        let p_tp = h.info.p_tp;
        let tp = self.cfg.tp.max(1);
        let issued_until = h.issued_until;
        let State::Registered { done, .. } = &mut h.state else {
            self.stats.late_notifications += 1;
            return;
        };
        // Rule 4: the write must have landed inside a grant we issued (+ grace).
        let in_grant = issued_until.is_some_and(|u| now <= u + write_grace);
        if !in_grant {
            self.fail_requests(d.handoff, FailReason::LateWrite);
            self.cancel_push(d.handoff, EndReason::Failed, now);
            return;
        }
        let pair = (d.d_rank, d.p_rank);
        if !done.contains(&pair) {
            done.push(pair);
        }
        if h.p_digest.is_none() {
            h.p_digest = d.digest;
        }
        let all = rank_pairs(p_tp, tp);
        if all.iter().all(|p| done.contains(p)) {
            let blocks = h.local.take().unwrap_or_default();
            self.held_blocks -= blocks.len();
            let requests = std::mem::take(&mut h.requests);
            for r in &requests {
                self.by_request.remove(r);
            }
            if requests.is_empty() {
                h.local = Some(blocks);
                self.held_blocks += h.local.as_ref().map_or(0, Vec::len);
                self.release_local(d.handoff, EndReason::Aborted, now);
            } else {
                self.stats.ready += 1;
                let waited = h.waited(now);
                self.outcomes.push_back(Outcome::Ready {
                    handoff: d.handoff,
                    requests,
                    blocks,
                    waited,
                    p_digest: h.p_digest,
                    num_tokens: h.info.num_tokens,
                    peer: h.info.peer,
                    cached: h.cached.clone(),
                });
            }
            self.end_handoff(d.handoff, now);
            self.tombstones.insert(d.handoff, true, now);
        }
    }

    pub(super) fn on_push_failed(&mut self, from: PeerId, f: PushFailed, now: Time) {
        let Some(h) = self.handoffs.get(&f.handoff) else {
            self.stats.late_notifications += 1;
            return;
        };
        if h.info.peer != from || h.info.epoch != f.epoch {
            self.stats.ignored += 1;
            return;
        }
        if let State::Registered { .. } = h.state {
            self.fail_requests(f.handoff, FailReason::WriteFailed);
            // Other P ranks may still be writing: cancel and wait for the ack or the grace.
            self.cancel_push(f.handoff, EndReason::Failed, now);
        }
    }

    pub(super) fn on_cancel_ack(&mut self, from: PeerId, a: PushCancelAck, now: Time) {
        let Some(h) = self.handoffs.get(&a.handoff) else {
            return;
        };
        if h.info.peer != from || h.info.epoch != a.epoch {
            return;
        }
        if let State::Cancelling { .. } = h.state {
            // P promised no write is or will be in flight: the blocks are safe to reuse (rule 3).
            self.release_local(a.handoff, EndReason::Cancelled, now);
            self.end_handoff(a.handoff, now);
        }
    }

    /// How long P may stay silent about a registration before D sends it again.
    pub(super) fn register_resend(&self) -> Duration {
        self.cfg.heartbeat_interval * REGISTER_RESEND_HEARTBEATS
    }

    /// One `PushRegister` per D rank for the blocks reserved for push handoff `id`.
    pub(super) fn send_registrations(&mut self, id: HandoffId) {
        let Some(h) = self.handoffs.get(&id) else {
            return;
        };
        let Some(blocks) = &h.local else {
            return;
        };
        let tp = self.cfg.tp.max(1);
        for d_rank in 0..tp {
            self.messages.push_back((
                h.info.peer,
                Message::PushRegister(PushRegister {
                    handoff: id,
                    epoch: h.info.epoch,
                    d_rank,
                    d_tp: tp,
                    num_tokens: h.info.num_tokens,
                    block_ids: blocks.clone(),
                    cached_blocks: h.cached.len() as u32,
                }),
            ));
        }
    }

    /// Push: stop P from writing, then free once that is certain.
    pub(super) fn cancel_push(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        let peer = h.info.peer;
        self.messages.push_back((
            peer,
            Message::PushCancel(PushCancel {
                handoff: id,
                epoch: h.info.epoch,
            }),
        ));
        self.stats.cancels_sent += 1;
        self.await_writes_end(id, reason, now);
    }

    /// Frees `id`'s blocks once no WRITE of P's can land in them any more: at once if P never
    /// got a grant (it writes only on one), else after the last grant D issued + the write grace.
    pub(super) fn await_writes_end(&mut self, id: HandoffId, reason: EndReason, now: Time) {
        let write_grace = self.cfg.write_grace;
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        match h.issued_until {
            None => {
                self.release_local(id, reason, now);
                self.end_handoff(id, now);
            }
            Some(issued) => {
                let until = (issued + write_grace).max(now);
                h.state = State::Cancelling { until, reason };
                h.timer.arm(&mut self.timers, id, until);
            }
        }
    }
}
