//! Record and replay: the simulation writes down every input of every core (through
//! `ConnectorCore::handle`, as the executor does) and `handoff_core::trace::Replay` feeds the
//! traces back through fresh cores.

mod common;

use common::{Faults, Node, ReqSpec, Sim};
use handoff_core::trace::Replay;
use handoff_core::KnownBug;
use handoff_proto::TransferMode;

fn replay(trace: &[String]) -> handoff_core::trace::ReplayReport {
    Replay::run(trace.iter().map(String::as_str)).expect("the trace replays")
}

/// A busy schedule with faults and a D killed mid-run: every engine's trace replays to the same
/// answers and batches, and keeps every rule, through the end of the trace and after it.
#[test]
fn a_recorded_run_with_a_kill_replays_to_the_same_outputs() {
    for (mode, layerwise) in [
        (TransferMode::Pull, false),
        (TransferMode::Pull, true),
        (TransferMode::Push, false),
    ] {
        let (reqs, faults) = common::busy_schedule();
        let mut sim = Sim::new(mode, reqs, faults);
        if layerwise {
            sim = sim.layerwise();
        }
        let run = sim.run();
        assert!(run.violations.is_empty(), "{:?}", run.violations);
        for (engine, trace) in ["p", "d0", "d1"].iter().zip(&run.traces) {
            assert!(trace.len() > 20, "{engine}: a trace with something in it");
            let r = replay(trace);
            assert_eq!(
                r.divergence, None,
                "{mode:?} (layer-wise {layerwise}) {engine}: the replay departs"
            );
            assert!(
                r.violations.is_empty(),
                "{mode:?} (layer-wise {layerwise}) {engine}: {:?}",
                r.violations
            );
            assert!(r.batches > 5, "{engine}: batches were checked");
        }
    }
}

/// One pull request to D0 whose READ is slow; a retry of it (same params) is rejected by D0
/// while the first reads (the schedule of `core_sim`'s
/// `a_retried_request_rejected_while_the_first_reads_does_not_free_p`).
fn retried_while_reading() -> Sim {
    let reqs = vec![ReqSpec {
        at_ms: 0,
        d: 0,
        blocks: 3,
        lag_ms: 10,
        admit_after_ms: 10,
        fate: 3,
        fate_ms: 300,
        cached: 0,
    }];
    let faults = Faults {
        max_delay_ms: 5,
        transfer_min_ms: 1000,
        transfer_ms: 500,
        seed: 7,
        ..Default::default()
    };
    Sim::new(TransferMode::Pull, reqs, faults)
}

/// The trace of a run with a fixed bug put back: the replay names the rule it broke and the
/// input after which it broke (the reject), and shows that today's core departs from the
/// recording right there. The same schedule without the bug replays clean.
#[test]
fn a_trace_recorded_with_a_known_bug_names_the_rule_and_the_input() {
    let buggy = retried_while_reading()
        .with_bug(Node::D(0), KnownBug::RejectWithoutLedger)
        .run();
    assert!(
        !buggy.violations.is_empty(),
        "the simulation itself sees the bug (P frees under the READ)"
    );
    let d0 = &buggy.traces[1];
    let r = replay(d0);
    let first = r
        .violations
        .first()
        .expect("the replay finds the broken rule");
    assert_eq!(first.rule, 2, "{first:?}");
    let reject = d0
        .iter()
        .find(|l| l.contains("\"Reject\""))
        .expect("the trace has the reject");
    assert!(
        reject.contains(&format!("\"n\":{}", first.input)),
        "the violation names the reject's input ({}): {reject}",
        first.input
    );
    let diverged = r.divergence.expect("today's core does not do that");
    assert_eq!(diverged.input, first.input);

    // The same trace is committed for `handoff replay`'s own test (crates/cli/tests/replay.rs):
    // it must stay what this build records.
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/reject-without-ledger.d0.jsonl");
    let text = d0.join("\n") + "\n";
    if std::env::var_os("HANDOFF_WRITE_TRACE_FIXTURES").is_some() {
        std::fs::write(&fixture, &text).expect("fixture written");
    }
    assert!(
        std::fs::read_to_string(&fixture).ok().as_deref() == Some(text.as_str()),
        "{} is not what this build records: HANDOFF_WRITE_TRACE_FIXTURES=1 cargo test -p handoff-core --test replay",
        fixture.display()
    );

    let fixed = retried_while_reading().run();
    assert!(fixed.violations.is_empty(), "{:?}", fixed.violations);
    let r = replay(&fixed.traces[1]);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert_eq!(r.divergence, None);
}

/// A recorded batch that is not what the core emits is found, at its input.
#[test]
fn a_batch_the_core_did_not_emit_is_a_divergence() {
    let run = retried_while_reading().run();
    let mut trace = run.traces[1].clone();
    let (at, line) = trace
        .iter()
        .enumerate()
        .rev()
        .find(|(_, l)| l.starts_with("{\"batch\"") && l.contains("\"closes\":[]"))
        .map(|(i, l)| (i, l.clone()))
        .expect("a batch");
    trace[at] = line.replace("\"closes\":[]", "\"closes\":[99]");
    let r = replay(&trace);
    assert!(
        r.divergence.is_some(),
        "a changed batch must not replay clean"
    );
}

/// A trace that does not start where the core started is refused with a reason, not replayed
/// into nonsense.
#[test]
fn a_trace_without_its_first_segment_is_refused() {
    let run = retried_while_reading().run();
    let mut trace = run.traces[0].clone();
    trace[0] = trace[0].replace("\"segment\":0", "\"segment\":3");
    let e = Replay::run(trace.iter().map(String::as_str)).unwrap_err();
    assert!(e.to_string().contains("rotated out"), "{e}");
}
