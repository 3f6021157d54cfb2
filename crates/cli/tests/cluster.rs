//! Engines as separate processes on loopback (the `handoff` binary, tcp transport): crashes of
//! either side, and the demo itself. Every test is bounded in time.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{engine, Engine};

use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

fn prompt(words: usize) -> String {
    (0..words)
        .map(|i| format!("x{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn p_leg(c: &reqwest::blocking::Client, p: &Engine, text: &str) -> Value {
    let r: Value = c
        .post(format!("{}/v1/completions", p.url))
        .json(&json!({"prompt": text, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    r["kv_transfer_params"].clone()
}

/// An engine's `/health` report.
fn health(c: &reqwest::blocking::Client, e: &Engine) -> Value {
    c.get(format!("{}/health", e.url))
        .send()
        .unwrap()
        .json()
        .unwrap()
}

fn held_for(c: &reqwest::blocking::Client, p: &Engine, d: &str) -> u64 {
    health(c, p)["prefill_blocks_held_for"][d]
        .as_u64()
        .unwrap_or(0)
}

fn staged(c: &reqwest::blocking::Client, p: &Engine) -> u64 {
    health(c, p)["staged_messages"].as_u64().unwrap_or(0)
}

/// Polls `cond` until it holds and returns how long that took; fails the test after `limit`.
fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    start.elapsed()
}

fn p_held(c: &reqwest::blocking::Client, p: &Engine) -> u64 {
    health(c, p)["held_blocks"]["prefill"]
        .as_u64()
        .unwrap_or(u64::MAX)
}

#[test]
fn d_killed_before_it_pulls_is_reclaimed_at_once() {
    let c = client();
    let p = engine("p-kill-d", "prefill", &[]);
    // D's pool holds one request: a long one occupies it, so ours waits in D's queue.
    let mut d = engine(
        "d-killed",
        "decode",
        &["--num-blocks", "40", "--set", "decode_step_ms=50"],
    );
    let hog = prompt(300);
    let hog_params = p_leg(&c, &p, &hog);
    let (url, body) = (
        d.url.clone(),
        json!({"prompt": hog, "max_tokens": 300, "stream": true, "kv_transfer_params": hog_params}),
    );
    let _hog = std::thread::spawn(move || {
        // Keep reading, or D sees the client leave and frees the pool.
        let r = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send();
        let _ = r.and_then(|r| r.text());
    });
    // The hog has read its KV (P holds nothing), so it is admitted and fills D's pool.
    wait_until(Duration::from_secs(10), "the hog pulled its KV", || {
        p_held(&c, &p) == 0
    });
    let text = prompt(200);
    let params = p_leg(&c, &p, &text);
    let (url, body) = (
        d.url.clone(),
        json!({"prompt": text, "max_tokens": 4, "kv_transfer_params": params}),
    );
    std::thread::spawn(move || {
        let _ = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send();
    });
    // P holds the queued request's blocks for D (D heartbeats them while they wait).
    wait_until(Duration::from_secs(5), "D claimed the handoff", || {
        held_for(&c, &p, "d-killed") > 0
    });
    let _ = d.child.kill();
    let took = wait_until(Duration::from_secs(2), "P freed a dead D's blocks", || {
        p_held(&c, &p) == 0
    });
    eprintln!("P reclaimed a dead D's blocks {took:?} after SIGKILL (lease: 10 s)");
    let m = c
        .get(format!("{}/metrics", p.url))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(
        m.contains("handoff_handoffs_ended_total{reason=\"peer_dead\"}"),
        "{m}"
    );
}

#[test]
fn d_killed_while_it_pulls_is_reclaimed_at_once() {
    let c = client();
    // A bigger KV shape so that a read takes long enough to be killed in the middle.
    let shape = [
        "--set",
        "num_layers=32",
        "--set",
        "head_dim=128",
        "--set",
        "num_kv_heads=8",
        "--num-blocks",
        "512",
    ];
    let p = engine("p-kill-read", "prefill", &shape);
    let mut d = engine("d-killed-reading", "decode", &shape);
    let text = prompt(4000);
    let params = p_leg(&c, &p, &text);
    let (url, body) = (
        d.url.clone(),
        json!({"prompt": text, "max_tokens": 4, "kv_transfer_params": params}),
    );
    std::thread::spawn(move || {
        let _ = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send();
    });
    let start = Instant::now();
    while held_for(&c, &p, "d-killed-reading") == 0 {
        if start.elapsed() > Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = d.child.kill();
    wait_until(Duration::from_secs(2), "P freed a dead D's blocks", || {
        p_held(&c, &p) == 0
    });
}

#[test]
fn p_killed_makes_d_recompute_or_fail_per_policy() {
    let c = client();
    let mut p = engine("p-dies", "prefill", &[]);
    let d_recompute = engine("d-recompute", "decode", &[]);
    let d_fail = engine("d-fail", "decode", &["--set", "failure_policy=fail"]);
    let mono = engine("mono-p-dies", "both", &[]);
    let text = prompt(100);
    let params = p_leg(&c, &p, &text);
    let params2 = p_leg(&c, &p, &text);
    let _ = p.child.kill();
    let _ = p.child.wait();
    let start = Instant::now();
    let r: Value = c
        .post(format!("{}/v1/completions", d_recompute.url))
        .json(&json!({"prompt": text, "max_tokens": 6, "kv_transfer_params": params}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let m: Value = c
        .post(format!("{}/v1/completions", mono.url))
        .json(&json!({"prompt": text, "max_tokens": 6}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        r["choices"][0]["text"], m["choices"][0]["text"],
        "recomputed locally: {r}"
    );
    let resp = c
        .post(format!("{}/v1/completions", d_fail.url))
        .json(&json!({"prompt": text, "max_tokens": 6, "kv_transfer_params": params2}))
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 502);
    let e: Value = resp.json().unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV transfer"),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(10), "no hang");
}

/// Runs `handoff demo --json ARGS` and returns its report (the last line) and what it printed;
/// the demo must have exited successfully.
fn demo(args: &[&str], dir: Option<&std::path::Path>) -> (Value, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_handoff"));
    cmd.arg("demo").arg("--json").args(args);
    if let Some(dir) = dir {
        cmd.arg("--record").arg(dir);
    }
    let out = cmd.stderr(Stdio::null()).output().expect("demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let last = stdout.lines().last().expect("report");
    let r: Value = serde_json::from_str(last).unwrap_or_else(|_| panic!("not JSON: {stdout}"));
    assert!(out.status.success(), "{stdout}");
    (r, stdout)
}

/// The demo, with every engine recording its connector core (`--record`): nothing leaks, every
/// output matches the monolithic engine's, the killed decode engine's blocks come back; and each
/// engine's trace, the killed one's too, replays (`handoff replay`) to the same answers and
/// batches with every rule kept. A trace with one input taken out does not.
#[test]
fn demo_reclaims_leaks_nothing_and_matches_monolithic_and_its_traces_replay() {
    let dir = std::env::temp_dir().join(format!("handoff-demo-traces-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (r, stdout) = demo(&["--requests", "48", "--seed", "3"], Some(&dir));
    assert_eq!(r["leaked_blocks"], 0, "{stdout}");
    assert_eq!(r["output_mismatches"], 0, "{stdout}");
    assert!(r["requests_ok"].as_u64().unwrap() > 20, "{stdout}");
    assert!(r["outputs_compared"].as_u64() == r["requests_ok"].as_u64());
    let reclaim = r["reclaim_after_kill_s"].as_f64().expect("reclaimed");
    assert!(reclaim < 2.0, "{stdout}");
    let killed = r["killed_engine"]
        .as_str()
        .expect("a killed engine")
        .to_string();

    let replay = |path: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_handoff"))
            .arg("replay")
            .arg(path)
            .arg("--json")
            .output()
            .expect("replay runs")
    };
    for engine in ["prefill-0", "decode-1", "decode-2", "mono"] {
        let path = dir.join(format!("{engine}.jsonl"));
        let out = replay(&path);
        let text = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{engine}: {text}\n{stderr}");
        let rep: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text}"));
        assert!(rep["divergence"].is_null(), "{engine}: {text}");
        assert_eq!(rep["violations"], json!([]), "{engine}: {text}");
        // A trace of the run, not of its start: P sees every one of the 48 requests; how they
        // split over the two D engines (one killed midway) varies from run to run (98 inputs
        // for one D in a run on the two-core host).
        let least = match engine {
            "prefill-0" => Some(100),
            "mono" => None,
            _ => Some(20),
        };
        if let Some(least) = least {
            assert!(rep["inputs"].as_u64().unwrap() > least, "{engine}: {text}");
        }
        if engine == killed {
            assert!(
                rep["settled_inputs"].as_u64().unwrap() > 0,
                "{engine}: {text}"
            );
        }
    }

    // Power: the same trace less one side-channel frame is not what the core saw.
    let path = dir.join("decode-1.jsonl");
    let text = std::fs::read_to_string(&path).expect("trace");
    let lines: Vec<&str> = text.lines().collect();
    let frame = lines
        .iter()
        .position(|l| l.starts_with("{\"input\"") && l.contains("\"Frame\""))
        .expect("a frame");
    let cut: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != frame)
        .map(|(_, l)| *l)
        .collect();
    let tampered = dir.join("tampered.jsonl");
    std::fs::write(&tampered, cut.join("\n")).expect("write");
    let out = replay(&tampered);
    assert!(
        !out.status.success(),
        "a trace less one input must not replay clean"
    );
    let rep: Value = serde_json::from_slice(&out.stdout).expect("a report");
    assert!(!rep["divergence"].is_null(), "{rep}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `demo --model-shape mla`: DeepSeek's latent KV (one 576-dim latent per token, held by every
/// rank) through pull from P at TP 2 to D at TP 1, and through push from P at TP 1 to D at TP 2:
/// nothing leaks and every output matches the monolithic engine's.
#[test]
fn the_demo_serves_an_mla_model_across_tp_sizes_in_pull_and_push() {
    for (mode, p_tp, d_tp) in [("pull", "2", "1"), ("push", "1", "2")] {
        let (r, stdout) = demo(
            &[
                "--model-shape",
                "mla",
                "--mode",
                mode,
                "--prefill-tp",
                p_tp,
                "--decode-tp",
                d_tp,
                "--requests",
                "24",
                // Four in flight: the busy decode engine's small pool (256 blocks) refuses a push
                // (503, before any block moves) only when it is full.
                "--concurrency",
                "4",
                "--no-kill",
                "--seed",
                "5",
            ],
            None,
        );
        served_clean(&r, ("mla", "latent"), mode, &stdout);
        // The workload has D reject some requests on purpose (seeded), and a push that finds
        // the busy D's pool full is refused at once; nothing else fails.
        let failed = r["failed_reasons"].as_object().unwrap();
        assert!(
            failed
                .keys()
                .all(|k| k == "rejected by decode before admission"
                    || (mode == "push" && k == "decode unavailable (503)")),
            "{mode}: {stdout}"
        );
        assert!(
            r["kv_bytes_moved"].as_f64().unwrap() > 0.0,
            "{mode}: {stdout}"
        );
    }
}

/// `demo --model-shape ssm`: Granite 4's shape (a recurrent state in three of every four
/// layers, one block a request) through push from P at TP 1 to D at TP 2 with D's blocks twice
/// P's: nothing leaks, every output matches the monolithic engine's (which reads the state back
/// and steps it over the prompt's last token, as D does).
#[test]
fn the_demo_serves_a_state_model_across_tp_and_block_sizes() {
    let (r, stdout) = demo(
        &[
            "--model-shape",
            "ssm",
            "--mode",
            "push",
            "--prefill-tp",
            "1",
            "--decode-tp",
            "2",
            "--decode-block-size",
            "32",
            "--requests",
            "24",
            "--concurrency",
            "4",
            "--no-kill",
            "--seed",
            "7",
        ],
        None,
    );
    served_clean(&r, ("ssm", "recurrent state"), "push", &stdout);
}

/// A `--model-shape` demo run of 24 requests (`shape`, with its KV described in words that
/// include `kv`): nothing leaked, recomputed or mismatched, at least 16 answered, each compared.
fn served_clean(r: &Value, (shape, kv): (&str, &str), mode: &str, stdout: &str) {
    assert_eq!(r["model_shape"], shape, "{stdout}");
    assert!(r["kv_shape"].as_str().unwrap().contains(kv), "{stdout}");
    assert_eq!(r["leaked_blocks"], 0, "{mode}: {stdout}");
    assert_eq!(r["output_mismatches"], 0, "{mode}: {stdout}");
    assert_eq!(r["requests_recomputed"], 0.0, "{mode}: {stdout}");
    assert!(r["requests_ok"].as_u64().unwrap() >= 16, "{mode}: {stdout}");
    assert!(r["outputs_compared"].as_u64() == r["requests_ok"].as_u64());
}

/// `demo --model-shape hybrid`: Gemma 3's shape (a window of 512 tokens in five of every six
/// layers, each kind of layer in a KV cache group of its own) through pull from P at TP 2 to D
/// at TP 1 and push from P at TP 1 to D at TP 2: nothing leaks, every output matches the
/// monolithic engine's (which reads each sliding layer's window from the blocks that moved), and
/// the same requests move fewer bytes than with every layer keeping every token.
#[test]
fn the_demo_serves_a_hybrid_model_across_tp_sizes_moving_only_the_windows() {
    let run = |shape: &str, mode: &str, p_tp: &str, d_tp: &str| {
        demo(
            &[
                "--model-shape",
                shape,
                "--mode",
                mode,
                "--prefill-tp",
                p_tp,
                "--decode-tp",
                d_tp,
                "--requests",
                "24",
                "--concurrency",
                "4",
                "--no-kill",
                "--seed",
                "6",
            ],
            None,
        )
    };
    let mut pull_bytes = 0.0;
    for (mode, p_tp, d_tp) in [("pull", "2", "1"), ("push", "1", "2")] {
        let (r, stdout) = run("hybrid", mode, p_tp, d_tp);
        served_clean(&r, ("hybrid", "sliding window"), mode, &stdout);
        if mode == "pull" {
            pull_bytes = r["kv_bytes_moved"].as_f64().unwrap();
        }
    }
    let (dense, stdout) = run("gqa", "pull", "2", "1");
    let every_layer = dense["kv_bytes_moved"].as_f64().unwrap();
    assert!(
        pull_bytes > 0.0 && pull_bytes < every_layer,
        "hybrid moved {pull_bytes} bytes, every layer {every_layer}: {stdout}"
    );
}

/// `demo --drain`: one of two prefill engines gets SIGTERM mid-load while it holds handoffs a
/// busy D has not read; it serves them, exits by itself, and nothing is recomputed or leaked.
#[test]
fn demo_drains_a_prefill_engine_mid_load_without_a_recompute() {
    let (r, stdout) = demo(&["--drain", "--requests", "48", "--seed", "3"], None);
    assert_eq!(r["drained_engine"], "prefill-1", "{stdout}");
    assert!(
        r["blocks_held_by_drained_engine_at_drain"]
            .as_u64()
            .unwrap()
            > 0,
        "{stdout}"
    );
    assert_eq!(r["drain_report"]["timed_out"], false, "{stdout}");
    assert!(r["drain_s"].as_f64().is_some(), "{stdout}");
    assert_eq!(r["requests_recomputed"], 0.0, "{stdout}");
    assert_eq!(r["leaked_blocks"], 0, "{stdout}");
    assert_eq!(r["output_mismatches"], 0, "{stdout}");
    assert!(r["outputs_compared"].as_u64() == r["requests_ok"].as_u64());
}

fn info(c: &reqwest::blocking::Client, e: &Engine) -> Value {
    c.get(format!("{}/v1/handoff/info", e.url))
        .send()
        .unwrap()
        .json()
        .unwrap()
}

fn push_d_body(pi: &Value, hid: &str, text: &str) -> Value {
    json!({"prompt": text, "max_tokens": 4, "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "push", "handoff_id": hid,
        "remote_engine_id": pi["engine_id"], "remote_host": pi["remote_host"],
        "remote_port": pi["remote_port"], "tp_size": pi["tp_size"]}})
}

fn push_p_body(hid: &str, text: &str) -> Value {
    json!({"prompt": text, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": true, "do_remote_prefill": false, "transfer_mode": "push", "handoff_id": hid}})
}

#[test]
fn push_d_killed_after_registering_releases_p_at_once() {
    let c = client();
    let p = engine("p-push-dkill", "prefill", &["--mode", "push"]);
    let mut d = engine("d-push-killed", "decode", &["--mode", "push"]);
    let pi = info(&c, &p);
    let hid = "00000000000000000000000000c0ffee";
    let text = prompt(300);
    let (url, body) = (d.url.clone(), push_d_body(&pi, hid, &text));
    std::thread::spawn(move || {
        let _ = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send();
    });
    // D registered with P (P staged it: its prefill has not started), then dies.
    wait_until(Duration::from_secs(10), "P staged D's registration", || {
        staged(&c, &p) > 0
    });
    let _ = d.child.kill();
    let _ = d.child.wait();
    std::thread::sleep(Duration::from_millis(100));
    let r: Value = c
        .post(format!("{}/v1/completions", p.url))
        .json(&push_p_body(hid, &text))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert!(r["choices"].is_array(), "{r}");
    wait_until(
        Duration::from_secs(2),
        "P freed a dead D's blocks (lease is 10 s)",
        || p_held(&c, &p) == 0,
    );
}

#[test]
fn push_p_killed_during_prefill_makes_d_recompute() {
    let c = client();
    // Slow prefill: P dies while writing layer by layer.
    let mut p = engine(
        "p-push-dies",
        "prefill",
        &["--mode", "push", "--set", "prefill_us_per_token=400"],
    );
    let d = engine("d-push-survives", "decode", &["--mode", "push"]);
    let mono = engine("mono-push", "both", &[]);
    let pi = info(&c, &p);
    let hid = "00000000000000000000000000decade";
    let text = prompt(2000);
    let (url, body) = (p.url.clone(), push_p_body(hid, &text));
    std::thread::spawn(move || {
        let _ = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send();
    });
    let (durl, dbody) = (d.url.clone(), push_d_body(&pi, hid, &text));
    let d_leg = std::thread::spawn(move || {
        let r = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap()
            .post(format!("{durl}/v1/completions"))
            .json(&dbody)
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    });
    std::thread::sleep(Duration::from_millis(300));
    let _ = p.child.kill();
    let killed = Instant::now();
    let (status, r) = d_leg.join().unwrap();
    assert_eq!(status, 200, "{r}");
    assert!(killed.elapsed() < Duration::from_secs(10), "no hang");
    let m: Value = c
        .post(format!("{}/v1/completions", mono.url))
        .json(&json!({"prompt": text, "max_tokens": 4}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(r["choices"][0]["text"], m["choices"][0]["text"]);
    // D's pool is whole again once no WRITE of P's can land: after the last grant D gave P
    // (2 s) and the write grace (1.5 s), not at P's death (rule 3).
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let dm = c
            .get(format!("{}/metrics", d.url))
            .send()
            .unwrap()
            .text()
            .unwrap();
        let held: f64 = dm
            .lines()
            .filter(|l| l.starts_with("handoff_kv_blocks_held"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if held == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{dm}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn push_p_killed_before_or_after_the_write_leaves_d_whole() {
    let c = client();
    let d = engine("d-push-pdies", "decode", &["--mode", "push"]);
    let mono = engine("mono-push-2", "both", &[]);
    let text = prompt(500);
    let m: Value = c
        .post(format!("{}/v1/completions", mono.url))
        .json(&json!({"prompt": text, "max_tokens": 4}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    for (i, when) in ["before", "after"].into_iter().enumerate() {
        let mut p = engine(&format!("p-push-{when}"), "prefill", &["--mode", "push"]);
        let pi = info(&c, &p);
        let hid = format!("{:032x}", 0xbef0 + i);
        let (durl, dbody) = (d.url.clone(), push_d_body(&pi, &hid, &text));
        let d_leg = std::thread::spawn(move || {
            let r = reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap()
                .post(format!("{durl}/v1/completions"))
                .json(&dbody)
                .send()
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().unwrap())
        });
        if when == "after" {
            let r: Value = c
                .post(format!("{}/v1/completions", p.url))
                .json(&push_p_body(&hid, &text))
                .send()
                .unwrap()
                .json()
                .unwrap();
            assert!(r["choices"].is_array(), "{r}");
            std::thread::sleep(Duration::from_millis(200));
        } else {
            // D registered; P dies before its prefill ever starts.
            std::thread::sleep(Duration::from_millis(300));
        }
        let _ = p.child.kill();
        let (status, r) = d_leg.join().unwrap();
        assert_eq!(status, 200, "{when}: {r}");
        assert_eq!(r["choices"][0]["text"], m["choices"][0]["text"], "{when}");
    }
    let start = Instant::now();
    loop {
        let v = health(&c, &d);
        if v["held_blocks"]["decode"] == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "D holds blocks: {v}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
