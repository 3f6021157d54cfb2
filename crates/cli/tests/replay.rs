//! `handoff replay` on a trace recorded with a fixed bug put back (D's reject told P to release
//! without asking D's ledger, while D's READ of that handoff was in flight): the command names
//! rule 2 and the input after which it broke (the reject), says that today's core departs from
//! the recording there, and exits 1. The trace is the simulation's (crates/core/tests/replay.rs
//! writes it and checks that the committed copy is what the build records).

use std::process::Command;

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/fixtures/reject-without-ledger.d0.jsonl")
}

#[test]
fn replay_of_a_trace_with_a_known_bug_names_the_rule_and_the_input() {
    let text = std::fs::read_to_string(fixture()).expect("the fixture");
    let reject = text
        .lines()
        .find(|l| l.contains("\"Reject\""))
        .expect("the trace has the reject");
    let n: u64 = reject
        .split("\"n\":")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .expect("the reject's input number");
    let out = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg("replay")
        .arg(fixture())
        .output()
        .expect("replay runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a broken rule is a failure:\n{stdout}"
    );
    assert!(
        stdout.contains(&format!("rule 2 broken after input {n} ")),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("today's core departs after input {n}:")),
        "{stdout}"
    );
    assert!(stderr.contains("rule(s) broken"), "{stderr}");
}
