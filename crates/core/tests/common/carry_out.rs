//! Carrying out an engine's `Ready` batch as its executor and workers would: frames onto
//! connections, grants onto the workers' transports, transfer jobs posted (and checked against
//! the pools), events to the engine.

use super::*;

impl Sim {
    /// Carries out every engine's `Ready` batch until none is left.
    pub(super) fn drain(&mut self) {
        loop {
            let mut any = false;
            for i in 0..3 {
                if !self.engines[i].alive || !self.engines[i].core.has_ready() {
                    continue;
                }
                any = true;
                let r = self.engines[i].core.ready();
                let node = match i {
                    0 => Node::P,
                    d => Node::D(d - 1),
                };
                use std::fmt::Write as _;
                let _ = writeln!(self.report.transcript, "{:?} {node:?} {r:?}", self.now);
                self.carry_out(node, &r);
                self.engines[i].core.advance(r);
            }
            if !any {
                break;
            }
        }
    }

    pub(super) fn carry_out(&mut self, node: Node, r: &Ready) {
        let now = self.now;
        // The workers' transports: a grant is in force (and confirmed) a little later (now and
        // then much later: a busy worker), a revoke at once.
        for (rank, op) in &r.worker_ops {
            match op {
                WorkerOp::Grant {
                    grant,
                    op,
                    agents,
                    blocks,
                    ..
                } => {
                    self.eng(node)
                        .grants
                        .insert(*grant, (*op, agents.clone(), blocks.clone()));
                    let t = match self.below(4) {
                        0 => now + ms(self.below(300)),
                        _ => now + ms(self.below(4)),
                    };
                    self.at(
                        t,
                        Ev::Granted {
                            node,
                            rank: *rank,
                            grant: *grant,
                        },
                    );
                }
                WorkerOp::Revoke { grant } => {
                    self.eng(node).grants.remove(grant);
                }
                _ => {}
            }
        }
        for (conn, msg) in &r.messages {
            if let Some(&(to, their)) = self.links.get(&(node, *conn)) {
                let t = self.arrival((node, *conn), to);
                self.at(
                    t,
                    Ev::Frame {
                        to,
                        conn: their,
                        msg: msg.clone(),
                    },
                );
            }
        }
        for conn in &r.closes {
            if let Some((to, their)) = self.links.remove(&(node, *conn)) {
                let t = self.arrival((node, *conn), to);
                self.at(t, Ev::Closed { to, conn: their });
            }
        }
        for c in &r.connects {
            let Node::D(d) = node else {
                self.errs.push(format!("{node:?} dials {}", c.addr));
                continue;
            };
            if c.addr != "p:7000" || c.engine != "p" {
                self.errs
                    .push(format!("D{d} dials {} ({})", c.addr, c.engine));
                continue;
            }
            if !self.alive(Node::P) {
                self.at(
                    now + ms(50),
                    Ev::ConnectFailed {
                        d,
                        engine: c.engine.clone(),
                        attempt: c.attempt,
                    },
                );
                continue;
            }
            let (mine, theirs) = (self.next_conn, self.next_conn + 1);
            self.next_conn += 2;
            self.links.insert((node, mine), (Node::P, theirs));
            self.links.insert((Node::P, theirs), (node, mine));
            self.connecting
                .insert((node, mine), (c.engine.clone(), c.attempt));
            self.pending_accept.insert((Node::P, theirs));
            let t = self.arrival((node, mine), Node::P);
            self.at(
                t,
                Ev::Frame {
                    to: Node::P,
                    conn: theirs,
                    msg: c.hello.clone(),
                },
            );
        }
        for (_, job) in &r.transfers_to_post {
            self.post(node, job);
        }
        for (_, job) in &r.transfers_to_abort {
            // The worker lets the transfer go and reports it ended, failed.
            if self.eng(node).jobs.remove(job).is_some() {
                self.at(now, Ev::Aborted { node, job: *job });
            }
        }
        for o in &r.observations {
            if matches!(o, handoff_core::Observation::AnonymousRefused) {
                self.report.anonymous_refused += 1;
            }
        }
        for ev in &r.events {
            self.event(node, ev);
        }
    }

    pub(super) fn post(&mut self, node: Node, job: &TransferJob) {
        let now = self.now;
        let part = &job.parts[0];
        let Some(peer) = [Node::P, Node::D(0), Node::D(1)]
            .into_iter()
            .find(|n| n.agent() == part.agent)
        else {
            self.errs
                .push(format!("{node:?} posts to unknown agent {}", part.agent));
            return;
        };
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for p in &job.parts {
            for d in &p.descs {
                local.extend(blocks_of(d.local_offset, d.len));
                remote.extend(blocks_of(d.remote_offset, d.len));
            }
        }
        local.sort_unstable();
        local.dedup();
        remote.sort_unstable();
        remote.dedup();
        let (src, dst) = match job.op {
            XferOp::Read => (remote, local),
            XferOp::Write => (local, remote),
        };
        // Rule 2 / rule 3 at post time: the blocks on both sides belong to this transfer's
        // handoff (P) and request (D).
        let d = match (node, peer) {
            (Node::D(d), Node::P) | (Node::P, Node::D(d)) => d,
            _ => {
                self.errs.push(format!("{node:?} posts to {peer:?}"));
                return;
            }
        };
        let d_owner: HashSet<u128> = dst
            .iter()
            .filter_map(|b| self.engines[1 + d].pool.owner.get(b).copied())
            .collect();
        let p_owner: HashSet<u128> = src
            .iter()
            .filter_map(|b| self.engines[0].pool.owner.get(b).copied())
            .collect();
        let d_ok = d_owner.len() == 1
            && dst
                .iter()
                .all(|b| self.engines[1 + d].pool.owner.contains_key(b));
        let p_ok = p_owner.len() == 1
            && src
                .iter()
                .all(|b| self.engines[0].pool.owner.contains_key(b));
        if self.alive(Node::P) && !p_ok {
            self.errs.push(format!(
                "rule 2: {node:?} posts a {:?} of P blocks {src:?} that P does not hold for one handoff, at {now:?}",
                job.op
            ));
        }
        if self.alive(Node::D(d)) && !d_ok {
            self.errs.push(format!(
                "rule 3: {node:?} posts a {:?} into D{d} blocks {dst:?} that D does not hold for one request, at {now:?}",
                job.op
            ));
        }
        // Layer-wise pull: D reads no layer P has not saved yet (the cross-layer layout puts
        // layer `l` of a block at `l` block sizes into its range).
        if let (true, XferOp::Read, Some(h)) = (self.layerwise, job.op, p_owner.iter().next()) {
            let layer_bytes = spec().block_bytes();
            let stride = block_stride();
            let deepest = job
                .parts
                .iter()
                .flat_map(|p| &p.descs)
                .map(|x| {
                    let (first, last) = (x.remote_offset, x.remote_offset + x.len.max(1) - 1);
                    if last / stride != first / stride {
                        LAYERS - 1
                    } else {
                        ((last % stride) / layer_bytes) as u32
                    }
                })
                .max();
            let i = self.state.iter().position(|st| {
                st.handoff
                    .is_some_and(|x| u128::from_le_bytes(x.to_bytes()) == *h)
            });
            if let (Some(deepest), Some(i)) = (deepest, i) {
                let st = &self.state[i];
                let saved = if st.filling { st.layers_saved } else { LAYERS };
                if deepest >= saved && self.alive(Node::P) {
                    self.errs.push(format!(
                        "layer-wise: D{d} reads layer {deepest} of handoff {i} with {saved} saved, at {now:?}"
                    ));
                }
            }
        }
        if let (Some(h), Some(r)) = (p_owner.iter().next(), d_owner.iter().next()) {
            let matched = self
                .by_d_req
                .get(&(d, *r as u64))
                .and_then(|&i| self.state[i].handoff)
                .is_some_and(|x| u128::from_le_bytes(x.to_bytes()) == *h);
            if !matched {
                self.errs.push(format!(
                    "rule 4: a {:?} moves handoff {h:x}'s blocks into D{d} request {r}'s, at {now:?}",
                    job.op
                ));
            }
        }
        // The target's transport serves only what it granted to the poster's agent (a second
        // enforcement of rules 2 and 3, beside the ledgers).
        let touched = match job.op {
            XferOp::Read => &src,
            XferOp::Write => &dst,
        };
        let me = node.agent();
        let granted = touched.iter().all(|b| {
            self.eng(peer).grants.values().any(|(op, agents, blocks)| {
                *op == job.op && agents.contains(&me) && blocks.contains(b)
            })
        });
        if self.alive(peer) && !granted {
            self.errs.push(format!(
                "grant: {node:?} posts a {:?} of {peer:?} blocks {touched:?} outside any grant to it, at {now:?}",
                job.op
            ));
        }
        let notifications = job
            .parts
            .iter()
            .filter_map(|p| p.notification.clone())
            .collect();
        self.eng(node).jobs.insert(
            job.job,
            Job {
                op: job.op,
                peer,
                src,
                dst,
                notifications,
                agent: node.agent(),
            },
        );
        let roll = self.below(100) as u8;
        if roll < self.faults.hang_pct {
            return; // runs until aborted
        }
        let ok = roll >= self.faults.hang_pct + self.faults.fail_pct;
        let took = ms(1 + self.faults.transfer_min_ms + self.below(self.faults.transfer_ms + 1));
        self.at(
            now + took,
            Ev::JobEnd {
                node,
                job: job.job,
                ok,
            },
        );
    }

    pub(super) fn event(&mut self, node: Node, ev: &ConnectorEvent) {
        let now = self.now;
        match (node, ev) {
            (_, ConnectorEvent::BlocksReleased { blocks, reason, .. }) => {
                self.free(node, blocks, reason);
            }
            (Node::D(d), ConnectorEvent::Ready { requests, blocks }) => {
                for r in requests {
                    let Some(&i) = self.by_d_req.get(&(d, *r)) else {
                        self.errs
                            .push(format!("D{d} ready for unknown request {r}"));
                        continue;
                    };
                    let h = self.state[i]
                        .handoff
                        .map(|h| u128::from_le_bytes(h.to_bytes()));
                    // Rule 4: every block decoded holds KV that landed for this handoff.
                    for b in blocks {
                        let filled = self.landed[d].get(b).copied();
                        if filled != Some(u128::from(*r)) {
                            self.errs.push(format!(
                                "rule 4: D{d} decodes request {r} (handoff {h:x?}) from block {b}, which no transfer of it filled, at {now:?}"
                            ));
                        }
                    }
                    self.outcome(d, i, "ready");
                    self.report.ready += 1;
                    self.at(now + ms(50), Ev::DecodeDone { d, req: *r });
                }
            }
            (Node::D(_), ConnectorEvent::RemoteStarted { .. }) => {}
            (Node::D(d), ConnectorEvent::Recompute { requests, .. })
            | (Node::D(d), ConnectorEvent::Failed { requests, .. }) => {
                for r in requests {
                    if let Some(&i) = self.by_d_req.get(&(d, *r)) {
                        self.outcome(d, i, "recomputed");
                        self.report.recomputed += 1;
                    }
                }
            }
            (Node::P, other) => self.errs.push(format!("P emits {other:?}")),
        }
    }
}
