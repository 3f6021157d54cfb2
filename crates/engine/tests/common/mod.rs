//! Helpers shared by the engine's end-to-end tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use handoff_connector::ClusterKey;
use handoff_engine::{EngineConfig, RunningEngine};
use serde_json::Value;

/// A model-shape test's engine: in-process transport, a fast cost model, 256 blocks, and a
/// transfer that fails fails the request (nothing is quietly recomputed). Each test sets the
/// shape on top.
pub fn shaped(role: &str, mode: &str, tp: u32) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "mem".into(),
        mode: mode.into(),
        tp,
        num_blocks: 256,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        failure_policy: "fail".into(),
        ..EngineConfig::default()
    }
}

/// A prompt of `words` words, different for each `tag` and `seed`.
pub fn words(tag: &str, seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("{tag}{}", (i * 37 + seed * 577) % 2500))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A fast engine on loopback over the tcp transport, proving `key` (none: unauthenticated),
/// with a 2 s lease so an unread handoff ends within a test.
pub fn keyed_tcp(role: &str, key: Option<&ClusterKey>) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "tcp".into(),
        num_blocks: 256,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        cluster_key: key.map(ClusterKey::to_hex).unwrap_or_default(),
        lease_ms: 2_000,
        ..EngineConfig::default()
    }
}

/// POSTs a completion request and returns its status and JSON body (bounded: no hang).
pub async fn post(c: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("no hang");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Each choice's text.
pub fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["text"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// The sum of a metric's samples in Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    metric_with(text, name, "")
}

/// The sum of a metric's samples whose line contains `label` (e.g. `matched="false"`).
pub fn metric_with(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until the engine's connector holds no block; fails after `limit`. Returns the wait.
pub async fn released_within(e: &RunningEngine, limit: Duration) -> Duration {
    let c = e.connector.as_ref().expect("connector");
    let start = Instant::now();
    while c.held_blocks().unwrap() != (0, 0) {
        assert!(
            start.elapsed() < limit,
            "{} still holds {:?}",
            e.engine_id,
            c.held_blocks().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    start.elapsed()
}

/// The engine's `/metrics` page.
pub async fn metrics_text(c: &reqwest::Client, e: &RunningEngine) -> String {
    c.get(format!("{}/metrics", e.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Polls the engine's `/metrics` until `cond` holds and returns that page; fails after `limit`
/// naming `what` it waited for, with the last page.
pub async fn metrics_until(
    c: &reqwest::Client,
    e: &RunningEngine,
    limit: Duration,
    what: &str,
    cond: impl Fn(&str) -> bool,
) -> String {
    let start = Instant::now();
    loop {
        let m = metrics_text(c, e).await;
        if cond(&m) {
            return m;
        }
        assert!(start.elapsed() < limit, "{}: {what}:\n{m}", e.engine_id);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until every block is back in the engine's KV pool (the connector hands released blocks
/// to the scheduler, which frees them on its next step); fails after `limit` with the metrics.
pub async fn pool_whole_within(c: &reqwest::Client, e: &RunningEngine, limit: Duration) {
    metrics_until(c, e, limit, "the pool is not whole", |m| {
        metric(m, "engine_kv_blocks_used") == 0.0
    })
    .await;
}

/// The engine's `GET /v1/handoff/info`.
pub async fn info(c: &reqwest::Client, e: &RunningEngine) -> Value {
    c.get(format!("{}/v1/handoff/info", e.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// POSTs a completion in a task of its own, after `delay` (bounded: no hang); its status and
/// JSON body.
pub fn post_later(
    c: &reqwest::Client,
    url: String,
    body: Value,
    delay: Duration,
) -> tokio::task::JoinHandle<(u16, Value)> {
    let c = c.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let r = c
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<Value>().await.unwrap_or(Value::Null),
        )
    })
}

/// Both legs at once, as the proxy sends them in push mode or for a layer-wise pull; `d_first`
/// delays P's leg by 50 ms, else D's. P's answer, then D's.
pub async fn both_legs(
    c: &reqwest::Client,
    (p, p_body): (&RunningEngine, Value),
    (d, d_body): (&RunningEngine, Value),
    d_first: bool,
) -> ((u16, Value), (u16, Value)) {
    let (late, now) = (Duration::from_millis(50), Duration::ZERO);
    let (p_delay, d_delay) = if d_first { (late, now) } else { (now, late) };
    let p_leg = post_later(c, p.url(), p_body, p_delay);
    let d_leg = post_later(c, d.url(), d_body, d_delay);
    (p_leg.await.unwrap(), d_leg.await.unwrap())
}

/// A pull as the proxy runs it: P with `max_tokens` 1 and `do_remote_decode`, then D with P's
/// `kv_transfer_params`, `max_tokens` and `n`. D's status and answer.
pub async fn pulled(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    text: &str,
    max_tokens: u32,
    n: u32,
) -> (u16, Value) {
    let (s, pr) = post(
        c,
        &p.url(),
        serde_json::json!({"prompt": text, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
    )
    .await;
    assert_eq!(s, 200, "{pr}");
    post(
        c,
        &d.url(),
        serde_json::json!({"prompt": text, "max_tokens": max_tokens, "n": n,
            "kv_transfer_params": pr["kv_transfer_params"]}),
    )
    .await
}

/// P's handoffs held now, and how many ended per reason so far.
pub fn producer_stats(e: &RunningEngine) -> (usize, std::collections::HashMap<&'static str, u64>) {
    e.connector
        .as_ref()
        .expect("a connector")
        .producer_stats()
        .expect("the connector runs")
        .expect("a prefill engine")
}

/// A push as handoff's proxy sends it: both legs at once under handoff id `hid` (D's with P's
/// side channel from its info; `d_first` delays P's leg), P with `max_tokens` 1, D with 8 and
/// `n`. D's status and answer.
pub async fn pushed(
    c: &reqwest::Client,
    (p, d): (&RunningEngine, &RunningEngine),
    text: &str,
    n: u32,
    hid: &str,
    d_first: bool,
) -> (u16, Value) {
    let pi = info(c, p).await;
    let p_body = serde_json::json!({"prompt": text, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": true, "do_remote_prefill": false, "transfer_mode": "push", "handoff_id": hid}});
    let d_body = serde_json::json!({"prompt": text, "max_tokens": 8, "n": n, "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "push", "handoff_id": hid,
        "remote_engine_id": pi["engine_id"], "remote_host": pi["remote_host"], "remote_port": pi["remote_port"],
        "tp_size": pi["tp_size"]}});
    let ((ps, pv), d_answer) = both_legs(c, (p, p_body), (d, d_body), d_first).await;
    assert_eq!(ps, 200, "{pv}");
    assert_eq!(pv["kv_transfer_params"]["transfer_mode"], "push");
    d_answer
}

/// One request through P and D in `mode` (`pull` or `push`), as handoff's proxy sends it; D's
/// status and answer. A push runs under handoff id `tag << 64 | id`.
pub async fn disaggregated(
    c: &reqwest::Client,
    mode: &str,
    (p, d): (&RunningEngine, &RunningEngine),
    text: &str,
    (tag, id): (u64, u64),
) -> (u16, Value) {
    if mode == "pull" {
        return pulled(c, p, d, text, 8, 1).await;
    }
    let hid = format!("{:032x}", u128::from(tag) << 64 | u128::from(id));
    pushed(c, (p, d), text, 1, &hid, true).await
}

/// Bytes the side that posts moved: D's READs (pull), P's WRITEs (push).
pub async fn moved(
    c: &reqwest::Client,
    mode: &str,
    (p, d): (&RunningEngine, &RunningEngine),
) -> f64 {
    let poster = if mode == "pull" { d } else { p };
    metric(
        &metrics_text(c, poster).await,
        "handoff_transfer_bytes_total",
    )
}
