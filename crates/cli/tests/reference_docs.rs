//! The book's reference pages that are generated from the code: the engine settings (from
//! `EngineConfig`'s fields, doc comments and defaults), the command line (from clap's help) and
//! the metrics an engine exports (from a running engine's `/metrics`). Each test fails when its
//! page and the code differ, and when a setting has no doc comment;
//! `HANDOFF_BLESS_DOCS=1 cargo test -p handoff --test reference_docs` writes the pages anew.

mod common;

use std::path::PathBuf;
use std::process::Command;

use handoff_engine::EngineConfig;

fn page(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/src/reference")
        .join(name)
}

/// Compares `want` with the page on disk (or writes it when blessing).
fn check(name: &str, want: &str) {
    let path = page(name);
    if std::env::var("HANDOFF_BLESS_DOCS").as_deref() == Ok("1") {
        std::fs::write(&path, want).unwrap();
        return;
    }
    let got = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        got == want,
        "{} differs from what the code says: run \
         `HANDOFF_BLESS_DOCS=1 cargo test -p handoff --test reference_docs` and commit the page",
        path.display()
    );
}

/// `EngineConfig`'s fields in order, each with its doc comment, read from the source.
fn fields_with_docs() -> Vec<(String, String)> {
    let src = include_str!("../../engine/src/config.rs");
    let start = src
        .find("pub struct EngineConfig {")
        .expect("EngineConfig in config.rs");
    let body = &src[start..src[start..].find("\n}").unwrap() + start];
    let mut out = Vec::new();
    let mut doc: Vec<String> = Vec::new();
    for line in body.lines().skip(1) {
        let line = line.trim();
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(field) = line.strip_prefix("pub ") {
            let name = field.split(':').next().unwrap().trim().to_string();
            out.push((name, doc.join(" ")));
            doc.clear();
        } else if !line.is_empty() && !line.starts_with("#[") && !line.starts_with("//") {
            doc.clear();
        }
    }
    out
}

fn engine_settings_page() -> String {
    let defaults = serde_json::to_value(EngineConfig::default()).unwrap();
    let mut s = String::from(
        "# Engine settings\n\n\
         Generated from `EngineConfig` (`crates/engine/src/config.rs`) by \
         `crates/cli/tests/reference_docs.rs`: do not edit by hand.\n\n\
         Every field of the reference engine, in the order it is read: defaults, then a TOML \
         file (`handoff engine --config FILE`, any field), then the environment variable \
         `HANDOFF_<FIELD>` (upper case), then flags (`--role`, `--port`, ... and \
         `--set field=value` for any other). An invalid value is refused at start with a \
         message naming the field.\n\n\
         | setting | environment | default | meaning |\n| --- | --- | --- | --- |\n",
    );
    let fields = fields_with_docs();
    let undocumented: Vec<&str> = fields
        .iter()
        .filter(|(_, d)| d.is_empty())
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(
        undocumented.is_empty(),
        "EngineConfig fields without a doc comment (say what each means): {undocumented:?}"
    );
    for (name, doc) in &fields {
        let default = match &defaults[name] {
            serde_json::Value::String(v) if v.is_empty() => "(empty)".to_string(),
            serde_json::Value::String(v) => format!("`{v}`"),
            v => format!("`{v}`"),
        };
        s.push_str(&format!(
            "| `{name}` | `HANDOFF_{}` | {default} | {} |\n",
            name.to_uppercase(),
            doc.replace('|', "\\|")
        ));
    }
    s
}

#[test]
fn the_engine_settings_page_is_engine_config() {
    let fields = fields_with_docs();
    let defaults = serde_json::to_value(EngineConfig::default()).unwrap();
    assert_eq!(
        fields.len(),
        defaults.as_object().unwrap().len(),
        "the source parser and serde disagree on EngineConfig's fields"
    );
    check("engine-settings.md", &engine_settings_page());
}

/// The check has power: a field added without a doc comment is refused.
#[test]
#[should_panic(expected = "without a doc comment")]
fn a_setting_without_documentation_fails_the_check() {
    let mut fields = fields_with_docs();
    fields.push(("new_knob".into(), String::new()));
    let undocumented: Vec<_> = fields.iter().filter(|(_, d)| d.is_empty()).collect();
    assert!(
        undocumented.is_empty(),
        "EngineConfig fields without a doc comment: {undocumented:?}"
    );
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env("COLUMNS", "100")
        .output()
        .expect("run handoff");
    assert!(out.status.success(), "handoff {args:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_cli_page_is_clap_s_help() {
    let mut s = String::from(
        "# Command line\n\n\
         Generated from `handoff help` by `crates/cli/tests/reference_docs.rs`: do not edit by \
         hand.\n",
    );
    let commands: &[&[&str]] = &[
        &[],
        &["demo"],
        &["engine"],
        &["proxy"],
        &["keygen"],
        &["bench"],
        &["bench", "ttft"],
        &["bench", "transfer"],
        &["bench", "descriptors"],
        &["bench", "connector"],
        &["bench", "ledger"],
        &["bench", "soak"],
    ];
    for c in commands {
        let title = if c.is_empty() {
            "handoff".to_string()
        } else {
            format!("handoff {}", c.join(" "))
        };
        let mut args = vec!["help"];
        args.extend_from_slice(c);
        s.push_str(&format!("\n## `{title}`\n\n```text\n{}```\n", help(&args)));
    }
    check("cli.md", &s);
}

#[test]
fn the_metrics_page_is_what_an_engine_exports() {
    let e = common::engine("docs-metrics", "both", &[]);
    let text = reqwest::blocking::get(format!("{}/metrics", e.url))
        .and_then(|r| r.text())
        .unwrap_or_default();
    drop(e);
    let mut rows: Vec<(String, String, String)> = Vec::new();
    let mut helps = std::collections::BTreeMap::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            helps.insert(name.to_string(), help.trim_end_matches('.').to_string());
        } else if let Some(rest) = l.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let help = helps.get(name).cloned().unwrap_or_default();
            rows.push((name.to_string(), kind.to_string(), help));
        }
    }
    assert!(
        rows.len() > 20,
        "the engine exported {} metrics",
        rows.len()
    );
    let mut s = String::from(
        "# Metrics\n\n\
         Generated from a reference engine's `/metrics` (role `both`) by \
         `crates/cli/tests/reference_docs.rs`: do not edit by hand. A counter's samples end in \
         `_total` on the page Prometheus scrapes.\n\n\
         | metric | type | meaning |\n| --- | --- | --- |\n",
    );
    for (name, kind, help) in rows {
        s.push_str(&format!(
            "| `{name}` | {kind} | {} |\n",
            help.replace('|', "\\|")
        ));
    }
    check("metrics.md", &s);
}

/// `1 000`, as the vLLM page writes numbers.
fn spaced(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// One set of defaults: the vLLM connector and the reference engine both take the ledgers' own
/// (`ProducerConfig::default`, `ConsumerConfig::default`), which the engine settings page is
/// generated from; the vLLM settings page (written by hand) must state the same numbers.
#[test]
fn the_vllm_settings_page_states_the_engine_s_defaults() {
    let d = EngineConfig::default();
    let text = std::fs::read_to_string(page("vllm-extra-config.md")).unwrap();
    for (key, value) in [
        ("initial_lease_ms", d.lease_ms),
        ("wait_deadline_ms", d.wait_deadline_ms),
        ("read_timeout_ms", d.read_timeout_ms),
        ("transfer_floor_mb_per_s", d.transfer_floor_mb_per_s),
        ("push_deadline_ms", d.push_deadline_ms),
        ("hard_cap_ms", d.hard_cap_ms),
        ("registration_lease_ms", d.registration_lease_ms),
    ] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("no row for {key} in vllm-extra-config.md"));
        let default = row.split('|').nth(3).unwrap_or_default().trim();
        assert_eq!(
            default,
            spaced(value),
            "vllm-extra-config.md: {key}'s default differs from the engine's"
        );
    }
}
