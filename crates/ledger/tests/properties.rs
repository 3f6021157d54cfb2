//! Focused property tests of the two ledgers, on the zero-delay harness of the scenarios: random
//! scripts of what engines and peers do to one P ledger and one D ledger — pull and push
//! handoffs asked for by n>1 siblings, allocations, transfers that end, fail or never end,
//! aborts, a side channel cut and restored — after which every block of both pools went back
//! exactly once, every request got at most one outcome (exactly one unless its client aborted
//! it), and both ledgers are empty once every deadline passed.
//!
//! The cluster as a whole (TP pairs, lossy and repeating side channels, lease edges, crashes,
//! rules 1–7 on the real connector cores) is the core simulation's
//! (`crates/core/tests/core_sim.rs`), checked by `handoff_core::trace::Cluster`.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{hid, ms, Pair};
use handoff_ledger::testing::simulation_configs;
use handoff_ledger::{BlockId, Outcome, RequestId};
use handoff_proto::{HandoffId, ReleaseReason, TransferMode};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Step {
    /// A handoff of `blocks` P blocks, asked for by `siblings` D requests.
    Handoff {
        push: bool,
        blocks: u8,
        siblings: u8,
    },
    /// D's engine gives blocks to the `k`-th handoff that has none yet.
    Allocate(u8),
    /// The `k`-th transfer in flight ends, well or not.
    EndTransfer(u8, bool),
    /// The client aborts the `k`-th live request.
    Abort(u8),
    /// Time passes (ms).
    Wait(u16),
    /// The side channel is cut (messages lost both ways), or restored.
    Cut(bool),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (any::<bool>(), 1u8..5, 1u8..4)
            .prop_map(|(push, blocks, siblings)| Step::Handoff { push, blocks, siblings }),
        3 => any::<u8>().prop_map(Step::Allocate),
        3 => (any::<u8>(), prop_oneof![4 => Just(true), 1 => Just(false)])
            .prop_map(|(k, ok)| Step::EndTransfer(k, ok)),
        1 => any::<u8>().prop_map(Step::Abort),
        3 => (0u16..2500).prop_map(Step::Wait),
        1 => any::<bool>().prop_map(Step::Cut),
    ]
}

/// One script's run, and what it left.
#[derive(Default)]
struct Run {
    /// P's blocks of each handoff, as given to its ledger.
    p_given: BTreeMap<HandoffId, Vec<BlockId>>,
    /// D's blocks of each handoff, as given to its ledger.
    d_given: BTreeMap<HandoffId, Vec<BlockId>>,
    /// D's requests of each handoff, and those the client aborted.
    requests: BTreeMap<HandoffId, Vec<RequestId>>,
    aborted: BTreeSet<RequestId>,
    errors: Vec<String>,
}

fn run(steps: &[Step]) -> Run {
    let (p, d) = simulation_configs(1, 1);
    let mut pair = Pair::new(p, d);
    let mut r = Run::default();
    let (mut next_p_block, mut next_d_block, mut next_req) = (0u32, 1000u32, 1u64);
    let mut waiting: Vec<HandoffId> = Vec::new();
    let (mut reads_done, mut writes_done) = (0usize, 0usize);
    for (i, s) in steps.iter().enumerate() {
        match s {
            Step::Handoff {
                push,
                blocks,
                siblings,
            } => {
                let id = hid(i as u128 + 1);
                let mode = if *push {
                    TransferMode::Push
                } else {
                    TransferMode::Pull
                };
                let blocks: Vec<u32> = (0..u32::from(*blocks)).map(|b| next_p_block + b).collect();
                next_p_block += blocks.len() as u32;
                if pair
                    .p
                    .create_handoff(id, blocks.clone(), mode, pair.now)
                    .is_ok()
                {
                    r.p_given.insert(id, blocks.clone());
                }
                let inc = pair.incoming(id, &blocks, mode);
                for _ in 0..*siblings {
                    let req = RequestId(next_req);
                    next_req += 1;
                    if pair
                        .d
                        .on_request_arrived(req, inc.clone(), pair.now)
                        .is_ok()
                    {
                        r.requests.entry(id).or_default().push(req);
                    }
                }
                if r.requests.contains_key(&id) {
                    waiting.push(id);
                }
            }
            Step::Allocate(k) if !waiting.is_empty() => {
                let id = waiting.remove(usize::from(*k) % waiting.len());
                let n = r.p_given.get(&id).map_or(2, Vec::len) as u32;
                let blocks: Vec<u32> = (0..n).map(|b| next_d_block + b).collect();
                next_d_block += n;
                if pair
                    .d
                    .on_blocks_allocated(id, blocks.clone(), pair.now)
                    .is_ok()
                {
                    r.d_given.insert(id, blocks);
                }
            }
            Step::EndTransfer(k, ok) => {
                let reads: Vec<_> = pair.reads[reads_done..].to_vec();
                let writes: Vec<_> = pair.writes[writes_done..].to_vec();
                let n = reads.len() + writes.len();
                if n == 0 {
                    continue;
                }
                let pick = usize::from(*k) % n;
                if pick < reads.len() {
                    // The one picked ends; those before it never will (abandoned).
                    reads_done += pick + 1;
                    let read = &reads[pick];
                    if *ok {
                        pair.complete_read(read);
                    } else {
                        pair.d.on_read_done(read.handoff, 0, false, pair.now);
                    }
                } else {
                    let w = &writes[pick - reads.len()];
                    writes_done += pick - reads.len() + 1;
                    if *ok {
                        pair.complete_write(w);
                    } else {
                        pair.p
                            .on_push_write_done(w.handoff, w.d_rank, false, pair.now);
                    }
                }
            }
            Step::Abort(k) => {
                let live: Vec<RequestId> = r
                    .requests
                    .values()
                    .flatten()
                    .filter(|q| !r.aborted.contains(q))
                    .copied()
                    .collect();
                if let Some(&req) = live.get(usize::from(*k) % live.len().max(1)) {
                    pair.d
                        .on_request_ended(req, ReleaseReason::Aborted, pair.now);
                    r.aborted.insert(req);
                }
            }
            Step::Wait(t) => pair.advance(ms(u64::from(*t))),
            Step::Cut(cut) => {
                pair.p_alive = !cut;
                pair.d_alive = !cut;
            }
            Step::Allocate(_) => {}
        }
        pair.pump();
    }
    // The transfers still in flight end (a transport reports every job in the end), then
    // every deadline passes.
    for read in pair.reads[reads_done..].iter() {
        pair.d.on_read_done(read.handoff, 0, false, pair.now);
    }
    for w in pair.writes[writes_done..].iter() {
        pair.p
            .on_push_write_done(w.handoff, w.d_rank, false, pair.now);
    }
    pair.advance(ms(120_000));
    check(&pair, &mut r);
    r
}

fn check(pair: &Pair, r: &mut Run) {
    let mut p_back: BTreeMap<HandoffId, Vec<BlockId>> = BTreeMap::new();
    for rel in &pair.p_releases {
        p_back.entry(rel.handoff).or_default().extend(&rel.blocks);
    }
    for (id, given) in &r.p_given {
        let mut back = p_back.remove(id).unwrap_or_default();
        back.sort_unstable();
        if &back != given {
            r.errors.push(format!(
                "rule 1: P was given {given:?} for {id} and gave back {back:?}"
            ));
        }
    }
    if !p_back.is_empty() {
        r.errors.push(format!(
            "rule 1: P gave back blocks it was not given: {p_back:?}"
        ));
    }
    // D's blocks go back through a release or to the engine with the request's KV.
    let mut d_back: BTreeMap<HandoffId, Vec<BlockId>> = BTreeMap::new();
    for rel in &pair.d_releases {
        d_back.entry(rel.handoff).or_default().extend(&rel.blocks);
    }
    let mut outcomes: BTreeMap<RequestId, usize> = BTreeMap::new();
    for o in &pair.outcomes {
        let (handoff, requests) = match o {
            Outcome::Ready {
                handoff,
                requests,
                blocks,
                ..
            } => {
                d_back.entry(*handoff).or_default().extend(blocks);
                (handoff, requests)
            }
            Outcome::Recompute {
                handoff, requests, ..
            }
            | Outcome::Failed {
                handoff, requests, ..
            } => (handoff, requests),
        };
        for q in requests {
            *outcomes.entry(*q).or_default() += 1;
            if !r.requests.get(handoff).is_some_and(|v| v.contains(q)) {
                r.errors.push(format!(
                    "an outcome for request {q:?}, not one of {handoff}'s"
                ));
            }
        }
    }
    for (id, given) in &r.d_given {
        let mut back = d_back.remove(id).unwrap_or_default();
        back.sort_unstable();
        if &back != given {
            r.errors.push(format!(
                "rule 1: D was given {given:?} for {id} and gave back {back:?}"
            ));
        }
    }
    if !d_back.is_empty() {
        r.errors.push(format!(
            "rule 1: D gave back blocks it was not given: {d_back:?}"
        ));
    }
    for q in r.requests.values().flatten() {
        let n = outcomes.get(q).copied().unwrap_or(0);
        if n > 1 || (n == 0 && !r.aborted.contains(q)) {
            r.errors
                .push(format!("rule 6: request {q:?} got {n} outcomes"));
        }
    }
    if !pair.p.is_empty() || !pair.d.is_empty() {
        r.errors.push(format!(
            "rules 5, 6: after every deadline P keeps {} handoffs, D {}",
            pair.p.len(),
            pair.d.len()
        ));
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(400),
        ..ProptestConfig::default()
    })]

    /// Whatever the engines and the side channel do, both ledgers give every block back once,
    /// end every request once, and keep nothing past the deadlines.
    #[test]
    fn every_script_gives_every_block_back_once(steps in proptest::collection::vec(step(), 1..40)) {
        let r = run(&steps);
        prop_assert!(r.errors.is_empty(), "{}", r.errors.join("\n"));
    }
}

/// The check has power: a release dropped, or one given twice, is found.
#[test]
fn a_lost_or_doubled_release_is_found() {
    let steps = [
        Step::Handoff {
            push: false,
            blocks: 2,
            siblings: 2,
        },
        Step::Allocate(0),
        Step::EndTransfer(0, true),
        Step::Wait(100),
    ];
    let r = run(&steps);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(!r.p_given.is_empty() && !r.d_given.is_empty());

    let (p, d) = simulation_configs(1, 1);
    let mut pair = Pair::new(p, d);
    let id = hid(1);
    pair.p
        .create_handoff(id, vec![0, 1], TransferMode::Pull, pair.now)
        .unwrap();
    pair.advance(ms(120_000));
    let mut lost = Run {
        p_given: [(id, vec![0, 1])].into(),
        ..Run::default()
    };
    pair.p_releases.clear();
    check(&pair, &mut lost);
    assert!(
        lost.errors.iter().any(|e| e.starts_with("rule 1: P")),
        "{:?}",
        lost.errors
    );

    let mut doubled = Run {
        p_given: [(id, vec![0, 1])].into(),
        ..Run::default()
    };
    pair.advance(ms(1));
    let mut twice = pair;
    let rel = handoff_ledger::BlockRelease {
        handoff: id,
        blocks: vec![0, 1],
        reason: handoff_ledger::EndReason::Expired,
        held_for: ms(1),
    };
    twice.p_releases = vec![rel.clone(), rel];
    check(&twice, &mut doubled);
    assert!(
        doubled.errors.iter().any(|e| e.starts_with("rule 1: P")),
        "{:?}",
        doubled.errors
    );
}
