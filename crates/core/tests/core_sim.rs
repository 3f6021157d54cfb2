//! Rules 1–7 checked on the real [`handoff_core::ConnectorCore`] under generated
//! schedules (see `common/mod.rs`), plus named regressions.

mod common;

use common::{Faults, Report, ReqSpec, Sim};
use handoff_proto::TransferMode;
use proptest::prelude::*;

fn req() -> impl Strategy<Value = ReqSpec> {
    (
        0u64..3000,
        0usize..2,
        1u8..5,
        0u64..400,
        0u64..2500,
        0u8..8,
        0u64..1500,
        prop_oneof![3 => Just(0u8), 1 => 1u8..3],
    )
        .prop_map(
            |(at_ms, d, blocks, lag_ms, admit_after_ms, fate, fate_ms, cached)| ReqSpec {
                at_ms,
                d,
                blocks,
                lag_ms,
                admit_after_ms,
                // Half the requests do nothing special.
                fate: if fate > 4 { 0 } else { fate },
                fate_ms,
                cached,
            },
        )
}

fn faults() -> impl Strategy<Value = Faults> {
    (
        prop_oneof![3 => 0u64..50, 1 => 0u64..800],
        1u64..1500,
        prop_oneof![Just(0u8), 0u8..20],
        prop_oneof![Just(0u8), 0u8..10],
        proptest::option::weighted(0.2, (0usize..2, 0u64..5000, any::<bool>())),
        proptest::option::weighted(0.1, (0u64..5000, any::<bool>())),
        proptest::option::weighted(0.3, (0u64..4000, 500u64..5000)),
        proptest::option::weighted(0.3, 0u64..4000),
        any::<u64>(),
    )
        .prop_map(
            |(
                max_delay_ms,
                transfer_ms,
                fail_pct,
                hang_pct,
                kill_d,
                kill_p,
                partition,
                stranger_at_ms,
                seed,
            )| {
                Faults {
                    max_delay_ms,
                    transfer_ms,
                    fail_pct,
                    hang_pct,
                    kill_d,
                    kill_p,
                    partition,
                    stranger_at_ms,
                    proxy_release_at_ms: None,
                    transfer_min_ms: 0,
                    drop_pct: 0,
                    dup_pct: 0,
                    seed,
                }
            },
        )
}

/// A peer or network that loses and repeats side-channel frames, on top of the faults above.
fn lossy_faults() -> impl Strategy<Value = Faults> {
    (
        faults(),
        prop_oneof![Just(0u8), 0u8..30],
        prop_oneof![Just(0u8), 0u8..25],
    )
        .prop_map(|(f, drop_pct, dup_pct)| Faults {
            drop_pct,
            dup_pct,
            ..f
        })
}

/// Rule 2 on D's side needs a request admitted just as its grant runs out: pull requests close
/// together, admitted early or late, mostly across a partition long enough for grants to lapse
/// (D's run down while it hears nothing from P) and with short delays (so that D's grant ends
/// close to P's lease), with frames lost now and then.
fn lease_edge_req() -> impl Strategy<Value = ReqSpec> {
    (0u64..3000, 0usize..2, 1u8..5, 0u64..1000, 0u64..4000).prop_map(
        |(at_ms, d, blocks, lag_ms, admit_after_ms)| ReqSpec {
            at_ms,
            d,
            blocks,
            lag_ms,
            admit_after_ms,
            fate: 0,
            fate_ms: 0,
            cached: 0,
        },
    )
}

fn lease_edge_faults() -> impl Strategy<Value = Faults> {
    (
        prop_oneof![Just(0u8), 0u8..40],
        0u8..10,
        prop_oneof![3 => 0u64..100, 1 => 0u64..1500],
        1u64..1200,
        proptest::option::weighted(0.9, (0u64..4000, 1000u64..4000)),
        any::<u64>(),
    )
        .prop_map(
            |(drop_pct, dup_pct, max_delay_ms, transfer_ms, partition, seed)| Faults {
                drop_pct,
                dup_pct,
                max_delay_ms,
                transfer_ms,
                partition,
                seed,
                ..Faults::default()
            },
        )
}

/// Pull, push, or pull as a layer-wise pull.
fn mode() -> impl Strategy<Value = (TransferMode, bool)> {
    prop_oneof![
        Just((TransferMode::Pull, false)),
        Just((TransferMode::Push, false)),
        Just((TransferMode::Pull, true)),
    ]
}

/// P's and D's TP sizes: equal, P's larger, D's larger.
fn tp_pair() -> impl Strategy<Value = (u16, u16)> {
    prop_oneof![
        2 => Just((1, 1)),
        1 => Just((2, 4)),
        1 => Just((4, 2)),
        1 => Just((2, 2)),
        1 => Just((1, 2)),
    ]
}

/// A run kept rules 1–7 on the cores, and each engine's trace replays to the same outputs and
/// keeps the rules as one engine sees them, after its end too (no false alarm from
/// `handoff replay` on a sound run).
fn kept_the_rules_and_replays(report: &Report) -> Result<(), TestCaseError> {
    prop_assert!(
        report.violations.is_empty(),
        "broken rules:\n{}",
        report.violations.join("\n")
    );
    for trace in &report.traces {
        let r = handoff_core::trace::Replay::run(trace.iter().map(String::as_str));
        let r = r.map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&r.divergence, &None);
        prop_assert!(r.violations.is_empty(), "replay: {:?}", r.violations);
    }
    Ok(())
}

fn sim(
    (mode, layerwise): (TransferMode, bool),
    reqs: Vec<ReqSpec>,
    faults: Faults,
    (p_tp, d_tp): (u16, u16),
) -> Sim {
    let s = Sim::with_tp(mode, reqs, faults, p_tp, d_tp);
    if layerwise {
        s.layerwise()
    } else {
        s
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(400),
        ..ProptestConfig::default()
    })]

    /// Every schedule keeps rules 1–7 on the connector cores themselves; and each engine's
    /// trace replays to the same outputs, and keeps the rules as one engine sees them, after
    /// its end too (no false alarm from `handoff replay` on a sound run).
    #[test]
    fn every_schedule_keeps_the_rules_on_the_real_core(
        mode in mode(),
        reqs in proptest::collection::vec(req(), 1..12),
        faults in lossy_faults(),
        tp in tp_pair(),
    ) {
        kept_the_rules_and_replays(&sim(mode, reqs, faults, tp).run())?;
    }

    /// Rule 2 on D's side, where it is hardest: D starts a READ only while P's own lease has
    /// more than D's read margin left, however short, late or lost the grants were.
    #[test]
    fn reads_start_only_well_inside_ps_lease(
        reqs in proptest::collection::vec(lease_edge_req(), 1..14),
        faults in lease_edge_faults(),
        tp in tp_pair(),
    ) {
        let report = sim((TransferMode::Pull, false), reqs, faults, tp).run();
        prop_assert!(report.violations.is_empty(), "broken rules:\n{}", report.violations.join("\n"));
    }

    /// Without faults and without fates every request is decoded from KV that was moved.
    #[test]
    fn a_clean_network_serves_every_request_through_the_core(
        mode in mode(),
        reqs in proptest::collection::vec(req(), 1..12),
        seed in any::<u64>(),
        tp in tp_pair(),
    ) {
        let reqs: Vec<ReqSpec> = reqs.into_iter().map(|r| ReqSpec { fate: 0, admit_after_ms: r.admit_after_ms % 500, ..r }).collect();
        let n = reqs.len();
        let report = sim(mode, reqs, Faults { max_delay_ms: 20, transfer_ms: 100, seed, ..Default::default() }, tp).run();
        prop_assert!(report.violations.is_empty(), "broken rules:\n{}", report.violations.join("\n"));
        prop_assert_eq!(report.recomputed, 0);
        prop_assert_eq!(report.ready, n);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(150),
        ..ProptestConfig::default()
    })]

    /// A hybrid model (one full-attention layer, one with a sliding window or a recurrent
    /// state): each handoff lists every block of the full group and the window's tail or the
    /// state's block of the other, and every schedule keeps rules 1–7 on it (each listed block
    /// goes back exactly once) and replays.
    #[test]
    fn a_hybrid_model_keeps_the_rules(
        mode in mode(),
        reqs in proptest::collection::vec(req(), 1..12),
        faults in lossy_faults(),
        tp in tp_pair(),
        groups in hybrid_groups(),
    ) {
        kept_the_rules_and_replays(&Sim::with_groups(mode.0, reqs, faults, tp, groups).run())?;
    }

    /// Without faults every request of a hybrid model is decoded from KV that was moved: the
    /// core cuts both sides' lists into groups and plans each (a list it could not cut, or a
    /// plan it refused, would fail the transfer and recompute).
    #[test]
    fn a_clean_network_serves_every_hybrid_request(
        mode in mode(),
        reqs in proptest::collection::vec(req(), 1..12),
        seed in any::<u64>(),
        tp in tp_pair(),
        groups in hybrid_groups(),
    ) {
        let reqs: Vec<ReqSpec> = reqs.into_iter().map(|r| ReqSpec { fate: 0, admit_after_ms: r.admit_after_ms % 500, ..r }).collect();
        let n = reqs.len();
        let faults = Faults { max_delay_ms: 20, transfer_ms: 100, seed, ..Default::default() };
        let report = Sim::with_groups(mode.0, reqs, faults, tp, groups).run();
        prop_assert!(report.violations.is_empty(), "broken rules:\n{}", report.violations.join("\n"));
        prop_assert_eq!(report.recomputed, 0);
        prop_assert_eq!(report.ready, n);
    }
}

/// A sliding window of 1–80 tokens, or a recurrent state, beside one full-attention layer.
fn hybrid_groups() -> impl Strategy<Value = handoff_plan::KvGroups> {
    prop_oneof![
        3 => (1u32..80).prop_map(Sim::hybrid),
        1 => Just(Sim::with_state()),
    ]
}

/// One pull request to D0, admitted at once, whose READ takes 1–1.5 s.
fn one_slow_read(fate: u8, fate_ms: u64) -> (Vec<ReqSpec>, Faults) {
    (
        vec![ReqSpec {
            at_ms: 0,
            d: 0,
            blocks: 3,
            lag_ms: 10,
            admit_after_ms: 10,
            fate,
            fate_ms,
            cached: 0,
        }],
        Faults {
            max_delay_ms: 5,
            transfer_min_ms: 1000,
            transfer_ms: 500,
            seed: 7,
            ..Default::default()
        },
    )
}

/// A retried request (same `kv_transfer_params`) hits D's full queue while the first one
/// reads P's blocks: D refuses the retry, and P must not hear "release" for a handoff D still
/// reads (before the core, `reject` sent P a release without asking D's ledger: rule 2).
#[test]
fn a_retried_request_rejected_while_the_first_reads_does_not_free_p() {
    let (reqs, faults) = one_slow_read(3, 300);
    let report = Sim::new(TransferMode::Pull, reqs, faults).run();
    assert!(
        report.violations.is_empty(),
        "{}",
        report.violations.join("\n")
    );
    assert_eq!(report.ready, 1, "the first request still decodes P's KV");
}

/// A stranger connects to P without a handshake and sends a heartbeat (and a release) for a
/// handoff D is reading; then the proxy releases it. Before the core, anonymous frames were
/// delivered as the proxy's peer, so the heartbeat made "the proxy" the reader and its release
/// then freed P's blocks at once, under D's READ (rule 2). Now the stranger is refused and the
/// proxy's release only ends the lease: the blocks wait for the read.
#[test]
fn an_anonymous_heartbeat_cannot_make_a_proxy_release_free_at_once() {
    let (reqs, mut faults) = one_slow_read(0, 0);
    faults.stranger_at_ms = Some(5);
    faults.proxy_release_at_ms = Some(200);
    let report = Sim::new(TransferMode::Pull, reqs, faults).run();
    assert!(
        report.violations.is_empty(),
        "{}",
        report.violations.join("\n")
    );
    assert_eq!(
        report.anonymous_refused, 2,
        "both of the stranger's frames are refused"
    );
    assert_eq!(report.ready, 1);
}

/// P and D partitioned while D reads (the data path still moves, the side channel does not):
/// P's lease runs out under the READ, and P fences before it reuses the blocks, so the READ has
/// ended (failed, on D's own grant + read grace) first. D recomputes. (Without the fence, P
/// frees under the READ and this fails.)
#[test]
fn a_partition_during_a_read_never_frees_under_it() {
    let (mut reqs, mut faults) = one_slow_read(0, 0);
    // Admitted 2.7 s in: the read starts on what is left of the first grant (3 s).
    reqs[0].admit_after_ms = 2700;
    faults.partition = Some((100, 6000));
    let report = Sim::new(TransferMode::Pull, reqs, faults).run();
    assert!(
        report.violations.is_empty(),
        "{}",
        report.violations.join("\n")
    );
    assert_eq!(report.recomputed, 1);
}

/// Sans-IO means replayable: the same schedule through fresh cores gives the same outputs in the
/// same order, byte for byte (ordered maps on every path that emits; a `HashMap` with its random
/// state there makes two runs in one process differ). A busy schedule: two D engines, many
/// handoffs per peer (heartbeats, block queries and releases batch them), faults and a kill.
#[test]
fn one_schedule_gives_the_same_outputs_byte_for_byte() {
    for (mode, layerwise) in [
        (TransferMode::Pull, false),
        (TransferMode::Pull, true),
        (TransferMode::Push, false),
    ] {
        let (reqs, faults) = common::busy_schedule();
        let a = sim((mode, layerwise), reqs.clone(), faults.clone(), (2, 1)).run();
        let b = sim((mode, layerwise), reqs, faults, (2, 1)).run();
        assert!(a.violations.is_empty(), "{:?}", a.violations);
        assert!(
            a.transcript.lines().count() > 50,
            "a schedule with something to emit"
        );
        if a.transcript != b.transcript {
            let at = a
                .transcript
                .lines()
                .zip(b.transcript.lines())
                .position(|(x, y)| x != y)
                .unwrap_or(0);
            panic!(
                "{mode:?} (layer-wise {layerwise}): runs differ from output {at}:\n{}\n{}",
                a.transcript.lines().nth(at).unwrap_or(""),
                b.transcript.lines().nth(at).unwrap_or("")
            );
        }
    }
}
