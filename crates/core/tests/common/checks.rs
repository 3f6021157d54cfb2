//! The simulation's own bookkeeping of outcomes and pools, and the engines it kills or
//! impersonates. The rules are checked by `handoff_core::trace::Cluster`, fed by each
//! [`SimCore`](super::SimCore) as the cores act: the checker `handoff replay` uses, per engine.

use super::*;

impl Sim {
    pub(super) fn outcome(&mut self, i: usize) {
        self.state[i].outcome = true;
    }

    /// Blocks back in `node`'s pool (a block it does not hold stays where it is: the checker
    /// reports rule 1).
    pub(super) fn free(&mut self, node: Node, blocks: &[u32]) {
        let e = &mut self.engines[node.idx()];
        for b in blocks {
            if e.pool.owner.get(b).is_some_and(|o| *o != PREFIX) && e.pool.owner.remove(b).is_some()
            {
                e.pool.free.push(*b);
            }
        }
    }

    pub(super) fn kill(&mut self, node: Node, fin: bool) {
        let now = self.now;
        self.eng(node).alive = false;
        self.eng(node).jobs.clear();
        self.eng(node).core.died();
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
            let agents: Vec<String> = (0..self.eng(node).tp).map(|r| node.agent(r)).collect();
            for to in [Node::P, Node::D(0), Node::D(1)] {
                if to != node {
                    self.at(
                        now + ms(2),
                        Ev::DeadAgent {
                            to,
                            agents: agents.clone(),
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
}
