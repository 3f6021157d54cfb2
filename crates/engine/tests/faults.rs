//! Pull and push through transports that drop, duplicate and delay completion notifications and
//! fail transfers (the `faulty` backend over `mem`, seeded): every request still ends with the
//! monolithic engine's output (transferred, or recomputed after a failure), every block of both
//! pools comes back, and nothing hangs. READs that land damaged are caught by the KV digest.

mod common;

use std::time::Duration;

use common::{metric, metric_with, metrics_text, pool_whole_within, post, released_within};

use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

fn cfg(role: &str, mode: &str, faults: &str) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "mem".into(),
        transport_faults: faults.into(),
        mode: mode.into(),
        num_blocks: 1024,
        prefill_us_per_token: 5.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        // Short leases so that lost completions cost a second, not the default ten.
        lease_ms: 1_500,
        heartbeat_interval_ms: 100,
        heartbeat_extension_ms: 600,
        fence_grace_ms: 400,
        read_grace_ms: 200,
        read_timeout_ms: 1_000,
        wait_deadline_ms: 2_500,
        ..EngineConfig::default()
    }
}

fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("f{}", (i * 37 + seed * 1009) % 2000))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn one(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    mode: &str,
    text: &str,
    id: u128,
) -> (u16, Value) {
    if mode == "pull" {
        let (s, pr) = post(
            c,
            &p.url(),
            json!({"prompt": text, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await;
        assert_eq!(s, 200, "{pr}");
        return post(c, &d.url(), json!({"prompt": text, "max_tokens": 6, "kv_transfer_params": pr["kv_transfer_params"]})).await;
    }
    let info: Value = c
        .get(format!("{}/v1/handoff/info", p.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let hid = format!(
        "{:032x}",
        0xfa17_0000_0000_0000_0000_0000_0000_0000u128 | id
    );
    let p_body = json!({"prompt": text, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": true, "transfer_mode": "push", "handoff_id": hid}});
    let d_body = json!({"prompt": text, "max_tokens": 6, "kv_transfer_params": {
        "do_remote_prefill": true, "transfer_mode": "push", "handoff_id": hid,
        "remote_engine_id": info["engine_id"], "remote_host": info["remote_host"],
        "remote_port": info["remote_port"], "tp_size": info["tp_size"]}});
    let (c1, purl) = (c.clone(), p.url());
    let p_leg = tokio::spawn(async move { post(&c1, &purl, p_body).await });
    let d = post(c, &d.url(), d_body).await;
    let _ = p_leg.await;
    d
}

/// Lost completions end by lease + fence: every block of both engines comes back, then both
/// stop.
async fn all_back_then_stop(c: &reqwest::Client, p: RunningEngine, d: RunningEngine) {
    released_within(&p, Duration::from_secs(10)).await;
    released_within(&d, Duration::from_secs(10)).await;
    pool_whole_within(c, &p, Duration::from_secs(2)).await;
    pool_whole_within(c, &d, Duration::from_secs(2)).await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_duplicated_delayed_notifications_and_failed_transfers_cost_time_never_blocks() {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", "pull", "")).await.unwrap();
    for (mode, seed) in [("pull", 1), ("push", 2)] {
        let faults = format!("seed={seed},drop=25,dup=20,delay=20,fail=15");
        let p = start(cfg("prefill", mode, &faults)).await.unwrap();
        let d = start(cfg(
            "decode",
            mode,
            &format!("seed={},drop=25,dup=20,delay=20,fail=15", seed + 10),
        ))
        .await
        .unwrap();
        let mut ok = 0;
        for i in 0..16u128 {
            let text = prompt(i as usize, 20 + (i as usize * 37) % 300);
            let (s, v) = one(&c, &p, &d, mode, &text, i).await;
            assert_eq!(s, 200, "{mode} request {i}: {v}");
            let (_, m) = post(&c, &mono.url(), json!({"prompt": text, "max_tokens": 6})).await;
            assert_eq!(
                v["choices"][0]["text"], m["choices"][0]["text"],
                "{mode} request {i}"
            );
            ok += 1;
        }
        assert_eq!(ok, 16);
        all_back_then_stop(&c, p, d).await;
    }
    mono.stop().await;
}

/// Every READ lands with one byte changed (`corrupt=100` on D's transport). With the KV digest
/// on, D notices each time, recomputes, and answers the monolithic engine's output; with it off
/// (the negative control) the damaged KV is decoded and the output differs: the check is what
/// keeps damaged KV from being decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_kv_is_caught_by_the_digest_and_never_decoded() {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", "pull", "")).await.unwrap();
    for digest in [true, false] {
        let with = |mut e: EngineConfig| {
            e.kv_digest = digest;
            e
        };
        let p = start(with(cfg("prefill", "pull", ""))).await.unwrap();
        let d = start(with(cfg("decode", "pull", "seed=5,corrupt=100")))
            .await
            .unwrap();
        let mut differing = 0;
        let n = 6;
        for i in 0..n {
            let text = prompt(i, 40 + i * 53);
            let (s, v) = one(&c, &p, &d, "pull", &text, i as u128).await;
            assert_eq!(s, 200, "request {i}: {v}");
            let (_, m) = post(&c, &mono.url(), json!({"prompt": text, "max_tokens": 6})).await;
            if v["choices"][0]["text"] != m["choices"][0]["text"] {
                differing += 1;
            }
        }
        let text = metrics_text(&c, &d).await;
        let mismatched = metric_with(
            &text,
            "handoff_kv_digests_checked_total",
            "matched=\"false\"",
        );
        if digest {
            assert_eq!(differing, 0, "damaged KV was decoded despite the digest");
            assert_eq!(mismatched, n as f64, "every damaged READ is counted");
            assert!(metric(&text, "handoff_requests_failed_total") >= n as f64);
        } else {
            assert!(
                differing > 0,
                "the damage does not show in the output: the test has no power"
            );
            assert_eq!(mismatched, 0.0);
        }
        all_back_then_stop(&c, p, d).await;
    }
    mono.stop().await;
}
