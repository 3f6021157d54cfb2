//! The rules checked against the simulation's own pools as the cores act (a block freed once
//! and never under a transfer, one outcome per request within its deadline), and what must
//! hold at the end of a run.

use super::*;

impl Sim {
    pub(super) fn outcome(&mut self, d: usize, i: usize, what: &'static str) {
        let now = self.now;
        if let Some(prev) = self.state[i].outcome {
            self.errs.push(format!(
                "request {i} on D{d}: a second outcome {what} after {prev}, at {now:?}"
            ));
        }
        if let Some(arrived) = self.state[i].arrived {
            // Rule 6: an outcome within the request's wait deadline (plus a timer tick).
            if now > arrived + self.dcfg.wait_deadline + ms(100) {
                self.errs.push(format!(
                    "rule 6: request {i} on D{d} ended at {now:?}, past its deadline (arrived {arrived:?})"
                ));
            }
        }
        self.state[i].outcome = Some(what);
    }

    pub(super) fn free(&mut self, node: Node, blocks: &[u32], why: &str) {
        let now = self.now;
        if node == Node::P {
            let owners: HashSet<u128> = blocks
                .iter()
                .filter_map(|b| self.engines[0].pool.owner.get(b).copied())
                .collect();
            for (i, st) in self.state.iter().enumerate() {
                let mine = st
                    .handoff
                    .is_some_and(|h| owners.contains(&u128::from_le_bytes(h.to_bytes())));
                // A push's prefill writes no block once its last layer is saved; a layer-wise
                // pull's handoff holds its blocks until the prefill said it ended.
                let writing = st.filling && (self.layerwise || st.layers_saved < LAYERS);
                if mine && writing {
                    self.errs.push(format!(
                        "prefill: P frees handoff {i}'s blocks ({why}) while its prefill writes them, at {now:?}"
                    ));
                }
            }
        }
        // Rules 2 and 3: no block goes back under a transfer that may still touch it.
        for other in 0..3 {
            let owner = match other {
                0 => Node::P,
                d => Node::D(d - 1),
            };
            if !self.engines[other].alive {
                continue;
            }
            for (job, j) in &self.engines[other].jobs {
                let touched = match node {
                    Node::P if j.peer == Node::P || owner == Node::P => &j.src,
                    Node::D(d) if j.peer == Node::D(d) || owner == Node::D(d) => &j.dst,
                    _ => continue,
                };
                if let Some(b) = blocks.iter().find(|b| touched.contains(b)) {
                    let rule = if node == Node::P { 2 } else { 3 };
                    self.errs.push(format!(
                        "rule {rule}: {node:?} frees block {b} ({why}) while {owner:?}'s {:?} job {} touches it, at {now:?}",
                        j.op, job.0
                    ));
                }
            }
        }
        let e = &mut self.engines[node.idx()];
        for b in blocks {
            if e.pool.owner.get(b) == Some(&PREFIX) {
                self.errs.push(format!(
                    "rule 1: {node:?} frees block {b} ({why}) of D's prefix cache, which no transfer owns, at {now:?}"
                ));
                continue;
            }
            if e.pool.owner.remove(b).is_none() {
                self.errs.push(format!(
                    "rule 1: {node:?} frees block {b} ({why}), which it does not hold, at {now:?}"
                ));
                continue;
            }
            e.pool.free.push(*b);
        }
    }

    pub(super) fn kill(&mut self, node: Node, fin: bool) {
        let now = self.now;
        self.eng(node).alive = false;
        self.eng(node).jobs.clear();
        let ends: Vec<((Node, ConnId), (Node, ConnId))> = self
            .links
            .iter()
            .filter(|((n, _), _)| *n == node)
            .map(|(a, b)| (*a, *b))
            .collect();
        for (mine, (to, their)) in ends {
            self.links.remove(&mine);
            if fin {
                self.at(now + ms(1), Ev::Closed { to, conn: their });
            }
        }
        if fin {
            let agent = node.agent();
            for to in [Node::P, Node::D(0), Node::D(1)] {
                if to != node {
                    self.at(
                        now + ms(2),
                        Ev::DeadAgent {
                            to,
                            agent: agent.clone(),
                        },
                    );
                }
            }
        }
    }

    /// A connection to P that never says hello: a heartbeat for a live handoff, then a
    /// release of it.
    pub(super) fn stranger(&mut self) {
        let now = self.now;
        if !self.alive(Node::P) {
            return;
        }
        let Some(h) = self.state.iter().rev().find_map(|s| s.handoff) else {
            return;
        };
        let conn = self.next_conn;
        self.next_conn += 1;
        let hb = Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![HeartbeatEntry {
                handoff: h,
                epoch: Epoch::FIRST,
            }],
        });
        let p = &mut self.engines[0].core;
        p.input(
            Input::Accepted {
                conn,
                msg: hb,
                proven: None,
            },
            now,
        );
        let msg = Message::Release(handoff_proto::Release {
            handoff: h,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Done,
        });
        p.input(Input::Frame { conn, msg }, now);
    }

    pub(super) fn final_checks(&mut self) {
        let p_alive = self.engines[0].alive;
        if p_alive {
            let held = self.engines[0].pool.owner.len();
            if held > 0 {
                self.errs
                    .push(format!("rule 5: P still holds {held} blocks at the end"));
            }
        }
        for d in 0..2 {
            if !self.engines[1 + d].alive {
                continue;
            }
            let held = self.engines[1 + d].pool.owner.len() - PREFIX_BLOCKS;
            if held > 0 {
                self.errs.push(format!(
                    "rule 1/6: D{d} still holds {held} blocks at the end"
                ));
            }
            for (i, st) in self.state.iter().enumerate() {
                if self.reqs[i].d % 2 == d && st.tracked && !st.aborted && st.outcome.is_none() {
                    self.errs
                        .push(format!("rule 6: request {i} on D{d} never ended"));
                }
            }
        }
        for (i, e) in self.engines.iter().enumerate() {
            if !e.alive {
                continue;
            }
            let m = e.core.memory();
            if m.reads + m.pushes + m.jobs > 0 {
                self.errs.push(format!(
                    "rule 7: engine {i} keeps {} reads, {} pushes, {} jobs at the end",
                    m.reads, m.pushes, m.jobs
                ));
            }
        }
    }
}
