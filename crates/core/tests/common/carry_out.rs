//! Carrying out an engine's `Ready` batch as its executor and workers would: frames onto
//! connections, grants onto the workers' transports, transfer jobs posted, events to the
//! engine.

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
                let now = self.now;
                let r = self.engines[i].core.ready(now);
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
        // The workers' transports: a grant is in force at once (the checker holds posts to it)
        // and confirmed a little later (now and then much later: a busy worker).
        for (rank, op) in &r.worker_ops {
            if let WorkerOp::Grant { grant, .. } = op {
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
        }
        for (conn, msg) in &r.messages {
            if let Some(&(to, their)) = self.links.get(&(node, *conn)) {
                // A peer that loses or repeats frames (rule 7: either costs time, never a
                // block); never the handshake, which only opens the connection.
                let handshake = matches!(msg, Message::Hello(_) | Message::HelloReply(_));
                let (drop, dup) = (self.faults.drop_pct, self.faults.dup_pct);
                if !handshake && drop > 0 && self.rng.pct(drop) {
                    continue;
                }
                let copies = if !handshake && dup > 0 && self.rng.pct(dup) {
                    2
                } else {
                    1
                };
                for _ in 0..copies {
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
        for (rank, job) in &r.transfers_to_post {
            self.post(node, *rank, job);
        }
        for (rank, job) in &r.transfers_to_abort {
            // The worker lets the transfer go and reports it ended, failed.
            if self.eng(node).jobs.remove(job).is_some() {
                let (rank, job) = (*rank, *job);
                self.at(now, Ev::Aborted { node, rank, job });
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

    pub(super) fn post(&mut self, node: Node, rank: u16, job: &TransferJob) {
        let now = self.now;
        let part = &job.parts[0];
        let Some((peer, peer_rank)) = [Node::P, Node::D(0), Node::D(1)]
            .into_iter()
            .flat_map(|n| (0..self.eng(n).tp).map(move |r| (n, r)))
            .find(|(n, r)| n.agent(*r) == part.agent)
        else {
            self.errs
                .push(format!("{node:?} posts to unknown agent {}", part.agent));
            return;
        };
        let notifications = job
            .parts
            .iter()
            .filter_map(|p| p.notification.clone())
            .collect();
        self.eng(node).jobs.insert(
            job.job,
            Job {
                peer,
                peer_rank,
                notifications,
                agent: node.agent(rank),
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
                rank,
                job: job.job,
                ok,
            },
        );
    }

    pub(super) fn event(&mut self, node: Node, ev: &ConnectorEvent) {
        let now = self.now;
        match (node, ev) {
            (_, ConnectorEvent::BlocksReleased { blocks, .. }) => {
                self.free(node, blocks);
            }
            (Node::D(d), ConnectorEvent::Ready { requests, .. }) => {
                for r in requests {
                    let Some(&i) = self.by_d_req.get(&(d, *r)) else {
                        self.errs
                            .push(format!("D{d} ready for unknown request {r}"));
                        continue;
                    };
                    self.outcome(i);
                    self.report.ready += 1;
                    self.at(now + ms(50), Ev::DecodeDone { d, req: *r });
                }
            }
            (Node::D(_), ConnectorEvent::RemoteStarted { .. }) => {}
            (Node::D(d), ConnectorEvent::Recompute { requests, .. })
            | (Node::D(d), ConnectorEvent::Failed { requests, .. }) => {
                for r in requests {
                    if let Some(&i) = self.by_d_req.get(&(d, *r)) {
                        self.outcome(i);
                        self.report.recomputed += 1;
                    }
                }
            }
            (Node::P, other) => self.errs.push(format!("P emits {other:?}")),
        }
    }
}
