//! What the simulation does at each scheduled event: a request's legs, deliveries, job ends,
//! kills, a stranger, the proxy's release. Each one drives the cores through their hooks.

use super::*;

impl Sim {
    pub(super) fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Create(i) => {
                if !self.alive(Node::P) {
                    return;
                }
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&self.rng.next_u64().to_le_bytes());
                id[8..].copy_from_slice(&(i as u64 + 1).to_le_bytes());
                let handoff = HandoffId::from_bytes(id);
                if self.layerwise || self.mode == TransferMode::Push {
                    // Both legs leave at once; either may arrive first.
                    let (_, d_params) = self.both_legs(i, handoff);
                    self.state[i].handoff = Some(handoff);
                    self.state[i].params = Some(d_params);
                    let lag = ms(self.reqs[i].lag_ms);
                    let (p_at, d_at) = if self.reqs[i].lag_ms % 2 == 1 {
                        (now + lag, now)
                    } else {
                        (now, now + lag)
                    };
                    self.at(p_at, Ev::PrefillStart(i));
                    self.at(d_at, Ev::Arrive(i));
                    return;
                }
                let Some(blocks) = self.p_blocks_for(i, handoff) else {
                    return;
                };
                let tokens = self.tokens(i);
                let request = format!("r{i}");
                let leg = KvTransferParams::for_prefill_leg();
                let p = self.engines[0].core.at(now);
                let ended = p
                    .prefill_started(&request, &leg, handoff, blocks.clone(), tokens)
                    .and_then(|_| p.prefill_ended(&request, PrefillOutcome::Finished));
                let params = match ended {
                    Ok(PrefillEnd {
                        params: Some(prm),
                        holding: Some(_),
                    }) => prm,
                    other => {
                        self.errs
                            .push(format!("P refused to create handoff {i}: {other:?}"));
                        return;
                    }
                };
                self.state[i].handoff = Some(handoff);
                self.state[i].params = Some(params);
                self.state[i].p_blocks = blocks;
                let lag = ms(self.reqs[i].lag_ms);
                self.at(now + lag, Ev::Arrive(i));
            }
            Ev::PrefillStart(i) => {
                let Some(handoff) = self.state[i].handoff else {
                    return;
                };
                if !self.alive(Node::P) {
                    return;
                }
                let Some(blocks) = self.p_blocks_for(i, handoff) else {
                    return;
                };
                let (p_params, _) = self.both_legs(i, handoff);
                let tokens = self.tokens(i);
                match self.engines[0].core.at(now).prefill_started(
                    &format!("r{i}"),
                    &p_params,
                    handoff,
                    blocks.clone(),
                    tokens,
                ) {
                    Ok(Some(h)) if h == handoff => {}
                    other => {
                        self.errs
                            .push(format!("P refused the prefill of {i}: {other:?}"));
                        return;
                    }
                }
                self.state[i].p_blocks = blocks;
                self.state[i].filling = true;
                for l in 0..LAYERS {
                    self.at(now + ms(20 * u64::from(l + 1)), Ev::LayerSaved(i, l));
                }
                self.at(now + ms(20 * u64::from(LAYERS) + 5), Ev::PrefillEnd(i));
            }
            Ev::PrefillEnd(i) => {
                if !self.alive(Node::P) || !self.state[i].filling {
                    return;
                }
                self.state[i].filling = false;
                let ended = self.engines[0]
                    .core
                    .at(now)
                    .prefill_ended(&format!("r{i}"), PrefillOutcome::Finished);
                if !matches!(
                    ended,
                    Ok(PrefillEnd {
                        params: Some(_),
                        holding: Some(_)
                    })
                ) {
                    self.errs
                        .push(format!("P refused to end the prefill of {i}: {ended:?}"));
                }
            }
            Ev::LayerSaved(i, l) => {
                if self.alive(Node::P) && self.state[i].filling {
                    self.engines[0]
                        .core
                        .at(now)
                        .layers_saved(&format!("r{i}"), l + 1);
                }
            }
            Ev::Arrive(i) => {
                let d = self.reqs[i].d % 2;
                let Some(params) = self.state[i].params.clone() else {
                    return;
                };
                if self.reqs[i].fate == 4 {
                    // The proxy could not reach D: it releases at P.
                    if self.alive(Node::P) {
                        let _ = self.engines[0].core.at(now).release_from_proxy(&params);
                    }
                    return;
                }
                if !self.alive(Node::D(d)) {
                    if self.alive(Node::P) {
                        let _ = self.engines[0].core.at(now).release_from_proxy(&params);
                    }
                    return;
                }
                let tokens = self.tokens(i);
                let core = &mut self.engines[1 + d].core;
                if self.reqs[i].fate == 1 {
                    let _ = core.at(now).reject(&params);
                    return;
                }
                let req = (i as u64) * 2;
                self.state[i].d_req = req;
                self.by_d_req.insert((d, req), i);
                match core.at(now).request_arrived(req, &params, tokens) {
                    Ok(_) => {
                        self.state[i].tracked = true;
                        let admit = ms(self.reqs[i].admit_after_ms);
                        self.at(now + admit, Ev::Admit(i));
                        if matches!(self.reqs[i].fate, 2 | 3) {
                            self.at(now + ms(self.reqs[i].fate_ms), Ev::Fate(i));
                        }
                    }
                    Err(e) => self.errs.push(format!("D{d} refused request {i}: {e}")),
                }
            }
            Ev::Admit(i) => {
                let d = self.reqs[i].d % 2;
                let st = &self.state[i];
                if !self.alive(Node::D(d)) || st.outcome || st.aborted {
                    return;
                }
                let req = st.d_req;
                let n = usize::from(self.reqs[i].blocks);
                let hit = usize::from(self.reqs[i].cached)
                    .min(n.saturating_sub(1))
                    .min(PREFIX_BLOCKS);
                let moved = self.moved_blocks(i, hit);
                let Some(blocks) = self.engines[1 + d].pool.alloc(moved, u128::from(req)) else {
                    return; // stays queued until its deadline
                };
                let cached = self.engines[1 + d].prefix[..hit].to_vec();
                match self.engines[1 + d]
                    .core
                    .at(now)
                    .blocks_allocated(req, cached, blocks.clone())
                {
                    Ok(()) => self.state[i].d_blocks = blocks,
                    Err(_) => self.free(Node::D(d), &blocks),
                }
            }
            Ev::Fate(i) => {
                let d = self.reqs[i].d % 2;
                if !self.alive(Node::D(d)) || self.state[i].outcome {
                    return;
                }
                let Some(params) = self.state[i].params.clone() else {
                    return;
                };
                let core = &mut self.engines[1 + d].core;
                if self.reqs[i].fate == 2 {
                    self.state[i].aborted = true;
                    core.at(now)
                        .request_ended(self.state[i].d_req, ReleaseReason::Aborted);
                    // The prompt blocks stay the connector's until it releases them.
                } else {
                    // A retry of the same request hits a full queue: D refuses it.
                    let _ = core.at(now).reject(&params);
                }
            }
            Ev::Frame { to, conn, msg } => {
                if !self.alive(to) {
                    return;
                }
                if let Some((engine, attempt)) = self.connecting.remove(&(to, conn)) {
                    let reply = msg;
                    self.eng(to).core.input(
                        Input::Connected {
                            engine,
                            attempt,
                            conn,
                            reply,
                        },
                        now,
                    );
                    return;
                }
                if self.pending_accept.remove(&(to, conn)) {
                    self.eng(to).core.input(
                        Input::Accepted {
                            conn,
                            msg,
                            proven: None,
                        },
                        now,
                    );
                } else {
                    self.eng(to).core.input(Input::Frame { conn, msg }, now);
                }
            }
            Ev::Closed { to, conn } => {
                self.connecting.remove(&(to, conn));
                if self.alive(to) && self.links.remove(&(to, conn)).is_some() {
                    self.eng(to).core.input(Input::Closed { conn }, now);
                }
            }
            Ev::ConnectFailed { d, engine, attempt } => {
                if self.alive(Node::D(d)) {
                    self.engines[1 + d].core.input(
                        Input::ConnectFailed {
                            engine,
                            attempt,
                            error: "refused".into(),
                        },
                        now,
                    );
                }
            }
            Ev::JobEnd {
                node,
                rank,
                job,
                ok,
            } => {
                if !self.alive(node) {
                    return;
                }
                let Some(j) = self.eng(node).jobs.remove(&job) else {
                    return; // aborted
                };
                if ok {
                    let from = j.agent.clone();
                    for bytes in j.notifications {
                        let t = self.arrival((node, u64::MAX - job.0), j.peer);
                        self.at(
                            t,
                            Ev::Notify {
                                to: j.peer,
                                rank: j.peer_rank,
                                from: from.clone(),
                                bytes,
                            },
                        );
                    }
                }
                let report = WorkerReport {
                    rank,
                    ended: vec![(job, ok)],
                    ..Default::default()
                };
                self.eng(node).core.input(Input::WorkerReport(report), now);
            }
            Ev::Granted { node, rank, grant } => {
                if self.alive(node) {
                    let report = WorkerReport {
                        rank,
                        granted: vec![(grant, true)],
                        ..Default::default()
                    };
                    self.eng(node).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::Aborted { node, rank, job } => {
                if self.alive(node) {
                    let report = WorkerReport {
                        rank,
                        ended: vec![(job, false)],
                        ..Default::default()
                    };
                    self.eng(node).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::Notify {
                to,
                rank,
                from,
                bytes,
            } => {
                if self.alive(to) {
                    let report = WorkerReport {
                        rank,
                        notifications: vec![(from, bytes)],
                        ..Default::default()
                    };
                    self.eng(to).core.input(Input::WorkerReport(report), now);
                }
            }
            Ev::DeadAgent { to, agents } => {
                // Every rank's transport sees the peer's agents die.
                for rank in 0..self.eng(to).tp {
                    if self.alive(to) {
                        let report = WorkerReport {
                            rank,
                            dead_agents: agents.clone(),
                            ..Default::default()
                        };
                        self.eng(to).core.input(Input::WorkerReport(report), now);
                    }
                }
            }
            Ev::DecodeDone { d, req } => {
                if let Some(&i) = self.by_d_req.get(&(d, req)) {
                    let blocks = std::mem::take(&mut self.state[i].d_blocks);
                    if self.alive(Node::D(d)) {
                        self.free(Node::D(d), &blocks);
                    }
                }
            }
            Ev::Kill(node, fin) => self.kill(node, fin),
            Ev::Stranger => self.stranger(),
            Ev::ProxyRelease => {
                let params = self.state.iter().rev().find_map(|s| s.params.clone());
                if let (true, Some(prm)) = (self.alive(Node::P), params) {
                    let _ = self.engines[0].core.at(now).release_from_proxy(&prm);
                }
            }
        }
    }
}
