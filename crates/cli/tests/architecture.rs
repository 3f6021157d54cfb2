//! The shape of the code, checked: no import circle between the modules of any crate (a module
//! is a top-level `src/<name>.rs` or `src/<name>/`; the crate root, which assembles them, is left
//! out), and the sans-IO parts (`ledger`, `plan`, `proto` and the connector core, crate `core`)
//! name no thread, lock, atomic, clock, runtime, socket or random source, and depend on no crate
//! that does. Comments are not code: a doc line may point at any module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crates/")
        .to_path_buf()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The source without comments (line comments, doc comments, block comments); string literals
/// are kept, which is harmless for what is looked for here.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut in_block = 0usize;
    for line in text.lines() {
        let mut rest = line;
        let mut kept = String::new();
        loop {
            if in_block > 0 {
                match rest.find("*/") {
                    Some(i) => {
                        in_block -= 1;
                        rest = &rest[i + 2..];
                    }
                    None => break,
                }
            } else {
                let line_c = rest.find("//");
                let block_c = rest.find("/*");
                match (line_c, block_c) {
                    (Some(l), Some(b)) if b < l => {
                        kept.push_str(&rest[..b]);
                        in_block += 1;
                        rest = &rest[b + 2..];
                    }
                    (Some(l), _) => {
                        kept.push_str(&rest[..l]);
                        break;
                    }
                    (None, Some(b)) => {
                        kept.push_str(&rest[..b]);
                        in_block += 1;
                        rest = &rest[b + 2..];
                    }
                    (None, None) => {
                        kept.push_str(rest);
                        break;
                    }
                }
            }
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// Module → the sibling modules it names (`crate::x`, `crate::{x, y}`), for one crate's `src/`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for f in rust_files(src) {
        let rel = f.strip_prefix(src).expect("under src");
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" || top == "bin" {
            continue;
        }
        files.entry(top).or_default().push(f);
    }
    let names: BTreeSet<String> = files.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (m, fs) in &files {
        let mut to = BTreeSet::new();
        for f in fs {
            let code = code_of(&std::fs::read_to_string(f).expect("readable"));
            for (i, _) in code.match_indices("crate::") {
                let after = &code[i + "crate::".len()..];
                let named: Vec<&str> = if let Some(group) = after.strip_prefix('{') {
                    let end = group.find('}').unwrap_or(group.len());
                    group[..end]
                        .split(',')
                        .map(|s| s.trim().split("::").next().unwrap_or("").trim())
                        .collect()
                } else {
                    vec![after
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .next()
                        .unwrap_or("")]
                };
                for n in named {
                    if n != m && names.contains(n) {
                        to.insert(n.to_string());
                    }
                }
            }
        }
        graph.insert(m.clone(), to);
    }
    graph
}

/// A circle in `graph`, if any (as the list of modules along it).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        v: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|x| x == v) {
            let mut c = path[at..].to_vec();
            c.push(v.to_string());
            return Some(c);
        }
        if done.contains(v) {
            return None;
        }
        path.push(v.to_string());
        for w in g.get(v).into_iter().flatten() {
            if let Some(c) = visit(g, w, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(v.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for v in graph.keys() {
        if let Some(c) = visit(graph, v, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut found = Vec::new();
    let mut crates = 0;
    for e in std::fs::read_dir(workspace()).expect("crates/").flatten() {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        crates += 1;
        if let Some(c) = find_cycle(&module_graph(&src)) {
            found.push(format!(
                "{}: {}",
                e.file_name().to_string_lossy(),
                c.join(" → ")
            ));
        }
    }
    assert!(crates >= 8, "found the workspace's crates");
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The check has power: a circle written into a graph is found, and comments are no edges.
#[test]
fn the_circle_check_finds_a_circle() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert!(find_cycle(&g).is_some());
    let mut acyclic = g.clone();
    acyclic.insert("c".into(), BTreeSet::new());
    assert!(find_cycle(&acyclic).is_none());
    assert_eq!(
        code_of("use crate::a; // crate::b\n/* crate::c */ x"),
        "use crate::a; \n x\n"
    );
}

/// What the sans-IO parts may not name: they take time as an argument and own no thread,
/// lock, socket or random source (rule: same inputs, same outputs).
const IO_NAMES: &[&str] = &[
    "std::thread",
    "Mutex",
    "RwLock",
    "atomic",
    "Instant::now",
    "SystemTime::now",
    "tokio",
    "TcpStream",
    "TcpListener",
    "UdpSocket",
    "std::net::",
    "rand::",
    "RandomState",
    "getrandom",
];

fn io_names_in(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for f in rust_files(dir) {
        // Tests may use a clock or a thread to drive the code under test.
        if f.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&f).expect("readable"));
        for name in IO_NAMES {
            if code.contains(name) {
                out.push(format!("{}: {name}", f.display()));
            }
        }
    }
    out
}

#[test]
fn the_sans_io_parts_name_no_thread_lock_clock_socket_or_random_source() {
    let w = workspace();
    let mut found = Vec::new();
    for dir in [
        w.join("ledger/src"),
        w.join("plan/src"),
        w.join("proto/src"),
        w.join("core/src"),
    ] {
        assert!(dir.is_dir(), "{}", dir.display());
        found.extend(io_names_in(&dir));
    }
    assert!(
        found.is_empty(),
        "I/O in the sans-IO parts:\n{}",
        found.join("\n")
    );
    // Power: the executor, which does the I/O, is caught by the same check.
    assert!(!io_names_in(&w.join("connector/src")).is_empty());
}

/// What the sans-IO crates may depend on: each other, and crates of plain data, errors and log
/// macros (`tracing` is a facade: the subscriber that writes is the binary's).
const SANS_IO_DEPENDENCIES: &[&str] = &[
    "handoff-proto",
    "handoff-ledger",
    "handoff-plan",
    "serde",
    "serde_json",
    "postcard",
    "thiserror",
    "tracing",
];

/// The names in a manifest's `[dependencies]` table.
fn dependencies(manifest: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(manifest).expect("readable");
    let mut out = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == "[dependencies]";
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            if let Some(name) = line.split(['=', '.']).next() {
                out.push(name.trim().to_string());
            }
        }
    }
    out
}

#[test]
fn the_sans_io_crates_depend_only_on_data_crates() {
    let w = workspace();
    let mut found = Vec::new();
    for krate in ["core", "ledger", "plan", "proto"] {
        let deps = dependencies(&w.join(krate).join("Cargo.toml"));
        assert!(
            !deps.is_empty() || krate == "proto",
            "{krate}: no dependency read"
        );
        for d in deps {
            if !SANS_IO_DEPENDENCIES.contains(&d.as_str()) {
                found.push(format!("{krate} depends on {d}"));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
    // Power: the connector, which does the I/O, depends on more.
    let connector = dependencies(&w.join("connector/Cargo.toml"));
    assert!(connector
        .iter()
        .any(|d| !SANS_IO_DEPENDENCIES.contains(&d.as_str())));
}

/// Calls through which an engine tells its core about a request (see `handoff_core::Hooks`).
const ENGINE_HOOKS: [&str; 6] = [
    ".prefill_started",
    ".prefill_ended",
    ".layers_saved",
    ".prefilled(",
    ".prefill_planned",
    ".request_arrived(",
];

/// What reads a request's flow from its params.
const FLOW_READS: [&str; 8] = [
    "transfer_mode",
    "Flow::",
    ".flow()",
    "is_layerwise_pull",
    ".layerwise",
    "TransferMode::Push",
    "TransferMode::Pull",
    ".mode()",
];

/// The flow reads in `code` when it also calls an engine hook: the core decides the flow, so an
/// engine that branched on it to pick a hook would decide it a second time.
fn flow_choices(code: &str) -> Vec<&'static str> {
    if !ENGINE_HOOKS.iter().any(|h| code.contains(h)) {
        return Vec::new();
    }
    FLOW_READS
        .iter()
        .copied()
        .filter(|r| names(code, r))
        .collect()
}

/// Whether `code` has `name` as a whole name (`.layerwise` is not `.layerwise_pull`).
fn names(code: &str, name: &str) -> bool {
    code.match_indices(name).any(|(at, _)| {
        let next = code[at + name.len()..].chars().next();
        !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// Python source without comments and docstrings (lines inside triple quotes).
fn python_code_of(text: &str) -> String {
    let mut out = String::new();
    let mut in_doc = false;
    for line in text.lines() {
        let t = line.trim_start();
        let quotes = t.matches("\"\"\"").count();
        if in_doc || t.starts_with("\"\"\"") {
            if quotes % 2 == 1 {
                in_doc = !in_doc;
            }
            continue;
        }
        out.push_str(line.split('#').next().unwrap_or(""));
        out.push('\n');
    }
    out
}

#[test]
fn no_engine_glue_reads_the_flow_to_pick_a_hook() {
    let root = workspace();
    let mut found = Vec::new();
    for krate in ["engine", "vllm", "connector", "proxy", "cli", "bench"] {
        for f in rust_files(&root.join(krate).join("src")) {
            let code = code_of(&std::fs::read_to_string(&f).unwrap());
            for r in flow_choices(&code) {
                found.push(format!("{} reads {r}", f.display()));
            }
        }
    }
    let python = root.join("vllm/python/handoff_vllm");
    for e in std::fs::read_dir(&python).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "py") {
            let code = python_code_of(&std::fs::read_to_string(&p).unwrap());
            for r in flow_choices(&code) {
                found.push(format!("{} reads {r}", p.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the core decides the flow:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_flow_check_finds_a_flow_read_beside_a_hook() {
    // The shape the vLLM glue had before the core decided the flow.
    let glue = r#"if params.transfer_mode == Some(TransferMode::Push) { c.prefilled(..) }"#;
    // (`layerwise_pull: false`, an engine's setting, is not a read of a request's flow.)
    assert_eq!(flow_choices(glue), ["transfer_mode", "TransferMode::Push"]);
    let python =
        "if params.get(\"transfer_mode\") == \"push\":  # a comment\n    s.prefill_planned(r)\n";
    assert_eq!(flow_choices(&python_code_of(python)), ["transfer_mode"]);
    // A file that calls no hook may read the flow (a router picks it).
    assert!(flow_choices("p.flow() == Flow::Push").is_empty());
    // Comments are not code.
    assert!(flow_choices(&code_of("// transfer_mode\nc.prefill_started(..)")).is_empty());
    assert!(flow_choices("c.prefill_started(..); cfg.layerwise_pull").is_empty());
}
