//! One named scenario per case of the lifecycle: each drives a P ledger and a D ledger through a
//! script on a simulated clock and checks what a P/D cluster relies on. A module per flow: pull
//! (leases, notifications, epochs, retries, siblings, TP), push, when D may start a read (rule 2
//! on D's side, and what a hostile peer's made-up messages cannot do), layer-wise pull. The
//! helpers every flow uses are here.

#[path = "../common/mod.rs"]
mod common;
mod layerwise;
mod pull;
mod push;
mod read_start;

use std::time::Duration;

use common::*;
use handoff_ledger::*;
use handoff_proto::{
    Epoch, Grant, GrantBatch, Heartbeat, HeartbeatEntry, Message, PullDone, PushCancel,
    PushRegister, Release, ReleaseReason, TransferMode,
};

const BLOCKS: [u32; 4] = [10, 11, 12, 13];

/// P creates `id` (pull, on `BLOCKS`), then request `req` naming it arrives at D.
/// D's `PullDone` for a handoff of one P rank read by one D rank: it read everything.
fn read_all(id: handoff_proto::HandoffId) -> Message {
    Message::PullDone(PullDone {
        handoff: id,
        epoch: Epoch::FIRST,
        p_rank: 0,
        consumer_rank: 0,
        consumers: 1,
    })
}

fn pull_arrives(pair: &mut Pair, id: handoff_proto::HandoffId, req: u64) {
    pair.p
        .create_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    let inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    pair.d
        .on_request_arrived(RequestId(req), inc, pair.now)
        .unwrap();
}

/// P creates, D arrives and is admitted: returns the read D starts.
fn start_pull(pair: &mut Pair, id: handoff_proto::HandoffId, req: u64) -> StartRead {
    pull_arrives(pair, id, req);
    pair.pump();
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
    pair.reads
        .last()
        .cloned()
        .expect("a granted, admitted handoff starts its read")
}

fn push_pair() -> Pair {
    let mut pair = Pair::default_pair();
    pair.d = ConsumerLedger::new(ConsumerConfig {
        push_deadline: Duration::from_secs(5),
        ..Default::default()
    });
    pair
}

/// The end of the last grant sent for `id` in direction `dir` ("P>D": P's lease on its blocks
/// to D; "D>P": D's on a push registration to P), as its sender measured it (= the pair's clock).
fn last_grant_end(pair: &Pair, dir: &str, id: handoff_proto::HandoffId) -> Option<Duration> {
    pair.log
        .iter()
        .rev()
        .filter(|(_, d, _)| *d == dir)
        .find_map(|(t, _, m)| match m {
            Message::GrantBatch(g) => g
                .grants
                .iter()
                .find(|g| g.handoff == id)
                .map(|g| *t + ms(g.lease_ms as u64)),
            _ => None,
        })
}
