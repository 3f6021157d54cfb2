//! `handoff replay`: feeds a recorded trace (engine setting `record_trace`) through a fresh
//! connector core and checks it: the rules the recorded run broke, and where today's core
//! departs from the recording. The format and the checks are `handoff_core::trace`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use handoff_connector::recorder::segment_path;
use handoff_core::trace::{Replay, ReplayReport};

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// The trace: the file `record_trace` named. Its rotated segments (`FILE.1`, `FILE.2`, …)
    /// are read first, oldest first. Several files: read in the order given, as they are.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// The segments of one trace, oldest first.
fn segments(path: &Path) -> Vec<PathBuf> {
    let mut older: Vec<PathBuf> = (1..)
        .map(|age| segment_path(path, age))
        .take_while(|p| p.exists())
        .collect();
    older.reverse();
    older.push(path.to_path_buf());
    older
}

/// Replays; the exit status says whether the recorded run kept every rule and today's core
/// gives the same outputs (0), or not (1).
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let files = match args.files.as_slice() {
        [one] => segments(one),
        many => many.to_vec(),
    };
    let mut text = String::new();
    for f in &files {
        text.push_str(
            &std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        );
        if !text.ends_with('\n') {
            text.push('\n');
        }
    }
    let report = Replay::run(text.lines())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&files, &report);
    }
    if !report.violations.is_empty() || report.divergence.is_some() {
        bail!(
            "{} rule(s) broken; {}",
            report.violations.len(),
            match &report.divergence {
                Some(d) => format!(
                    "today's core departs from the recording after input {}",
                    d.input
                ),
                None => "today's core gives the recorded outputs".into(),
            }
        );
    }
    Ok(())
}

fn print_report(files: &[PathBuf], r: &ReplayReport) {
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    println!(
        "replayed {}: {} inputs, {} batches",
        names.join(", "),
        r.inputs,
        r.batches
    );
    match &r.divergence {
        None => println!("outputs: the same as recorded, answer for answer and batch for batch"),
        Some(d) => println!(
            "outputs: today's core departs after input {}: {}",
            d.input, d.what
        ),
    }
    if r.divergence.is_none() {
        println!(
            "after the trace's end: {} inputs (jobs ended, timers run with silent peers)",
            r.settled_inputs
        );
    }
    if r.violations.is_empty() {
        println!("rules 1-7: kept");
    }
    for v in &r.violations {
        println!(
            "rule {} broken after input {} (at {} ms): {}",
            v.rule, v.input, v.at_ms, v.what
        );
    }
}
